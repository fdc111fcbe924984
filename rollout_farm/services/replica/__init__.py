"""The engine replicas: the ingress's handle on them, and what each replica does with a call.

A rollout chunk goes handle (ingress) -> engine_server -> group_sampling (each replica). The engine itself (torch,
SGLang, bench) is rollout_farm/services/engine/; weights staged on a replica come from
rollout_farm/services/weights/stage.py; a prompt's ids and the token texts of a scored prompt come from
rollout_farm/services/chat/. Chat rendering runs in the ingress (rollout_farm/services/chat/renderer.py), with the
tokenizer a replica hands it once (`EngineServer.chat_tokenizer`).

| module | owns |
| --- | --- |
| `handle.py` | `Replicas`, in the ingress: one replica or all through Serve's handle; full is a 429, dead a 503 |
| `seeds.py` | the seed of each chunk (ingress) and each sampler round (replica) |
| `engine_server.py` | `EngineServer`, one per replica: rollout slots and the waiting room, scoring, control, health |
| `weight_verbs.py` | its weight verbs: catch-up to the committed version, the two push phases, the NCCL transport |
| `adapter_verbs.py` | its adapter verbs: stage (with the digest it computes), commit, retire, load from Redis |
| `overload.py` | the replica's `Full` answer (an expected 429, not an exception) and the rate-limited warnings |
| `group_sampling.py` | a chunk's groups: the sampler's rounds through engine.agenerate, decoding, rewards |
| `cuts.py` | `Cuts`: a rollout cut short by its request_id, keeping the tokens it generated |
| `pause_bound.py` | `PauseBound`: a generate call waits on a paused replica at most FARM_PAUSE_WAIT_S, then 503 |
| `session_routes.py` | sticky sessions: a session's turns go to its home replica (Serve's model multiplexing) |
"""
