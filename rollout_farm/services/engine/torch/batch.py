"""The torch engine's running batch: rows from any number of generate calls decoding together (scheduler.py).

Batch   one KV cache, left padded so that every row's next token sits at the same column: rows that join a running
        batch are prefilled apart and their cache is padded on the left to the batch's length (or the batch's to
        theirs); a finished row leaves (its cache row is dropped), and columns that no row attends to any more are
        trimmed from the left. Positions are per row, so padding never shifts a row's positions, and a padded column
        is masked out: a row decodes as it would alone, up to float rounding.
        The group cache: a prompt that several new rows share (a GRPO group's n samples) goes through the model
        once; `fan_out` then copies its cache row and first-token logits to each of them, which decode apart.
Slots   each row's tokens, logprobs, sampling logprobs (write) and per-token weight versions (record_token_versions)
        so far, written for the whole batch in one operation each per step, read once when the row ends.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rollout_farm.services.engine.torch.lora import adapter_rows


def forward(model, calls: list, **inputs):
    """The model on a batch whose row i belongs to calls[i]: each row with its call's adapter (lora.py)."""
    with adapter_rows(model, [call.adapter for call in calls]):
        return model(**inputs)


class Batch:
    """The rows decoding together: `cache` (HF DynamicCache), `mask` (B, T), and per-row tensors in `t`:
      slot         the row's Slots row;  step: tokens it has generated;  max_new: its call's max_new_tokens
      temperature, top_k, top_p   its call's sampling params;  stops (B, S): its stop token ids, -1 padded
      pos          the position of its next input token;  last: that token (sampled, not yet in the cache)
      gone         it has ended but the scheduler's rows_to_keep kept it in the batch
    `calls[i]` is row i's call and `index[i]` which of the call's prompts it is; a call's rows stay contiguous."""

    def __init__(self):
        self.cache = None
        self.mask: torch.Tensor | None = None
        self.t: dict[str, torch.Tensor] = {}
        self.calls: list = []
        self.index: list[int] = []

    def __len__(self) -> int:
        return len(self.calls)

    @classmethod
    def prefill(cls, model, prompts: list[list[int]], pad_id: int, rows: dict, calls: list, index: list[int]):
        """New rows: their prompts in one forward pass (left padded; give each distinct prompt once and fan_out).
        Returns the batch of them and the logits of their first token (B, V)."""
        B, L, dev = len(prompts), max(map(len, prompts)), rows["slot"].device
        ids = torch.full((B, L), pad_id, dtype=torch.long)
        mask = torch.zeros((B, L), dtype=torch.long)
        for i, prompt in enumerate(prompts):
            ids[i, L - len(prompt) :] = torch.tensor(prompt)
            mask[i, L - len(prompt) :] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = forward(model, calls, input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        b = cls()
        b.cache, b.mask, b.calls, b.index = out.past_key_values, mask, list(calls), list(index)
        b.t = {**rows, "pos": mask.sum(-1), "last": torch.zeros(B, dtype=torch.long, device=dev)}  # drawn next
        return b, out.logits[:, -1, :].float()

    @classmethod
    def prefill_cached(cls, model, cached, prompt: list[int], rows: dict, calls: list, index: list[int]):
        """One new row whose prompt extends `cached` (session_cache.py): only the tokens after the cached
        ones go through the model. Returns the batch of it and the logits of its first token (1, V)."""
        from transformers.cache_utils import DynamicCache

        dev, k, n = rows["slot"].device, len(cached.tokens), len(prompt)
        ids = torch.tensor([prompt[k:]], dtype=torch.long, device=dev)
        mask = torch.ones((1, n), dtype=torch.long, device=dev)
        cache = DynamicCache(ddp_cache_data=[(keys.to(dev), values.to(dev)) for keys, values in cached.layers])
        positions = torch.arange(k, n, device=dev)[None]
        out = forward(
            model,
            calls,
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
        )
        b = cls()
        b.cache, b.mask, b.calls, b.index = out.past_key_values, mask, list(calls), list(index)
        b.t = {**rows, "pos": torch.tensor([n], device=dev), "last": torch.zeros(1, dtype=torch.long, device=dev)}
        return b, out.logits[:, -1, :].float()

    def fan_out(self, logits: torch.Tensor, which: list[int], rows: dict, calls: list, index: list[int]):
        """Row j of the result is a copy of this batch's row which[j] (its cache, mask and position), with its own
        `rows` params, call and index: the rows of one prompt share its prefill. Returns their logits
        (len(which), V)."""
        if which != list(range(len(self))):
            idx = torch.tensor(which, dtype=torch.long, device=self.mask.device)
            self.cache.reorder_cache(idx)  # index_select: each row gets its own copy, so rows leave one by one
            self.mask, logits, pos = self.mask[idx], logits[idx], self.t["pos"][idx]
        else:
            pos = self.t["pos"]
        self.t = {**rows, "pos": pos, "last": torch.zeros(len(which), dtype=torch.long, device=pos.device)}
        self.calls, self.index = list(calls), list(index)
        return logits

    def row_cache(self, i: int, drop_last: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Row i's keys and values at the columns it attends to, (1, heads, tokens, dim) per layer, copied (without
        the last of them with drop_last)."""
        cols = self.mask[i].bool()
        if drop_last:
            cols = cols.clone()
            cols[int(cols.nonzero()[-1])] = False
        return [
            (layer.keys[i : i + 1, :, cols].clone(), layer.values[i : i + 1, :, cols].clone())
            for layer in self.cache.layers
        ]

    def decode(self, model) -> torch.Tensor:
        """One step of every row: each row's last token goes in; the logits of its next token (B, V) come out."""
        t = self.t
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(self), 1))], dim=1)
        out = forward(
            model,
            self.calls,
            input_ids=t["last"][:, None],
            attention_mask=self.mask,
            position_ids=t["pos"][:, None],
            past_key_values=self.cache,
            use_cache=True,
        )
        self.cache, t["pos"] = out.past_key_values, t["pos"] + 1
        return out.logits[:, -1, :].float()

    def verify(self, model, draft: torch.Tensor, n_draft: torch.Tensor) -> torch.Tensor:
        """One forward pass of every row's last token and its drafts (B, K), row i's first n_draft[i] real: the logits
        at those K + 1 positions (B, K + 1, V) (draft_step.py). The K + 1 new columns stay until settle()."""
        t, K = self.t, draft.shape[1]
        cols = torch.arange(K + 1, device=draft.device)
        self.mask = torch.cat([self.mask, (cols[None] <= n_draft[:, None]).to(self.mask.dtype)], dim=1)
        out = forward(
            model,
            self.calls,
            input_ids=torch.cat([t["last"][:, None], draft], 1),
            attention_mask=self.mask,
            position_ids=t["pos"][:, None] + cols[None],
            past_key_values=self.cache,
            use_cache=True,
        )
        self.cache = out.past_key_values
        return out.logits.float()

    def settle(self, rows: int, width: int, fed: torch.Tensor) -> None:
        """After verify(): the first `rows` rows keep the first fed[i] of the `width` columns it added (their last
        token and the drafts accepted) and mask out the rest; columns no row attends to any more are dropped."""
        cols = torch.arange(width, device=fed.device)
        self.mask[:rows, -width:] = (cols[None] < fed[:, None]).to(self.mask.dtype)
        self.t["pos"][:rows] += fed
        used = self.mask.any(0)
        if not bool(used.all()) and self.joinable():
            idx = used.nonzero().squeeze(-1)
            self.mask = self.mask[:, idx]
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, idx], layer.values[:, :, idx]

    def joinable(self) -> bool:
        """Whether rows can join this batch: every cache layer is a plain DynamicLayer (full attention). A model with
        sliding-window or other cache layers runs each batch to its end; calls arriving meanwhile form the next."""
        from transformers.cache_utils import DynamicLayer

        return self.cache is None or all(type(layer) is DynamicLayer for layer in self.cache.layers)

    def extend(self, other: Batch) -> None:
        """Add `other`'s rows after this batch's."""
        if not len(self):
            self.cache, self.mask, self.t, self.calls, self.index = (
                other.cache,
                other.mask,
                other.t,
                other.calls,
                other.index,
            )
            return
        T, U = self.mask.shape[1], other.mask.shape[1]
        width = max(T, U)
        self.mask = torch.cat([F.pad(self.mask, (width - T, 0)), F.pad(other.mask, (width - U, 0))])
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            mine.keys = torch.cat([_pad_left(mine.keys, width - T), _pad_left(theirs.keys, width - U)])
            mine.values = torch.cat([_pad_left(mine.values, width - T), _pad_left(theirs.values, width - U)])
        S = max(self.t["stops"].shape[1], other.t["stops"].shape[1])
        stops = [F.pad(x.t["stops"], (0, S - x.t["stops"].shape[1]), value=-1) for x in (self, other)]
        self.t = {k: torch.cat([self.t[k], other.t[k]]) for k in self.t if k != "stops"}
        self.t["stops"] = torch.cat(stops)
        self.calls += other.calls
        self.index += other.index

    def select(self, keep: torch.Tensor) -> None:
        """Keep only the rows where `keep` (B,) is True, then trim the columns no row attends to."""
        if not bool(keep.any()):
            self.__init__()
            return
        if bool(keep.all()):
            return
        idx = keep.nonzero().squeeze(-1)
        self.cache.reorder_cache(idx)
        self.mask = self.mask[idx]
        self.t = {k: v[idx] for k, v in self.t.items()}
        rows = idx.tolist()
        self.calls, self.index = [self.calls[i] for i in rows], [self.index[i] for i in rows]
        first = int(self.mask.any(0).to(torch.int8).argmax())  # the first column some row attends to
        if first > 0 and self.joinable():
            self.mask = self.mask[:, first:]
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]


def _pad_left(x: torch.Tensor, n: int) -> torch.Tensor:
    """(B, H, T, D) keys or values with n zero columns before T (masked out: they never count)."""
    return F.pad(x, (0, 0, n, 0)) if n else x


class Slots:
    """Per-row outputs in preallocated (rows, tokens) tensors: tokens, raw logprobs, sampling logprobs, versions."""

    def __init__(self, device: torch.device):
        self.device = device
        self.tok = torch.zeros((0, 0), dtype=torch.long, device=device)
        self.lp = torch.zeros((0, 0), device=device)
        self.slp = torch.zeros((0, 0), device=device)
        self.ver = torch.zeros((0, 0), dtype=torch.long, device=device)
        self.free: list[int] = []

    def acquire(self, n: int, length: int) -> list[int]:
        """n free rows that hold at least `length` tokens each."""
        rows, cols = self.tok.shape
        grow_rows = max(0, n - len(self.free))
        if grow_rows or length > cols:
            new_rows, new_cols = rows + (max(grow_rows, rows) if grow_rows else 0), max(cols, length)
            for name in ("tok", "lp", "slp", "ver"):
                old = getattr(self, name)
                new = torch.zeros((new_rows, new_cols), dtype=old.dtype, device=self.device)
                new[:rows, :cols] = old
                setattr(self, name, new)
            self.free += range(rows, new_rows)
        taken, self.free = self.free[:n], self.free[n:]
        return taken

    def release(self, slots: list[int]) -> None:
        self.free += slots

    def write(self, slot: torch.Tensor, step: torch.Tensor, tok, lp, slp) -> None:
        """This step's token of each row and its raw and sampling logprobs (slot, step: (B,) each)."""
        self.tok[slot, step], self.lp[slot, step], self.slp[slot, step] = tok, lp, slp

    def record_token_versions(self, slot: torch.Tensor, step: torch.Tensor, version: int) -> None:
        """The weight version that sampled this step's token of each row (slot, step: (B,) each): one per token, so
        a row's versions change mid-sample under the "partial" commit policy (EngineOutput.token_versions)."""
        self.ver[slot, step] = version

    def tokens(self, slot: int, n: int) -> list[int]:
        return self.tok[slot, :n].tolist()

    def read(self, slot: int, n: int) -> tuple[list[int], list[float], list[float], list[int]]:
        return (
            self.tok[slot, :n].tolist(),
            self.lp[slot, :n].tolist(),
            self.slp[slot, :n].tolist(),
            self.ver[slot, :n].tolist(),
        )
