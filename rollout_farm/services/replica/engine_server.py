"""One engine replica (a Serve deployment): it owns an Engine and serves the ingress's calls.

Rollouts run at once, up to FARM_ENGINE_MAX_ONGOING_REQUESTS: each awaits engine.agenerate, and the engine merges
their calls into shared batches (the torch engine's scheduler thread makes every model call: torch runs fastest
that way; SGLang batches them itself). Past that, a replica holds its share of FARM_ENGINE_MAX_QUEUED_REQUESTS
waiting (waiting_room), and answers Full (the ingress's 429) beyond. Serve gives the replica CONTROL_SLOTS more
request slots (request_slots), so weight pushes, control and scrapes get through a full replica, and Serve's own
queue at the ingress is only a backstop (routing_queue). Before a replica
serves its first request it loads the committed weight version from the WeightStore, and a rollout asking for a
newer version waits for it. While the replica is paused its generate calls wait, at most FARM_PAUSE_WAIT_S
(pause_bound.py), and the rollout then answers FarmPaused (503).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import os
import threading
from contextlib import nullcontext

from rollout_farm.services import protocol as P
from rollout_farm.services.chat.pieces import alternative, token_pieces
from rollout_farm.services.chat.template import prompt_ids
from rollout_farm.services.config.settings import ServiceSettings
from rollout_farm.services.engine import ENGINES, Engine, EngineOutput
from rollout_farm.services.engine.auto import engine_name
from rollout_farm.services.engine.base import AdapterNotResident, cancellable
from rollout_farm.services.errors import (
    Conflict,
    EngineVerbMissing,
    FarmPaused,
    NotSupported,
    Overloaded,
    ServiceError,
    Unavailable,
    VersionNotReached,
    described,
)
from rollout_farm.services.extensions.plugins import load_plugins
from rollout_farm.services.extensions.samplers import make_sampler
from rollout_farm.services.observability import logs
from rollout_farm.services.replica.adapter_verbs import ReplicaAdapters, adapter_gone, adapter_store
from rollout_farm.services.replica.cuts import Cut, Cuts
from rollout_farm.services.replica.group_sampling import sample_groups
from rollout_farm.services.replica.overload import Full
from rollout_farm.services.replica.pause_bound import PauseBound, Progress
from rollout_farm.services.replica.session_routes import session_routes
from rollout_farm.services.replica.weight_verbs import ReplicaWeights, replica_id

log = logging.getLogger("farm.service")

CONTROL_SLOTS = 4  # Serve request slots per replica beyond the rollouts' (running and waiting)
ABORT_RERUNS = 3  # times the samples cut by "abort" commits are run again
STORE_FOLLOW_S = 2.0  # how often a replica checks the WeightStore for a version it missed


def waiting_room(settings: ServiceSettings) -> int:
    """Rollouts a replica holds waiting for a slot: its share of FARM_ENGINE_MAX_QUEUED_REQUESTS (rounded up)."""
    return -(-settings.engine_max_queued_requests // settings.replicas)


def request_slots(settings: ServiceSettings) -> int:
    """Serve's max_ongoing_requests for a replica: its running rollouts, its waiting room, and CONTROL_SLOTS that
    rollouts hold only for an instant (one past the waiting room gets Full at once and gives its slot back)."""
    return settings.engine_max_ongoing_requests + waiting_room(settings) + CONTROL_SLOTS


def routing_queue(settings: ServiceSettings) -> int:
    """Serve's max_queued_requests for the engine deployment (each ingress replica's handle): a backstop. Serve counts
    a call as queued while it routes it, and refuses past the limit even when replicas have free slots (a burst of
    calls counts in full), so the limit holds every call the replicas could admit at once; the replicas' waiting
    rooms keep FARM_ENGINE_MAX_QUEUED_REQUESTS."""
    return max(settings.replicas, settings.max_replicas) * request_slots(settings) + settings.engine_max_queued_requests


class EngineServer(ReplicaWeights, ReplicaAdapters):
    async def __init__(self, settings: ServiceSettings):
        from rollout_farm.services.models import resolve_model

        load_plugins(settings)
        logs.setup_farm_loggers(settings.log_level)
        self.settings = settings
        kind = ENGINES.get(engine_name(settings), settings.plugins)
        model = str(resolve_model(settings.model)) if kind.needs_model else settings.model
        threads = settings.engine_threads or max(1, (os.cpu_count() or 1) // settings.replicas)
        self.engine: Engine = await asyncio.to_thread(kind.from_settings, model, settings, threads)
        self.catch_up_lock = asyncio.Lock()
        self.rollout_slots, self.rollouts_waiting = asyncio.Semaphore(settings.engine_max_ongoing_requests), 0
        self.rollouts_running = 0
        self.drafts: dict[str, list[int]] = {}  # sampler -> [drafted, accepted] tokens (speculative decoding)
        self.weights_lost: str | None = None  # the WeightStore's reason, while the committed version cannot be loaded
        self.waiting_room = waiting_room(settings)
        self.pending_version = 0  # a commit in progress on this replica
        self.homes: set[str] = set()  # the sessions this replica is the home of (session_routes.py)
        self.session_route = session_routes(self.engine, settings.sessions_per_replica, self.homes)
        self.cuts = Cuts()  # the running rollouts by request_id, for cut_rollout (cuts.py)
        self.pauses = PauseBound(settings.pause_wait_s, lambda: self.engine.busy, replica_id())
        self.adapter_lock = asyncio.Lock()  # one adapter load from Redis at a time (adapter_verbs.py)
        self.adapter_digests = {}  # key -> (digest computed at its stage, the base digest it was computed on)
        self.adapter_bodies, self.adapter_prefix = adapter_store(settings)
        await self.catch_up(0)  # before Serve routes any traffic here
        self.following = asyncio.create_task(self._follow_store())

    async def _follow_store(self) -> None:
        """Forever: load a version committed while this replica missed the push (it started between a push's
        phases, so the commit's broadcast did not reach it)."""
        while True:
            await asyncio.sleep(STORE_FOLLOW_S)
            try:
                await self.catch_up(0)
            except Exception as e:  # the store is being recreated, or the weights cannot be loaded: say so, retry
                log.warning("catch_up_failed", extra={"error": described(e)})

    def _on_engine_thread(self, fn, *args):
        """A blocking engine verb (scoring, health) on the engine's one thread (Engine.engine_thread)."""
        return asyncio.get_running_loop().run_in_executor(self.engine.engine_thread(), fn, *args)

    # rollouts --------------------------------------------------------------------------------------------
    async def rollout(
        self,
        prompts: list[P.Prompt],
        n: int,
        params: P.SamplingParams,
        reward: str | None,
        min_version: int = 0,
        meta: dict | None = None,
        sampler: P.SamplerSpec | None = None,
        routing_key: str | None = None,
        request_id: str | None = None,
        adapter: tuple[P.AdapterRef, str] | None = None,
    ) -> list[P.Group] | Full | VersionNotReached | Unavailable | Conflict:
        """The groups of these prompts, n samples each. Past FARM_ENGINE_MAX_ONGOING_REQUESTS running and the
        waiting room full, the replica is full: it answers Full (the ingress's 429), an expected answer, not an
        exception (Serve would log each one with a traceback); so are a version not committed in time (409), one
        that cannot be loaded (503) and a pause that outlasted FARM_PAUSE_WAIT_S (FarmPaused, 503), which the ingress
        raises (rollout_farm/services/replica/handle.py).
        cut_rollout(request_id) ends its engine calls at their next token, and it answers with the tokens they had
        (finish_reason "abort"). `adapter`: the exact adapter version the ingress resolved, and its digest; every
        sample carries the policy that drew it (P.Policy)."""
        if self.rollout_slots.locked() and self.rollouts_waiting >= self.waiting_room:
            return Full(self.rollouts_waiting)
        with self.cuts.rollout(request_id) as cut:
            return await self._rollout(
                prompts, n, params, reward, min_version, meta, sampler, routing_key, cut, adapter
            )

    async def _rollout(
        self, prompts, n, params, reward, min_version, meta, sampler, routing_key, cut: Cut | None, adapter=None
    ):
        progress = Progress()  # its arrival: a wait on a pause counts from here (pause_bound.py)
        self.rollouts_waiting += 1
        try:
            await self.rollout_slots.acquire()
        finally:
            self.rollouts_waiting -= 1
        self.rollouts_running += 1
        try:
            if self.engine.weight_version < min_version:
                try:
                    await self.catch_up(min_version)
                except (VersionNotReached, Unavailable) as e:  # expected answers: returned, so Serve logs no traceback
                    return e
            spec = sampler or P.SamplerSpec()
            if routing_key:
                await self.session_route(routing_key)  # this replica is the key's home now (Serve routes it here)
            cache_key = routing_key if routing_key and self.engine.keeps_sessions else None
            try:
                key, held = await self.ensure_adapter(*adapter) if adapter else (None, None)
                with self.engine.pinned(key):  # the version stays for every round and rerun of this rollout
                    return await self._sample(
                        prompts, n, params, reward, meta, spec, cache_key, cut, progress, adapter, key, held
                    )
            except (Conflict, NotSupported, Overloaded, Unavailable) as e:  # expected: returned (Serve logs no trace)
                return e
            except AdapterNotResident:
                return adapter_gone(adapter[0])
        except FarmPaused as e:  # an expected answer: returned, so Serve logs no traceback
            return e
        finally:
            self.rollouts_running -= 1
            self.rollout_slots.release()

    async def _sample(self, prompts, n, params, reward, meta, spec, cache_key, cut, progress, adapter, key, held):
        """The groups, on the pinned adapter `key` (None: the base), each sample stamped with its policy."""
        policy = self.policy_of((adapter[0], held) if adapter else None)
        groups = await sample_groups(
            functools.partial(
                self._generate_rerun,
                cache_key=cache_key,
                cut=cut,
                sampler=spec.name,
                progress=progress,
                adapter=key,
            ),
            self.engine.tokenizer,
            prompts,
            n,
            params,
            reward,
            meta or {"sampler": "plain"},
            make_sampler(spec, self.settings.plugins),
        )
        return policy.stamp(groups)

    async def _generate_rerun(
        self,
        prompts: list[list[int]],
        params: P.SamplingParams,
        cache_key: str | None = None,
        cut: Cut | None = None,
        sampler: str = "plain",
        progress: Progress | None = None,
        adapter: str | None = None,
    ) -> list[EngineOutput]:
        """engine.generate, then the samples cut by an "abort" weight commit run again on the new weights (not
        those of a rollout cut by its request_id: they are its answer). The drafts verified for them (speculative
        decoding) count for `sampler`."""
        progress = progress or Progress()
        outs = await self._generate(prompts, params, cache_key, cut, progress, adapter)
        self._count_drafts(sampler, outs)
        for _ in range(ABORT_RERUNS):
            if cut is not None and cut.done:
                break
            served = (
                await self._settled() if any(o.finish_reason == "abort" for o in outs) else self.engine.weight_version
            )
            redo = [i for i, o in enumerate(outs) if o.finish_reason == "abort" and o.weight_version < served]
            if not redo:
                break
            again = await self._generate([prompts[i] for i in redo], params, cache_key, cut, progress, adapter)
            self._count_drafts(sampler, again)
            for i, o in zip(redo, again):
                outs[i] = o
        return outs

    async def _generate(
        self,
        prompts: list[list[int]],
        params: P.SamplingParams,
        cache_key: str | None = None,
        cut: Cut | None = None,
        progress: Progress | None = None,
        adapter: str | None = None,
    ) -> list[EngineOutput]:
        """engine.agenerate, beside every other rollout's calls; if this call is cancelled, so is the engine work
        (its rows leave the batch at the next step). `cache_key` only for an engine that keeps sessions. `cut`: the
        rollout's Cut, which ends the engine work the same way but keeps its outputs. While the replica is paused
        the call waits, at the gate or in the engine, until the rollout's `progress` is FARM_PAUSE_WAIT_S old:
        then FarmPaused (pause_bound.py)."""
        progress = progress or Progress()
        await self.pauses.admitted(progress)
        keyed = {"cache_key": cache_key} if cache_key is not None else {}
        if adapter is not None:
            keyed["adapter"] = adapter
        with cut.call() if cut is not None else nullcontext(threading.Event()) as cancel:
            with self.pauses.watched(progress, cancel) as watch:
                outs = await cancellable(self.engine.agenerate(prompts, params, cancel, **keyed), cancel)
        # the watchdog's cut, not a call that finished as it looked, nor the rollout's own cut (its tokens so far)
        if watch.ended and any(o.finish_reason == "abort" for o in outs) and not (cut is not None and cut.done):
            raise self.pauses.error(progress)
        progress.moved()
        return outs

    def _count_drafts(self, sampler: str, outs: list[EngineOutput]) -> None:
        drafted = sum(o.draft_tokens for o in outs)
        if drafted:
            counts = self.drafts.setdefault(sampler, [0, 0])
            counts[0] += drafted
            counts[1] += sum(o.draft_accepted for o in outs)

    async def _settled(self) -> int:
        """The served version once no commit is pending (an "abort" commit cuts samples before it lands)."""
        while self.pending_version > self.engine.weight_version:
            await asyncio.sleep(0.01)
        return self.engine.weight_version

    # control and health ----------------------------------------------------------------------------------
    def state(self) -> P.ReplicaState:
        e = self.engine
        return P.ReplicaState(
            replica=replica_id(),
            weight_version=e.weight_version,
            paused=e.paused,
            busy=e.busy,
            generated_tokens=e.generated_tokens,
            rollouts_running=self.rollouts_running,
            rollouts_waiting=self.rollouts_waiting,
            weights_lost=self.weights_lost,
            drafts_by_sampler={name: P.DraftCounts(drafted=d, accepted=a) for name, (d, a) in self.drafts.items()},
            **e.stats.snapshot(),
            **self.residency_state(),
        )

    async def pause(self, mode: str = "wait") -> P.ReplicaState:
        """Stop admitting generate calls; calls already running finish ("wait"), or are held: "in_place" (at a
        step boundary, with their KV cache) or "retract" (back to the queue), until resume. An engine that cannot
        hold them raises EngineVerbMissing (501). A call waits on the pause at most FARM_PAUSE_WAIT_S
        (pause_bound.py)."""
        if mode != "wait" and "mode" not in inspect.signature(self.engine.pause).parameters:  # plug-in pause(self)
            raise EngineVerbMissing.of(self.engine, f"pause mode {mode!r}", "pause with mode 'abort'")
        self.pauses.pause(mode)  # the gate first: a resume that lands while the engine holds its rows opens it again
        try:
            if mode == "wait":
                self.engine.pause()
            else:
                await asyncio.to_thread(self.engine.pause, mode)  # returns once the engine holds its rows
        except BaseException:
            self.pauses.resume()
            raise
        return self.state()

    async def resume(self) -> P.ReplicaState:
        """Admit generate calls again: the engine's, then those waiting at the replica's gate, all at once."""
        self.engine.resume()
        self.pauses.resume()
        return self.state()

    def abort(self) -> P.ReplicaState:
        """End the generate calls in flight at their next token."""
        self.engine.abort()
        return self.state()

    def cut_rollout(self, request_id: str) -> int:
        """End the engine calls of the rollout of `request_id` at their next token; the rollout answers with the
        tokens they had (rollout_farm/services/replica/cuts.py). How many calls were cut here."""
        return self.cuts.cut(request_id)

    async def health(self) -> P.Health:
        """The engine samples one token (temperature 1); a replica that cannot (NaN weights, a broken device) is
        Unavailable, naming itself and the error. The sample joins the running batch (the torch engine takes it
        ahead of waiting calls), so a busy replica answers within a step or two."""
        me, version = replica_id(), self.engine.weight_version
        if self.engine.paused:
            return P.Health(status="paused", weight_version=version, replica=me)
        try:
            token = await self._on_engine_thread(self.engine.health)
        except Exception as e:
            raise Unavailable(f"replica {me} cannot sample: {type(e).__name__}: {e}") from None
        return P.Health(status="ok", weight_version=version, generated_token_id=token, replica=me)

    def __del__(self):
        """Serve calls this when it stops the replica: an engine with processes of its own (vLLM) ends them."""
        close = getattr(self.__dict__.get("engine"), "close", None)
        if close is not None:
            close()

    # for the OpenAI surface ------------------------------------------------------------------------------
    def vocab_size(self) -> int:
        return self.engine.vocab_size()

    def chat_tokenizer(self):
        """The engine's tokenizer, for the ingress to render chats with (rollout_farm/services/chat/renderer.py)."""
        return self.engine.tokenizer

    def context_length(self) -> int | None:
        return self.engine.context_length()

    def prompt_lengths(self, prompts: list[P.Prompt]) -> list[int]:
        """Each prompt's length in tokens, tokenized as a rollout tokenizes it."""
        return [len(prompt_ids(self.engine.tokenizer, p)) for p in prompts]

    async def score(
        self, sequences: list[list[int]], top_k: int, adapter: tuple[P.AdapterRef, str] | None = None
    ) -> list[dict] | ServiceError:
        """Prompt logprobs (OpenAI's echo): per sequence, each token's text piece and logprob, and the top_k
        alternatives as {text: logprob}; with `adapter` (resolved at the ingress), under that adapter."""
        scored = await self._scored(sequences, top_k, adapter)
        if isinstance(scored, Exception):
            return scored
        tok = self.engine.tokenizer
        return [
            {
                "pieces": token_pieces(tok, ids),
                "logprobs": s.logprobs,
                "top": [{alternative(tok, t): lp for t, lp in alts} for alts in s.top],
            }
            for ids, s in zip(sequences, scored)
        ]

    # for the SGLang surface -------------------------------------------------------------------------------
    async def score_ids(
        self, sequences: list[list[int]], top_k: int, adapter: tuple[P.AdapterRef, str] | None = None
    ) -> list[dict] | ServiceError:
        """Prompt logprobs (SGLang's input_token_logprobs): per sequence, each token's logprob (None for the first)
        and the top_k alternatives of its position as [token_id, logprob] pairs; with `adapter`, under it."""
        scored = await self._scored(sequences, top_k, adapter)
        if isinstance(scored, Exception):
            return scored
        return [{"logprobs": s.logprobs, "top": [[[t, lp] for t, lp in alts] for alts in s.top]} for s in scored]

    def token_texts(self, ids: list[int]) -> list[str]:
        """Each token decoded alone (SGLang's return_text_in_logprobs)."""
        return self.engine.tokenizer.batch_decode([[i] for i in ids])

    def encode_texts(self, texts: list[str]) -> list[list[int]]:
        """Texts tokenized as SGLang's tokenizer manager does (tokenizer.encode: special tokens such as BOS added)."""
        return [self.engine.tokenizer.encode(t) for t in texts]
