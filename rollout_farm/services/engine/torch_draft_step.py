"""Speculative decoding in the torch engine's scheduler (FARM_ENGINE_SPECULATIVE_TOKENS = k > 0; off by default):
a decode step that also verifies up to k drafted tokens per row, the drafts coming from the farm's own history
(torch_speculative.History: earlier rollouts of the same prompt and the rows of that prompt running now).

A step with drafts feeds each running row its last token and its drafts in one forward pass (Batch.verify), and
torch_speculative.verify applies the exact acceptance rule, so each row emits between 1 and k + 1 tokens whose
distribution, logprobs and sampling logprobs are the plain path's. Then the emitted tokens are cut at the first stop
token, stop string or max_new_tokens, as one token at a time would have stopped; the cache keeps the tokens fed
that were accepted (Batch.settle masks out the rest). Rows that joined this step draw their first token as usual.
Rows with a regex, and a step where few rows have drafts (under DRAFT_SHARE of the rows x the widest draft: the
verification feeds every row that many tokens), take the plain step (torch_scheduler.py).
"""

from __future__ import annotations

import torch

from rollout_farm.services.engine.torch_batch import Batch
from rollout_farm.services.engine.torch_sampling import text_hits_stop
from rollout_farm.services.engine.torch_speculative import verify

DRAFT_SHARE = 0.5  # a step verifies drafts only when they fill this share of its rows x the widest draft


class DraftSteps:
    """Mixed into BatchScheduler: uses batch, slots, history (None: off), speculative_tokens, model, pad_id,
    tokenizer, weight_version, stats, _groups/_regroup, _stop_rows, _active, _finish_row and _remove."""

    def _drafts(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The running rows' drafts (B, K) and how many of each row's are real (B,), or None when no row has one."""
        b, k = self.batch, self.speculative_tokens
        t = b.t
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

    def _forget_drafts(self, hist: torch.Tensor) -> None:
        """Rows that leave without _finish_row (retracted, failed, or removed after it): their draft history rows
        still open are closed, not remembered."""
        if self.history is not None:
            for h in hist.tolist():
                if h in self.history.rows:
                    self.history.close(h, keep=False)

    def _step_drafted(self, new: tuple[Batch, torch.Tensor] | None, draft: torch.Tensor, n_draft: torch.Tensor):
        """One verification step of the running rows (their drafts) and the first token of the new ones."""
        b = self.batch
        running, K = draft.shape
        logits = b.verify(self.model, draft, n_draft)  # (running, K + 1, V)
        if new is not None:
            first = new[1]
            padded = torch.cat([first[:, None], first.new_zeros((len(first), K, first.shape[-1]))], 1)
            logits = torch.cat([logits, padded])  # the new rows: no drafts, their first token at position 0
            draft = torch.cat([draft, draft.new_zeros((len(first), K))])
            n_draft = torch.cat([n_draft, n_draft.new_zeros(len(first))])
            b.extend(new[0])
            self._groups = None
        t = b.t
        self._ready_groups()
        v = verify(logits, draft, n_draft, t["temperature"], t["top_k"], t["top_p"], self._groups, self.pad_id)
        b.settle(running, K + 1, v.accepted[:running] + 1)  # fed: the last token and the accepted drafts
        live = ~t["gone"]
        t["drafted"] += torch.where(live, n_draft, 0)
        t["accepted"] += torch.where(live, v.accepted, 0)
        self.stats.drafted(int(n_draft[live].sum()), int(v.accepted[live].sum()))
        self._emit(v, live)

    def _emit(self, v, live: torch.Tensor) -> None:
        """Write each live row's emitted tokens, cut where the row stops, and end the rows that stopped."""
        b, t = self.batch, self.batch.t
        cols = torch.arange(v.tokens.shape[1], device=v.tokens.device)
        n = torch.minimum(v.n, t["max_new"] - t["step"])
        stop = (v.tokens[..., None] == t["stops"][:, None, :]).any(-1) & (cols[None] < n[:, None])
        hit = stop.any(-1)
        n = torch.where(hit, stop.to(torch.int8).argmax(-1) + 1, n)
        n = torch.where(live, n, 0)
        for j in range(int(n.max()) if len(n) else 0):
            rows = (cols[j] < n).nonzero().squeeze(-1)
            slot, step = t["slot"][rows], t["step"][rows] + j
            self.slots.write(slot, step, v.tokens[rows, j], v.logprob[rows, j], v.sampling_logprob[rows, j])
            self.slots.record_token_versions(slot, step, self.weight_version)
        counts = n.tolist()
        for i in self._stop_rows:  # stop strings: the row's text after each emitted token
            start = int(t["step"][i])
            for j in range(counts[i]):
                said = self.slots.tokens(int(t["slot"][i]), start + j + 1)
                if text_hits_stop(self.tokenizer, said, b.calls[i].params.stop):
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
        self.stats.step(int(live.sum()), len(self._active))
        if bool(ended.any()):
            for i in ended.nonzero().squeeze(-1).tolist():
                self._finish_row(i, int(step[i]), "stop" if bool(hit[i]) else "length")
            self._remove(ended)
