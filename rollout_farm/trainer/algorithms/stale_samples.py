"""The config's rules for training on samples from older weights (async_training.staleness_threshold, or a queue
that delivers them: trainer.queue_max_staleness): what they need, and how they are corrected by default.

Token-level importance weights correct each token's choice, not the distribution of the prefix it was chosen
after, which the older weights drew too: on the enumeration toy they barely beat no correction on stale and
spanning samples (docs/trainer.md, bench/rollout_correction.py). So such samples are weighted by the sequence's
ratio unless the config chooses: capped at STALE_SEQUENCE_CAP, the lowest error over a 256-sample batch at a drift
of 1.0 a version there, where a cap of 2.0 biases the update by 0.3.

Under top-p, top-k or a regex constraint the sequence's ratio also carries each token's kept mass (prod Z_t <= 1, the
exact pi_T / q; 3e-5 to 2e-3 over 100 tokens at top_p 0.9), which shrinks long responses' weights toward 0: there
the config must choose. The truncation is the sampler's effective one, not only the config's top_p: the sampler is built
from its registry (rollout_farm/services/extensions/samplers.py; a plug-in by its dotted path) and asked for the params
it draws with (`Sampler.effective`), so kl_adaptive_temperature's own top_p 0.9 and pattern_conditional's constrained
regex count. Asked in-process, not over GET /v1/samplers: the config is checked when it loads, before any service is
reached, and the endpoint lists descriptions, not params. A sampler the trainer cannot build (its plug-in module is not
importable here) is not judged at load; `refuse_truncated` is the backstop when its samples arrive.
"""

from __future__ import annotations

from pydantic import ValidationError

from rollout_farm.services import protocol as P
from rollout_farm.services.extensions.samplers import make_sampler

STALE_SEQUENCE_CAP = 5.0


def check(cfg) -> None:
    """Raise ValueError, naming the key and the fix, for an async config that cannot work; set the stale samples'
    default correction."""
    s = cfg.async_training.staleness_threshold
    if s:
        if cfg.trainer.rollout_source != "queue":
            raise ValueError(
                f"async_training.staleness_threshold: {s} needs the service's queue to generate ahead; "
                "set trainer.rollout_source=queue (or the threshold to 0)"
            )
        if cfg.actor_rollout_ref.actor.old_logprobs == "rollout":
            raise ValueError(
                f"async_training.staleness_threshold: {s} trains on samples up to {s} versions old; set "
                "actor_rollout_ref.actor.old_logprobs=recompute, so the rollout correction weights them"
            )
        if cfg.trainer.queue_max_staleness not in (0, s):
            raise ValueError(
                f"trainer.queue_max_staleness: async_training.staleness_threshold={s} sets the queue's bound in "
                "async mode; leave queue_max_staleness at 0 (or set it to the same value)"
            )
    if s or cfg.trainer.queue_max_staleness > 0:
        correct_by_sequence(cfg)


def correct_by_sequence(cfg) -> None:
    """Sequence-level weights capped at STALE_SEQUENCE_CAP, unless the config sets rollout_is (or its own cap)."""
    rc = cfg.algorithm.rollout_correction
    if "rollout_is" in rc.model_fields_set:
        return
    truncated = truncation(effective_sampling(cfg))
    if truncated:
        raise ValueError(
            f"algorithm.rollout_correction.rollout_is: samples from older weights are weighted by the sequence's "
            f"ratio by default, but the sampler {cfg.actor_rollout_ref.rollout.sampler!r} draws with {truncated}, "
            "so that ratio also carries every token's kept mass and shrinks long responses' weights toward 0. "
            "Choose: rollout_is=sequence with rollout_is_batch_normalize=true (rescaled to mean 1, a small bias), "
            "rollout_is=token (biased on stale samples), or sample at top_p 1 without top_k or a regex"
        )
    rc.rollout_is = "sequence"
    if "rollout_is_threshold" not in rc.model_fields_set:
        rc.rollout_is_threshold = STALE_SEQUENCE_CAP
    rc._stale_default = True  # refuse_truncated's cue: the sequence ratio is this module's choice, not the config's


def effective_sampling(cfg) -> P.SamplingParams | None:
    """The sampling params the configured sampler draws with (Sampler.effective); None when the trainer cannot build
    it (a plug-in whose module is not importable here: refuse_truncated judges its samples)."""
    r = cfg.actor_rollout_ref.rollout
    sampling = P.SamplingParams(temperature=r.temperature, top_p=r.top_p)
    spec = P.SamplerSpec(name=r.sampler, params=dict(r.sampler_params))
    try:
        return make_sampler(spec, None).effective(sampling, None)  # None: the config's own dotted paths are trusted
    except (KeyError, ImportError):
        return None
    except ValidationError as e:
        raise ValueError(f"actor_rollout_ref.rollout.sampler_params: {r.sampler!r} refuses them: {e}") from None


def truncation(q: P.SamplingParams | P.SampledWith | None) -> str:
    """What truncates the distribution `q` draws from ('' for none): top_p below 1, top_k above 0, a regex."""
    if q is None:
        return ""
    cut = [f"top_p {q.top_p:g}"] if q.top_p < 1.0 else []
    cut += [f"top_k {q.top_k}"] if q.top_k > 0 else []
    return ", ".join(cut + (["a regex constraint"] if q.regex else []))


def refuse_truncated(cfg, groups: list[P.Group], version: int) -> None:
    """The backstop of correct_by_sequence at run time: raise RuntimeError when a sample from older weights than
    `version` was drawn with truncation (its sampled_with) and the stale samples get this module's default, the
    uncorrected sequence ratio (a sampler the config check could not ask, or one that truncates only later)."""
    rc = cfg.algorithm.rollout_correction
    if not rc._stale_default:
        return
    for g in groups:
        for s in g.samples:
            spans = [t.sampled_with for t in s.sampled_turns] if s.sampled_turns else [s.sampled_with]
            cut = next((c for c in map(truncation, spans) if c), None)  # every turn of an episode, not the first
            if cut and min(s.token_weight_versions or [s.weight_version]) < version:
                raise RuntimeError(
                    f"a sample from weight version {s.weight_version} (the trainer is at {version}) was drawn with "
                    f"{cut}: under the default sequence-level correction its weight carries every token's kept mass "
                    "and shrinks toward 0. Set algorithm.rollout_correction.rollout_is=sequence with "
                    "rollout_is_batch_normalize=true, or rollout_is=token, or sample without truncation"
                )
