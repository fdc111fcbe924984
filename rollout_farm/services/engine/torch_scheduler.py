"""The torch engine's iteration-level scheduler: one thread makes every generate call's model calls, and the calls
that arrive while a batch runs join it at the next decode step (continuous batching).

Why our own scheduler and not Serve's @serve.batch: @serve.batch gathers calls into a batch that then runs to its
end, so a call arriving a step after it started waits for the longest sample of that batch; and it would live in the
replica, where the in-process engine tests could not see it. Here a call joins at a step boundary: its prompts are
prefilled apart, their KV cache is padded on the left to the running batch's length and appended (torch_batch.py),
and from the next step on they decode with everyone else. Every row keeps its call's SamplingParams (temperature,
top-k, top-p, max_new_tokens, stop ids and strings, regex, seed: torch_sampling.py), so calls need not match to
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
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import Future

import torch

from rollout_farm.services.engine.base import EngineOutput
from rollout_farm.services.engine.torch_batch import Batch, Slots
from rollout_farm.services.engine.torch_draft_step import DraftSteps
from rollout_farm.services.engine.torch_hold import HoldRows
from rollout_farm.services.engine.torch_prefill import PrefillRows
from rollout_farm.services.engine.torch_sampling import Group, RegexMask, draw, text_hits_stop
from rollout_farm.services.engine.torch_session_cache import CachedSequence
from rollout_farm.services.protocol import SamplingParams

log = logging.getLogger("farm.service")
IDLE_WAIT_S = 0.05  # how often an idle scheduler looks at the pending calls' cancel events


class Call:
    """One generate call: its prompts and params, the caller's cancel event and future, and its outputs so far."""

    def __init__(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        cancel: threading.Event,
        urgent: bool,
        cache_key: str | None = None,
    ):
        self.prompts, self.params, self.cancel, self.urgent = prompts, params, cancel, urgent
        self.cache_key = cache_key if len(prompts) == 1 else None  # a session's one sequence (torch_session_cache.py)
        self.kv_version = -1  # the weight version its KV cache was computed on
        self.future: Future = Future()
        self.arrived = time.monotonic()
        self.epoch = 0  # the engine's abort epoch when the call was admitted
        self.gen: torch.Generator | None = None  # its own generator when it has a seed
        self.regex: RegexMask | None = None
        self.outputs: list[EngineOutput | None] = [None] * len(prompts)
        self.live = len(prompts)


class BatchScheduler(HoldRows, PrefillRows, DraftSteps):
    """Mixed into TorchEngine, which sets model, device, tokenizer, eos_ids, pad_id, weight_version, the locks and
    the commit state, session_kv, prompt_kv and _apply_staged(); Engine gives `paused`, `stats` and
    _cancelled_before_start()."""

    def _start_scheduler(self, threads: int | None, max_batch_size: int, window_s: float) -> None:
        self.max_batch_size, self.window_s = max_batch_size, window_s
        self._cv = threading.Condition()  # guards _pending, and wakes the scheduler (new call, commit, resume)
        self._pending: deque[Call] = deque()
        self._active: dict[Call, None] = {}  # the calls with rows in the batch, in admission order
        self._done: list[Call] = []  # finished this loop: their futures are set once the loop lets go of the locks
        self._admitting: list[Call] = []  # admitted this loop
        self.batch, self.slots = Batch(), Slots(self.device)
        self._groups: list[Group] | None = None  # who draws with which generator; rebuilt when the rows change
        self._stop_rows: list[int] = []  # rows whose calls have stop strings
        self._gen = torch.Generator(device=self.device).manual_seed(int.from_bytes(os.urandom(7), "big"))
        threading.Thread(target=self._run, args=(threads,), name="torch-engine", daemon=True).start()

    # the callers' side -----------------------------------------------------------------------------------
    def _submit(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        cancel: threading.Event | None,
        urgent: bool = False,
        cache_key: str | None = None,
    ) -> Future:
        call = Call(prompts, params, cancel or threading.Event(), urgent, cache_key)
        if not prompts:
            call.future.set_result([])
            return call.future
        with self._cv:
            self._pending.append(call)
            self._cv.notify_all()
        return call.future

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

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
                self._settle_retracted()  # torch_hold.py: pause with the running rows held
                self._drop_cancelled_pending()
                if self._done or (self._hold is not None and self._held_work()):
                    admit = []
                    break
                if self._commit is not None and (self._commit == "partial" or not self.batch):
                    admit = []
                    break
                admit, wait_s = self._admissible()
                if admit or (self.batch and self._hold is None):
                    break
                self._cv.wait(wait_s)
        with self._lock, torch.inference_mode():
            hold = self._hold
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
                self._carry_over(new)
                self._step(new)
            self.stats.busy(bool(self.batch) and hold is None)
        if applied:
            self._wake()  # commit_weights waits for it

    def _admissible(self) -> tuple[list[Call], float]:
        """The pending calls to admit now, or [] and how long to wait before looking again."""
        if not self._pending or self.paused or not self.batch.joinable():
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
            call.outputs = self._cancelled_before_start(call.prompts)
            self._done.append(call)

    def _admit_calls(self, calls: list[Call]) -> tuple[Batch, torch.Tensor] | None:
        """The admitted calls' rows, prefilled: a Batch to join the running one and the logits of their first
        tokens (None: no call)."""
        prompts, calls_of, index, rows = [], [], [], {k: [] for k in ("max_new", "temperature", "top_k", "top_p")}
        stops = []
        for call in calls:
            p = call.params
            stop_ids = sorted((set() if p.ignore_eos else self.eos_ids) | set(p.stop_token_ids))
            try:
                call.regex = RegexMask(p.regex, self.tokenizer, set(stop_ids)) if p.regex else None
            except Exception as e:  # a pattern the regex package refuses
                call.future.set_exception(e)
                continue
            call.epoch, call.kv_version = self._abort_epoch, self.weight_version
            call.gen = None if p.seed is None else torch.Generator(device=self.device).manual_seed(p.seed)
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
        dev, B = self.device, len(prompts)
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
            "drafted": torch.zeros(B, dtype=torch.long, device=dev),  # per row, for EngineOutput (torch_draft_step.py)
            "accepted": torch.zeros(B, dtype=torch.long, device=dev),
            "hist": torch.tensor(  # the row's sequence in the draft history (torch_draft_step.py), -1: off
                [self.history.open(p) for p in prompts] if self.history is not None else [-1] * B, device=dev
            ),
        }
        return self._prefill(prompts, t, calls_of, index)

    def _step(self, new: tuple[Batch, torch.Tensor] | None) -> None:
        """One decode step of the running rows and the first token of the new ones."""
        b = self.batch
        if self.history is not None and len(b) and b.joinable():
            drafted = self._drafts()
            if drafted is not None:  # torch_draft_step.py: some row has a draft
                return self._step_drafted(new, *drafted)
        parts = [b.decode(self.model)] if len(b) else []
        if new is not None:
            parts.append(new[1])
            b.extend(new[0])
            self._groups = None
        if not parts:
            return
        logits = torch.cat(parts) if len(parts) > 1 else parts[0]
        t = b.t
        self._ready_groups()
        d = draw(logits, t["temperature"], t["top_k"], t["top_p"], self._groups, self.pad_id)
        live = ~t["gone"]
        everyone = bool(live.all())
        rows = [t["slot"], t["step"], d.token, d.logprob, d.sampling_logprob]
        slot, step, token, logprob, sampling_logprob = rows if everyone else [x[live] for x in rows]
        self.slots.write(slot, step, token, logprob, sampling_logprob)
        self.slots.record_token_versions(slot, step, self.weight_version)
        t["last"] = d.token
        if self.history is not None:
            for h, token, alive in zip(t["hist"].tolist(), d.token.tolist(), live.tolist()):
                if alive:
                    self.history.extend(h, [token])
        hit = (d.token[:, None] == t["stops"]).any(-1)
        if d.dead is not None:
            hit &= ~d.dead
        n = t["step"] + 1
        for i in self._stop_rows:  # stop strings: the row's text so far
            said = self.slots.tokens(int(t["slot"][i]), int(n[i]))
            if not bool(hit[i]) and text_hits_stop(self.tokenizer, said, b.calls[i].params.stop):
                hit[i] = True
        ended = hit | (n >= t["max_new"])
        if d.dead is not None:
            ended |= d.dead
        ended &= live
        t["step"] = torch.where(live, n, t["step"])
        self.stats.step(int(live.sum()) if not everyone else len(b), len(self._active))
        if bool(ended.any()):
            dead = d.dead if d.dead is not None else torch.zeros_like(ended)
            for i in ended.nonzero().squeeze(-1).tolist():
                length = int(n[i]) - int(dead[i])
                self._finish_row(i, length, "stop" if bool(hit[i]) else "length")
            self._remove(ended)

    def _ready_groups(self) -> None:
        """The draw groups for this step (rebuilt after the rows changed), regex groups given their rows' tokens."""
        t = self.batch.t
        if self._groups is None:
            self._regroup()
        for g in self._groups:
            if g.regex is not None:
                g.texts = [self.slots.tokens(int(t["slot"][i]), int(t["step"][i])) for i in g.rows]

    def _regroup(self) -> None:
        """Which rows draw together, and which check stop strings (after the rows changed)."""
        by_call: dict[Call, list[int]] = {}
        gone = self.batch.t["gone"].tolist()
        for i, call in enumerate(self.batch.calls):
            if not gone[i]:
                by_call.setdefault(call, []).append(i)
        groups, unseeded, self._stop_rows = [], [], []
        for call, rows in by_call.items():
            p = call.params
            if p.stop:
                self._stop_rows += rows
            if call.regex is not None:
                groups.append(Group(rows, call.gen or self._gen, call.regex, self.device))
            elif p.temperature == 0:
                continue
            elif call.gen is not None:
                groups.append(Group(rows, call.gen, device=self.device))
            else:
                unseeded += rows
        if unseeded:
            groups.append(Group(unseeded, self._gen, device=self.device))
        self._groups = groups

    def _finish_row(self, i: int, length: int, reason: str) -> None:
        b = self.batch
        call, slot = b.calls[i], int(b.t["slot"][i])
        tok, lp, slp, ver = self.slots.read(slot, length)
        if self.history is not None:
            self.history.close(int(b.t["hist"][i]), keep=reason != "abort")
        drafts = int(b.t["drafted"][i]), int(b.t["accepted"][i])
        first = ver[0] if length else self.weight_version
        call.outputs[b.index[i]] = EngineOutput(tok, lp, reason, first, ver, slp, *drafts)
        if call.cache_key is not None and reason != "abort":
            self._keep_session(i, call, tok)
        call.live -= 1
        if not call.live:
            del self._active[call]
            self.generated_tokens += sum(len(o.token_ids) for o in call.outputs)
            self._done.append(call)

    def _keep_session(self, i: int, call: Call, sampled: list[int]) -> None:
        """Row i's KV cache, kept for its session's next turn: the prompt and every sampled token but the last (the
        last was drawn, not fed). Only when all of it was computed on the weights served now."""
        covered = call.prompts[0] + sampled[:-1]
        b = self.batch
        if call.kv_version != self.weight_version or not sampled or not b.joinable():
            return
        if int(b.mask[i].sum()) != len(covered):  # a row that ended on a token it could not feed (a regex dead end)
            return
        self.session_kv.put(call.cache_key, CachedSequence(covered, self.weight_version, b.row_cache(i)))

    def _remove(self, ended: torch.Tensor) -> None:
        """Rows that ended leave the batch (unless _rows_to_keep keeps them: then they are gone, not decoded for)."""
        b = self.batch
        keep = self._rows_to_keep(ended | b.t["gone"], torch.arange(len(b), device=ended.device))
        b.t["gone"] |= ended
        self._forget_drafts(b.t["hist"][~keep])
        if bool(b.t["gone"][keep].all()):  # only rows kept after their end: the batch is over
            keep = torch.zeros_like(keep)
        self.slots.release(b.t["slot"][~keep].tolist())
        b.select(keep)
        self._groups = None

    def _end_cancelled(self) -> None:
        """The running calls that were cancelled, or running when abort() was called: their rows end ("abort")."""
        b = self.batch
        ending = [c for c in self._active if c.cancel.is_set() or c.epoch != self._abort_epoch]
        if not ending:
            return
        ending_set = set(ending)
        ended = torch.tensor([c in ending_set for c in b.calls], dtype=torch.bool, device=self.device)
        ended &= ~b.t["gone"]
        steps = b.t["step"].tolist()
        for i in ended.nonzero().squeeze(-1).tolist():
            self._finish_row(i, steps[i], "abort")
        self._remove(ended)

    def _fail_running(self, error: Exception) -> None:
        with self._lock:
            for call in [*self._active, *self._admitting]:
                if not call.future.done():
                    call.future.set_exception(error)
            self._active.clear()
            self._admitting = []
            if len(self.batch):
                self._forget_drafts(self.batch.t["hist"])
            self.batch, self.slots, self._groups = Batch(), Slots(self.device), None
            self.stats.busy(False)

    def _deliver(self) -> None:
        done, self._done = self._done, []
        for call in done:
            if not call.future.done():
                call.future.set_result(call.outputs)

    @staticmethod
    def _rows_to_keep(done: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Which of the batch's rows stay for the next step: the unfinished ones (a finished row leaves the batch
        and its KV cache). bench/engine_batching.py overrides it to measure the cost of keeping them."""
        return ~done[rows]
