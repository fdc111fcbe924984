"""Rollouts at the ingress: from a checked request to groups, whole or streamed.

The path of `POST /v1/rollouts` (rollout_farm/services/api/rollouts.py) through this package:

  rollouts.py        Rollouts.start: check the request, start it or replay it under its request_id, answer or stream
  request_checks.py  422s pydantic cannot know: reward and sampler names, sampler params, vocabulary, context length
  jobs.py            the request_id table in Redis (replays, 409 on another body), NDJSON lines, the disconnect grace
  fanout.py          Fanout.produce: chunks of prompts over the engine replicas
  (rollout_farm/services/replica/handle.py), each with
                     its seed (rollout_farm/services/replica/seeds.py) and the version floor
  group_filter.py    dynamic_group_filter's scheduler, when the sampler filters groups: windowed calls, early cancel
  policy_stats.py    the trainer's reported KL and reward variance, and each sampler's sampling plan from them

The queue (rollout_farm/services/queue/) and the OpenAI and SGLang-native surfaces (rollout_farm/services/compat/)
generate through the same Fanout.
"""
