"""The vLLM engine's weight verbs (VLLMWeights, a part of VLLMEngine in vllm_engine.py): a push's checks, its load
into the vLLM server, and the check by behaviour that every load passes before it serves.

The checks and the base digest are SGLang's (SGLangWeights, sglang_weights.py: names, shapes, dtypes, finite values,
a newer version; the digest of what the engine was told to load): both engines hold the only copy of the weights
in another process. What differs is the load:
- weights travel to vLLM as a folder, never as tensors (/collective_rpc passes strings; tensors through vLLM's loader
  killed the engine): a push by path is loaded from its folder, an upload's tensors are written to one first;
- the load is the farm's worker extension (vllm_side/farm_vllm_worker.py), which redoes the tied output layer that
  vLLM's own reload leaves stale on CPU;
- a load is trusted only after a check (`_verify`): the prompt logprobs vLLM now computes for a fixed token sequence
  against a plain forward pass of the same tensors (transformers, in the replica, float32), within VERIFY_TOLERANCE.
  A load that fails it is rolled back to the served folder and the push refused (WeightsRejected, naming vLLM's
  error); if the roll back fails too, the engine stops serving (health fails, Serve replaces the replica, which
  loads the committed version). The model vLLM starts with is checked the same way.

A commit drains (finish; partial is finish here, as on SGLang) or aborts the running calls and holds new ones back
(`_exclusive`), loads, checks, names the new version to vLLM (/update_weight_version: its per-token spans) and serves.
A push's probe (score_staged_weights) is scored the same way, on the staged weights loaded under the closed gate,
then the served ones are loaded back: vLLM holds one copy. The NCCL transport is not offered (501).
"""

from __future__ import annotations

import math
import random
import shutil
import tempfile
from pathlib import Path

import torch

from rollout_farm.services.engine.base import read_safetensors_folder
from rollout_farm.services.engine.sglang_digest import folder_digest
from rollout_farm.services.engine.sglang_weights import SGLangWeights
from rollout_farm.services.errors import EngineVerbMissing
from rollout_farm.services.protocol import InFlightPolicy
from rollout_farm.services.weights.checks import WeightsRejected

VERIFY_TOKENS = 24
VERIFY_TOLERANCE = {torch.float32: 1e-3}  # other dtypes: LOW_PRECISION_TOLERANCE (a stale head is off by > 0.1)
LOW_PRECISION_TOLERANCE = 0.05
LOAD_TIMEOUT_S = 600.0


class VLLMWeights(SGLangWeights):
    """Set by VLLMEngine: model_path, dtype, server, weight_version, _cv, _inflight, _committing, abort(), _post,
    _loop, _ascore."""

    def _attach_weights(self) -> None:
        super()._attach_weights()
        self._served_folder: str = self.model_path
        self._own_folders: list[str] = []  # folders this engine wrote an upload's tensors to (deleted when replaced)
        self._broken: str | None = None
        self._epoch = 0  # loads so far: the prefix cache's salt (no cached block spans two loads)
        self._verify_ids = self._probe_ids()
        self._post("/update_weight_version", {"new_version": "0"})
        problem, self._served_want = self._verify(read_safetensors_folder(self.model_path))
        if problem:
            raise RuntimeError(f"vLLM does not serve the model it loaded: {problem}")
        self._served_digest(0, folder_digest(self.model_path, self._names(), self.dtype))

    def _probe_ids(self) -> list[int]:
        vocab = self.vocab_size()
        rng = random.Random(0)
        return [rng.randrange(vocab) for _ in range(VERIFY_TOKENS)]

    # the check -------------------------------------------------------------
    def _reference(self, tensors: dict[str, torch.Tensor]) -> list[float]:
        """The probe's logprobs (from the second token) of a plain float32 forward pass of `tensors`."""
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.initialization import no_init_weights

        with no_init_weights():  # every parameter is loaded below; the buffers (rotary) are made as usual
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.model_path), dtype=torch.float32)
        missing, _ = model.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
        model.tie_weights()
        if missing := [n for n in missing if n in self._names()]:
            raise WeightsRejected(f"the weights lack {missing[:5]}")
        ids = torch.tensor([self._verify_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits.float()
        logprobs = torch.log_softmax(logits[0, :-1], dim=-1)
        return logprobs.gather(1, ids[0, 1:, None])[:, 0].tolist()

    def _verify(self, tensors: dict[str, torch.Tensor]) -> tuple[str | None, list[float]]:
        """(why vLLM's prompt logprobs of the probe differ from a plain forward pass of `tensors`, or None when they
        agree within the dtype's tolerance; the forward pass's logprobs)."""
        want = self._reference(tensors)
        return self._differs(want), want

    def _differs(self, want: list[float]) -> str | None:
        """Why vLLM's prompt logprobs of the probe are not `want` (within the dtype's tolerance), or None."""
        scored = self._loop.run_until_complete(self._ascore(self._verify_ids, 0))
        worst = max(abs(a - b) if math.isfinite(a) else math.inf for a, b in zip(scored.logprobs[1:], want))
        tolerance = VERIFY_TOLERANCE.get(self.dtype, LOW_PRECISION_TOLERANCE)
        if worst > tolerance:
            return (
                f"after the load, vLLM's logprobs differ from a plain forward pass of the same weights by {worst:.4g} "
                f"(tolerance {tolerance:g}): vLLM does not serve the weights it was given"
            )
        return None

    # loads -----------------------------------------------------------------
    def _load(self, folder: str, repack_tied: bool = True) -> None:
        """Load a safetensors folder into vLLM (the worker extension's farm_reload)."""
        body = {"method": "farm_reload", "args": [folder, "1" if repack_tied else "0"], "timeout": LOAD_TIMEOUT_S}
        self._epoch += 1  # before: a load that fails midway leaves no block of the old salt reachable either
        self._post("/collective_rpc", body)

    def _folder_of(self, staged: dict[str, torch.Tensor] | str) -> str:
        """The staged weights as a folder vLLM can load: a push by path's own, or a new one for an upload's tensors
        (a tied duplicate written once)."""
        if isinstance(staged, str):
            return staged
        from safetensors.torch import save_file

        folder = tempfile.mkdtemp(prefix="farm-vllm-weights-")
        unique = {k: v.detach().contiguous() for k, v in staged.items() if k in self._names()}  # a tied head once
        save_file(unique, str(Path(folder) / "model.safetensors"))
        self._own_folders.append(folder)
        return folder

    def _load_checked(self, staged: dict[str, torch.Tensor] | str) -> tuple[str, list[float]]:
        """Load the staged weights and check them (under the closed gate); roll back and raise WeightsRejected when
        the check fails. Returns the folder loaded and the check's logprobs."""
        folder = self._folder_of(staged)
        tensors = staged if isinstance(staged, dict) else read_safetensors_folder(folder)
        try:
            self._load(folder)
            problem, want = self._verify(tensors)
        except Exception as e:  # vLLM refused the load (its message says why)
            problem, want = f"vLLM could not load the weights: {e}", []
        if problem:
            self._roll_back(folder)
            raise WeightsRejected(problem)
        return folder, want

    def _roll_back(self, failed: str) -> None:
        """Load the served folder again and check that vLLM serves what it served before (the folder of a push by
        path is the pusher's, and may have changed since); if not, or if the load fails, stop serving: health fails
        and Serve replaces the replica, which loads the committed version."""
        try:
            self._load(self._served_folder)
            problem = self._differs(self._served_want)
        except Exception as e:
            problem = f"vLLM could not load them ({e})"
        if problem:
            self._broken = f"the served weights could not be loaded back after a load: {problem}; replace the replica"
        self._forget_folder(failed)

    def _forget_folder(self, folder: str) -> None:
        if folder in self._own_folders and folder != self._served_folder:
            self._own_folders.remove(folder)
            shutil.rmtree(folder, ignore_errors=True)

    # the verbs -------------------------------------------------------------
    def _commit_staged(self, version: int, policy: InFlightPolicy | None) -> None:
        staged = self._staged[1]
        with self._exclusive(abort=policy == "abort"):
            folder, want = self._load_checked(staged)
            try:  # vLLM labels each token with it (per-token versions)
                self._post("/update_weight_version", {"new_version": str(version)})
            except Exception as e:
                self._roll_back(folder)
                raise WeightsRejected(f"vLLM did not take the version's label: {e}") from None
            previous, self._served_folder, self._served_want = self._served_folder, folder, want
            self._forget_folder(previous)
            self._staged = None
            self._served_digest(version, self._staged_digest)

    def score_staged_weights(self, version: int, sequences: list[list[int]]) -> list[list[float | None]]:
        """The staged weights loaded (and checked) under the closed gate, the probe scored, the served weights
        loaded back: vLLM holds one copy."""
        if self._staged is None or self._staged[0] != version:
            raise WeightsRejected(f"version {version} is not staged on this replica")
        staged = self._staged[1]
        with self._exclusive():
            folder, _ = self._load_checked(staged)
            try:
                scored = self._loop.run_until_complete(self._ascore_all(sequences, 0))
            finally:
                self._roll_back(folder)  # an upload's folder is written again at the commit
        return [s.logprobs for s in scored]

    def init_weights_update_group(self, *args, **kwargs) -> None:
        raise EngineVerbMissing.of(self, "NCCL weight transport", "push by path or upload; or FARM_ENGINE=sglang")

    def update_weights_from_distributed(self, *args, **kwargs) -> None:
        raise EngineVerbMissing.of(self, "NCCL weight transport", "push by path or upload; or FARM_ENGINE=sglang")
