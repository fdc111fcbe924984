"""The HTTP front's designs other than the split one (FARM_FRONT; the split front is rollout_farm/services/ingress.py
in front of the engine replicas, rollout_farm/services/replica/).

| module | owns |
| --- | --- |
| `fused.py` | `FARM_FRONT=fused`: each engine replica is its own ingress; one replica's worth runs in process |
"""
