"""FarmLLMServerClient: the object verl's agent loops call as `self.server_manager`, answered by the farm.

verl 0.9.1's AgentLoopWorker hands its LLMServerClient to every agent loop; SingleTurnAgentLoop and ToolAgentLoop
call `await server_manager.generate(request_id=..., prompt_ids=..., sampling_params=..., image_data=...,
audio_data=..., video_data=..., mm_processor_output=..., mm_processor_kwargs=..., priority=...)` and read a
TokenOutput. Here each call is one POST /v1/rollouts with one prompt (verl repeats a prompt rollout.n times itself).
"""

from __future__ import annotations

import asyncio
import os
import uuid
from typing import Any

from omegaconf import DictConfig
from verl.utils.rollout_trace import rollout_trace_op
from verl.utils.tokenizer.tokenizer import normalize_token_ids
from verl.workers.rollout.llm_server import LLMServerClient
from verl.workers.rollout.replica import TokenOutput

from rollout_farm.integrations.verl.sampling import farm_sampling_params
from rollout_farm.services import protocol as P
from rollout_farm.services.client import AsyncFarmClient

LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs")  # verl's rollout.logprobs_mode values the farm can serve
STOP_REASONS = {"stop": "completed", "length": "completed", "abort": "aborted"}  # as verl's vLLM server maps them


class FarmLLMServerClient(LLMServerClient):
    """verl's LLMServerClient over the farm's HTTP API.

    The farm is found at `url`, else `actor_rollout_ref.rollout.custom.farm_url`, else $FARM_URL; the token is
    `token`, else $FARM_API_TOKEN. `rollout.logprobs_mode` picks the logprobs verl gets back: processed_logprobs
    (verl's default, vLLM's meaning) are the farm's `sampling_logprobs`, those of the distribution sampled
    (temperature, top-k, top-p); raw_logprobs are the farm's `logprobs`, the model's at temperature 1. A greedy
    sample has no sampled distribution, so it gets the model's logprobs, as vLLM gives a greedy request.
    extra_fields["global_steps"] (and min_/max_global_steps) is the sample's weight version: push weights with
    version=global_steps (weights.push_state_dict) and verl's staleness metrics read the trainer steps.
    """

    def __init__(self, config: DictConfig, url: str | None = None, token: str | None = None, **kwargs):
        super().__init__(config=config, load_balancer_handle=None)
        rollout = config.actor_rollout_ref.rollout
        self.url = url or (rollout.get("custom") or {}).get("farm_url") or os.environ.get("FARM_URL")
        if not self.url:
            raise ValueError("no farm URL: pass url=, set actor_rollout_ref.rollout.custom.farm_url, or set FARM_URL")
        self.token = token if token is not None else os.environ.get("FARM_API_TOKEN")
        self.response_length = int(rollout.response_length)
        self.logprobs_mode = rollout.get("logprobs_mode") or "processed_logprobs"
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"actor_rollout_ref.rollout.logprobs_mode={self.logprobs_mode!r}: the farm serves "
                f"{' or '.join(LOGPROBS_MODES)}"
            )
        self._farm, self._loop = None, None

    def __getstate__(self) -> dict:
        """Pickled for Ray (AgentLoopManager sends the client to its workers) without the HTTP client."""
        return {**self.__dict__, "_farm": None, "_loop": None}

    def farm(self) -> AsyncFarmClient:
        """The HTTP client of the running event loop (an httpx.AsyncClient is bound to the loop it first ran on)."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._farm, self._loop = AsyncFarmClient(self.url, self.token), loop
        return self._farm

    @rollout_trace_op
    async def generate(
        self,
        request_id,
        *,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        image_data: list[Any] | None = None,
        video_data: list[Any] | None = None,
        audio_data: list[Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> TokenOutput:
        """One sample for prompt_ids. verl's request_id (its sticky-session key, the same for every turn of a
        trajectory) is the farm's routing_key: a multi-turn trajectory's turns (ToolAgentLoop's) go to one engine
        replica, whose KV cache saves the prefill of the earlier turns (verl builds each turn's prompt ids as the
        last prompt, its response and the new tokens, which is what the cache matches). The farm's own request_id
        is an idempotency key, so each call gets a fresh one, as verl's own client does for vLLM. `priority` is
        dropped: the farm has no request priorities (verl drops it for SGLang too). Images, video and audio are
        refused: the farm serves text-only models."""
        media = {"image_data": image_data, "video_data": video_data, "audio_data": audio_data}
        media["mm_processor_output"] = kwargs.pop("mm_processor_output", None)
        given = sorted(k for k, v in media.items() if v)
        if given:
            raise ValueError(f"generate got {given}: the farm serves text-only models; drop the multimodal inputs")
        kwargs.pop("priority", None)
        if kwargs:
            raise ValueError(f"generate got arguments the farm cannot honour: {sorted(kwargs)}")
        params, want_logprobs = farm_sampling_params(sampling_params, self.response_length)
        prompt = P.Prompt(token_ids=normalize_token_ids(prompt_ids))
        req = P.RolloutRequest(
            prompts=[prompt], sampling_params=params, request_id=uuid.uuid4().hex, routing_key=str(request_id)[:128]
        )
        sample = (await self.farm().rollouts(req)).groups[0].samples[0]
        return self.token_output(sample, want_logprobs)

    def token_output(self, sample: P.Sample, want_logprobs: bool) -> TokenOutput:
        """verl's TokenOutput for a farm sample; a sample that failed in the farm (finish_reason 'error') raises."""
        if sample.finish_reason == "error":
            raise RuntimeError(
                f"the farm failed this sample (finish_reason 'error', text {sample.text!r}): see its logs"
            )
        version = sample.weight_version  # verl's base client sets min_/max_global_steps from its server's steps
        extra = {"global_steps": version, "min_global_steps": version, "max_global_steps": version}
        return TokenOutput(
            token_ids=sample.token_ids,
            log_probs=self.logprobs(sample) if want_logprobs else None,
            stop_reason=STOP_REASONS[sample.finish_reason],
            extra_fields=extra,
        )

    def logprobs(self, sample: P.Sample) -> list[float]:
        """The logprobs of `logprobs_mode` (see the class); raises where the farm has no processed ones."""
        if self.logprobs_mode == "raw_logprobs":
            return sample.logprobs
        if sample.sampling_logprobs is not None:
            return sample.sampling_logprobs
        if sample.sampled_with is not None and sample.sampled_with.temperature == 0:
            return sample.logprobs
        raise ValueError(
            "the farm returned no sampling_logprobs for this sample (its engine cannot report them, e.g. SGLang, or a "
            "regex forced a token): set actor_rollout_ref.rollout.logprobs_mode=raw_logprobs"
        )
