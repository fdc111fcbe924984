"""Wire contracts of the rollout service, shared by the service and the client: `from services import protocol as P`.

Only data lives here: request and response models with a comment on each field, one module per API area.
Field names follow SGLang's sampling params (temperature, top_p, top_k, max_new_tokens, stop_token_ids, seed)
so that users of SGLang recognise them, and OpenAI's on the OpenAI-compatible endpoints.
"""

from services.protocol.common import (
    API_VERSION,
    MAX_N,
    MAX_NEW_TOKENS,
    MAX_PROMPTS,
    ErrorResponse,
    FinishReason,
    InFlightPolicy,
    Prompt,
    SamplingParams,
)
from services.protocol.control import ControlResponse, Health, Readiness, ReplicaState
from services.protocol.openai import ChatCompletionRequest, ChatMessage, CompletionRequest
from services.protocol.queue import (
    AckRequest,
    AckResponse,
    PullRequest,
    PullResponse,
    QueueItem,
    QueuePrompts,
    QueueSource,
    QueueSourceState,
)
from services.protocol.rollouts import (
    CancelResponse,
    FilterReport,
    Group,
    GroupEvent,
    PolicyStats,
    RolloutRequest,
    RolloutResponse,
    Sample,
    SampledWith,
    SamplerSpec,
    StreamEnd,
)
from services.protocol.weights import (
    DistributedGroup,
    DistributedUpdate,
    WeightsFromPath,
    WeightsPushResponse,
    WeightsVersion,
)

__all__ = [
    "API_VERSION",
    "MAX_N",
    "MAX_PROMPTS",
    "MAX_NEW_TOKENS",
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
    "ControlResponse",
    "Readiness",
    "CompletionRequest",
    "ChatMessage",
    "ChatCompletionRequest",
]
