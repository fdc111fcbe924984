"""The rollout service: the Ray Serve app, its engines, sessions, samplers' plumbing, rewards, tasks and the client.

The layers and who imports whom: docs/architecture.md. Each sub-package's `__init__.py` tables its own modules.

| module | owns |
| --- | --- |
| `errors.py` | the service's errors with their statuses, and `as_service_error`: any exception to one of them |
| `models.py` | model folders: any HF folder by path, or the embedded default `arith-tiny`, built on first use |
| `net.py` | small network helpers (a free port) for the CLI, the benchmarks and the tests |
| `serving/` | the Ray Serve app and its deployments (the split or the fused front); `farm serve`, KubeRay's entry |
| `config/` | every `FARM_*` setting, checked at start-up, and docs/settings.md generated from them |
| `observability/` | Prometheus metrics and JSON log lines |
| `extensions/` | the extension points' registry and `FARM_PLUGINS`; samplers, rewards and tasks (built-in, plug-ins) |
| `client/` | the Python client (`FarmClient`, `AsyncFarmClient`, `FarmError`), and a peft folder's upload body |
| `protocol/` | every request and response model, one module per API area; the client imports it too |
| `api/` | the ingress (the domain objects the routes call) and the HTTP routes, one router per area; auth; errors |
| `rollout/` | `POST /v1/rollouts` at the ingress: checks, request_id records, the fan-out, the group filter |
| `queue/` | the pull-mode trajectory queue: sources, leases, acks, background generation (Redis Streams) |
| `weights/` | weight pushes, from the trainer's state dict to every replica, atomically |
| `adapters/` | LoRA adapters as policies: peft format, digests, immutable versions and resident windows, pushes |
| `tenants/` | tenants: hashed tokens, and who may use and change what (`Principal`) |
| `replica/` | the ingress's handle on the engine replicas, and what each replica does with a call |
| `engine/` | the engine contract and registry; the torch (`engine/torch/`), SGLang and bench engines |
| `compat/` | the OpenAI-compatible and SGLang-native HTTP surfaces, on the same domain objects |
| `chat/` | chat messages to tokens and back: templates, session deltas, tool formats and schemas, token texts |
| `episodes/` | multi-turn sessions with exact tokens, and episodes run against environment plug-ins |
| `state/` | the control-plane state: the Redis client and the embedded redis-server |
| `data/` | GSM8K's train and test sets (MIT), for the `gsm8k` task |
"""
