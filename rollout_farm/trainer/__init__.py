"""The trainer: pulls trajectories over HTTP, computes advantages, runs PPO, pushes weights."""
