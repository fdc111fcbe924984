"""The engine replicas: the ingress's handle on them, and what each replica does with a call.

A rollout chunk's path through this package:

  handle.py          Replicas, in the ingress: one replica or all of them through Serve's handle; a full replica or
                     Serve's back-pressure becomes a 429, a dead replica a 503
  seeds.py           the seed of each chunk (ingress) and each sampler round (replica)
  engine_server.py   EngineServer, one per replica: rollout slots and the waiting room, scoring, control and health
  weight_verbs.py    its weight verbs: catch-up to the committed version, the two push phases, the NCCL transport
  overload.py        the replica's Full answer (an expected 429, not an exception) and the rate-limited warnings
  group_sampling.py  a chunk's groups: the sampler's rounds through engine.agenerate, decoding, rewards
  token_pieces.py    each token's text, for logprobs answers (the replica holds the tokenizer)

The engine itself (torch, SGLang, bench) is rollout_farm/services/engine/; weights staged on a replica come from
rollout_farm/services/weights/stage.py.
"""
