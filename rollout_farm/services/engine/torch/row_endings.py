"""The rows that end, for the Scheduler (scheduler.py, which inherits RowEndings): a row that finished, was cut or
cancelled leaves the batch with its outputs, its call ends once its last row has, and the futures of the calls that
ended are set once the loop lets go of the model lock (_deliver). A loop that fails fails every running call."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from rollout_farm.services.engine.base import EngineOutput
from rollout_farm.services.engine.stats import EngineStats
from rollout_farm.services.engine.torch.batch import Batch, Slots
from rollout_farm.services.engine.torch.call import Call
from rollout_farm.services.engine.torch.sampling import Draws

if TYPE_CHECKING:
    from rollout_farm.services.engine.torch.draft_step import Drafter
    from rollout_farm.services.engine.torch.model import ServedModel
    from rollout_farm.services.engine.torch.prefill import Prefill


class RowEndings:
    """The Scheduler's part that ends rows and calls; its state is the Scheduler's (set in Scheduler.__init__)."""

    served: ServedModel
    prefill: Prefill
    drafter: Drafter | None
    draws: Draws
    stats: EngineStats
    rows_to_keep: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    batch: Batch
    slots: Slots
    _active: dict[Call, None]
    _done: list[Call]
    _admitting: list[Call]
    _abort_epoch: int
    _generated: int

    def _finish_row(self, i: int, length: int, reason: str) -> None:
        b = self.batch
        call, slot = b.calls[i], int(b.t["slot"][i])
        tok, lp, slp, ver = self.slots.read(slot, length)
        if self.drafter is not None:
            self.drafter.close(int(b.t["hist"][i]), keep=reason != "abort")
        drafts = int(b.t["drafted"][i]), int(b.t["accepted"][i])
        first = ver[0] if length else self.served.version
        call.outputs[b.index[i]] = EngineOutput(tok, lp, reason, first, ver, slp, *drafts)
        if call.cache_key is not None and reason != "abort":
            self.prefill.keep_session(b, i, call, tok)
        call.live -= 1
        if not call.live:
            del self._active[call]
            self._generated += sum(len(o.token_ids) for o in call.outputs)
            self._done.append(call)

    def _remove(self, ended: torch.Tensor) -> None:
        """Rows that ended leave the batch (unless rows_to_keep keeps them: then they are gone, not decoded for)."""
        b = self.batch
        keep = self.rows_to_keep(ended | b.t["gone"], torch.arange(len(b), device=ended.device))
        b.t["gone"] |= ended
        self._forget_drafts(b.t["hist"][~keep])
        if bool(b.t["gone"][keep].all()):  # only rows kept after their end: the batch is over
            keep = torch.zeros_like(keep)
        self.slots.release(b.t["slot"][~keep].tolist())
        b.select(keep)
        self.draws.changed()

    def _forget_drafts(self, hist: torch.Tensor) -> None:
        if self.drafter is not None:
            self.drafter.forget(hist)

    def _end_cancelled(self) -> None:
        """The running calls that were cancelled, or running when abort() was called: their rows end ("abort")."""
        b = self.batch
        ending = [c for c in self._active if c.cancel.is_set() or c.epoch != self._abort_epoch]
        if not ending:
            return
        ending_set = set(ending)
        ended = torch.tensor([c in ending_set for c in b.calls], dtype=torch.bool, device=self.served.device)
        ended &= ~b.t["gone"]
        steps = b.t["step"].tolist()
        for i in ended.nonzero().squeeze(-1).tolist():
            self._finish_row(i, steps[i], "abort")
        self._remove(ended)

    def _fail_running(self, error: Exception) -> None:
        with self.served.lock:
            for call in [*self._active, *self._admitting]:
                if not call.future.done():
                    call.future.set_exception(error)
            self._active.clear()
            self._admitting = []
            if len(self.batch):
                self._forget_drafts(self.batch.t["hist"])
            self.batch, self.slots = Batch(), Slots(self.served.device)
            self.draws.changed()
            self.stats.busy(False)

    def _deliver(self) -> None:
        done, self._done = self._done, []
        for call in done:
            if not call.future.done():
                call.future.set_result(call.outputs)
