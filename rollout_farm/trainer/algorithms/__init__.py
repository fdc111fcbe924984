"""The trainer's RL math: pure tensor functions over a `Batch` (rollout_farm/trainer/batch.py), no I/O, in the order a
step uses them.

| module | owns |
| --- | --- |
| `forward.py` | forward passes: the policy's logprobs at each sample's temperature, the exact KL, the critic's values |
| `rollout_correction.py` | sampler vs policy: verl's truncated or masked importance weights and rejection |
| `stale_samples.py` | the rules for samples from older weights: what async training needs, sequence-level correction |
| `advantages.py` | outcome rewards, the KL penalty in the reward, zero-variance groups, the configured estimator |
| `estimators.py` | `ESTIMATORS`: verl's gae, grpo (GRPO), rloo, reinforce_plus_plus; adaptive_gae, control_variate |
| `losses.py` | the PPO loss and its pieces (token rewards, KL estimates, masked means) over verl's `core_algos` |
| `noise_scale.py` | the gradient noise scale B_simple, from the micro- and mini-batch gradients |
"""
