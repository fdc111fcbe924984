"""The ingress deployment: it holds the domain objects that the routes in rollout_farm/services/api/ call.

Replicas          the engine replicas' handle: calls to one or to every replica
WeightPush        two-phase pushes; the committed version (the version floor of every rollout)
Tenants           the tenants' hashed tokens (rollout_farm/services/tenants/)
AdapterRegistry   LoRA adapters' versions and resident windows; AdapterPush, their pushes (services/adapters/)
PolicyStatsBoard  what the trainer reports; the samplers' sampling plans
RequestChecks     422s for names, sampler params and token ids
Fanout            a rollout spread over the replicas (and the group filter's scheduler)
Rollouts          the request_id table, streaming, cancellation
TrajectoryQueue   the pull-mode queue
OpenAICompat      the OpenAI-shaped endpoints
SGLangNative      SGLang's native endpoints, translated onto the objects above
VLLMTokens        vLLM's token route (/inference/v1/generate) onto the OpenAI-shaped objects' rollouts
TinkerCompat      Tinker's sampling API (the tinker SDK): sessions, samples as rollouts, futures in Redis
Sessions          multi-turn sessions: token level, and OpenAI chat with tools (rollout_farm/services/episodes/)
Episodes          multi-turn episodes run in the farm against environment plug-ins (rollout_farm/services/episodes/)

Their shared state (queue, request_id records, sessions, committed version, policy stats) is in Redis
(rollout_farm/services/state/redis_client.py), so any number of ingress replicas (FARM_INGRESS_REPLICAS) serve one farm,
and a restarted one loses nothing.
"""

from __future__ import annotations

import asyncio
import logging

from ray import serve
from ray.serve.handle import DeploymentHandle

from rollout_farm.services import errors
from rollout_farm.services.adapters.push import AdapterPush
from rollout_farm.services.adapters.registry import AdapterRegistry
from rollout_farm.services.chat.tool_formats import TOOL_FORMATS
from rollout_farm.services.compat.openai_api import OpenAICompat
from rollout_farm.services.compat.sglang_native import SGLangNative
from rollout_farm.services.compat.tinker import TinkerCompat
from rollout_farm.services.compat.vllm_tokens import VLLMTokens
from rollout_farm.services.config.settings import ServiceSettings
from rollout_farm.services.episodes.allowed_hosts import AllowedHosts
from rollout_farm.services.episodes.episodes import Episodes
from rollout_farm.services.episodes.session_store import SessionStore
from rollout_farm.services.episodes.sessions import Sessions
from rollout_farm.services.extensions.plugins import load_plugins
from rollout_farm.services.extensions.samplers import SAMPLERS
from rollout_farm.services.observability import logs, metrics
from rollout_farm.services.queue.trajectory_queue import TrajectoryQueue
from rollout_farm.services.replica.handle import Replicas
from rollout_farm.services.rollout.fanout import Fanout
from rollout_farm.services.rollout.jobs import RolloutJobs
from rollout_farm.services.rollout.policy_stats import PolicyStatsBoard
from rollout_farm.services.rollout.request_checks import RequestChecks
from rollout_farm.services.rollout.rollouts import Rollouts
from rollout_farm.services.state import redis_client as state
from rollout_farm.services.tenants.registry import Tenants
from rollout_farm.services.weights.push import WeightPush

log = logging.getLogger("farm.service")
FOLLOW_S = 0.5  # how often a replica reads the committed version and the policy stats back from Redis


class Ingress:
    async def __init__(
        self, engine: DeploymentHandle | Replicas, settings: ServiceSettings, deployment: str = "ingress"
    ):
        load_plugins(settings)
        metrics.init_registered(SAMPLERS.names(), TOOL_FORMATS.names())
        logs.setup_farm_loggers(settings.log_level)
        self.settings = settings
        self.redis, prefix = state.connect(settings.redis_url), state.prefix(settings.app_name)
        # a fused replica builds its Ingress on its own Replicas (rollout_farm/services/serving/fused_front.py)
        self.replicas = engine if isinstance(engine, Replicas) else Replicas(engine)
        self.deployment = deployment  # the Serve deployment whose replicas serve HTTP (ingress_metrics' peers)
        self.weights = WeightPush(self.replicas, settings, self.redis, prefix)
        busy = settings.fair_share_samples or settings.replicas * settings.engine_max_batch_size
        self.tenants = Tenants(self.redis, prefix, busy)
        self.adapters = AdapterRegistry(self.redis, prefix, settings.adapter_versions_resident)
        self.adapter_push = AdapterPush(self.replicas, self.adapters, settings, self.redis, prefix)
        self.weights.base_guard = self.adapter_push.guard_base
        self.policy = PolicyStatsBoard(self.redis, prefix)
        self.checks = RequestChecks(self.replicas, settings)
        self.fanout = Fanout(self.replicas, settings, lambda: self.weights.committed, self.policy, self.adapters)
        self.jobs = RolloutJobs(settings, self.redis, prefix)
        self.rollouts = Rollouts(self.fanout, self.checks, self.jobs)
        self.openai = OpenAICompat(self.fanout, self.replicas, self.checks, settings.model, self.weights.refresh)
        store = SessionStore(self.redis, prefix)
        # a session's chat turns are rendered here, with the replicas' tokenizer (chat/renderer.py)
        self.sessions = Sessions(self.rollouts.answer, self.openai.renderer, store, self.openai.model_name)
        allowed = AllowedHosts(settings.env_allowed_hosts)
        episodes = (self.sessions, self.checks.context_length, settings.plugins, allowed, settings.mcp_servers)
        self.episodes = Episodes(*episodes)
        self.queue = TrajectoryQueue(
            self.redis,
            prefix,
            self.fanout.generate_for_queue,
            self.episodes.generate_for_queue,
            self.weights.refresh,
            batch_groups=4 * settings.replicas,
            admitted=self.tenants.admitted,
        )
        self.sglang_native = SGLangNative(self.rollouts, self.weights, self.replicas, self.openai, settings)
        self.vllm_tokens = VLLMTokens(self.openai)
        parts = (self.rollouts, self.fanout, self.checks, self.replicas, self.adapters, self.redis, prefix)
        self.tinker = TinkerCompat(*parts, settings.model)
        await self.follow_once()
        self.tasks = [asyncio.create_task(t) for t in (self.follow(), self.queue.supervise(), self.jobs.heartbeat())]

    @classmethod
    async def build(cls, engine: Replicas, settings: ServiceSettings, deployment: str) -> Ingress:
        """An Ingress built inside another deployment's replica (Serve awaits the async __init__ of the ingress it
        builds itself; this does the same for rollout_farm/services/serving/fused_front.py)."""
        front = cls.__new__(cls)
        await front.__init__(engine, settings, deployment)
        return front

    def local_metrics(self) -> tuple[str, str]:
        """(this replica's id, its Prometheus text)."""
        return serve.get_replica_context().replica_id.unique_id, metrics.local()

    async def ingress_metrics(self) -> tuple[str, dict[str, str]]:
        """This replica's id, and every ingress replica's Prometheus text by replica id (this one's alone if the
        others do not answer in time). This replica's state gauges are read from Redis just now."""
        await self.follow_once()
        me, text = self.local_metrics()
        peers = serve.get_deployment_handle(self.deployment, self.settings.app_name)
        try:
            answers = await peers.broadcast("local_metrics").results_async(timeout_s=5, return_exceptions=True)
        except Exception as e:
            log.warning("ingress_metrics_partial", extra={"error": errors.described(e)})
            answers = []
        return me, {**dict(a for a in answers if isinstance(a, tuple)), me: text}

    async def follow_once(self) -> None:
        metrics.VERSION.set(await self.weights.refresh())
        await self.policy.refresh()

    async def follow(self) -> None:
        """Forever: the committed version and the policy stats as Redis has them (other replicas write them too)."""
        failing = False
        while True:
            await asyncio.sleep(FOLLOW_S)
            try:
                await self.follow_once()
                if failing:
                    log.info("state_reachable_again", extra={"committed": self.weights.committed})
                failing = False
            except errors.STATE_ERRORS as e:
                if not failing:
                    log.warning("state_unreachable", extra={"error": errors.described(e)})
                failing = True
