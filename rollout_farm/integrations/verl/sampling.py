"""verl's sampling_params dict -> the farm's SamplingParams. A key the farm cannot honour is refused by name.

verl's AgentLoopWorker.generate_sequences sends {temperature, top_p, top_k, repetition_penalty: 1.0, logprobs:
calculate_log_probs}; a caller may add max_tokens (or SGLang's max_new_tokens), as FullyAsyncLLMServerClient does.
Without one, the response length is rollout.response_length, the cap verl's vLLM server applies.
"""

from __future__ import annotations

from typing import Any

from rollout_farm.services.protocol import SamplingParams

SAME_NAME = ("temperature", "top_p", "seed", "stop_token_ids", "ignore_eos")  # the farm's own names and meanings
SUPPORTED = (*SAME_NAME, "top_k", "max_tokens", "max_new_tokens", "logprobs", "repetition_penalty")


def farm_sampling_params(sampling_params: dict[str, Any], response_length: int) -> tuple[SamplingParams, bool]:
    """The farm's params for verl's dict, and whether verl asked for logprobs (the farm always computes them).

    top_k 0 means "keep all" in verl's HF convention, as -1 does in vLLM's: both become the farm's -1.
    Raises ValueError naming the key for an unknown key, a repetition_penalty other than 1, top-n logprobs, or
    both max_tokens and max_new_tokens; pydantic's ValidationError (a ValueError) for a value out of range.
    """
    unknown = sorted(set(sampling_params) - set(SUPPORTED))
    if unknown:
        raise ValueError(
            f"sampling_params {unknown} cannot be honoured by the farm: drop them, or use only {', '.join(SUPPORTED)}"
        )
    if sampling_params.get("repetition_penalty", 1.0) != 1.0:
        raise ValueError("sampling_params repetition_penalty: the farm has no repetition penalty; use 1.0")
    logprobs = sampling_params.get("logprobs", False)
    if logprobs not in (True, False):
        raise ValueError(
            f"sampling_params logprobs={logprobs!r}: the farm returns the sampled token's logprob only; "
            "use True or False"
        )
    if "max_tokens" in sampling_params and "max_new_tokens" in sampling_params:
        raise ValueError("sampling_params has both max_tokens and max_new_tokens: give one")
    limit = sampling_params.get("max_tokens", sampling_params.get("max_new_tokens", response_length))
    fields = {k: sampling_params[k] for k in SAME_NAME if k in sampling_params}
    if "top_k" in sampling_params:
        fields["top_k"] = -1 if sampling_params["top_k"] == 0 else sampling_params["top_k"]
    return SamplingParams(**fields, max_new_tokens=limit), bool(logprobs)
