"""LoRA adapters as policies: immutable versions pushed like weights, a digest on every sample, resident windows.

`POST /v1/adapters/{name}` (rollout_farm/services/api/adapters.py) goes push (ingress: checks, then stage on every
replica, record, commit) -> adapter verbs (each replica: rollout_farm/services/replica/adapter_verbs.py) -> the
engine's adapter layers (rollout_farm/services/engine/torch/lora.py). A rollout naming an adapter is resolved here
to an exact resident version (registry.py) and checked, sample by sample, against its digest
(rollout_farm/services/rollout/fanout.py). docs/tenants.md says it for users.

| module | owns |
| --- | --- |
| `peft_format.py` | peft's adapter format: the config's checks, the tensors' names and shapes against the model |
| `digest.py` | the policy digest of the base weights and of an adapter, from per-tensor checksums (client-side too) |
| `registry.py` | `AdapterRegistry`: owners, immutable versions, resident windows and bodies in Redis; `resolve` |
| `residency.py` | which versions one replica keeps loaded within its byte budget: least recently used, unpinned out |
| `push.py` | `AdapterPush`: an adapter push's checks and its two phases over every replica; retiring |
"""
