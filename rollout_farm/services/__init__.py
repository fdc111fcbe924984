"""The rollout service: the Ray Serve app, its engines, sessions, samplers' plumbing, rewards, tasks and the client.

The layers and who imports whom: docs/architecture.md. Each sub-package's `__init__.py` tables its own modules.

| module | owns |
| --- | --- |
| `app.py` | the Serve application: the engine and ingress deployments, the `WeightStore` actor; checks `FARM_ENGINE` |
| `ingress.py` | the ingress deployment: builds the domain objects, follows the committed version, merges metrics |
| `server.py` | starts Ray, the embedded Redis (when `FARM_REDIS_URL` is unset) and the app; `farm serve` |
| `serve_entry.py` | the import path for `serve run rollout_farm.services.serve_entry:app` and KubeRay |
| `settings.py` | every `FARM_*` setting, and the one-line-per-variable explanation of a bad one |
| `settings_doc.py` | docs/settings.md, generated from the settings model |
| `errors.py` | the service's errors with their statuses, and `as_service_error`: any exception to one of them |
| `client.py` | the Python client: each call defined once, sync and async faces, retries with `Retry-After` |
| `client_calls.py` | one client call on the wire: its answer or `FarmError`, whether to send it again, a stream |
| `metrics.py` | every Prometheus metric, and the scrape (replica gauges read at scrape time, from a table) |
| `logs.py` | JSON log lines: one object per line, the event and its fields |
| `registry.py` | `Registry`, the one type behind every extension point (names, dotted paths, helpful misses) |
| `plugins.py` | the `FARM_PLUGINS` modules: imported at start-up, the only ones a request or setting may name |
| `samplers.py` | the sampler plug-in API (`Sampler`, its hooks and `Params`) and the built-in samplers |
| `rewards.py` | reward functions, registered by name (`gsm8k`, `last_number`, `zero`) |
| `tasks.py` | prompt sources with reference answers: arithmetic, addition, products, GSM8K |
| `models.py` | model folders: any HF folder by path, or the embedded default `arith-tiny`, built on first use |
| `peft_files.py` | a peft adapter folder's two files, and an adapter upload's body made from them (stdlib only) |
| `net.py` | small network helpers (a free port) for the CLI, the benchmarks and the tests |
| `protocol/` | every request and response model, one module per API area; the client imports it too |
| `api/` | the HTTP routes, one router per area; auth; errors to statuses |
| `rollout/` | `POST /v1/rollouts` at the ingress: checks, request_id records, the fan-out, the group filter |
| `queue/` | the pull-mode trajectory queue: sources, leases, acks, background generation (Redis Streams) |
| `weights/` | weight pushes, from the trainer's state dict to every replica, atomically |
| `adapters/` | LoRA adapters as policies: peft format, digests, immutable versions and resident windows, pushes |
| `tenants/` | tenants: hashed tokens, and who may use and change what (`Principal`) |
| `front/` | the fused HTTP front (`FARM_FRONT=fused`): engine replicas that are their own ingress |
| `replica/` | the ingress's handle on the engine replicas, and what each replica does with a call |
| `engine/` | the engine contract and registry; the torch (`engine/torch/`), SGLang and bench engines |
| `compat/` | the OpenAI-compatible and SGLang-native HTTP surfaces, on the same domain objects |
| `chat/` | chat messages to tokens and back: templates, session deltas, tool formats and schemas, token texts |
| `episodes/` | multi-turn sessions with exact tokens, and episodes run against environment plug-ins |
| `state/` | the control-plane state: the Redis client and the embedded redis-server |
| `data/` | GSM8K's train and test sets (MIT), for the `gsm8k` task |
"""
