"""422s for what pydantic cannot know from a request alone: unknown rewards and samplers, sampler params that do
not fit the request, and token ids outside the model's vocabulary. A request never makes the service import
anything: rewards by registered name only, samplers by name or from FARM_PLUGINS modules."""

from __future__ import annotations

from pydantic import ValidationError

from services import protocol as P
from services import rewards
from services.errors import Invalid, pydantic_fields
from services.replicas import Replicas
from services.samplers import make_sampler
from services.settings import ServiceSettings


class RequestChecks:
    def __init__(self, replicas: Replicas, settings: ServiceSettings):
        self.replicas, self.settings = replicas, settings
        self.vocab: int | None = None  # asked once

    async def rollout(self, req: P.RolloutRequest | P.QueueSource) -> None:
        """A rollout request or a queue source (whose sampler runs over an endless stream of prompts)."""
        if req.reward is not None and req.reward not in rewards.REWARDS.names():
            raise Invalid(
                [
                    {
                        "field": "reward",
                        "message": f"unknown reward {req.reward!r}; valid names: "
                        f"{', '.join(rewards.REWARDS.names())} (add your own with FARM_PLUGINS)",
                    }
                ]
            )
        prompts = len(req.prompts) if isinstance(req, P.RolloutRequest) else None
        if bad := self.sampler_problems(req.sampler, "sampler", prompts):
            raise Invalid(bad)
        await self.tokens(req.prompts)

    def sampler_problems(self, spec: P.SamplerSpec, field: str, prompts: int | None) -> list[dict]:
        """422 detail for a sampler spec (and a filter's inner one): its name, its params, and what they mean for
        this request."""
        try:
            sampler = make_sampler(spec, self.settings.plugins)
        except KeyError as e:
            return [{"field": f"{field}.name", "message": e.args[0]}]
        except ValidationError as e:
            return pydantic_fields(e.errors(), field, "params")
        bad = [{**b, "field": f"{field}.params.{b['field']}"} for b in sampler.problems(prompts, self.settings.engine)]
        if sampler.filters_groups:
            bad += self.sampler_problems(sampler.params.inner, f"{field}.params.inner", prompts)
        return bad

    async def tokens(self, prompts: list[P.Prompt]) -> None:
        if self.vocab is None:
            self.vocab = await self.replicas.call("vocab_size")
        bad = [
            {
                "field": f"prompts.{i}.token_ids",
                "message": f"token ids must be in [0, {self.vocab}): the model's vocabulary",
            }
            for i, p in enumerate(prompts)
            if p.token_ids and not all(0 <= t < self.vocab for t in p.token_ids)
        ]
        if bad:
            raise Invalid(bad)
