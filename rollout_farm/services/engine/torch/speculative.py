"""Speculative decoding for the torch engine with no draft model: the drafts come from the farm's own history.

History   what earlier rollouts of the same prompt generated, and what the rows of that prompt running now have
          generated so far (a group's siblings). A row's draft is what followed, in one of those sequences, the
          longest suffix (min_ngram to max_ngram tokens) of the row's prompt tail and tokens so far, the most recent
          of the longest (among the last max_candidates places its last min_ngram tokens occur). Bounded: prompts
          are evicted least recently used past max_prompts or max_bytes, and a prompt keeps its last per_prompt
          finished sequences. A prompt is known by the hash of its tokens: a collision costs drafts that get
          rejected, never a wrong sample.
verify    one verification of k drafted tokens per row (k may differ by row), given the target's logits at the
          k + 1 positions (one forward pass over the last token and the draft). The exact rule for a deterministic
          draft: draft token x is accepted with probability p(x) under the processed distribution (temperature,
          top-k, top-p: sampling.processed_rows); at the first rejection the row's token is drawn from p with
          x removed, renormalised ((p - q)+ with q a point mass on x); when all k are accepted, a bonus token is drawn
          from the last position's p. Greedy rows accept while the draft is the argmax. So each emitted token is
          distributed as the plain path's, and its logprob and sampling logprob are the ones draw() reports.
          Rows draw from their group's generator (sampling.Group); a group with no drafts draws exactly what
          draw() would, but drafts change the draws a seeded call makes: its samples are then reproducible only
          with the same drafts. Regex rows take no drafts and pick one token as in draw().
"""

from __future__ import annotations

from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rollout_farm.services.engine.torch.sampling import Group, processed_rows

BYTES_PER_TOKEN = 120  # a stored token, its chain entry and a new n-gram's dict entry (tracemalloc, random tokens)
_LOW = (1 << 32) - 1


class _Prompt:
    """One prompt's sequences (its tail, then what was generated) by id, and their index as hash chains: `head` maps
    the hash of an n-gram (min_ngram tokens) to its last occurrence (id << 32 | the position after it), and
    chains[id][position] is the occurrence of the same hash before that one (-1: none). Flat integer arrays: no
    object per token for the garbage collector to walk. A dropped sequence's chain stays until the index is rebuilt,
    so that the chains through it still lead to older sequences."""

    __slots__ = ("tail", "seqs", "chains", "head", "done", "live", "tokens", "dead")

    def __init__(self, tail: list[int]):
        self.tail, self.seqs, self.chains, self.head, self.done = tail, {}, {}, {}, deque()
        self.live = self.tokens = self.dead = 0


class History:
    """Drafts from earlier and running sequences of the same prompt. A running row: open() it, extend() it with each
    step's tokens, propose() its next k, close() it when it ends (keep=False: it is not remembered). record() adds a
    finished sequence that ran elsewhere; lookup() drafts for a context that is not an open row. A proposal looks at
    the max_candidates most recent occurrences of the context's last min_ngram tokens."""

    def __init__(
        self,
        max_prompts: int = 4096,
        per_prompt: int = 16,
        max_bytes: int = 256 << 20,
        min_ngram: int = 2,
        max_ngram: int = 8,
        max_candidates: int = 16,
    ):
        self.max_prompts, self.per_prompt, self.max_bytes = max_prompts, per_prompt, max_bytes
        self.min_ngram, self.max_ngram, self.max_candidates = min_ngram, max_ngram, max_candidates
        self.prompts: OrderedDict[int, _Prompt] = OrderedDict()
        self.rows: dict[int, _Prompt] = {}
        self.tokens = 0  # stored in every prompt, running rows and dropped sequences' chains included
        self._next = 0

    @property
    def bytes(self) -> int:
        return self.tokens * BYTES_PER_TOKEN

    def open(self, prompt: Sequence[int]) -> int:
        """A new running row of `prompt`; returns its id."""
        key = hash(tuple(prompt))
        p = self.prompts.get(key)
        if p is None:
            p = self.prompts[key] = _Prompt(list(prompt[-self.max_ngram :]))
        self.prompts.move_to_end(key)
        sid, p.live = self._next, p.live + 1
        self._next += 1
        p.seqs[sid], p.chains[sid] = array("q"), array("q", [-1])
        self.rows[sid] = p
        self._add(p, sid, p.tail)
        return sid

    def extend(self, row: int, tokens: Sequence[int]) -> None:
        """The tokens row `row` emitted this step, in order."""
        self._add(self.rows[row], row, tokens)
        self._evict()

    def propose(self, row: int, k: int) -> list[int]:
        """Up to k draft tokens for row `row`'s next positions (none when no suffix of it was seen before)."""
        p = self.rows[row]
        return self._match(p, p.seqs[row], k)

    def close(self, row: int, keep: bool = True) -> None:
        """Row `row` ended: its sequence is remembered (keep), or dropped (an aborted row)."""
        p = self.rows.pop(row)
        p.live -= 1
        if keep:
            p.done.append(row)
            while len(p.done) > self.per_prompt:
                self._drop(p, p.done.popleft())
        else:
            self._drop(p, row)
        self._evict()

    def record(self, prompt: Sequence[int], tokens: Sequence[int]) -> None:
        """A finished sequence of `prompt` (e.g. a previous epoch's rollout)."""
        row = self.open(prompt)
        self.extend(row, tokens)
        self.close(row)

    def lookup(self, prompt: Sequence[int], generated: Sequence[int], k: int) -> list[int]:
        """Up to k draft tokens after `prompt` + `generated`, for a context that is not an open row."""
        p = self.prompts.get(hash(tuple(prompt)))
        return [] if p is None else self._match(p, p.tail + list(generated), k)

    def _add(self, p: _Prompt, sid: int, tokens: Sequence[int]) -> None:
        seq, chain, head, n = p.seqs[sid], p.chains[sid], p.head, self.min_ngram
        start = len(seq)
        seq.extend(tokens)
        chain.extend([-1] * (len(seq) - start))
        for end in range(max(start, n), len(seq)):  # an n-gram is indexed once a token follows it: a proposal
            key = hash(tuple(seq[end - n : end]))  # never walks past running siblings that stand where it stands
            chain[end] = head.get(key, -1)
            head[key] = sid << 32 | end
        p.tokens += len(seq) - start
        self.tokens += len(seq) - start

    def _match(self, p: _Prompt, ctx: Sequence[int], k: int) -> list[int]:
        n = self.min_ngram
        if k <= 0 or len(ctx) < n:
            return []
        occ = p.head.get(hash(tuple(ctx[-n:])), -1)
        best_len, best, seen, m_ctx = n - 1, None, 0, min(self.max_ngram, len(ctx))
        while occ >= 0 and seen < self.max_candidates:  # the most recent first
            sid, end = occ >> 32, occ & _LOW
            occ, seen = p.chains[sid][end], seen + 1
            seq = p.seqs.get(sid)
            if seq is None or end >= len(seq):  # dropped, or nothing follows it yet (the row itself, its end)
                continue
            m, limit = 0, min(m_ctx, end)
            while m < limit and seq[end - 1 - m] == ctx[-1 - m]:
                m += 1
            if m > best_len:  # at least min_ngram tokens (not a hash collision), longer than the ones seen
                best_len, best = m, (seq, end)
                if m == m_ctx:
                    break
        if best is None:
            return []
        seq, end = best
        return list(seq[end : end + k])

    def _drop(self, p: _Prompt, sid: int) -> None:
        p.dead += len(p.seqs.pop(sid))
        if p.dead * 2 > p.tokens:  # half the chains are dropped sequences': index the rest again
            self.tokens -= p.dead
            p.tokens -= p.dead
            p.dead, p.head = 0, {}
            for s, seq in sorted(p.seqs.items()):
                p.seqs[s], p.chains[s] = array("q"), array("q", [-1])
                self._add(p, s, seq)
                p.tokens -= len(seq)
                self.tokens -= len(seq)
            p.chains = {s: p.chains[s] for s in p.seqs}

    def _evict(self) -> None:
        if len(self.prompts) <= self.max_prompts and self.bytes <= self.max_bytes:
            return
        for key in list(self.prompts):  # least recently used first; prompts with running rows stay
            if len(self.prompts) <= self.max_prompts and self.bytes <= self.max_bytes:
                return
            p = self.prompts[key]
            if not p.live:
                del self.prompts[key]
                self.tokens -= p.tokens


@dataclass
class Verified:
    """One verification of every row: row i emitted n[i] tokens (accepted[i] drafts, then one drawn token; n[i] is
    accepted[i] when its regex left no allowed token, dead[i]). tokens, logprob, sampling_logprob are (B, K + 1),
    valid in the first n[i] columns (pad_id and 0 after): raw logprobs (log_softmax at temperature 1) and logprobs
    under the distribution sampled (0 when greedy), as draw() reports them."""

    tokens: torch.Tensor
    n: torch.Tensor
    accepted: torch.Tensor
    logprob: torch.Tensor
    sampling_logprob: torch.Tensor
    dead: torch.Tensor | None


def _accepts(u: torch.Tensor, p_draft: torch.Tensor) -> torch.Tensor:
    """Which drafts are accepted: the draft token x with probability p(x)."""
    return u < p_draft


def _residual(probs: torch.Tensor, draft: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """What a row draws from (B, V): where its draft was rejected, p without the draft token ((p - q)+); else p."""
    out = probs.clone()
    rows = rejected.nonzero().squeeze(-1)
    out[rows, draft[rows]] = 0.0
    empty = out.sum(-1) <= 0  # a draft of p(x) = 1 minus rounding, rejected: nothing else to draw
    return torch.where(empty[:, None], probs, out)


def verify(
    logits: torch.Tensor,
    draft: torch.Tensor,
    n_draft: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    groups: list[Group],
    pad_id: int,
) -> Verified:
    """logits (B, K + 1, V): the target's raw logits at each row's next K + 1 positions, position j after the first
    j draft tokens; draft (B, K) the drafts, row i's first n_draft[i] valid (the rest any token); temperature, top_k,
    top_p (B,) as draw() takes them; groups: who draws with which generator (sampling.Group; greedy rows in
    none, regex rows with n_draft 0 and their texts set)."""
    B, K1, V = logits.shape
    K, dev = K1 - 1, logits.device
    logits = logits.float()
    cols = torch.arange(K, device=dev)
    greedy = temperature == 0
    sampled = not bool(greedy.all())
    flat = logits.reshape(B * K1, V)
    if sampled:
        proc = processed_rows(
            flat,
            torch.where(greedy, 1.0, temperature).repeat_interleave(K1),
            top_k.repeat_interleave(K1),
            top_p.repeat_interleave(K1),
        ).view(B, K1, V)
        proc_lse = torch.logsumexp(proc, -1)  # (B, K + 1)
    valid = cols[None] < n_draft[:, None]  # (B, K)
    drafted = torch.where(valid, draft, 0)
    ok = drafted == logits[:, :K].argmax(-1)  # greedy rows: the argmax
    if sampled and K:
        p_draft = torch.exp(proc[:, :K].gather(-1, drafted[..., None]).squeeze(-1) - proc_lse[:, :K])
        u = torch.ones((B, K), device=dev)  # rows without a generator (greedy) never use theirs
        for g in groups:
            k_g = int(n_draft[g.idx].max()) if g.regex is None and len(g.rows) else 0
            if k_g:
                u[g.idx, :k_g] = torch.rand((len(g.rows), k_g), generator=g.gen, device=dev)
        ok = torch.where(greedy[:, None], ok, _accepts(u, p_draft))
    accepted = (ok & valid).to(torch.long).cumprod(-1).sum(-1) if K else torch.zeros(B, dtype=torch.long, device=dev)
    at = accepted[:, None, None].expand(B, 1, V)
    token = logits.gather(1, at).squeeze(1).argmax(-1)  # the last token of greedy rows
    dead = log_z = None
    if sampled:
        rejected = accepted < n_draft
        x = drafted.gather(-1, accepted.clamp(max=max(K - 1, 0))[:, None]).squeeze(-1) if K else accepted
        probs = _residual(torch.softmax(proc.gather(1, at).squeeze(1), -1), x, rejected)
    for g in groups:
        if g.regex is None:
            token[g.idx] = torch.multinomial(probs[g.idx], 1, generator=g.gen).squeeze(-1)
            continue
        for i, ids in zip(g.rows, g.texts):
            pick = g.regex.pick(ids, logits[i, 0], None if bool(greedy[i]) else proc[i, 0], g.gen)
            if pick is None:  # a dead end: the row ends before this token
                dead = torch.zeros_like(greedy) if dead is None else dead
                dead[i] = True
            elif not bool(greedy[i]):  # the constrained q, as sampling.draw reports it (no drafts: column 0)
                log_z = torch.zeros_like(logits[:, 0, 0]) if log_z is None else log_z
                log_z[i] = g.regex.log_allowed_mass(ids, proc[i, 0])
            token[i] = pad_id if pick is None else pick
    tokens = torch.cat([drafted, torch.zeros((B, 1), dtype=torch.long, device=dev)], 1)
    tokens.scatter_(1, accepted[:, None], token[:, None])
    n = accepted + 1 if dead is None else accepted + 1 - dead.to(torch.long)
    kept = torch.arange(K1, device=dev)[None] < n[:, None]
    tokens = torch.where(kept, tokens, pad_id)
    picked = tokens.clamp(0, V - 1)[..., None]
    logprob = logits.gather(-1, picked).squeeze(-1) - torch.logsumexp(logits, -1)
    logprob = torch.where(kept, logprob, 0.0)
    sampling_logprob = torch.zeros_like(logprob)
    if sampled:
        slp = proc.gather(-1, picked).squeeze(-1) - proc_lse
        if log_z is not None:
            slp[:, 0] -= log_z
        sampling_logprob = torch.where(kept & ~greedy[:, None], slp, 0.0)
    return Verified(tokens, n, accepted, logprob, sampling_logprob, dead)
