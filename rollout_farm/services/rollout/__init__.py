"""Rollouts at the ingress: from a checked request to groups, whole or streamed.

`POST /v1/rollouts` (rollout_farm/services/api/rollouts.py) goes rollouts -> request_checks -> jobs -> fanout (over
the engine replicas, rollout_farm/services/replica/handle.py). The queue (rollout_farm/services/queue/) and the
OpenAI and SGLang-native surfaces (rollout_farm/services/compat/) generate through the same Fanout.

| module | owns |
| --- | --- |
| `rollouts.py` | `Rollouts`: check a request, start it or replay it under its request_id, answer or stream, cancel |
| `request_checks.py` | 422s pydantic cannot know: reward and sampler names, sampler params, vocabulary, context |
| `jobs.py` | request_id records in Redis: a retry finds its running job or its result; 409 on another body; NDJSON |
| `fanout.py` | `Fanout`: chunks of prompts over the replicas, each with its seed, the version floor and adapter |
| `policy_check.py` | the backstop: each sample on an adapter carries that version's digest, or none is kept |
| `group_filter.py` | `dynamic_group_filter`'s scheduler: windowed calls, early cancel, the `FilterReport` |
| `policy_stats.py` | `PolicyStatsBoard`: what the trainer reports (in Redis), and each sampler's sampling plan |
"""
