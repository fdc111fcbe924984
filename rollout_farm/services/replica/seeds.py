"""Seeds for the parts of one request: each chunk (on its replica) and each sampler round draws with its own seed,
so the parts never repeat each other's draws, and the same request with the same seed gives the same samples."""

from __future__ import annotations

from rollout_farm.services import protocol as P

ROUND_STRIDE = 1_000_003  # a round's seed offset, far from the chunks' (seed + chunk index)


def chunk_params(params: P.SamplingParams, i: int) -> P.SamplingParams:
    """Params for chunk i of a request: seed + i."""
    return params if params.seed is None else params.model_copy(update={"seed": (params.seed + i) % 2**63})


def round_params(params: P.SamplingParams, r: int) -> P.SamplingParams:
    """Params for a sampler's round r within a chunk."""
    return chunk_params(params, r * ROUND_STRIDE)
