"""The torch engine's iteration-level scheduler: one thread makes every generate call's model calls, and the calls
that arrive while a batch runs join it at the next decode step (continuous batching).

Why our own scheduler and not Serve's @serve.batch: @serve.batch gathers calls into a batch that then runs to its
end, so a call arriving a step after it started waits for the longest sample of that batch; and it would live in the
replica, where the in-process engine tests could not see it. Here a call joins at a step boundary: its prompts are
prefilled apart, their KV cache is padded on the left to the running batch's length and appended (batch.py),
and from the next step on they decode with everyone else. Every row keeps its call's SamplingParams (temperature,
top-k, top-p, max_new_tokens, stop ids and strings, regex, seed: sampling.py), so calls need not match to
share a batch, and a row decodes as it would alone (up to float rounding; a seeded call draws from its own
torch.Generator).

Each loop: commits and cancellations first, then admission, then one step.
  - a "partial" commit is applied before the step; "finish" and "abort" commits hold new calls back until the
    batch is empty (an "abort" commit ends the running calls at this step first) and are applied before the calls
    they ended see their outputs, so the replica reruns those on the new weights;
  - a call whose `cancel` is set, or that was running when abort() was called, ends ("abort"); its rows leave;
  - pending calls are admitted in arrival order while the batch has room (FARM_ENGINE_MAX_BATCH_SIZE rows; a
    larger call is admitted alone into an empty batch). Into an empty batch they are admitted FARM_ENGINE_BATCH_
    WINDOW_S after the first one arrived, so calls that arrive together start together; paused: none is admitted.
    A health check skips the queue and the commit hold: it answers within a step or two of a long batch;
  - one decode step of the running rows and one prefill of the admitted ones, one draw for all of them.
The parts it is given do the rest: the admitted rows' prefill (Prefill, prefill.py), the pause modes that hold the
running rows (Hold, hold.py), a step with drafts (Drafter, draft_step.py), who draws with which generator (Draws,
sampling.py); the weights and the model lock are the served model's (ServedModel, model.py). The rows that end, and
the calls they end, are handled by the part it inherits (RowEndings, row_endings.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from rollout_farm.services.engine.base import EngineOutput
from rollout_farm.services.engine.stats import EngineStats
from rollout_farm.services.engine.torch.batch import Batch, Slots
from rollout_farm.services.engine.torch.call import Call
from rollout_farm.services.engine.torch.hold import HOLD_POLL_S, Continuation, Hold, HoldMode, carry_over, retract
from rollout_farm.services.engine.torch.row_endings import RowEndings
from rollout_farm.services.engine.torch.sampling import Draws, RegexMask, draw, text_hits_stop
from rollout_farm.services.protocol import InFlightPolicy, SamplingParams

if TYPE_CHECKING:
    from rollout_farm.services.engine.torch.draft_step import Drafter
    from rollout_farm.services.engine.torch.model import ServedModel
    from rollout_farm.services.engine.torch.prefill import Prefill

log = logging.getLogger("farm.service")
IDLE_WAIT_S = 0.05  # how often an idle scheduler looks at the pending calls' cancel events


class Scheduler(RowEndings):
    """Owns the pending calls (and `_cv`, the condition that guards them and wakes the loop), the running calls with
    their rows' Batch and Slots, the loop thread, the commit waiting to be applied, the abort epoch and the count of
    tokens generated. Given the served model (its lock and weights), the Prefill, Hold and Drafter (None: no
    speculative decoding) parts, the running batch's Draws, the engine's admit gate (clear: paused) and stats, and
    rows_to_keep (which rows stay in the batch after a step: the unfinished ones; bench/engine_batching.py keeps
    them all)."""

    def __init__(
        self,
        served: ServedModel,
        prefill: Prefill,
        hold: Hold,
        drafter: Drafter | None,
        draws: Draws,
        gate: threading.Event,
        stats: EngineStats,
        max_batch_size: int,
        window_s: float,
        threads: int | None,
        rows_to_keep: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ):
        self.served, self.prefill, self.hold, self.drafter, self.draws = served, prefill, hold, drafter, draws
        self.gate, self.stats, self.rows_to_keep = gate, stats, rows_to_keep
        self.max_batch_size, self.window_s = max_batch_size, window_s
        self._cv = threading.Condition()  # guards _pending, and wakes the scheduler (new call, commit, resume)
        self._pending: deque[Call] = deque()
        self._active: dict[Call, None] = {}  # the calls with rows in the batch, in admission order
        self._done: list[Call] = []  # finished this loop: their futures are set once the loop lets go of the locks
        self._admitting: list[Call] = []  # admitted this loop
        self._commit: InFlightPolicy | None = None  # the policy of a commit waiting to be applied
        self._abort_epoch = 0  # bumped by abort() and by an "abort" commit: running calls compare at each step
        self._generated = 0  # tokens of the calls that ended (generated_tokens)
        self.batch, self.slots = Batch(), Slots(served.device)
        threading.Thread(target=self._run, args=(threads,), name="torch-engine", daemon=True).start()

    # the callers' side -----------------------------------------------------------------------------------
    def submit(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        cancel: threading.Event | None,
        urgent: bool = False,
        cache_key: str | None = None,
        adapter: str | None = None,
    ) -> Future:
        call = Call(prompts, params, cancel or threading.Event(), urgent, cache_key, adapter)
        if not prompts:
            call.future.set_result([])
            return call.future
        with self._cv:
            self._pending.append(call)
            self._cv.notify_all()
        return call.future

    def wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def abort(self) -> None:
        self._abort_epoch += 1

    @property
    def busy(self) -> bool:
        return bool(self._active)

    @property
    def generated_tokens(self) -> int:
        return self._generated

    def commit(self, version: int, policy: InFlightPolicy | None) -> None:
        """Have the staged weights applied by the loop and wait until it has (or the staged tensors were discarded)."""
        with self._cv:
            if policy is not None or self._commit is None:  # a catch-up (None) does not override a push's policy
                self._commit = policy or "finish"
            if policy == "abort":
                self._abort_epoch += 1
            # the scheduler applies it: "partial" at the next step, "finish" and "abort" once the batch is empty
            self._cv.notify_all()
            while self.served.version < version and self._commit is not None:
                self._cv.wait(0.05)

    def hold_rows(self, mode: HoldMode) -> None:
        """Hold the running rows (hold.py) and return once the loop holds them."""
        with self._cv:
            self.hold.start(mode)
            self._cv.notify_all()
            while self.hold.waiting(mode):
                self._cv.wait(HOLD_POLL_S)

    def release_rows(self) -> None:
        """Stop holding (the engine's resume then wakes the loop)."""
        with self._cv:
            self.hold.stop()

    # the scheduler thread --------------------------------------------------------------------------------
    def _run(self, threads: int | None) -> None:
        if threads:
            torch.set_num_threads(threads)
        while True:
            try:
                self._loop_once()
            except Exception as e:  # a step failed (e.g. out of memory): its calls get the error, the engine goes on
                log.exception("engine_step_failed")
                self._fail_running(e)
            self._deliver()

    def _loop_once(self) -> None:
        with self._cv:
            while True:
                self._settle_retracted()  # hold.py: pause with the running rows held
                self._drop_cancelled_pending()
                holding = self.hold.mode is not None
                if self._done or (holding and self._held_work()):
                    admit = []
                    break
                if self._commit is not None and (self._commit == "partial" or not self.batch):
                    admit = []
                    break
                admit, wait_s = self._admissible()
                if admit or (self.batch and not holding):
                    break
                self._cv.wait(wait_s)
        with self.served.lock, torch.inference_mode():
            hold = self.hold.mode
            if hold == "retract":
                self._retract()
            applied = self._commit == "partial" or (hold is not None and self._commit == "finish")
            if applied:
                self._apply_staged()
            self._end_cancelled()
            if self._commit is not None and not self.batch:  # "finish" or "abort": in-flight rows are gone
                self._apply_staged()
                applied = True
            self._admitting = admit = self._hold_back(admit) if hold is not None else admit
            if admit or (self.batch and hold is None):  # failed with the running calls if the step fails
                new = self._admit_calls(admit)
                if new is not None:
                    carry_over(new[0], self.slots)  # hold.py: retracted rows go on from their step
                self._step(new)
            self.stats.busy(bool(self.batch) and hold is None)
        if applied:
            self.wake()  # commit_weights waits for it

    def _apply_staged(self) -> None:
        """The staged weights go in (holding the model lock); the commit's waiter returns."""
        self.served.apply_staged()
        self._commit = None  # after the version: a waiter that sees no commit sees the new version

    def _admissible(self) -> tuple[list[Call], float]:
        """The pending calls to admit now, or [] and how long to wait before looking again."""
        if not self._pending or not self.gate.is_set() or not self.batch.joinable():
            return [], IDLE_WAIT_S
        hold = self._commit is not None  # a "finish" or "abort" commit waits for the batch to empty
        rows = len(self.batch)
        if not rows and not hold and not any(c.urgent for c in self._pending):
            wait = self._pending[0].arrived + self.window_s - time.monotonic()
            if wait > 0 and sum(len(c.prompts) for c in self._pending) < self.max_batch_size:
                return [], min(wait, IDLE_WAIT_S)
        admit, blocked = [], hold
        for call in self._pending:
            fits = not rows or rows + len(call.prompts) <= self.max_batch_size
            if call.urgent or (fits and not blocked):
                admit.append(call)
                rows += len(call.prompts)
            else:
                blocked = True  # in arrival order: a call that does not fit is not overtaken (but by health checks)
        for call in admit:
            self._pending.remove(call)
        return admit, IDLE_WAIT_S

    def _drop_cancelled_pending(self) -> None:
        for call in [c for c in self._pending if c.cancel.is_set()]:
            self._pending.remove(call)
            call.outputs = [EngineOutput([], [], "abort", self.served.version, []) for _ in call.prompts]
            self._done.append(call)

    # holding (hold.py) -------------------------------------------------------------------------------------
    def _held_work(self) -> bool:
        """Under _cv, while holding: whether the loop has something to do (else it waits)."""
        return self.hold.has_work(self._commit is not None, bool(self.batch), self._active, self._abort_epoch)

    def _hold_back(self, admit: list[Call]) -> list[Call]:
        """Holding: the calls taken for admission go back to the front of the queue; the pauser learns we hold."""
        with self._cv:
            self._pending.extendleft(reversed(admit))
            self.hold.reach()
            self._cv.notify_all()
        return []

    def _retract(self) -> None:
        """Every running call's live rows leave the batch and wait at the front of the queue as a continuation."""
        b = self.batch
        if not len(b):
            return
        slots = b.t["slot"].tolist()
        retracted = retract(b, self.slots)
        for call, _ in retracted:
            del self._active[call]
            self._generated += sum(len(o.token_ids) for o in call.outputs if o is not None)
        self.slots.release(slots)
        self._forget_drafts(b.t["hist"])  # a continuation is a new row of the draft history
        self.batch = Batch()
        self.draws.changed()
        with self._cv:
            self._pending.extendleft(reversed([cont for _, cont in retracted]))

    def _settle_retracted(self) -> None:
        """Under _cv: a waiting continuation that was cancelled or aborted ends "abort" with the tokens it had."""
        for call in [c for c in self._pending if isinstance(c, Continuation)]:
            if call.ended(self._abort_epoch):
                self._pending.remove(call)
                call.outputs = call.aborted_outputs(self.served.version)
                self._generated += sum(len(o.token_ids) for o in call.outputs)
                self._done.append(call)

    # admission and steps -----------------------------------------------------------------------------------
    def _admit_calls(self, calls: list[Call]) -> tuple[Batch, torch.Tensor] | None:
        """The admitted calls' rows, prefilled: a Batch to join the running one and the logits of their first
        tokens (None: no call)."""
        served = self.served
        prompts, calls_of, index, rows = [], [], [], {k: [] for k in ("max_new", "temperature", "top_k", "top_p")}
        stops = []
        for call in calls:
            p = call.params
            stop_ids = sorted((set() if p.ignore_eos else served.eos_ids) | set(p.stop_token_ids))
            try:
                call.regex = RegexMask(p.regex, served.tokenizer, set(stop_ids)) if p.regex else None
            except Exception as e:  # a pattern the regex package refuses
                call.future.set_exception(e)
                continue
            call.epoch, call.kv_version = self._abort_epoch, served.version
            call.gen = None if p.seed is None else torch.Generator(device=served.device).manual_seed(p.seed)
            self._active[call] = None
            for i, prompt in enumerate(call.prompts):
                prompts.append(prompt)
                calls_of.append(call)
                index.append(i)
                stops.append(stop_ids)
                for k in rows:
                    rows[k].append(getattr(p, "max_new_tokens" if k == "max_new" else k))
        if not prompts:
            return None
        dev, B = served.device, len(prompts)
        width = max(1, max(map(len, stops)))
        t = {
            "slot": torch.tensor(self.slots.acquire(B, max(rows["max_new"])), dtype=torch.long, device=dev),
            "step": torch.zeros(B, dtype=torch.long, device=dev),
            "max_new": torch.tensor(rows["max_new"], dtype=torch.long, device=dev),
            "temperature": torch.tensor(rows["temperature"], dtype=torch.float32, device=dev),
            "top_k": torch.tensor(rows["top_k"], dtype=torch.long, device=dev),
            "top_p": torch.tensor(rows["top_p"], dtype=torch.float32, device=dev),
            "gone": torch.zeros(B, dtype=torch.bool, device=dev),
            "stops": torch.tensor([s + [-1] * (width - len(s)) for s in stops], dtype=torch.long, device=dev),
            "drafted": torch.zeros(B, dtype=torch.long, device=dev),  # per row, for EngineOutput (draft_step.py)
            "accepted": torch.zeros(B, dtype=torch.long, device=dev),
            "hist": torch.tensor(  # the row's sequence in the draft history (draft_step.py), -1: off
                self.drafter.open(prompts) if self.drafter is not None else [-1] * B, device=dev
            ),
        }
        return self.prefill.rows(prompts, t, calls_of, index, self.batch.joinable())

    def _step(self, new: tuple[Batch, torch.Tensor] | None) -> None:
        """One decode step of the running rows and the first token of the new ones; the rows that stop end."""
        b = self.batch
        drafted = None
        if self.drafter is not None and len(b) and b.joinable():
            drafted = self.drafter.drafts(b)
        if drafted is not None:  # draft_step.py: some row has a draft
            ended, lengths, hit, live = self.drafter.step(b, self.slots, new, *drafted)
        else:
            stepped = self._decode(new)
            if stepped is None:
                return
            ended, lengths, hit, live = stepped
        self.stats.step(live, len(self._active))
        if bool(ended.any()):
            for i in ended.nonzero().squeeze(-1).tolist():
                self._finish_row(i, int(lengths[i]), "stop" if bool(hit[i]) else "length")
            self._remove(ended)

    def _decode(self, new: tuple[Batch, torch.Tensor] | None):
        """The plain step: one token for every running row and the first of the new ones (they join the batch),
        written to the slots. Returns the rows that ended, their lengths, which hit a stop, and how many rows were
        live; None when there is no row."""
        b = self.batch
        parts = [b.decode(self.served.model)] if len(b) else []
        if new is not None:
            parts.append(new[1])
            b.extend(new[0])
            self.draws.changed()
        if not parts:
            return None
        logits = torch.cat(parts) if len(parts) > 1 else parts[0]
        t = b.t
        groups = self.draws.groups(b, self.slots)
        d = draw(logits, t["temperature"], t["top_k"], t["top_p"], groups, self.served.pad_id)
        live = ~t["gone"]
        everyone = bool(live.all())
        rows = [t["slot"], t["step"], d.token, d.logprob, d.sampling_logprob]
        slot, step, token, logprob, sampling_logprob = rows if everyone else [x[live] for x in rows]
        self.slots.write(slot, step, token, logprob, sampling_logprob)
        self.slots.record_token_versions(slot, step, self.served.version)
        t["last"] = d.token
        if self.drafter is not None:
            self.drafter.extend(t["hist"], d.token, live)
        hit = (d.token[:, None] == t["stops"]).any(-1)
        if d.dead is not None:
            hit &= ~d.dead
        n = t["step"] + 1
        for i in self.draws.stop_rows():  # stop strings: the row's text so far
            said = self.slots.tokens(int(t["slot"][i]), int(n[i]))
            if not bool(hit[i]) and text_hits_stop(self.served.tokenizer, said, b.calls[i].params.stop):
                hit[i] = True
        ended = hit | (n >= t["max_new"])
        if d.dead is not None:
            ended |= d.dead
        ended &= live
        t["step"] = torch.where(live, n, t["step"])
        lengths = n if d.dead is None else n - d.dead.to(torch.long)  # a dead row ends before its token
        return ended, lengths, hit, int(live.sum()) if not everyone else len(b)
