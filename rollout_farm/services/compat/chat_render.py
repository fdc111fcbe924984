"""Chat templates rendered in the ingress: a chat request costs no Ray call to an engine replica for its prompt.

The tokenizer is the engine replicas' own (Engine.tokenizer), fetched from one replica on the first chat request and
kept (Ray pickles a Hugging Face tokenizer whole, chat template and special tokens included). So the ingress renders
exactly as a replica would for every engine, a user engine's too, and needs neither the model folder on its node
nor the built-in model built there. The replica's render_chat verb renders with the same function
(rollout_farm/services/replica/chat_template.py `render`): the service tests compare the two. The other verbs that need
only the tokenizer run here too (`ChatRenderer.read`, with the replica verbs' own functions): a session's chat turn
(rollout_farm/services/episodes/sessions.py: `chat_turn`) and the text pieces of sampled tokens (OpenAI logprobs and a
session turn's: `token_pieces`).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from rollout_farm.services import protocol as P
from rollout_farm.services.replica.chat_template import chat_turn, render
from rollout_farm.services.replica.group_sampling import prompt_ids
from rollout_farm.services.replica.token_pieces import token_pieces

if TYPE_CHECKING:
    from rollout_farm.services.replica.handle import Replicas


LOCAL = {  # replica verbs that need only the tokenizer: run in the ingress
    "chat_turn": chat_turn,
    "token_pieces": lambda tok, samples: [token_pieces(tok, ids) for ids in samples],
}


class ChatRenderer:
    """The served model's tokenizer in the ingress, asked of a replica once."""

    def __init__(self, replicas: Replicas):
        self.replicas = replicas
        self.tokenizer = None
        self.lock = asyncio.Lock()

    async def loaded(self):
        if self.tokenizer is None:
            async with self.lock:  # one fetch, however many chat requests arrive first
                if self.tokenizer is None:
                    self.tokenizer = await self.replicas.read("chat_tokenizer")
        return self.tokenizer

    async def render(self, messages: list[dict]) -> str | None:
        return render(await self.loaded(), messages)

    async def token_ids(self, text: str) -> list[int]:
        """The text's token ids as a replica tokenizes a text prompt
        (rollout_farm/services/replica/group_sampling.py)."""
        return prompt_ids(await self.loaded(), P.Prompt(text=text))

    async def read(self, method: str, *args):
        """Replicas.read, with the verbs that need only the tokenizer (LOCAL) run here."""
        if method in LOCAL:
            return LOCAL[method](await self.loaded(), *args)
        return await self.replicas.read(method, *args)
