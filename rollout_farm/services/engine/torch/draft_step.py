"""Speculative decoding in the torch engine's scheduler (FARM_ENGINE_SPECULATIVE_TOKENS = k > 0; off by default):
a decode step that also verifies up to k drafted tokens per row, the drafts coming from the farm's own history
(speculative.History: earlier rollouts of the same prompt and the rows of that prompt running now).

A step with drafts feeds each running row its last token and its drafts in one forward pass (Batch.verify), and
speculative.verify applies the exact acceptance rule, so each row emits between 1 and k + 1 tokens whose
distribution, logprobs and sampling logprobs are the plain path's. Then the emitted tokens are cut at the first stop
token, stop string or max_new_tokens, as one token at a time would have stopped; the cache keeps the tokens fed
that were accepted (Batch.settle masks out the rest). Rows that joined this step draw their first token as usual.
Rows with a regex, and a step where few rows have drafts (under DRAFT_SHARE of the rows x the widest draft: the
verification feeds every row that many tokens), take the plain step (scheduler.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rollout_farm.services.engine.stats import EngineStats
from rollout_farm.services.engine.torch.batch import Batch, Slots
from rollout_farm.services.engine.torch.sampling import Draws, text_hits_stop
from rollout_farm.services.engine.torch.speculative import History, Verified, verify

if TYPE_CHECKING:
    from rollout_farm.services.engine.torch.model import ServedModel

DRAFT_SHARE = 0.5  # a step verifies drafts only when they fill this share of its rows x the widest draft


class Drafter:
    """The speculative steps. Uses the History it is given (the sequences its drafts come from: it opens, extends
    and closes a row's sequence there) and owns nothing else but k, the most tokens it drafts per row. Given the
    served model (model, tokenizer, pad id, version), the running batch's Draws and the engine's stats."""

    def __init__(self, served: ServedModel, history: History, k: int, draws: Draws, stats: EngineStats):
        self.served, self.history, self.k, self.draws, self.stats = served, history, k, draws, stats

    # a row's sequence in the history -------------------------------------------------------------------
    def open(self, prompts: list[list[int]]) -> list[int]:
        """New rows of `prompts`: their sequences' ids in the history (a row's `hist`)."""
        return [self.history.open(p) for p in prompts]

    def extend(self, hist: torch.Tensor, tokens: torch.Tensor, live: torch.Tensor) -> None:
        """A plain step: each live row's one token."""
        for h, token, alive in zip(hist.tolist(), tokens.tolist(), live.tolist()):
            if alive:
                self.history.extend(h, [token])

    def close(self, hist: int, keep: bool) -> None:
        """A row ended (_finish_row): its sequence is remembered (keep), or dropped (an aborted row)."""
        self.history.close(hist, keep=keep)

    def forget(self, hist: torch.Tensor) -> None:
        """Rows that leave without _finish_row (retracted, failed, or removed after it): their draft history rows
        still open are closed, not remembered."""
        for h in hist.tolist():
            if h in self.history.rows:
                self.history.close(h, keep=False)

    # a step -------------------------------------------------------------------------------------------
    def drafts(self, b: Batch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The running rows' drafts (B, K) and how many of each row's are real (B,), or None when no row has one."""
        k, t = self.k, b.t
        left = (t["max_new"] - t["step"] - 1).tolist()  # a draft past max_new_tokens would be cut anyway
        hist, gone = t["hist"].tolist(), t["gone"].tolist()
        drafts = [
            [] if gone[i] or call.regex is not None or left[i] < 1 else self.history.propose(hist[i], min(k, left[i]))
            for i, call in enumerate(b.calls)
        ]
        width = max(map(len, drafts), default=0)
        if not width or sum(map(len, drafts)) < DRAFT_SHARE * width * len(drafts):
            return None  # a verification feeds every row width + 1 tokens: not for a few rows' drafts
        dev = t["last"].device
        draft = torch.tensor([d + [0] * (width - len(d)) for d in drafts], dtype=torch.long, device=dev)
        return draft, torch.tensor([len(d) for d in drafts], dtype=torch.long, device=dev)

    def step(
        self, b: Batch, slots: Slots, new: tuple[Batch, torch.Tensor] | None, draft: torch.Tensor, n_draft: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """One verification step of the running rows of `b` (their drafts) and the first token of the `new` ones
        (they join `b`), written to `slots`. Returns the rows that ended, their lengths, which hit a stop, and how
        many rows were live (the scheduler ends them)."""
        running, K = draft.shape
        logits = b.verify(self.served.model, draft, n_draft)  # (running, K + 1, V)
        if new is not None:
            first = new[1]
            padded = torch.cat([first[:, None], first.new_zeros((len(first), K, first.shape[-1]))], 1)
            logits = torch.cat([logits, padded])  # the new rows: no drafts, their first token at position 0
            draft = torch.cat([draft, draft.new_zeros((len(first), K))])
            n_draft = torch.cat([n_draft, n_draft.new_zeros(len(first))])
            b.extend(new[0])
            self.draws.changed()
        t = b.t
        groups = self.draws.groups(b, slots)
        v = verify(logits, draft, n_draft, t["temperature"], t["top_k"], t["top_p"], groups, self.served.pad_id)
        b.settle(running, K + 1, v.accepted[:running] + 1)  # fed: the last token and the accepted drafts
        live = ~t["gone"]
        t["drafted"] += torch.where(live, n_draft, 0)
        t["accepted"] += torch.where(live, v.accepted, 0)
        self.stats.drafted(int(n_draft[live].sum()), int(v.accepted[live].sum()))
        return self._emit(b, slots, v, live)

    def _emit(self, b: Batch, slots: Slots, v: Verified, live: torch.Tensor):
        """Write each live row's emitted tokens, cut where the row stops; return the rows that stopped (step())."""
        t = b.t
        cols = torch.arange(v.tokens.shape[1], device=v.tokens.device)
        n = torch.minimum(v.n, t["max_new"] - t["step"])
        stop = (v.tokens[..., None] == t["stops"][:, None, :]).any(-1) & (cols[None] < n[:, None])
        hit = stop.any(-1)
        n = torch.where(hit, stop.to(torch.int8).argmax(-1) + 1, n)
        n = torch.where(live, n, 0)
        for j in range(int(n.max()) if len(n) else 0):
            rows = (cols[j] < n).nonzero().squeeze(-1)
            slot, step = t["slot"][rows], t["step"][rows] + j
            slots.write(slot, step, v.tokens[rows, j], v.logprob[rows, j], v.sampling_logprob[rows, j])
            slots.record_token_versions(slot, step, self.served.version)
        counts = n.tolist()
        for i in self.draws.stop_rows():  # stop strings: the row's text after each emitted token
            start = int(t["step"][i])
            for j in range(counts[i]):
                said = slots.tokens(int(t["slot"][i]), start + j + 1)
                if text_hits_stop(self.served.tokenizer, said, b.calls[i].params.stop):
                    counts[i], hit[i] = j + 1, True
                    break
        n = torch.tensor(counts, dtype=torch.long, device=n.device)
        t["last"] = v.tokens.gather(1, (n - 1).clamp(min=0)[:, None]).squeeze(1)
        hist, tokens = t["hist"].tolist(), v.tokens.tolist()
        for i, count in enumerate(counts):
            if count:
                self.history.extend(hist[i], tokens[i][:count])
        step = t["step"] + n
        ended = hit | (step >= t["max_new"])
        if v.dead is not None:
            ended |= v.dead
            hit &= ~v.dead
        ended &= live
        t["step"] = step
        return ended, step, hit, int(live.sum())
