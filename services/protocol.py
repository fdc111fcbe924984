"""Wire contracts of the rollout service, shared by the service and the client.

Only data lives here: request and response models with a comment on each field.
Field names follow SGLang's sampling params (temperature, top_p, top_k,
max_new_tokens, stop_token_ids, seed) so that users of SGLang recognise them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

API_VERSION = "v1"
MAX_N = 64  # most samples per prompt in one request
MAX_PROMPTS = 512  # most prompts in one request
MAX_NEW_TOKENS = 4096  # most tokens one sample may generate

FinishReason = Literal["stop", "length", "abort", "error"]
InFlightPolicy = Literal["finish", "abort", "partial"]


class SamplingParams(BaseModel):
    """How each sample is drawn. Logprobs are always those of the raw model (see README)."""

    temperature: float = Field(1.0, ge=0.0, le=100.0, description="Softmax temperature; 0 means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass, in (0, 1].")
    top_k: int = Field(-1, ge=-1, description="Keep the k most likely tokens; -1 keeps all.")
    max_new_tokens: int = Field(128, ge=1, le=MAX_NEW_TOKENS, description="Most tokens to generate per sample.")
    stop_token_ids: list[int] = Field(default_factory=list, description="Extra token ids that end a sample (EOS always does).")
    ignore_eos: bool = Field(False, description="Keep generating past EOS, up to max_new_tokens (stop_token_ids still stop).")
    seed: int | None = Field(None, ge=0, lt=2**63, description="Seed for reproducible sampling of an identical request.")
    regex: str | None = Field(None, max_length=2000, description="Constrain each sample's text to match this regular expression in full "
                              "(SGLang's `regex`; the torch engine masks the tokens that would leave it). EOS is allowed only on a full match.")

    @model_validator(mode="after")
    def _top_k_not_zero(self) -> "SamplingParams":
        if self.top_k == 0:
            raise ValueError("top_k=0 keeps no token: use -1 to keep all, or a positive k")
        return self

    @field_validator("regex")
    @classmethod
    def _regex_compiles(cls, v: str | None) -> str | None:
        if v is not None:
            import regex

            try:
                regex.compile(v)
            except regex.error as e:
                raise ValueError(f"not a valid regular expression: {e}") from None
        return v


class Prompt(BaseModel):
    """One prompt: either text or token ids, plus what the reward function compares with."""

    text: str | None = Field(None, description="Prompt text; tokenized by the service without special tokens.")
    token_ids: list[int] | None = Field(None, description="Prompt token ids; used instead of text.")
    ground_truth: str | None = Field(None, description="Reference answer handed to the reward function.")

    @model_validator(mode="after")
    def _exactly_one(self) -> "Prompt":
        if (self.text is None) == (self.token_ids is None):
            raise ValueError("give exactly one of 'text' or 'token_ids'")
        if self.text is not None and not self.text:
            raise ValueError("text is empty: give a non-empty prompt")
        if self.token_ids is not None and not self.token_ids:
            raise ValueError("token_ids is empty: give at least one token id")
        return self


class PolicyStats(BaseModel):
    """POST /v1/policy_stats: what the trainer reports about its policy; samplers read it, /metrics exports it."""

    model_config = ConfigDict(extra="forbid")

    kl: float | None = Field(None, ge=0, description="KL between the current and the reference (or behaviour) policy, as the trainer estimates it.")
    reward_var: float | None = Field(None, ge=0, description="Variance of the rewards of the last batch.")
    step: int | None = Field(None, ge=0, description="The trainer's step.")


class SamplerSpec(BaseModel):
    """A registered sampler and its params (GET /v1/samplers lists them)."""

    name: str = Field("plain", description="Registered sampler name.")
    params: dict = Field(default_factory=dict, description="The sampler's own params; checked by the sampler.")


class RolloutRequest(BaseModel):
    """POST /v1/rollouts: n samples for each prompt, scored by a reward function."""

    prompts: list[Prompt] = Field(..., min_length=1, max_length=MAX_PROMPTS, description="The prompts, one group each.")
    n: int = Field(1, ge=1, le=MAX_N, description=f"Samples per prompt, 1..{MAX_N}.")
    sampling_params: SamplingParams = Field(default_factory=SamplingParams, description="Shared by every sample.")
    sampler: SamplerSpec = Field(default_factory=SamplerSpec, description="How each group is drawn.")
    reward: str | None = Field(None, description="Registered reward function name, or none for reward 0.")
    min_weight_version: int = Field(0, ge=0, description="Run only on replicas serving this weight version or later (waits for it).")
    request_id: str | None = Field(None, min_length=1, max_length=128,
                                   description="Idempotency key: a retry with the same id returns the first result and generates nothing.")
    stream: bool = Field(False, description="Answer NDJSON, one line per group as it finishes (a GroupEvent), then a StreamEnd line.")


class Sample(BaseModel):
    """One trajectory. A failed sample carries finish_reason 'error' instead of failing the batch."""

    token_ids: list[int] = Field(..., description="Generated token ids, the stop token included.")
    logprobs: list[float] = Field(..., description="Raw-model log-probability of each generated token.")
    text: str = Field(..., description="Decoded generated text, special tokens skipped.")
    finish_reason: FinishReason = Field(..., description="Why generation ended.")
    reward: float = Field(0.0, description="Reward function's score of this sample.")
    weight_version: int = Field(..., description="Weight version of the first token (the oldest, when a commit landed mid-sample).")
    token_weight_versions: list[int] | None = Field(None, description="Version of each token; only set when they differ (in-flight policy 'partial').")
    sampler_meta: dict = Field(default_factory=dict, description="What the sampler reports about this sample.")


class Group(BaseModel):
    """The n samples of one prompt and their reward statistics."""

    prompt_token_ids: list[int] = Field(..., description="The prompt as the engine saw it.")
    samples: list[Sample]
    reward_mean: float
    reward_std: float = Field(..., description="Population std of the group's rewards.")
    zero_variance: bool = Field(..., description="True when every reward in the group is equal (std < 1e-6).")
    prompt_index: int | None = Field(None, description="The prompt's index in the request (a filtering sampler returns only some).")
    candidates: int | None = Field(None, description="Samples generated for this group, when the sampler may generate more than n.")
    rejected: int | None = Field(None, description="Candidates the sampler rejected (pattern_conditional: those not matching).")
    generated_tokens: int | None = Field(None, description="Tokens of every candidate generated for this group (returned or not).")


class FilterReport(BaseModel):
    """What dynamic_group_filter generated and kept: the zero-variance fraction and the over-sampling waste."""

    target_groups: int = Field(..., description="Informative groups asked for.")
    target_reached: bool
    generated_groups: int = Field(..., description="Groups that finished generating.")
    kept_groups: int
    zero_variance_groups: int = Field(..., description="Dropped: reward std within std_tolerance.")
    zero_variance_fraction: float = Field(..., description="zero_variance_groups / generated_groups.")
    surplus_groups: int = Field(..., description="Informative groups that finished after the target was reached (dropped).")
    cancelled_groups: int = Field(..., description="Groups still generating when the target was reached: their engine work was aborted.")
    generated_tokens: int = Field(..., description="Tokens of every candidate of every finished group (cancelled work not included).")
    kept_tokens: int
    waste_fraction: float = Field(..., description="1 - kept_tokens / generated_tokens: the over-sampling waste.")


class RolloutResponse(BaseModel):
    groups: list[Group] = Field(..., description="One group per prompt, in request order (dynamic_group_filter: the kept ones).")
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
    status: int | None = Field(None, description="With an error: the HTTP status it would have had (409 cancelled or version not reached, 429 queues full).")
    filter: FilterReport | None = Field(None, description="Set by dynamic_group_filter.")


class CancelResponse(BaseModel):
    request_id: str
    cancelled: bool = Field(..., description="False when no request with this id was running.")


# The pull-mode trajectory queue: the service generates from a registered prompt source in the
# background; a trainer pulls leased groups and acks them.


class QueueSource(BaseModel):
    """POST /v1/queue/sources: register a prompt source; the service keeps `target_groups` groups ready from it."""

    name: str = Field(..., pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="Source name: letters, digits, '_', '.', '-'.")
    dataset: Literal["arith", "gsm8k"] | None = Field(None, description="A dataset in the repo (its train split, cycled); or none, to add prompts later.")
    prompts: list[Prompt] = Field(default_factory=list, max_length=100_000, description="Prompts to start with (more: POST .../prompts).")
    n: int = Field(4, ge=1, le=MAX_N, description="Samples per prompt (one group).")
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    sampler: SamplerSpec = Field(default_factory=SamplerSpec)
    reward: str | None = Field(None, description="Registered reward name; defaults to the dataset's reward.")
    target_groups: int = Field(8, ge=1, le=4096, description="Groups kept generated ahead of the trainer.")
    seed: int = Field(0, ge=0, description="Order of the dataset's prompts.")

    @model_validator(mode="after")
    def _dataset_or_prompts(self) -> "QueueSource":
        if self.dataset and self.prompts:
            raise ValueError("give a dataset or prompts, not both")
        return self


class QueuePrompts(BaseModel):
    """POST /v1/queue/sources/{name}/prompts as JSON (or send JSONL: one Prompt per line)."""

    prompts: list[Prompt] = Field(..., min_length=1, max_length=100_000)


class QueueSourceState(BaseModel):
    name: str
    dataset: str | None
    pending_prompts: int = Field(..., description="Prompts not yet generated (a dataset source cycles: 0 means endless).")
    ready: int = Field(..., description="Groups generated and waiting to be pulled.")
    leased: int = Field(..., description="Groups pulled and not yet acked.")
    acked: int
    redelivered: int = Field(..., description="Groups delivered again after their lease expired.")
    stale_dropped: int = Field(..., description="Groups dropped for exceeding a pull's max_staleness (their prompts are generated again).")
    generating: bool
    error: str | None = Field(None, description="The last generation failure, if the newest attempt failed.")


class PullRequest(BaseModel):
    """POST /v1/queue/pull: lease up to max_groups groups from a source."""

    source: str
    max_groups: int = Field(8, ge=1, le=4096)
    max_staleness: int | None = Field(None, ge=0, description="Largest allowed gap between the current version and a group's; older groups are dropped and generated again.")
    lease_s: float = Field(300.0, gt=0, le=86400, description="Seconds until unacked groups are delivered again.")
    wait_s: float = Field(0.0, ge=0, le=600, description="Wait up to this long for at least one group.")


class QueueItem(BaseModel):
    item_id: str = Field(..., description="Unique per group; the same on redelivery, so a trainer can drop a duplicate.")
    prompt: Prompt
    group: Group
    weight_version: int = Field(..., description="The oldest weight version among the group's tokens.")
    deliveries: int = Field(..., description="1 on first delivery; more after lease expiries.")


class PullResponse(BaseModel):
    lease_id: str
    lease_expires_s: float = Field(..., description="Seconds from now until these groups are delivered again unless acked.")
    current_version: int = Field(..., description="The committed weight version when pulled.")
    items: list[QueueItem]
    stale_dropped: int = Field(0, description="Groups this pull dropped as too stale.")


class AckRequest(BaseModel):
    """POST /v1/queue/ack: the groups the trainer has used. Acking twice is harmless."""

    item_ids: list[str] = Field(..., min_length=1, max_length=100_000)


class AckResponse(BaseModel):
    acked: list[str] = Field(..., description="Newly acked.")
    already_acked: list[str] = Field(..., description="Acked before: nothing changes.")
    unknown: list[str] = Field(..., description="Ids this service never delivered (a typo, or a source that was removed or added again).")


class WeightsFromPath(BaseModel):
    """POST /v1/weights/path: load a folder of safetensors files that every replica can read."""

    path: str = Field(..., min_length=1, description="Folder with *.safetensors files (a shared volume in a cluster).")
    version: int = Field(..., ge=1, description="The new version; higher than the served one.")
    policy: InFlightPolicy = Field("finish", description="What happens to in-flight samples at the commit.")


class DistributedGroup(BaseModel):
    """POST /v1/weights/distributed/init: SGLang's init_weights_update_group, on every replica."""

    master_address: str
    master_port: int = Field(..., ge=1, le=65535)
    rank_offset: int = Field(..., ge=0)
    world_size: int = Field(..., ge=2)
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class DistributedUpdate(BaseModel):
    """POST /v1/weights/distributed: SGLang's update_weights_from_distributed; the trainer broadcasts the tensors."""

    names: list[str] = Field(..., min_length=1)
    dtypes: list[str] = Field(..., min_length=1)
    shapes: list[list[int]] = Field(..., min_length=1)
    version: int = Field(..., ge=1)
    group_name: str = "weight_update_group"


class WeightsVersion(BaseModel):
    version: int = Field(..., description="The weight version every replica serves.")
    replicas: dict[str, int] = Field(default_factory=dict, description="Version reported by each replica.")


class WeightsPushResponse(BaseModel):
    version: int = Field(..., description="The version now served.")
    tensors: int = Field(..., description="Tensors loaded.")
    bytes: int = Field(..., description="Size of the upload.")
    seconds: float = Field(..., description="Time from upload received to every replica serving it.")


class Health(BaseModel):
    status: Literal["ok", "paused"] = Field(..., description="'paused' while sampling is paused; nothing is generated then.")
    weight_version: int
    generated_token_id: int | None = Field(None, description="The token the engine generated to prove it works.")


class ReplicaState(BaseModel):
    replica: str = Field(..., description="Ray Serve replica id.")
    weight_version: int
    paused: bool
    busy: bool = Field(False, description="A generate call is running.")
    generated_tokens: int = Field(0, description="Tokens this replica has generated since it started.")


class ControlResponse(BaseModel):
    """POST /v1/pause, /v1/resume, /v1/abort: the state of every replica after the action."""

    action: Literal["pause", "resume", "abort"]
    replicas: list[ReplicaState]


class Readiness(BaseModel):
    """GET /readyz: ready when no replica is paused and all serve one weight version."""

    ready: bool
    replicas: list[ReplicaState]


class ErrorResponse(BaseModel):
    """Every 4xx/5xx body: what went wrong, where, and how to fix it."""

    error: str
    detail: list[dict] = Field(default_factory=list, description="Per-field errors: field, message.")


# OpenAI-compatible endpoints, so evaluation tools (lm-eval and similar) can score the current policy.


class CompletionRequest(BaseModel):
    """POST /v1/completions, the subset of OpenAI's fields that a local policy can honour."""

    model: str | None = Field(None, description="Ignored: the service serves one policy.")
    prompt: str | list[str] = Field(..., description="One prompt or several.")
    max_tokens: int = Field(16, ge=1, le=MAX_NEW_TOKENS)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = Field(None, description="Text at which a choice ends (not included).")
    seed: int | None = Field(None, ge=0, lt=2**63)
    logprobs: int | None = Field(None, ge=0, le=0, description="0 returns the sampled tokens' logprobs; alternatives (1..5) are not available.")


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatCompletionRequest(BaseModel):
    """POST /v1/chat/completions; messages go through the model's chat template."""

    model: str | None = Field(None, description="Ignored: the service serves one policy.")
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS, description="Deprecated OpenAI name of max_completion_tokens.")
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    logprobs: bool = Field(False, description="Return the sampled tokens' logprobs.")
    top_logprobs: int | None = Field(None, ge=0, le=0, description="Alternatives are not available: only 0.")
