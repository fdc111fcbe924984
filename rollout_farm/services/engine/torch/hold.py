"""Pausing the torch engine with its running rows held, as SGLang's /pause_generation modes do; the scheduler
(scheduler.py) runs them, asking Hold at each loop.

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
from rollout_farm.services.engine.torch.batch import Batch, Slots
from rollout_farm.services.engine.torch.call import Call

HoldMode = Literal["in_place", "retract"]
HOLD_MODES = ("in_place", "retract")
HOLD_POLL_S = 0.05


class Hold:
    """Owns the hold `mode` (None: running; else the HoldMode a pause asked for) and whether the scheduler has
    reached it (a pause(mode) returns then). The scheduler reads and changes both under its condition."""

    def __init__(self):
        self._mode: HoldMode | None = None
        self._reached = False

    @property
    def mode(self) -> HoldMode | None:
        return self._mode

    def start(self, mode: HoldMode) -> None:
        self._mode, self._reached = mode, False

    def stop(self) -> None:
        self._mode = None

    def reach(self) -> None:
        """The scheduler holds: no step of the running rows starts until stop()."""
        self._reached = True

    def waiting(self, mode: HoldMode) -> bool:
        """A pause(mode) still waits for the scheduler to hold."""
        return self._mode == mode and not self._reached

    def has_work(self, commit_waiting: bool, running: bool, active, epoch: int) -> bool:
        """While holding: whether the scheduler's loop has something to do (else it waits): reach the hold, apply a
        commit, retract the rows still `running`, or end the `active` calls cancelled or aborted (epoch)."""
        if not self._reached or commit_waiting or (self._mode == "retract" and running):
            return True
        return any(c.cancel.is_set() or c.epoch != epoch for c in active)


class Continuation(Call):
    """A retracted call's live rows waiting to go on: their prompts are the original prompts (`origin`) + the tokens
    so far, `carried` holds those tokens' (tokens, logprobs, sampling logprobs, versions) per row, and it keeps its
    parent's abort epoch, generator and arrival. When it ends, its outputs are its parent's (retract())."""

    origin: list[list[int]]
    carried: list[tuple[list[int], list[float], list[float], list[int]]]
    parent_epoch: int
    parent_gen: torch.Generator | None

    def ended(self, epoch: int) -> bool:
        """Cancelled, or aborted while it waited (abort(), an "abort" commit)."""
        return self.cancel.is_set() or self.parent_epoch != epoch

    def aborted_outputs(self, version: int) -> list[EngineOutput]:
        """Its rows' outputs when it ends before it is admitted again: "abort", with the tokens they had."""
        return [
            EngineOutput(tok, lp, "abort", ver[0] if tok else version, ver, slp) for tok, lp, slp, ver in self.carried
        ]


def retract(batch: Batch, slots: Slots) -> list[tuple[Call, Continuation]]:
    """Every running call of `batch` with its continuation: its live rows' prompts + tokens so far (from `slots`).
    The continuation's future, once set, sets the call's."""
    b = batch
    steps, gone, slot = b.t["step"].tolist(), b.t["gone"].tolist(), b.t["slot"].tolist()
    rows: dict = {}  # Call -> its live rows
    for i, call in enumerate(b.calls):
        if not gone[i]:
            rows.setdefault(call, []).append(i)
    out = []
    for call, mine in rows.items():
        carried = [slots.read(slot[i], steps[i]) for i in mine]
        index = [b.index[i] for i in mine]
        origin = call.origin if isinstance(call, Continuation) else call.prompts
        prompts = [origin[j] + c[0] for j, c in zip(index, carried)]
        cont = Continuation(prompts, call.params, call.cancel, call.urgent, adapter=call.adapter)
        cont.origin, cont.carried = [origin[j] for j in index], carried
        cont.parent_epoch, cont.parent_gen, cont.arrived = call.epoch, call.gen, call.arrived
        cont.future.add_done_callback(_rejoin(call, index))
        out.append((call, cont))
    return out


def carry_over(new: Batch, slots: Slots) -> None:
    """After admission: a continuation's rows in `new` start at the step they were retracted at, their slots holding
    the tokens so far, and a seeded continuation draws on from its own generator."""
    b, s = new, slots
    for i, call in enumerate(b.calls):
        if not isinstance(call, Continuation):
            continue
        if call.parent_gen is not None:
            call.gen = call.parent_gen
        tok, lp, slp, ver = call.carried[b.index[i]]
        k, slot = len(tok), int(b.t["slot"][i])
        if not k:
            continue
        for name, values in (("tok", tok), ("lp", lp), ("slp", slp), ("ver", ver)):
            dest = getattr(s, name)
            dest[slot, :k] = torch.tensor(values, dtype=dest.dtype, device=dest.device)
        b.t["step"][i] = k


def _rejoin(parent: Call, index: list[int]):
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
