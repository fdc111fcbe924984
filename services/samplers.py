"""Samplers: how the service draws the samples of one group (named in a request's `sampler`).

A sampler is registered by name; its `Params` model checks the request's `sampler.params`.
`plain` draws n samples with the request's sampling params; more arrive with the sampler plug-ins.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from services.registry import Registry


class NoParams(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Sampler:
    Params: type[BaseModel] = NoParams


SAMPLERS: Registry[type[Sampler]] = Registry("sampler")


@SAMPLERS.register("plain")
class Plain(Sampler):
    """n samples per prompt with the requested sampling params: the baseline."""
