"""422s for what pydantic cannot know from a request alone: unknown rewards and samplers, sampler params that do
not fit the request, token ids outside the model's vocabulary, and prompts that with max_new_tokens do not fit in
the model's context (text prompts are counted by an engine replica's tokenizer). A request never makes the service
import anything: rewards by registered name only, samplers by name or from FARM_PLUGINS modules."""

from __future__ import annotations

from pydantic import ValidationError

from rollout_farm.services import protocol as P
from rollout_farm.services.config.settings import ServiceSettings
from rollout_farm.services.errors import Invalid, pydantic_fields
from rollout_farm.services.extensions import rewards
from rollout_farm.services.extensions.samplers import make_sampler
from rollout_farm.services.replica.handle import Replicas


class RequestChecks:
    def __init__(self, replicas: Replicas, settings: ServiceSettings):
        self.replicas, self.settings = replicas, settings
        self.vocab: int | None = None  # asked once
        self.context: int | None = None  # asked once (None also when the engine cannot tell)
        self.context_asked = False

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
        await self.fits(req.prompts, req.sampling_params.max_new_tokens)

    async def added_prompts(self, source: P.QueueSource, prompts: list[P.Prompt]) -> None:
        """Prompts added to a queue source: refused now, not when the background generation reaches them."""
        await self.tokens(prompts)
        await self.fits(prompts, source.sampling_params.max_new_tokens)

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
            self.vocab = await self.replicas.read("vocab_size")
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

    async def context_length(self) -> int | None:
        """The model's context in tokens; None when the engine cannot tell."""
        if not self.context_asked:
            self.context, self.context_asked = await self.replicas.read("context_length"), True
        return self.context

    async def fits(
        self,
        prompts: list[P.Prompt],
        max_new_tokens: int,
        field: str = "sampling_params.max_new_tokens",
        prompt_field: str = "prompts",
    ) -> None:
        """422 for each prompt whose tokens plus max_new_tokens exceed the model's context, with both numbers. The
        detail names `field` when max_new_tokens can be lowered to fit, the prompt when it fills the context alone."""
        context = await self.context_length()
        if context is None:
            return
        texts = [p for p in prompts if p.token_ids is None]
        counted = iter(await self.replicas.read("prompt_lengths", texts) if texts else [])
        lengths = [len(p.token_ids) if p.token_ids is not None else next(counted) for p in prompts]
        name = field.rsplit(".", 1)[-1]
        bad = [
            {
                "field": field if n < context else f"{prompt_field}.{i}",
                "message": f"prompt {i} has {n} tokens + {name} {max_new_tokens} = {n + max_new_tokens} > the model's "
                f"context of {context}: shorten the prompt"
                + (f" or lower {name} to at most {context - n}" if n < context else ""),
            }
            for i, n in enumerate(lengths)
            if n + max_new_tokens > context
        ]
        if bad:
            raise Invalid(bad[:20], f"prompt tokens + {name} exceed the model's context of {context} tokens")
