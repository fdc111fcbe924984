"""The config's rules for training on samples from older weights (async_training.staleness_threshold, or a queue
that delivers them: trainer.queue_max_staleness): what they need, and how they are corrected by default.

Token-level importance weights correct each token's choice, not the distribution of the prefix it was chosen
after, which the older weights drew too: on the enumeration toy they barely beat no correction on stale and
spanning samples (docs/trainer.md, bench/rollout_correction.py). So such samples are weighted by the sequence's
ratio unless the config chooses: capped at STALE_SEQUENCE_CAP, the lowest error over a 256-sample batch at a drift
of 1.0 a version there, where a cap of 2.0 biases the update by 0.3.

Under top-p or top-k the sequence's ratio also carries each token's nucleus mass (prod Z_t <= 1, the exact
pi_T / q), which shrinks long responses' weights toward 0: there the config must choose.
"""

from __future__ import annotations

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
    r = cfg.actor_rollout_ref.rollout
    top_p = min(r.top_p, float(r.sampler_params.get("top_p", 1.0)))
    top_k = int(r.sampler_params.get("top_k", -1))
    if top_p < 1.0 or top_k > 0:
        raise ValueError(
            f"algorithm.rollout_correction.rollout_is: samples from older weights are weighted by the sequence's "
            f"ratio by default, but with top_p {top_p:g} / top_k {top_k} that ratio also carries every token's "
            "nucleus mass and shrinks long responses' weights toward 0. Choose: rollout_is=sequence with "
            "rollout_is_batch_normalize=true (rescaled to mean 1, a small bias), rollout_is=token (biased on stale "
            "samples), or sample at top_p 1 without top_k"
        )
    rc.rollout_is = "sequence"
    if "rollout_is_threshold" not in rc.model_fields_set:
        rc.rollout_is_threshold = STALE_SEQUENCE_CAP
