"""Adapters that let other RL frameworks use the farm as their rollout backend, one sub-package each
(docs/integrations.md).

| module | owns |
| --- | --- |
| `verl/` | verl 0.9.1 with the farm as its rollout backend: agent loops generating on the farm, weight pushes |
| `lm_eval/` | lm-eval task files (YAML and JSONL, no Python) for the farm's arithmetic task |
"""
