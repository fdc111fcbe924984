"""The model a torch engine serves: an HF causal LM and its tokenizer on one device, and its weights' lifecycle.

A push stages its tensors next to the served ones (stage: copied to the device, the served weights unchanged); the
scheduler (scheduler.py) applies them between two steps, holding the model lock, when the commit's policy says so
(apply_staged); discard drops them. The lock also makes a scoring pass (score) wait for the step that runs.

Adapters (lora.py) are staged the same way, checked against the model's linear layers (stage_adapter), and become
resident at their commit (commit_adapter) under a key that is never reused. The served base weights' digest
(rollout_farm/services/adapters/digest.py) is computed from their bytes when they load and at each commit.
"""

from __future__ import annotations

import threading

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollout_farm.services.adapters.digest import base_digest, tensor_checksums
from rollout_farm.services.adapters.peft_format import LoraConfig, check_fit
from rollout_farm.services.engine.base import ScoredTokens
from rollout_farm.services.engine.torch.lora import LoraLayers, adapter_rows
from rollout_farm.services.weights.checks import WeightsRejected, non_finite
from rollout_farm.services.weights.state_dict import canonical_state_dict, spec_of

DIGESTS_KEPT = 16  # base versions whose digest stays known (digest_of)


class ServedModel:
    """Owns the HF `model` and `tokenizer` on `device`, the stop ids a call ends at unless it ignores EOS (`eos_ids`),
    the `pad_id`, the model `lock` (one decode step, scoring pass or weight update at a time), the served weight
    `version` and the staged weights (`staged`: (version, tensors) or None), the adapters' layers (`lora`) and the
    adapters staged for their commit, and the served weights' `digest`. The attributes are set here, once."""

    def __init__(self, model_path: str, device: str, dtype: str):
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = (
            AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(self.device).eval()
        )
        eos = self.model.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        self.eos_ids = set(eos) | ({self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set())
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(self.eos_ids)
        self.lock = threading.Lock()  # the model: one decode step, scoring pass or weight update at a time
        self._served = (0, "")  # (version, digest) as one value: a reader never sees a version with another's digest
        self._staged: tuple[int, dict[str, torch.Tensor]] | None = None
        self.lora = LoraLayers(self.model)
        self._staged_adapters: dict[str, tuple[dict, float]] = {}  # key -> (module -> (A, B), scaling)
        self._served = (0, self._digest())
        self._digests = {0: self._served[1]}  # version -> digest, of the last DIGESTS_KEPT versions served

    @property
    def version(self) -> int:
        """The weight version served now."""
        return self._served[0]

    @property
    def digest(self) -> str:
        """The served base weights' policy digest (rollout_farm/services/adapters/digest.py)."""
        return self._served[1]

    def served(self) -> tuple[int, str]:
        """(version, digest), read together."""
        return self._served

    @property
    def staged(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The weights staged for the next commit, (version, tensors on the device), or None."""
        return self._staged

    def score_staged_weights(self, version: int, sequences: list[list[int]]) -> list[list[float | None]]:
        """The probe's logprobs under the weights staged as `version`, swapped in for this one forward pass under
        the lock (rollout_farm/services/weights/probe.py's score_staged): no request sees them."""
        from rollout_farm.services.weights.probe import score_staged

        staged = self._staged
        if staged is None or staged[0] != version:
            raise WeightsRejected(f"version {version} is not staged here")
        with self.lock:
            return score_staged(self.model, staged[1], sequences)

    # weights ---------------------------------------------------------------
    def spec(self) -> dict[str, tuple[list[int], str]]:
        return spec_of(canonical_state_dict(self.model))

    def stage(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Hold `state_dict` (checked by the caller) as `version`, on the device, next to the served weights."""
        self._staged = (version, {n: t.to(self.device) for n, t in state_dict.items()})

    def discard(self, version: int) -> None:
        if self._staged is not None and self._staged[0] == version:
            self._staged = None

    def apply_staged(self) -> None:
        """Copy the staged tensors into the model (the scheduler thread, holding the lock); nothing when they were
        discarded meanwhile."""
        staged = self._staged
        if staged is not None:
            version, tensors = staged
            with torch.no_grad():
                params = canonical_state_dict(self.model)
                for name, t in tensors.items():
                    params[name].copy_(t)
            self._served, self._staged = (version, self._digest()), None
            self._digests[version] = self._served[1]
            for old in sorted(self._digests)[:-DIGESTS_KEPT]:
                del self._digests[old]

    def digest_of(self, version: int) -> str | None:
        """The digest of base version `version` when it was served lately (a sample that spans commits names the
        policy of each of its tokens); None when it is too old, or was never served here."""
        return self._digests.get(version)

    def _digest(self) -> str:
        return base_digest(*tensor_checksums(canonical_state_dict(self.model)))

    # adapters --------------------------------------------------------------
    def stage_adapter(self, key: str, config: LoraConfig, tensors: dict[str, torch.Tensor]) -> None:
        """Check an adapter against the model's linear layers (AdapterInvalid naming each misfit; WeightsRejected for
        NaN or inf) and hold it, on the device, for commit_adapter."""
        pairs = check_fit(config, spec_of(tensors), self.lora.shapes(), self.model.config.name_or_path)
        if problems := non_finite(tensors):
            raise WeightsRejected("; ".join(problems))
        on = {m: (tensors[a].to(self.device), tensors[b].to(self.device)) for m, (a, b) in pairs.items()}
        self._staged_adapters[key] = (on, config.scaling)

    def commit_adapter(self, key: str) -> None:
        """The staged adapter becomes resident (a no-op when it is already); KeyError when it was never staged."""
        if key in self.lora.resident():
            return
        pairs, scaling = self._staged_adapters.pop(key)
        with self.lock:
            self.lora.load(key, pairs, scaling)

    def discard_adapter(self, key: str) -> None:
        self._staged_adapters.pop(key, None)

    def staged_adapter_bytes(self, key: str) -> int:
        """The bytes staged adapter `key` will hold once resident (in the model's dtype: LoraLayers.load)."""
        pairs, _ = self._staged_adapters[key]
        size = next(self.model.parameters()).element_size()
        return sum((a.numel() + b.numel()) * size for a, b in pairs.values())

    def score_staged_adapter(self, key: str, sequences: list[list[int]]) -> list[list[float | None]]:
        """Each sequence's logprobs under the staged (not yet served) adapter `key`: the push's probe."""
        pairs, scaling = self._staged_adapters[key]
        probe = f"probe:{key}"  # no request can name it: adapter keys are name@vN
        with self.lock:
            self.lora.load(probe, pairs, scaling)
        try:
            return [s.logprobs for s in self.score(sequences, 0, probe)]
        finally:
            self.lora.retire(probe)

    # reading the model -----------------------------------------------------
    def score(self, sequences: list[list[int]], top_k: int, adapter: str | None = None) -> list[ScoredTokens]:
        """One forward pass per sequence, under the lock, on the weights being served (with `adapter`, resident)."""
        out = []
        with self.lock, torch.inference_mode(), adapter_rows(self.model, [adapter]):
            for ids in sequences:
                x = torch.tensor([ids], dtype=torch.long, device=self.device)
                logp = torch.log_softmax(self.model(input_ids=x).logits[0, :-1].float(), -1)  # position j predicts j+1
                chosen = logp.gather(-1, x[0, 1:, None]).squeeze(-1).tolist()
                top = torch.topk(logp, top_k, -1) if top_k else None
                alts = [list(zip(i.tolist(), v.tolist())) for v, i in zip(*top)] if top else [[] for _ in chosen]
                out.append(ScoredTokens([None, *chosen], [[], *alts]))
        return out

    def vocab_size(self) -> int:
        return max(len(self.tokenizer), self.model.config.vocab_size)

    def health_token_id(self) -> int:
        return self.tokenizer.bos_token_id if self.tokenizer.bos_token_id is not None else self.pad_id

    def context_length(self) -> int | None:
        return getattr(self.model.config, "max_position_embeddings", None)
