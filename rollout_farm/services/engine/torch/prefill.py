"""How the torch engine's scheduler (scheduler.py) prefills the rows it admits, feeding as few prompt tokens
through the model as it can:

session cache  a row whose call names a session (`cache_key`) and whose prompt extends that session's last sequence
               on the same weights feeds only the new tokens (session_cache.py);
group cache    the other rows are grouped by prompt: each distinct prompt goes through the model once, in one
               left-padded forward pass with the others, and Batch.fan_out (batch.py) copies its cache to each
               of its rows, in their order (GRPO's n samples of a prompt prefill it once, not n times);
prompt cache   a prompt prefilled before on the same weights (a sampler's next round of candidates, a group split
               across calls) feeds only its last token: each prefilled prompt leaves its cache but for that token
               (FARM_ENGINE_PROMPT_CACHE_BYTES, least recently used first out).
The tokens fed and those each cache saved go to engine.stats (farm_replica_prefill_tokens, ..._session_cache_tokens,
..._prefill_shared_tokens). A row that ends leaves its session's cache for the next turn (keep_session).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rollout_farm.services.engine.stats import EngineStats
from rollout_farm.services.engine.torch.batch import Batch
from rollout_farm.services.engine.torch.session_cache import CachedSequence, SessionKV

if TYPE_CHECKING:
    from rollout_farm.services.engine.torch.call import Call
    from rollout_farm.services.engine.torch.model import ServedModel


def _prompt_key(prompt: tuple[int, ...], adapter: str | None) -> str:
    """The prompt cache's key for a prompt under a policy (an entry's tokens and policy are checked on a match, so a
    collision only misses)."""
    return f"prompt:{adapter or ''}:{len(prompt)}:{hash(prompt)}"


class Prefill:
    """Owns the session KV cache (`session_kv`: a session's cache between its turns), the prompt cache (`prompt_kv`:
    a prompt's cache for its next call) and the choice to share a prompt's prefill between its rows (`share_prompts`;
    False: each row prefills its own prompt, the tests' and bench's baseline). Given the served model (model, pad id,
    version) and the engine's stats."""

    def __init__(
        self, served: ServedModel, session_kv: SessionKV, prompt_kv: SessionKV, share_prompts: bool, stats: EngineStats
    ):
        self.served, self.stats = served, stats
        self.session_kv, self.prompt_kv, self.share_prompts = session_kv, prompt_kv, share_prompts

    def rows(self, prompts: list[list[int]], t: dict, calls_of: list, index: list[int], joinable: bool):
        """The new rows prefilled (`joinable`: the running batch takes rows, so caches can be kept and reused): a row
        whose session's KV cache this replica holds feeds only its new tokens (session_cache.py); the others share
        their prompts' prefill (_prefill_shared). Returns their Batch and their first tokens' logits."""
        model, version = self.served.model, self.served.version
        sessions = {}
        if joinable:
            for i, call in enumerate(calls_of):
                if call.cache_key is not None:
                    hit = self.session_kv.match(call.cache_key, prompts[i], (version, call.adapter))
                    if hit is not None:
                        sessions[i] = hit
        plain = [i for i in range(len(prompts)) if i not in sessions]
        parts, fed = [], 0
        if plain:
            *part, fed = self._prefill_shared(plain, prompts, t, calls_of, index, joinable)
            parts.append(part)
        for i, hit in sessions.items():
            rows = {k: v[i : i + 1] for k, v in t.items()}
            parts.append(Batch.prefill_cached(model, hit, prompts[i], rows, [calls_of[i]], [index[i]]))
            fed += len(prompts[i]) - len(hit.tokens)
        reused = sum(len(hit.tokens) for hit in sessions.values())
        self.stats.prefill(fed, reused, sum(map(len, prompts)) - reused - fed)
        batch, logits = parts[0]
        for other, more in parts[1:]:
            batch.extend(other)
            logits = torch.cat([logits, more])
        return batch, logits

    def _prefill_shared(self, plain: list[int], prompts, t: dict, calls_of: list, index: list[int], joinable):
        """The group cache (batch.py): each distinct prompt of rows `plain` goes through the model once, from
        the prompt cache when a call before left it there (a sampler's next round, a group split across calls), the
        rest together in one padded forward pass; then each prompt's cache is copied to its rows, in their order.
        Returns the batch, its logits and the prompt tokens fed."""
        model, version = self.served.model, self.served.version
        distinct: dict[tuple, int] = {}  # (adapter, prompt) -> its index; rows share a prefill only on one policy
        key = (lambda i: (calls_of[i].adapter, tuple(prompts[i]))) if self.share_prompts else (lambda i: (None, i))
        which = [distinct.setdefault(key(i), len(distinct)) for i in plain]
        first: dict[int, int] = {}  # distinct prompt -> its first row
        for i, d in zip(plain, which):
            first.setdefault(d, i)
        keep = joinable and self.share_prompts and self.prompt_kv.max_bytes > 0
        hits = {}
        for (adapter, prompt), d in distinct.items() if keep else ():
            hit = self.prompt_kv.match(_prompt_key(prompt, adapter), prompts[first[d]], (version, adapter))
            if hit is not None:
                hits[d] = hit
        fresh = [d for d in range(len(distinct)) if d not in hits]

        def firsts(ds: list[int]) -> tuple[dict, list, list[int]]:
            rows = [first[d] for d in ds]
            return {k: v[rows] for k, v in t.items()}, [calls_of[i] for i in rows], [index[i] for i in rows]

        parts, fed = [], 0
        if fresh:
            batch, logits = Batch.prefill(model, [prompts[first[d]] for d in fresh], self.served.pad_id, *firsts(fresh))
            parts.append((batch, logits))
            fed += sum(len(prompts[first[d]]) for d in fresh)
            if keep and batch.joinable():
                for j, d in enumerate(fresh):
                    prompt, adapter = prompts[first[d]], calls_of[first[d]].adapter
                    if len(prompt) > 1:  # its cache but the last token's: the next call feeds that one
                        entry = CachedSequence(prompt[:-1], (version, adapter), batch.row_cache(j, drop_last=True))
                        self.prompt_kv.put(_prompt_key(tuple(prompt), adapter), entry)
        for d, hit in hits.items():
            parts.append(Batch.prefill_cached(model, hit, prompts[first[d]], *firsts([d])))
            fed += len(prompts[first[d]]) - len(hit.tokens)
        batch, logits = parts[0]
        for other, more in parts[1:]:
            batch.extend(other)
            logits = torch.cat([logits, more])
        place = {d: j for j, d in enumerate(fresh + list(hits))}
        rows = {k: v[plain] for k, v in t.items()}
        logits = batch.fan_out(
            logits, [place[d] for d in which], rows, [calls_of[i] for i in plain], [index[i] for i in plain]
        )
        return batch, logits, fed

    def keep_session(self, batch: Batch, i: int, call: Call, sampled: list[int]) -> None:
        """Row i's KV cache, kept for its session's next turn: the prompt and every sampled token but the last (the
        last was drawn, not fed). Only when all of it was computed on the weights served now."""
        covered = call.prompts[0] + sampled[:-1]
        version = self.served.version
        if call.kv_version != version or not sampled or not batch.joinable():
            return
        if int(batch.mask[i].sum()) != len(covered):  # a row that ended on a token it could not feed (a regex dead end)
            return
        self.session_kv.put(call.cache_key, CachedSequence(covered, (version, call.adapter), batch.row_cache(i)))
