"""Pausing the torch engine with its running rows held, as SGLang's /pause_generation modes do; mixed into
BatchScheduler (torch_scheduler.py), whose _loop_once calls these at each loop.

pause(mode)  "wait" (Engine.pause): admit nothing new, the running rows go on. The two holding modes also stop
             stepping, and return once the scheduler holds (no step of the running rows starts after that):
  in_place   the running rows stay in the batch, with their KV cache, at a step boundary. A weight commit lands at
             once whatever its policy ("abort" ends the held rows first), so after resume the held rows go on under
             the new version: their per-token versions switch where they were held.
  retract    the running rows leave the batch (their KV cache is dropped) and go back to the front of the waiting
             queue as continuations: prompt + the tokens so far, prefilled again when admitted after resume (on the
             weights served then), decoding on from the same step. The tokens, logprobs, sampling logprobs and
             versions so far are kept in the row's slot, so stop strings, the regex and max_new_tokens see the whole
             sample, and a seeded call keeps drawing from its own generator.
resume()     lets them go. A held or retracted call that is cancelled, or aborted (abort(), an "abort" commit), ends
             "abort" with the tokens it had.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Literal

import torch

from rollout_farm.services.engine.base import EngineOutput

HoldMode = Literal["in_place", "retract"]
HOLD_MODES = ("in_place", "retract")
HOLD_POLL_S = 0.05


class HoldRows:
    """Mixed into BatchScheduler: `_hold` is None (running) or the HoldMode; `_hold_seen` once the scheduler holds."""

    _hold: HoldMode | None = None
    _hold_seen: bool = False

    # the callers' side -----------------------------------------------------------------------------------
    def pause(self, mode: str = "wait") -> None:
        """Engine.pause; with a HoldMode, also hold the running rows (this module's docstring)."""
        if mode == "wait":
            return super().pause()
        if mode not in HOLD_MODES:
            raise ValueError(f"pause mode {mode!r}: give one of wait, {', '.join(HOLD_MODES)}")
        with self._cv:
            super().pause()
            self._hold, self._hold_seen = mode, False
            self._cv.notify_all()
            while self._hold == mode and not self._hold_seen:
                self._cv.wait(HOLD_POLL_S)

    def resume(self) -> None:
        with self._cv:
            self._hold = None
        super().resume()

    @property
    def held(self) -> HoldMode | None:
        return self._hold

    # the scheduler thread (_loop_once) ---------------------------------------------------------------------
    def _held_work(self) -> bool:
        """Under _cv, while holding: whether the loop has something to do (else it waits)."""
        if not self._hold_seen or self._commit is not None or (self._hold == "retract" and self.batch):
            return True
        return any(c.cancel.is_set() or c.epoch != self._abort_epoch for c in self._active)

    def _hold_back(self, admit: list) -> list:
        """Holding: the calls taken for admission go back to the front of the queue; the pauser learns we hold."""
        with self._cv:
            self._pending.extendleft(reversed(admit))
            self._hold_seen = True
            self._cv.notify_all()
        return []

    def _retract(self) -> None:
        """Every running call's live rows leave the batch and wait at the front of the queue as a continuation."""
        b = self.batch
        if not len(b):
            return
        steps, gone, slots = b.t["step"].tolist(), b.t["gone"].tolist(), b.t["slot"].tolist()
        rows: dict = {}  # Call -> its live rows
        for i, call in enumerate(b.calls):
            if not gone[i]:
                rows.setdefault(call, []).append(i)
        continuations = []
        for call, mine in rows.items():
            carried = [self.slots.read(slots[i], steps[i]) for i in mine]
            index = [b.index[i] for i in mine]
            origin = getattr(call, "origin", call.prompts)
            cont = type(call)([origin[j] + c[0] for j, c in zip(index, carried)], call.params, call.cancel, call.urgent)
            cont.origin, cont.carried = [origin[j] for j in index], carried
            cont.parent_epoch, cont.parent_gen, cont.arrived = call.epoch, call.gen, call.arrived
            cont.future.add_done_callback(_rejoin(call, index))
            continuations.append(cont)
            del self._active[call]
            self.generated_tokens += sum(len(o.token_ids) for o in call.outputs if o is not None)
        self.slots.release(slots)
        self._forget_drafts(b.t["hist"])  # a continuation is a new row of the draft history
        self.batch, self._groups = type(b)(), None
        with self._cv:
            self._pending.extendleft(reversed(continuations))

    def _settle_retracted(self) -> None:
        """Under _cv: a waiting continuation that was cancelled or aborted ends "abort" with the tokens it had."""
        for call in [c for c in self._pending if getattr(c, "carried", None) is not None]:
            if call.cancel.is_set() or call.parent_epoch != self._abort_epoch:
                self._pending.remove(call)
                call.outputs = [
                    EngineOutput(tok, lp, "abort", ver[0] if tok else self.weight_version, ver, slp)
                    for tok, lp, slp, ver in call.carried
                ]
                self.generated_tokens += sum(len(o.token_ids) for o in call.outputs)
                self._done.append(call)

    def _carry_over(self, new) -> None:
        """After _admit_calls: a continuation's rows start at the step they were retracted at, their slots holding
        the tokens so far, and a seeded continuation draws on from its own generator."""
        if new is None:
            return
        b, s = new[0], self.slots
        for i, call in enumerate(b.calls):
            carried = getattr(call, "carried", None)
            if carried is None:
                continue
            if call.parent_gen is not None:
                call.gen = call.parent_gen
            tok, lp, slp, ver = carried[b.index[i]]
            k, slot = len(tok), int(b.t["slot"][i])
            if not k:
                continue
            for name, values in (("tok", tok), ("lp", lp), ("slp", slp), ("ver", ver)):
                dest = getattr(s, name)
                dest[slot, :k] = torch.tensor(values, dtype=dest.dtype, device=dest.device)
            b.t["step"][i] = k


def _rejoin(parent, index: list[int]):
    """When a continuation ends: its outputs are its parent's rows `index`, and the parent's future is set."""

    def done(f: Future) -> None:
        if parent.future.done():
            return
        if f.exception() is not None:
            parent.future.set_exception(f.exception())
            return
        for j, out in zip(index, f.result()):
            parent.outputs[j] = out
        parent.future.set_result(parent.outputs)

    return done
