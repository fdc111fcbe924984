"""Weight pushes, from the trainer's state dict to every replica serving the new version, atomically.

`POST /v1/weights` (rollout_farm/services/api/weights.py) goes pusher (trainer) -> stream and early (ingress) ->
push (ingress, every replica) -> stage (each replica) -> store (for replicas that start later). A push by path
(`POST /v1/weights/path`) skips the stream: its headers are read from the shared folder. The engine
(rollout_farm/services/engine/) copies the staged tensors into its parameters at the commit.

| module | owns |
| --- | --- |
| `pusher.py` | client side: `WeightPusher`, full, bucketed or delta pushes, falling back to full; `compute_probe` |
| `path_pusher.py` | client side: `PathPusher`, each version written once to a folder the farm reads, pushed by path |
| `buckets.py` | the body's framing: safetensors files back to back, each a bucket of whole tensors; bucket views |
| `manifest.py` | the push's manifest: per tensor a checksum of its new bytes and how it travels (full, same, xor) |
| `delta.py` | byte-level deltas: XOR against the served bytes, in byte planes, zlib where it pays |
| `stream.py` | ingress: the body read bucket by bucket into the object store, each header checked; `check_sha256` |
| `early.py` | ingress: `EarlyStage`, each bucket sent to every replica to stage while the next one streams |
| `push.py` | `WeightPush`: the push lock, stage on every replica, record, commit; any refusal, all discard; NCCL |
| `stage.py` | replica: `Staging`, each bucket staged as it arrives (checksums, deltas), then the whole push checked |
| `probe.py` | a push's probe (base or adapter): the pusher's logprobs, scored on each replica's staged policy |
| `store.py` | `WeightStore`, the engine deployment's actor: the committed version and its source, for late replicas |
| `checks.py` | every check on pushed weights: safetensors headers (no unpickling), `non_finite` (NaN and inf refused) |
| `state_dict.py` | a model's tensors as the transports see them: canonical names, specs, safetensors dtypes |
"""
