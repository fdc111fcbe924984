"""The trainer's side of the service, over HTTP (rollout_farm/services/client/farm_client.py): rollouts in, weights out.

| module | owns |
| --- | --- |
| `rollouts.py` | a step's rollouts from the service, request or queue, as a `Batch` (rank 0) |
| `staleness_bound.py` | async training: the queue fed ahead, and the staleness bound enforced on what is pulled |
| `weights.py` | the policy's weights to the service as the next version (full, bucketed or delta), checked served |
| `probe.py` | each push's probe: the policy's logprobs of fixed sequences; a farm that refuses it stops the run |
| `adapter.py` | LoRA: the adapter pushed as `<name>@v<N>`, and read-your-writes: each sample's policy digest checked |
"""
