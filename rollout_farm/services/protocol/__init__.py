"""Wire contracts of the rollout service, shared by the service and the client: `from rollout_farm.services import
protocol as P` inside the project, `from rollout_farm.protocol import ...` for users.

Only data lives here: request and response models with a comment on each field, one module per API area.
Field names follow SGLang's sampling params (temperature, top_p, top_k, max_new_tokens, stop_token_ids, seed)
so that users of SGLang recognise them, and OpenAI's on the OpenAI-compatible endpoints.

| module | owns |
| --- | --- |
| `common.py` | what every area shares: limits, `SamplingParams`, `Prompt`, the error body, the input checks |
| `rollouts.py` | `POST /v1/rollouts` and its groups, streamed events, the filter report, policy stats |
| `sessions.py` | sessions: open, a token turn, an OpenAI chat turn with tools, rewards, the trajectory's segments |
| `episodes.py` | episodes run in the farm: the environment and its params, limits, episode groups, the stream's end |
| `episode_groups.py` | `as_group`: an episode group as a rollout group (a pure function, for the queue and trainer) |
| `queue.py` | the trajectory queue: sources, prompts, pulls, leases, acks |
| `weights.py` | weight pushes (upload, path, NCCL) and the served versions |
| `adapters.py` | LoRA adapters: pushes, versions, the `AdapterRef` a request names, a sample's `Policy`; tenants |
| `control.py` | health, readiness, and the control of every replica |
| `openai.py` | the OpenAI-compatible requests; a field the farm cannot honour is a 422 naming it |
| `anthropic.py` | Anthropic's Messages requests on a session (anthropic SDK 2.17.0), its blocks; unserved: a 422 |
| `responses.py` | OpenAI's Responses requests on a session (openai 3.57), its input items; unserved ones a 422 |
| `sglang_native.py` | SGLang 0.5.14's native requests (`/generate`, weight and control routes), SGLang's names |
| `vllm_tokens.py` | vLLM's token route request (`/inference/v1/generate`), vLLM's names |
| `tinker.py` | Tinker's sampling requests and answers (the tinker SDK 0.38.0), Tinker's names; unserved fields a 422 |
"""

from rollout_farm.services.protocol.adapters import (
    AdapterFromPath,
    AdapterInfo,
    AdapterList,
    AdapterPushResponse,
    AdapterRef,
    AdapterVersion,
    Policy,
    TenantInfo,
    TenantList,
    TenantQuota,
    TenantToken,
)
from rollout_farm.services.protocol.common import (
    API_VERSION,
    FLOAT32_TINY,
    INT64_MAX,
    MAX_N,
    MAX_NEW_TOKENS,
    MAX_PROMPTS,
    MAX_STOPS,
    MIN_TEMPERATURE,
    ErrorResponse,
    FinishReason,
    Float,
    InFlightPolicy,
    Int64,
    NonEmptyText,
    Prompt,
    RequestModel,
    SamplingParams,
    Temperature,
    Text,
    TokenId,
)
from rollout_farm.services.protocol.control import ControlResponse, DraftCounts, Health, Readiness, ReplicaState
from rollout_farm.services.protocol.openai import ChatCompletionRequest, ChatMessage, CompletionRequest
from rollout_farm.services.protocol.queue import (
    AckRequest,
    AckResponse,
    PullRequest,
    PullResponse,
    QueueItem,
    QueuePrompts,
    QueueSource,
    QueueSourceState,
)
from rollout_farm.services.protocol.rollouts import (
    CancelResponse,
    FilterReport,
    Group,
    GroupEvent,
    PolicyStats,
    RolloutRequest,
    RolloutResponse,
    Sample,
    SampledSpan,
    SampledWith,
    SamplerSpec,
    StreamEnd,
)
from rollout_farm.services.protocol.weights import (
    DistributedGroup,
    DistributedUpdate,
    WeightsFromPath,
    WeightsPushResponse,
    WeightsVersion,
)

__all__ = [
    "AdapterFromPath",
    "AdapterInfo",
    "AdapterList",
    "AdapterPushResponse",
    "AdapterRef",
    "AdapterVersion",
    "Policy",
    "TenantInfo",
    "TenantList",
    "TenantQuota",
    "TenantToken",
    "API_VERSION",
    "MAX_N",
    "MAX_PROMPTS",
    "MAX_NEW_TOKENS",
    "MAX_STOPS",
    "INT64_MAX",
    "FLOAT32_TINY",
    "MIN_TEMPERATURE",
    "Float",
    "Int64",
    "TokenId",
    "Text",
    "NonEmptyText",
    "Temperature",
    "RequestModel",
    "FinishReason",
    "InFlightPolicy",
    "SamplingParams",
    "Prompt",
    "ErrorResponse",
    "PolicyStats",
    "SamplerSpec",
    "RolloutRequest",
    "Sample",
    "SampledWith",
    "SampledSpan",
    "Group",
    "FilterReport",
    "RolloutResponse",
    "GroupEvent",
    "StreamEnd",
    "CancelResponse",
    "QueueSource",
    "QueuePrompts",
    "QueueSourceState",
    "PullRequest",
    "QueueItem",
    "PullResponse",
    "AckRequest",
    "AckResponse",
    "WeightsFromPath",
    "DistributedGroup",
    "DistributedUpdate",
    "WeightsVersion",
    "WeightsPushResponse",
    "Health",
    "ReplicaState",
    "DraftCounts",
    "ControlResponse",
    "Readiness",
    "CompletionRequest",
    "ChatMessage",
    "ChatCompletionRequest",
]
