"""The torch engine's sampling, one decode step of a batch whose rows come from different generate calls, each row
with its call's SamplingParams: temperature, top-k and top-p are per-row tensors; greedy rows take the argmax.

A row draws from its call's torch.Generator when the call has a seed, so a seeded call's samples do not depend on
the calls it shares the batch with: at each step, the live rows of one seeded call draw in their order with one
torch.multinomial, exactly what the call would draw alone. Unseeded rows draw together from the engine's generator.
A `regex` constrains the text token by token (RegexMask); such rows are picked one by one. Draws keeps, for the
running batch, who draws with which generator.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from rollout_farm.services.protocol import SamplingParams


def processed_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor):
    """logits (B, V) after each row's temperature (> 0), top-k (<= 0 or >= V: off) and top-p (1: off); dropped
    tokens at -inf."""
    logits = logits / temperature[:, None]
    V = logits.shape[-1]
    k_on = (top_k > 0) & (top_k < V)
    if bool(k_on.any()):
        k_max = int(top_k[k_on].max())
        kth = torch.topk(logits, k_max, dim=-1).values.gather(-1, (top_k.clamp(1, k_max) - 1)[:, None])
        logits = logits.masked_fill(k_on[:, None] & (logits < kth), float("-inf"))
    p_on = top_p < 1.0
    if bool(p_on.any()):
        sorted_logits, idx = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, -1)
        # keep the smallest prefix whose mass reaches top_p (rows with top_p 1 keep all: no float rounding drops one)
        drop = (probs.cumsum(-1) - probs > top_p[:, None]) & p_on[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)
    return logits


def processed_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """logits (B, V) after temperature, top-k and top-p (dropped tokens at -inf); temperature > 0."""
    B, dev = logits.shape[0], logits.device
    return processed_rows(
        logits,
        torch.full((B,), p.temperature, dtype=logits.dtype, device=dev),
        torch.full((B,), p.top_k, dtype=torch.long, device=dev),
        torch.full((B,), p.top_p, dtype=logits.dtype, device=dev),
    )


class RegexMask:
    """Token-level regex constraint for the torch engine: a token may follow only if the text so far, with it,
    can still be extended to a full match (the `regex` package's partial matching); a stop token only on a full match.

    Sampling stays exact: the candidates are ranked by Gumbel-max keys over the temperature/top-k/top-p distribution,
    and the first allowed one is a draw from that distribution restricted to the allowed tokens. When no token of the
    nucleus is allowed, the rest are tried by raw logit, up to `limit` checks; past that the sample ends ("length").
    """

    def __init__(self, pattern: str, tokenizer, stop_ids: set[int], limit: int = 4096):
        import regex

        self.pattern, self.tok, self.stop_ids, self.limit = regex.compile(pattern), tokenizer, stop_ids, limit

    def allowed(self, ids: list[int], token: int) -> bool:
        if token in self.stop_ids:
            return self.pattern.fullmatch(self.tok.decode(ids, skip_special_tokens=True)) is not None
        return (
            self.pattern.fullmatch(self.tok.decode(ids + [token], skip_special_tokens=True), partial=True) is not None
        )

    def pick(self, ids: list[int], raw: torch.Tensor, proc: torch.Tensor | None, gen: torch.Generator) -> int | None:
        """The next token for one row (its (V,) raw logits, and processed ones unless greedy), or None at a dead end."""

        def ranked():
            if proc is not None:
                keys = proc - torch.log(
                    -torch.log(torch.rand(proc.shape, generator=gen, device=proc.device).clamp_min(1e-20))
                )
                yield from keys.argsort(descending=True)[: int(torch.isfinite(proc).sum())].tolist()
            # only reached when the nucleus has no allowed token
            yield from raw.argsort(descending=True)[: self.limit].tolist()

        tried = set()
        for token in ranked():
            if token in tried:
                continue
            tried.add(token)
            if self.allowed(ids, token):
                return token
            if len(tried) >= self.limit:
                break
        return None

    def log_allowed_mass(self, ids: list[int], proc: torch.Tensor) -> float:
        """log Z: the log of the probability the processed distribution (V,) gives the allowed tokens, so that a
        constrained draw's logprob is the processed one minus log Z. Tokens are checked from the most likely down
        until the unchecked mass cannot move Z by more than MASS_TOLERANCE of it (exact once every token the
        distribution can draw is checked); NaN (q unknown: the sample gets no sampling logprobs) when that takes
        more than MASS_CHECKS checks, or no token is allowed."""
        probs, order = torch.softmax(proc.double(), -1).sort(descending=True)
        drawable = min(int((probs > 0).sum()), MASS_CHECKS + 1)
        head = probs[:drawable]
        unchecked = (probs.sum() - (head.cumsum(0) - head)).tolist()  # unchecked[i]: mass of token i and after
        allowed = 0.0
        for i, (p, token) in enumerate(zip(head.tolist(), order[:drawable].tolist())):
            if unchecked[i] <= MASS_TOLERANCE * allowed:
                break
            if i == MASS_CHECKS:
                return math.nan
            if self.allowed(ids, token):
                allowed += p
        return math.log(allowed) if allowed > 0 else math.nan


# the constrained q's normaliser: checked down to a relative error of 1e-4 in Z, at most 1024 regex checks a token
MASS_TOLERANCE, MASS_CHECKS = 1e-4, 1024


def text_hits_stop(tokenizer, ids: list[int], stops: list[str]) -> bool:
    """Whether the text of `ids` now holds a stop string. Only the tail is decoded: a character takes at most 4 tokens
    (its bytes), and a stop string found earlier would have ended the sample then."""
    window = 4 * max(map(len, stops)) + 8
    tail = tokenizer.decode(ids[-window:], skip_special_tokens=True)
    return any(s in tail for s in stops)


@dataclass
class Draw:
    """One step's draw for every row: the token, its raw logprob, its logprob under the distribution sampled (0 when
    greedy), and the rows whose regex left no allowed token (they end before this token; None: no such row)."""

    token: torch.Tensor
    logprob: torch.Tensor
    sampling_logprob: torch.Tensor
    dead: torch.Tensor | None


class Group:
    """Rows of the batch that draw together: `rows` (indices into the step's batch, in order), from generator `gen`;
    one by one through `regex` when it is set, given the rows' tokens so far (`texts`, set before each step)."""

    __slots__ = ("rows", "idx", "gen", "regex", "texts")

    def __init__(self, rows: list[int], gen: torch.Generator, regex: RegexMask | None = None, device=None):
        self.rows, self.gen, self.regex, self.texts = rows, gen, regex, []
        self.idx = torch.tensor(rows, dtype=torch.long, device=device)


def draw(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    groups: list[Group],
    pad_id: int,
) -> Draw:
    """The tokens of one decode step: rows at temperature 0 take the argmax (unless in a regex group), the others
    draw by group (see Group)."""
    greedy = temperature == 0
    sampled = not bool(greedy.all())
    proc = processed_rows(logits, torch.where(greedy, 1.0, temperature), top_k, top_p) if sampled else None
    token = logits.argmax(-1)
    dead = log_z = None
    if sampled:
        probs = torch.softmax(proc, -1)
    for g in groups:
        if g.regex is None:
            every = len(g.rows) == len(token)  # the rows in order: no copy
            token[g.idx] = torch.multinomial(probs if every else probs[g.idx], 1, generator=g.gen).squeeze(-1)
            continue
        for i, ids in zip(g.rows, g.texts):
            pick = g.regex.pick(ids, logits[i], None if bool(greedy[i]) else proc[i], g.gen)
            if pick is None:  # a dead end: the row ends before this token
                dead = torch.zeros_like(greedy) if dead is None else dead
                dead[i] = True
            elif not bool(greedy[i]):  # drawn from the processed distribution restricted to the allowed tokens
                log_z = torch.zeros_like(logits[:, 0]) if log_z is None else log_z
                log_z[i] = g.regex.log_allowed_mass(ids, proc[i])
            token[i] = pad_id if pick is None else pick
    logprob = torch.log_softmax(logits, -1).gather(-1, token[:, None]).squeeze(-1)
    sampling_logprob = torch.zeros_like(logprob)
    if sampled:
        slp = torch.log_softmax(proc, -1).gather(-1, token[:, None]).squeeze(-1)
        sampling_logprob = torch.where(greedy, sampling_logprob, slp if log_z is None else slp - log_z)
    return Draw(token, logprob, sampling_logprob, dead)


class Draws:
    """Who draws with which generator in the running batch (scheduler.py). Owns the engine's generator (`gen`: the
    unseeded rows draw from it), the draw groups, rebuilt after the rows changed (changed()), and the rows whose calls
    have stop strings (stop_rows)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.gen = torch.Generator(device=device).manual_seed(int.from_bytes(os.urandom(7), "big"))
        self._groups: list[Group] | None = None
        self._stop_rows: list[int] = []

    def changed(self) -> None:
        """The batch's rows changed (joined, left, or the batch was replaced): regroup before the next draw."""
        self._groups = None

    def groups(self, batch, slots) -> list[Group]:
        """The draw groups for this step of `batch` (rebuilt after the rows changed), regex groups given their rows'
        tokens so far (from `slots`)."""
        t = batch.t
        if self._groups is None:
            self._regroup(batch)
        for g in self._groups:
            if g.regex is not None:
                g.texts = [slots.tokens(int(t["slot"][i]), int(t["step"][i])) for i in g.rows]
        return self._groups

    def stop_rows(self) -> list[int]:
        """The rows (as of the last groups()) whose calls have stop strings."""
        return self._stop_rows

    def _regroup(self, batch) -> None:
        """Which rows draw together, and which check stop strings (after the rows changed)."""
        by_call: dict = {}
        gone = batch.t["gone"].tolist()
        for i, call in enumerate(batch.calls):
            if not gone[i]:
                by_call.setdefault(call, []).append(i)
        groups, unseeded, self._stop_rows = [], [], []
        for call, rows in by_call.items():
            p = call.params
            if p.stop:
                self._stop_rows += rows
            if call.regex is not None:
                groups.append(Group(rows, call.gen or self.gen, call.regex, self.device))
            elif p.temperature == 0:
                continue
            elif call.gen is not None:
                groups.append(Group(rows, call.gen, device=self.device))
            else:
                unseeded += rows
        if unseeded:
            groups.append(Group(unseeded, self.gen, device=self.device))
        self._groups = groups
