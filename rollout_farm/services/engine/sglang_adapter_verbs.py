"""The SGLang engine's adapter verbs (SGLangAdapterVerbs, a part of SGLangEngine in sglang_engine.py, whose
docstring says how adapters are served): stage (checked, written as a peft folder, loaded under its key), commit,
discard and retire (unloaded once its last call ends). sglang_adapters.py holds the checks, the folder and the key
table. tests/unit/test_sglang_contract.py checks the calls made here on `self.llm` with those of sglang_engine.py.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import uuid
import weakref
from pathlib import Path

import torch

from rollout_farm.services.adapters.peft_format import AdapterInvalid, LoraConfig, problem
from rollout_farm.services.engine.sglang_adapters import KEY, Held, check_adapter, sglang_config, write_folder
from rollout_farm.services.errors import EngineVerbMissing
from rollout_farm.services.weights.checks import WeightsRejected, non_finite

log = logging.getLogger("farm.service")
UNLOAD_WAIT_S = 300.0  # longest a stage waits for an unload of the same key (SGLang's own wait for its requests)


class SGLangAdapterVerbs:
    """The adapter verbs of SGLangEngine, which sets what they read: llm, model_path, _loop, _lora, _adapters,
    _staging, _adapter_root, _linear_shapes, _meta_model()."""

    def stage_adapter(self, key: str, config: LoraConfig, tensors: dict[str, torch.Tensor]) -> None:
        """Check the adapter (AdapterInvalid naming each misfit, WeightsRejected for NaN or inf), write it as a peft
        folder and load it in SGLang under `key`, which no call names before commit_adapter. SGLang's refusal is an
        AdapterInvalid naming its message. Blocks (a worker thread: the replica runs it in one)."""
        if not self._lora.enabled:
            raise EngineVerbMissing.of(
                self,
                "LoRA adapters (it started without LoRA)",
                "set FARM_SGLANG_MAX_LORA_RANK (and FARM_SGLANG_LORA_TARGET_MODULES) to start SGLang with LoRA",
            )
        if not KEY.fullmatch(key):
            raise ValueError(f"{key!r} is not an adapter key (name@vN)")
        pairs = check_adapter(config, tensors, self._linears(), self._lora, self.model_path)
        if problems := non_finite(tensors):
            raise WeightsRejected("; ".join(problems))
        with self._staging:
            if self._adapters.holds(key) or self._adapters.reclaim(key):
                return  # loaded already (a key is never reused for other bytes)
            pending = self._adapters.pending_unload(key)
            if pending is not None:  # SGLang refuses a name it still holds
                pending.result(timeout=UNLOAD_WAIT_S)
            folder = self._adapter_folder(key)
            try:
                write_folder(folder, sglang_config(config, pairs, self.model_path), tensors)
                result = self.llm.load_lora_adapter(lora_name=key, lora_path=str(folder))
            except BaseException:
                shutil.rmtree(folder, ignore_errors=True)
                raise
            if not result.success:
                shutil.rmtree(folder, ignore_errors=True)
                raise AdapterInvalid([problem("adapter", f"SGLang did not load it: {result.error_message}")])
            self._adapters.stage(key, Held(folder, sum(t.numel() * t.element_size() for t in tensors.values())))

    def commit_adapter(self, key: str) -> None:
        """Calls may name the staged `key` from now (a no-op when resident); KeyError when it was never staged."""
        self._adapters.commit(key)

    def discard_adapter(self, key: str) -> None:
        """Unload a staged key (no call has named it), without waiting."""
        if (held := self._adapters.discard(key)) is not None:
            self._unload(key, held)

    def retire_adapter(self, key: str) -> None:
        """No new call may name `key` from now; it is unloaded when its last call ends (now when none uses it),
        without waiting."""
        if (held := self._adapters.retire(key)) is not None:
            self._unload(key, held)

    def resident_adapters(self, include_retiring: bool = False) -> dict[str, tuple[int, int]]:
        """The usable adapters; a retiring one is never staged again under its key here (stage reclaims or waits),
        so include_retiring adds nothing."""
        return self._adapters.snapshot()

    def _unload(self, key: str, held: Held) -> None:
        """Unload `key` in SGLang, then delete its folder, on the engine's loop; the caller does not wait."""
        self._adapters.unload_started(key, self._loop.submit(self._unloaded(key, held.folder)))

    async def _unloaded(self, key: str, folder: Path) -> None:
        try:
            result = await self.llm.async_unload_lora_adapter(lora_name=key)
            if not result.success and "does not exist" not in (result.error_message or ""):
                log.warning("adapter_unload_failed", extra={"adapter": key, "error": result.error_message})
        except Exception as e:  # logged: nobody awaits this
            log.warning("adapter_unload_failed", extra={"adapter": key, "error": repr(e)[:500]})
        finally:
            shutil.rmtree(folder, ignore_errors=True)  # after the unload: a straggler cannot load it again

    def _adapter_folder(self, key: str) -> Path:
        if self._adapter_root is None:
            self._adapter_root = Path(tempfile.mkdtemp(prefix="farm-lora-"))
            weakref.finalize(self, shutil.rmtree, str(self._adapter_root), True)
        return self._adapter_root / f"{key}-{uuid.uuid4().hex[:8]}"

    def _linears(self) -> dict[str, tuple[int, int]] | None:
        """The model's linear layers, module path -> (in_features, out_features), as peft (and SGLang's adapter
        loader) names them: from the config on the meta device; None when the model cannot be built so."""
        if self._linear_shapes is False:
            try:
                modules = self._meta_model().named_modules()
                self._linear_shapes = {
                    p: (m.in_features, m.out_features) for p, m in modules if isinstance(m, torch.nn.Linear)
                }
            except Exception as e:
                log.warning("adapter_linears_unknown", extra={"model": self.model_path, "error": repr(e)[:500]})
                self._linear_shapes = None
        return self._linear_shapes
