"""Weight pushes, from the trainer's state dict to every replica serving the new version, atomically.

The path of `POST /v1/weights` (rollout_farm/services/api/weights.py) through this package:

  pusher.py      client side (the trainer): WeightPusher lays a state dict out as buckets (buckets.py) with a manifest
                 of per-tensor checksums (manifest.py): full, bucketed, or delta (delta.py)
  stream.py      ingress side: the body read bucket by bucket into the object store, each header checked (checks.py)
                 against the model as it arrives; the body's SHA-256
  early.py       ingress side: each bucket sent to every replica to stage while the next one streams
  push.py        WeightPush: stage on every replica, record, commit on every replica; any refusal, all discard
  stage.py       replica side: each bucket staged as it arrives (views, no copy; checksums verified, deltas applied
                 to the served tensors, NaN and inf refused), then the whole push checked
  store.py       WeightStore, the engine deployment's actor: the committed version and its source, for replicas that
                 start later
  checks.py      every check on pushed weights: safetensors headers (no torch, no unpickling), NaN and inf tensors
  state_dict.py  a model's tensors as the transports see them: canonical names, specs, safetensors dtypes

A push by path (`POST /v1/weights/path`) skips the stream: its headers are read from the shared folder. The engine
(rollout_farm/services/engine/) copies the staged tensors into its parameters at the commit.
"""
