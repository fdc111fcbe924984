"""The SGLang engine's weight verbs (SGLangWeights, a part of SGLangEngine in sglang_engine.py): the checks of a
push, its commit into SGLang, the NCCL transport, and the base digest of what SGLang serves (sglang_digest.py).
tests/unit/test_sglang_contract.py checks the calls made here on `self.llm` (the sglang.Engine) with those of
sglang_engine.py, against the pinned wheel's source.

Weight commits. SGLang's own update (update_weights_from_tensor/_disk/_distributed) takes a writer lock
that waits for every running request and holds new ones back, so in-flight samples finish on the old
weights. This adapter does the same, with its own gate, so that it knows each sample's version:
  finish   wait for in-flight calls, then update (SGLang's default behaviour)
  abort    abort_request(abort_all=True) on in-flight calls, wait for them to return, then update
  partial  the same as finish: every sample keeps one version. A mid-sample switch would need
           pause_generation(mode="retract"), but in 0.5.14 the cache flush after the update then fails on
           the retracted requests and asserts in the scheduler (and without the flush the prefix cache
           keeps old-weight KV); per-token versions (meta_info["weight_versions"]) come only in 0.5.19.
stage_weights_from_path checks the folder's safetensors headers; SGLang reads the files at commit.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rollout_farm.services.engine.sglang_digest import folder_digest, tensors_digest
from rollout_farm.services.protocol import InFlightPolicy
from rollout_farm.services.weights.checks import (
    WeightsError,
    WeightsRejected,
    check_state_dict,
    non_finite,
    read_header_file,
)
from rollout_farm.services.weights.state_dict import spec_of

TORCH_DTYPE_NAMES = {
    "BF16": "bfloat16",
    "F16": "float16",
    "F32": "float32",
}  # SGLang's distributed update wants torch names
DIGESTS_KEPT = 8  # base versions whose digests are kept (a sample spanning commits names each token's policy)


class SGLangWeights:
    """The weight verbs of SGLangEngine, which sets what they read: llm, model_path, dtype, weight_version, _staged,
    _cv, _inflight, _committing, abort()."""

    def _attach_weights(self) -> None:
        self._spec: dict[str, tuple[list[int], str]] | None = None
        self.base_digest, self._digests, self._staged_digest = None, {}, None  # sglang_digest.py
        self._served_lock, self._served_names = threading.Lock(), None

    # weights ---------------------------------------------------------------
    def _meta_model(self) -> torch.nn.Module:
        """The model built from its config on the meta device: SGLang holds the only real copy."""
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.model_path), dtype=self.dtype)

    def _names(self) -> set[str]:
        """The served tensors' canonical names: the parameters (a tied one once) and the persistent buffers."""
        if self._served_names is None:
            model = self._meta_model()
            buffers = {n for n, _ in model.named_buffers()} & model.state_dict().keys()
            self._served_names = {n for n, _ in model.named_parameters()} | buffers
        return self._served_names

    def _served_digest(self, version: int, digest: str | None) -> None:
        """Serve base `version`, of `digest`: both change together for served_base's readers."""
        with self._served_lock:
            self.weight_version, self.base_digest = version, digest
            self._digests[version] = digest
            for old in sorted(self._digests)[:-DIGESTS_KEPT]:
                del self._digests[old]

    def served_base(self) -> tuple[int, str | None]:
        with self._served_lock:
            return self.weight_version, self.base_digest

    def base_digest_of(self, version: int) -> str | None:
        """The digest of base version `version` when it was served lately; None when too old or unknown."""
        return self._digests.get(version)

    def weight_spec(self) -> dict[str, tuple[list[int], str]]:
        if self._spec is None:
            self._spec = spec_of(dict(self._meta_model().named_parameters()))
        return self._spec

    def _check(self, got: dict[str, tuple[list[int], str]], version: int) -> None:
        problems = check_state_dict(self.weight_spec(), got) + self._version_problems(version)
        if problems:
            raise WeightsRejected("; ".join(problems))

    def stage_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        if problems := non_finite(state_dict):
            raise WeightsRejected("; ".join(problems))
        self._check(spec_of(state_dict), version)
        self._staged, self._staged_digest = (version, state_dict), tensors_digest(state_dict, self._names(), self.dtype)

    def stage_weights_from_path(self, path: str, version: int) -> None:
        """Check the folder's safetensors headers; SGLang reads the files itself at the commit."""
        got = {}
        try:
            for f in sorted(Path(path).glob("*.safetensors")):
                got.update(read_header_file(f))
        except WeightsError as e:
            raise WeightsRejected(str(e)) from None
        self._check(got, version)
        self._staged, self._staged_digest = (version, str(path)), folder_digest(path, self._names(), self.dtype)

    def _commit_staged(self, version: int, policy: InFlightPolicy | None) -> None:
        """Update SGLang's weights from the staged tensors or folder, alone: in-flight calls finish (or are aborted)
        first and new ones wait ("partial" is "finish" here)."""
        staged = self._staged[1]
        with self._exclusive(abort=policy == "abort"):
            if isinstance(staged, str):
                ok, message = self.llm.update_weights_from_disk(staged)[:2]
            else:
                ok, message = self.llm.update_weights_from_tensor(list(staged.items()))
            if not ok:
                raise WeightsRejected(message)
            self._staged = None
            self._served_digest(version, self._staged_digest)

    @contextmanager
    def _exclusive(self, abort: bool = False):
        """Hold new generate calls back and wait for the in-flight ones (aborting them first if asked)."""
        with self._cv:
            self._cv.wait_for(lambda: not self._committing)
            self._committing = True
            while self._inflight:
                if abort:
                    self.abort()
                self._cv.wait(0.05)
        try:
            yield
        finally:
            with self._cv:
                self._committing = False
                self._cv.notify_all()

    # NCCL transport: the trainer is rank 0 of the group and broadcasts each tensor ----------------
    # ranks_per_engine (set in __init__): tp_size GPUs per engine; replica i's ranks start at rank_offset + i * tp_size

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "nccl",
    ) -> None:
        ok, message = self.llm.init_weights_update_group(
            master_address, master_port, rank_offset, world_size, group_name, backend
        )
        if not ok:
            raise RuntimeError(message)

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        version: int,
        group_name: str = "weight_update_group",
    ) -> None:
        with self._exclusive():
            ok, message = self.llm.update_weights_from_distributed(
                names, [TORCH_DTYPE_NAMES.get(d, d) for d in dtypes], shapes, group_name
            )
            if not ok:
                raise WeightsRejected(message)
            self._served_digest(version, None)  # no bytes passed through here: unknown
