"""The trainer: pulls trajectories over HTTP, computes advantages, runs PPO, pushes weights (docs/trainer.md).

The loop and the run are here, with the update phase; the RL math, the trainer's side of the service and what a run
writes are sub-packages. `presets/` holds the YAML presets (`design.yaml`).

| module | owns |
| --- | --- |
| `loop.py` | `train`: the loop, one call per phase |
| `run.py` | `TrainingRun`: a run's state (models, optimizers, KL controller, client), its start (resume, first push) |
| `config.py` | the configuration with verl's key names: YAML plus dotted overrides, every key checked |
| `config_sections.py` | the config's model and learning sections: actor_rollout_ref, critic, algorithm |
| `batch.py` | a rollout batch as right-padded tensors, each token's weight version; rank 0's batch on every rank |
| `minibatches.py` | mini-batches of whole groups for the PPO epochs, this rank's share, micro-batches |
| `actor.py` | the actor's update: verl's dual-clip PPO loss per mini-batch, in micro-batches |
| `lora.py` | LoRA training's model: the peft adapter on the frozen base, the reference as the adapter disabled |
| `critic.py` | the critic's update: verl's clipped value loss |
| `distributed.py` | data parallel over torch.distributed: gloo or nccl, rank 0's broadcasts, one gradient all-reduce |
| `evaluate.py` | held-out accuracy through the service, greedy, with 95% intervals |
| `cli.py` | `farm`: serve, train, demo, build-model, and the service calls |
| `demo.py` | `farm demo`: the service and the trainer as separate processes, accuracy before and after |
| `algorithms/` | the RL math as tensor functions: forward passes, rollout correction, advantages, estimators, losses |
| `sync/` | the trainer's side of the service: rollouts pulled as a `Batch`, the staleness bound, weights pushed |
| `guards/` | the KL and variance guards, what the trainer does when one trips, the last good step a rollback restores |
| `outputs/` | what a run writes: checkpoints, each step's metrics, the samples' staleness, the console |
"""
