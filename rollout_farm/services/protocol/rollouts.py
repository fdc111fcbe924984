"""POST /v1/rollouts and what it returns: groups of samples, streamed or whole; the policy stats samplers read."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_serializer

from rollout_farm.services.protocol.adapters import AdapterRef, Policy
from rollout_farm.services.protocol.common import (
    MAX_N,
    MAX_PROMPTS,
    FinishReason,
    Float,
    Int64,
    Prompt,
    RequestModel,
    SamplingParams,
    Text,
)


class PolicyStats(RequestModel):
    """POST /v1/policy_stats: what the trainer reports about its policy; samplers read it, /metrics exports it."""

    model_config = ConfigDict(extra="forbid")

    kl: Float | None = Field(
        None,
        ge=0,
        description="KL between the current and the reference (or behaviour) policy, as the trainer estimates it.",
    )
    reward_var: Float | None = Field(None, ge=0, description="Variance of the rewards of the last batch.")
    step: Int64 | None = Field(None, ge=0, description="The trainer's step.")


class SamplerSpec(RequestModel):
    """A registered sampler and its params (GET /v1/samplers lists them)."""

    name: Text = Field("plain", description="Registered sampler name.")
    params: dict = Field(default_factory=dict, description="The sampler's own params; checked by the sampler.")


class RolloutRequest(RequestModel):
    """POST /v1/rollouts: n samples for each prompt, scored by a reward function."""

    prompts: list[Prompt] = Field(..., min_length=1, max_length=MAX_PROMPTS, description="The prompts, one group each.")
    n: int = Field(1, ge=1, le=MAX_N, description=f"Samples per prompt, 1..{MAX_N}.")
    sampling_params: SamplingParams = Field(default_factory=SamplingParams, description="Shared by every sample.")
    sampler: SamplerSpec = Field(default_factory=SamplerSpec, description="How each group is drawn.")
    reward: Text | None = Field(None, description="Registered reward function name, or none for reward 0.")
    min_weight_version: Int64 = Field(
        0, ge=0, description="Run only on replicas serving this weight version or later (waits for it)."
    )
    adapter: AdapterRef | None = Field(
        None,
        description="Sample from this LoRA adapter (an exact version, or the newest from min_version); null: the "
        "base model. 404 for an unknown adapter, 409 naming the resident window for a version outside it.",
    )
    routing_key: str | None = Field(
        None,
        min_length=1,
        max_length=128,
        pattern="^[ -~]*$",  # printable ASCII: Serve sends it as the multiplexed model id, and cannot encode others
        description="Requests with the same key go to the same engine replica while it is healthy, and the torch "
        "engine keeps the KV cache of the key's last sequence (one prompt, n=1), so a request whose prompt extends it "
        "prefills only its new tokens. Sessions use their id.",
    )
    request_id: Text | None = Field(
        None,
        min_length=1,
        max_length=128,
        description="Idempotency key: a retry with the same id returns the first result and generates nothing.",
    )
    stream: bool = Field(
        False, description="Answer NDJSON, one line per group as it finishes (a GroupEvent), then a StreamEnd line."
    )
    # set by the ingress, never sent: the exact adapter version `adapter` resolved to, and its policy digest
    _resolved_adapter: tuple[AdapterRef, str] | None = PrivateAttr(None)


class SampledWith(BaseModel):
    """The sampling params a sample was actually drawn with: a sampler (kl_adaptive_temperature) may change the
    request's."""

    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(..., description="Softmax temperature; 0 means greedy.")
    top_p: float = Field(..., description="Nucleus sampling mass; 1 keeps all.")
    top_k: int = Field(..., description="The k most likely tokens kept; -1 keeps all.")
    regex: bool = Field(
        False, description="Whether a regex constraint restricted the tokens: the raw logprobs are then not q."
    )

    def raw_is_q(self) -> bool:
        """Derived, not a field: whether the raw logprobs are those of the distribution sampled (temperature 1, no
        top-p, no top-k, no regex), so that they are q where an engine (SGLang) reports no sampling logprobs."""
        return self.temperature == 1.0 and self.top_p >= 1.0 and self.top_k <= 0 and not self.regex


class SampledSpan(BaseModel):
    """One turn of a multi-turn sample: its tokens and the params they were drawn with."""

    model_config = ConfigDict(extra="forbid")

    start: int = Field(..., description="The turn's first token, an index into the sample's token_ids.")
    end: int = Field(..., description="One past its last token.")
    sampled_with: SampledWith = Field(..., description="The params this turn was drawn with, after the sampler's plan.")


class Sample(BaseModel):
    """One trajectory. A failed sample carries finish_reason 'error' instead of failing the batch."""

    token_ids: list[int] = Field(..., description="Generated token ids, the stop token included.")
    logprobs: list[float] = Field(
        ...,
        description="Raw-model log-probability of each generated token: log_softmax of the logits at temperature 1, "
        "before top-k/top-p, whatever the sampling params (the PPO ratio's old logprob).",
    )
    sampling_logprobs: list[float] | None = Field(
        None,
        description="Log-probability of each generated token under the distribution actually sampled (see "
        "sampled_with): the logits divided by the temperature, top-k and top-p applied, renormalised. None for "
        "greedy samples (temperature 0), for engines that cannot report it (SGLang), and when a regex constraint "
        "forced a token outside that distribution. With a regex constraint it is the constrained distribution the "
        "token was drawn from: restricted to the tokens the regex allows and renormalised (None when its normaliser "
        "is too costly to compute). For a multi-turn sample, None when any turn's is unknown; 0.0 on context tokens.",
    )
    sampled_with: SampledWith | None = Field(
        None,
        description="The sampling params this sample was drawn with, after the sampler's plan (a multi-turn "
        "sample: its first turn's; each turn's are in sampled_turns).",
    )
    sampled_turns: list[SampledSpan] | None = Field(
        None,
        description="A multi-turn sample's turns, each with the params it was drawn with (a sampler may change "
        "them between turns): the trainer reads each token's temperature from its turn. None: one draw, "
        "sampled_with.",
    )
    text: str = Field(..., description="Decoded generated text, special tokens skipped.")
    finish_reason: FinishReason = Field(..., description="Why generation ended.")
    reward: float = Field(0.0, description="Reward function's score of this sample.")
    weight_version: int = Field(
        ..., description="Weight version of the first token (the oldest, when a commit landed mid-sample)."
    )
    token_weight_versions: list[int] | None = Field(
        None, description="Version of each token; only set when they differ (in-flight policy 'partial')."
    )
    policy: Policy | None = Field(
        None,
        description="The policy that drew it: base version, adapter and version, and the digest of their bytes "
        "(docs/tenants.md); the first token's where a commit landed mid-sample (then see policies). Null from engines "
        "that run no model.",
    )
    policies: list[Policy] | None = Field(
        None,
        description="Only for a sample whose tokens span a base weight commit (in-flight policy 'partial'; then "
        "token_weight_versions is set): every policy that drew it, in token order, one per base version, the first "
        "equal to `policy`. Token i's policy is the one whose base_version is token_weight_versions[i] "
        "(Sample.token_policies). A digest is null where the replica no longer knew that version's. A sample on an "
        "adapter never spans a commit (its rollout is a 409 instead). Null: every token is from `policy`.",
    )
    sampler_meta: dict = Field(default_factory=dict, description="What the sampler reports about this sample.")
    loss_mask: list[int] | None = Field(
        None,
        description="Per token: 1 where the model sampled it (trained), 0 on context inside the response (a "
        "multi-turn episode's tool results and template tokens). None: every token is sampled.",
    )

    def token_policies(self) -> list[Policy | None]:
        """Derived, not a field (not sent): each generated token's policy, from policies and token_weight_versions
        (every token's is `policy` when the sample spans no commit)."""
        if not self.policies or not self.token_weight_versions:
            return [self.policy] * len(self.token_ids)
        by_version = {p.base_version: p for p in self.policies}
        return [by_version.get(v) for v in self.token_weight_versions]


class Group(BaseModel):
    """The n samples of one prompt and their reward statistics."""

    prompt_token_ids: list[int] = Field(..., description="The prompt as the engine saw it.")
    samples: list[Sample]
    reward_mean: float
    reward_std: float = Field(..., description="Population std of the group's rewards.")
    zero_variance: bool = Field(..., description="True when every reward in the group is equal (std < 1e-6).")
    prompt_index: int | None = Field(
        None, description="The prompt's index in the request (a filtering sampler returns only some)."
    )
    candidates: int | None = Field(
        None, description="Samples generated for this group, when the sampler may generate more than n."
    )
    rejected: int | None = Field(
        None, description="Candidates the sampler rejected (pattern_conditional: those not matching)."
    )
    generated_tokens: int | None = Field(
        None, description="Tokens of every candidate generated for this group (returned or not)."
    )

    def oldest_version(self, default: int | None = None) -> int | None:
        """Derived, not a field (not sent): the oldest weight version among the group's tokens, each sample's
        token_weight_versions or else its weight_version; `default` for a group without samples."""
        return min((min(s.token_weight_versions or [s.weight_version]) for s in self.samples), default=default)


class FilterReport(BaseModel):
    """What dynamic_group_filter generated and kept: the zero-variance fraction and the over-sampling waste."""

    target_groups: int = Field(..., description="Informative groups asked for.")
    target_reached: bool
    generated_groups: int = Field(..., description="Groups that finished generating.")
    kept_groups: int
    zero_variance_groups: int = Field(..., description="Dropped: reward std within std_tolerance.")
    zero_variance_fraction: float = Field(..., description="zero_variance_groups / generated_groups.")
    surplus_groups: int = Field(
        ..., description="Informative groups that finished after the target was reached (dropped)."
    )
    cancelled_groups: int = Field(
        ..., description="Groups still generating when the target was reached: their engine work was aborted."
    )
    generated_tokens: int = Field(
        ..., description="Tokens of every candidate of every finished group (cancelled work not included)."
    )
    kept_tokens: int
    waste_fraction: float = Field(..., description="1 - kept_tokens / generated_tokens: the over-sampling waste.")


class RolloutResponse(BaseModel):
    groups: list[Group] = Field(
        ..., description="One group per prompt, in request order (dynamic_group_filter: the kept ones)."
    )
    filter: FilterReport | None = Field(None, description="Set by dynamic_group_filter.")


class GroupEvent(BaseModel):
    """One NDJSON line of a streamed rollout: a finished group and its prompt's index in the request."""

    index: int
    group: Group


class StreamEnd(BaseModel):
    """The last NDJSON line of a streamed rollout; `error` is set when it ended early."""

    done: bool = True
    groups: int = Field(..., description="Groups sent before this line.")
    error: str | None = None
    status: int | None = Field(
        None,
        description="With an error: the HTTP status it would have had (409 cancelled or version not reached, "
        "429 queues full).",
    )
    filter: FilterReport | None = Field(None, description="Set by dynamic_group_filter.")


class CancelResponse(BaseModel):
    request_id: str
    cancelled: bool = Field(..., description="False when no request with this id was running.")
    groups: list[Group] | None = Field(
        None,
        description="With ?partial=true: what the request generated up to the cut, for a trainer to recycle: its "
        "finished groups whole, and the samples cut short finished 'abort' with their tokens and logprobs so far; "
        "every sample carries token_weight_versions (one per token). Absent otherwise.",
    )

    @model_serializer(mode="wrap")
    def _absent_groups(self, dump):
        """`groups` is absent, not null, without ?partial=true: on the wire and in `farm cancel` alike."""
        out = dump(self)
        if out.get("groups") is None:
            out.pop("groups", None)
        return out
