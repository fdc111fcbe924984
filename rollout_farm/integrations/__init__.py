"""Adapters that let other RL frameworks use the farm as their rollout backend (one sub-package each)."""
