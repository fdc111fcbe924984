"""A session's tokens, in segments that only grow. Tokens in, tokens out: the sampled ids are appended as the engine
returned them, never decoded and encoded again, so each turn's prompt is its previous prompt and response plus the
new messages' tokens, bit for bit.

A segment keeps the chat history its tokens render (`messages`) and where each message ends in the tokens
(`message_ends`; None inside a run of messages rendered together, where no exact cut exists). A request whose
messages start with a segment's extends it: only the new messages are rendered and appended (loss mask 0), then the
sampled ids (mask 1); "start with" allows the known rewrites harnesses make of a history they send back (stripped
thinking, re-serialised arguments, re-ordered or merged tool results: rollout_farm/services/episodes/history_match.py).
A request that rewrites the history (edits, drops or replaces a message) forks: a new segment names its parent and
starts with the parent's tokens up to the last message both share that ends at a known token (copied with mask 0:
they are trained in the parent), never a realign of the old tokens to the new text.
A request that repeats the history a turn answered (a retry) gets that turn again.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from rollout_farm.services.chat.tool_formats import ToolCall
from rollout_farm.services.episodes.history_match import (  # the matching's names, where they were first
    THINK,
    THINK_END,
    arguments,
    match,
    normal,
    reasoning_split,
    reshaped,
    same_turn,
    shared_messages,
)

__all__ = [
    "THINK",
    "THINK_END",
    "Segment",
    "Turn",
    "arguments",
    "match",
    "normal",
    "reasoning_split",
    "reshaped",
    "same_turn",
    "shared_messages",
]


@dataclass
class Turn:
    """One sampled turn: its tokens are [start, end) of the segment; it answered messages[:prompt_messages]."""

    start: int
    end: int
    prompt_messages: int
    finish_reason: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    malformed: list[str] = field(
        default_factory=list
    )  # calls that did not read (rollout_farm/services/chat/tool_formats.py)
    reward: float | None = None  # this turn's reward, when the client scores turns
    sampled_with: dict | None = None  # the params it was drawn with (P.SampledWith), after the sampler's plan
    sampling_known: bool = True  # whether its sampling_logprobs are q (False: the engine reported none, raw is not q)
    policies: list[dict] | None = None  # the policies that drew it (P.Policy), in token order: one unless it spans

    @classmethod
    def from_dict(cls, data: dict) -> Turn:
        """The turn asdict gave (JSON's plain values) back."""
        return cls(**{**data, "tool_calls": [ToolCall(**c) for c in data["tool_calls"]]})


@dataclass
class Segment:
    id: str
    parent: str | None = None  # the segment this one forked from
    parent_tokens: int = 0  # its first parent_tokens tokens are the parent's
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)  # 1 exactly on the tokens sampled (and trained) here
    logprobs: list[float] = field(default_factory=list)  # the raw model's logprob of a sampled token; 0.0 elsewhere
    sampling_logprobs: list[float] = field(default_factory=list)  # under the distribution sampled; 0.0 elsewhere
    token_versions: list[int] = field(default_factory=list)  # the weight version of a sampled token; -1 elsewhere
    messages: list[dict] = field(default_factory=list)
    message_ends: list[int | None] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    from_token_ids: bool = False  # a token turn (/generate) went into it: its messages do not say its tokens

    def add_context(self, ids: list[int], messages: list[dict]) -> None:
        """Rendered tokens (template, prompts, observations: never trained) for these messages, appended."""
        self._extend(ids, 0, [0.0] * len(ids), [0.0] * len(ids), [-1] * len(ids))
        self.messages += messages
        self.message_ends += [None] * (len(messages) - 1) + [len(self.token_ids)] if messages else []

    def add_sampled(
        self,
        ids: list[int],
        logprobs: list[float],
        sampling_logprobs: list[float],
        versions: list[int],
        finish_reason: str,
        message: dict,
        calls: list[ToolCall] = (),
        malformed: list[str] = (),
        trained: bool = True,
        sampled_with: dict | None = None,
        sampling_known: bool = True,
        policies: list[dict] | None = None,
    ) -> Turn:
        """The engine's ids, appended as they are, and the assistant message they are (content and parsed calls);
        `trained=False` keeps them out of the loss (mask 0: a malformed call masked by the session's policy).
        `sampled_with`: the params they were drawn with; `sampling_known=False`: `sampling_logprobs` are not q;
        `policies`: the policies that drew them."""
        if not len(ids) == len(logprobs) == len(sampling_logprobs) == len(versions):
            raise ValueError("a sampled turn needs one logprob, sampling logprob and version per token")
        turn = Turn(len(self.token_ids), len(self.token_ids) + len(ids), len(self.messages), finish_reason)
        turn.tool_calls, turn.malformed = list(calls), list(malformed)
        turn.sampled_with, turn.sampling_known, turn.policies = sampled_with, sampling_known, policies
        self._extend(ids, int(trained), logprobs, sampling_logprobs, versions)
        self.messages.append(message)
        self.message_ends.append(len(self.token_ids))
        self.turns.append(turn)
        return turn

    def _extend(self, ids: list[int], mask: int, lps: list[float], slps: list[float], versions: list[int]) -> None:
        self.token_ids += ids
        self.loss_mask += [mask] * len(ids)
        self.logprobs += lps
        self.sampling_logprobs += slps
        self.token_versions += versions

    def ends_with_assistant(self) -> bool:
        """Whether the tokens end where an assistant message does (a sampled turn, or a fork cut right after one):
        the template's closing tokens for it have not been added yet."""
        ends = self.message_ends[-1] if self.message_ends else None
        return bool(self.messages) and self.messages[-1]["role"] == "assistant" and ends == len(self.token_ids)

    def answered(self, given: list[dict]) -> Turn | None:
        """The turn that answered exactly this history, if any: a retry gets it again."""
        m = match(self.messages, given)
        return next((t for t in self.turns if m.given == len(given) and t.prompt_messages == m.stored), None)

    def extended_by(self, given: list[dict]) -> bool:
        """Whether `given` is this segment's history and more."""
        m = match(self.messages, given)
        return m.stored == len(self.messages) and m.given < len(given)

    def fork_at(self, new_id: str, cut: int) -> Segment:
        """A segment that keeps this one's first `cut` tokens (copied untrained) and goes on from there: a token-level
        rewrite (the session's /generate with an offset). Messages stay with the turns that end by the cut."""
        keep = sum(1 for end in self.message_ends if end is not None and end <= cut)
        return Segment(
            new_id,
            parent=self.id,
            parent_tokens=cut,
            token_ids=self.token_ids[:cut],
            loss_mask=[0] * cut,
            logprobs=self.logprobs[:cut],
            sampling_logprobs=self.sampling_logprobs[:cut],
            token_versions=self.token_versions[:cut],
            messages=self.messages[:keep],
            message_ends=self.message_ends[:keep],
            from_token_ids=self.from_token_ids,
        )

    def fork(self, new_id: str, given: list[dict]) -> Segment:
        """A segment for a history that rewrites this one: this segment's tokens up to the last shared message that
        ends at a known token, copied untrained; the caller renders given[len(fork.messages):] next."""
        bounds = match(self.messages, given).bounds  # where a cut leaves whole steps of the match (not in a merge)
        keep = max(n for n, _ in bounds if n == 0 or self.message_ends[n - 1] is not None)
        fork = self.fork_at(new_id, self.message_ends[keep - 1] if keep else 0)
        fork.messages, fork.message_ends = self.messages[:keep], self.message_ends[:keep]
        fork.from_token_ids = False  # cut at a shared message: before any token-level turn, which has no message
        return fork

    def to_json(self) -> str:
        """The segment as JSON (a session keeps its segments in Redis); from_json gives it back exactly."""
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Segment:
        data = json.loads(text)
        data["turns"] = [Turn.from_dict(t) for t in data["turns"]]
        return cls(**data)
