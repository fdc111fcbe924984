"""The chat functions in the ingress, with the served model's tokenizer: a chat request or a session's chat turn
costs no Ray call to an engine replica for its prompt.

The tokenizer is the engine replicas' own (Engine.tokenizer), fetched from one replica on the first chat request
(EngineServer.chat_tokenizer) and kept (Ray pickles a Hugging Face tokenizer whole, chat template and special tokens
included). So the ingress renders exactly as a replica would for every engine, a user engine's too, and needs neither
the model folder on its node nor the built-in model built there: the service tests compare its render with one by
the tokenizer the replica builds. Each method runs one chat function (rollout_farm/services/chat/) with it: the
OpenAI chat route's prompt (`render`, `prompt_ids`), a session's chat turn (`turn`), and the text pieces of sampled
tokens (OpenAI logprobs and a session turn's: `token_pieces`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from rollout_farm.services import protocol as P
from rollout_farm.services.chat import delta, pieces, template
from rollout_farm.services.chat.tool_formats import detected

FetchTokenizer = Callable[[], Awaitable]  # the tokenizer, asked of one engine replica (Replicas.read)


class ChatRenderer:
    """The served model's tokenizer in the ingress, asked of a replica once."""

    def __init__(self, fetch: FetchTokenizer):
        self.fetch = fetch
        self.tokenizer = None
        self.lock = asyncio.Lock()
        self.detected: str | None = None

    async def loaded(self):
        if self.tokenizer is None:
            async with self.lock:  # one fetch, however many chat requests arrive first
                if self.tokenizer is None:
                    self.tokenizer = await self.fetch()
        return self.tokenizer

    async def render(self, messages: list[dict]) -> str | None:
        """The messages through the chat template, ready for generation; None without a template."""
        return template.render(await self.loaded(), messages)

    async def prompt_ids(self, text: str) -> list[int]:
        """The text's token ids as a replica tokenizes a text prompt."""
        return template.prompt_ids(await self.loaded(), P.Prompt(text=text))

    async def tool_format(self) -> str:
        """The tool format the model's chat template renders (a session's "auto"), told once."""
        if self.detected is None:
            self.detected = detected(await self.loaded())
        return self.detected

    async def turn(
        self,
        held_tail: list[int],
        after_sampled: bool,
        new: list[dict],
        tools: list[dict],
        opens: bool,
        forced: str,
        answered: list[dict] | None = None,
    ) -> list[list[int]]:
        """A session turn's context ids as [close, messages, prompt, forced]; NotAppendOnly when there is no exact
        continuation (rollout_farm/services/chat/delta.py)."""
        return delta.turn(await self.loaded(), held_tail, after_sampled, new, tools, opens, forced, answered)

    async def token_pieces(self, samples: list[list[int]]) -> list[list[str]]:
        """Each sample's token texts, joining to its text."""
        tokenizer = await self.loaded()
        return [pieces.token_pieces(tokenizer, ids) for ids in samples]
