"""The ingress deployment: it holds the domain objects that the routes in services/api/ call.

Replicas          the engine replicas' handle: calls to one or to every replica
WeightPush        two-phase pushes; the committed version (the version floor of every rollout)
PolicyStatsBoard  what the trainer reports; the samplers' sampling plans
RequestChecks     422s for names, sampler params and token ids
Fanout            a rollout spread over the replicas (and the group filter's scheduler)
Rollouts          the request_id table, streaming, cancellation
TrajectoryQueue   the pull-mode queue
OpenAICompat      the OpenAI-shaped endpoints
SGLangCompat      SGLang's native endpoints, translated onto the objects above
"""

from __future__ import annotations

import asyncio

from ray.serve.handle import DeploymentHandle

from services import logs
from services.fanout import Fanout
from services.openai_compat import OpenAICompat
from services.plugins import load_plugins
from services.policy_stats import PolicyStatsBoard
from services.queue import TrajectoryQueue
from services.replicas import Replicas
from services.request_checks import RequestChecks
from services.rollout_jobs import RolloutJobs
from services.rollouts import Rollouts
from services.settings import ServiceSettings
from services.sglang_compat import SGLangCompat
from services.weight_push import WeightPush


class Ingress:
    async def __init__(self, engine: DeploymentHandle, settings: ServiceSettings):
        load_plugins(settings)
        logs.setup_farm_loggers(settings.log_level)
        self.settings = settings
        self.replicas = Replicas(engine)
        self.weights = WeightPush(self.replicas, settings)
        self.policy = PolicyStatsBoard()
        self.checks = RequestChecks(self.replicas, settings)
        self.fanout = Fanout(self.replicas, settings, lambda: self.weights.committed, self.policy)
        self.rollouts = Rollouts(self.fanout, self.checks, RolloutJobs(settings))
        self.queue = TrajectoryQueue(
            self.fanout.generate_for_queue, lambda: self.weights.committed, batch_groups=4 * settings.replicas
        )
        self.openai = OpenAICompat(
            self.fanout, self.replicas, self.checks, settings.model, lambda: self.weights.committed
        )
        self.sglang = SGLangCompat(self)
        self.started = asyncio.create_task(self.weights.sync_committed())  # a restarted ingress: what replicas serve
