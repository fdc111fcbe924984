"""`farm`: serve, train, demo, build-model, and the service calls (rollout, weights, control, cancel, queue)."""

from __future__ import annotations

import argparse
import json
import os
import sys


def _setup_logging() -> None:
    """One JSON object per log line on stdout (rollout_farm/services/observability/logs.py), or the extra to install
    where the default install (the client alone) lacks the logging package of the service and trainer."""
    try:
        from rollout_farm.services.observability import logs
    except ModuleNotFoundError as e:
        sys.exit(f"farm needs the service and trainer ({e.name} is missing): pip install 'rollout-farm[trainer]'")
    logs.setup()


TRAIN_FLAGS = {  # short flags for the most used keys (verl names: dotted overrides)
    "service_url": ("trainer.service_url", str),
    "model": ("actor_rollout_ref.model.path", str),
    "task": ("trainer.task", str),
    "steps": ("trainer.total_training_steps", int),
    "train_batch_size": ("data.train_batch_size", int),
    "n": ("actor_rollout_ref.rollout.n", int),
    "ppo_mini_batch_size": ("actor_rollout_ref.actor.ppo_mini_batch_size", int),
    "lr": ("actor_rollout_ref.actor.optim.lr", float),
    "entropy_coeff": ("actor_rollout_ref.actor.entropy_coeff", float),
    "eval_size": ("trainer.eval_size", int),
    "seed": ("trainer.seed", int),
    "out": ("trainer.default_local_dir", str),
    "adv_estimator": ("algorithm.adv_estimator", str),
    "sampler": ("actor_rollout_ref.rollout.sampler", str),
    "adapter": ("trainer.adapter", str),  # with actor_rollout_ref.model.lora_rank > 0: the adapter's name
}


def _train_parser(sub) -> None:
    p = sub.add_parser(
        "train",
        help="run the trainer against a running service",
        description="Config: --config FILE (YAML with verl's keys; rollout_farm/trainer/presets/design.yaml is the "
        "design's list), then dotted overrides such as actor_rollout_ref.rollout.n=16, then the short flags below. "
        "Token: FARM_API_TOKEN (with LoRA, actor_rollout_ref.model.lora_rank > 0, a tenant's token will do).",
    )
    p.add_argument("--config", help="YAML file")
    p.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. algorithm.adv_estimator=rloo"
    )
    for name, (key, kind) in TRAIN_FLAGS.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None, help=key)
    p.add_argument(
        "--log-file",
        help="append the JSON log lines to this file; the console then gets warnings, errors and a short line every "
        "10 steps (FARM_LOG_LEVEL=debug: every JSON line too)",
    )


def train_config(args):
    from rollout_farm.trainer.config import load

    flags = [
        f"{key}={json.dumps(getattr(args, name))}"
        for name, (key, _) in TRAIN_FLAGS.items()
        if getattr(args, name) is not None
    ]
    return load(args.config, [*args.overrides, *flags])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="farm", description="rollout-farm: a rollout service and trainer for LLM RL")
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run the rollout service (settings from FARM_* environment variables)")
    s.add_argument("--model", help="HF model folder or 'arith-tiny' (FARM_MODEL)")
    s.add_argument("--port", type=int, help="HTTP port (FARM_PORT)")
    s.add_argument("--replicas", type=int, help="engine replicas (FARM_REPLICAS)")
    s.add_argument(
        "--fresh",
        action="store_true",
        help="start at weight version 0 from the model folder: drop the committed version, the queue and the uploads "
        "that the embedded Redis's state folder (FARM_STATE_DIR) kept from the last run",
    )
    _train_parser(sub)
    d = sub.add_parser("demo", help="start the service, train on the embedded model, report held-out accuracy")
    d.add_argument("--model", default="arith-tiny")
    d.add_argument("--steps", type=int, default=None)
    d.add_argument("--eval-size", type=int, default=None)
    d.add_argument("--out", default="runs/demo")
    _service_parsers(sub)
    b = sub.add_parser("build-model", help="build the embedded default model into the cache (done on first use anyway)")
    b.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    _setup_logging()

    if args.cmd == "serve":
        from pydantic import ValidationError

        from rollout_farm.services.config.settings import ServiceSettings, SettingsError, explain

        given = {"model": args.model, "port": args.port, "replicas": args.replicas}
        overrides = {k: v for k, v in given.items() if v is not None}
        try:
            settings = ServiceSettings(**overrides)
        except ValidationError as e:  # said before the seconds of importing Ray, torch and the engines
            sys.exit(explain(e))
        from rollout_farm.services.serving.server import run_forever

        try:
            run_forever(settings, fresh=args.fresh)
        except ValidationError as e:
            sys.exit(explain(e))
        except SettingsError as e:
            sys.exit(f"the service cannot start: {e}")
    elif args.cmd == "train":
        from rollout_farm.trainer.config import ConfigError
        from rollout_farm.trainer.loop import train
        from rollout_farm.trainer.run import TrainingRun
        from rollout_farm.trainer.sync.probe import ProbeRefused

        try:
            cfg = train_config(args)
        except ConfigError as e:
            sys.exit(str(e))
        if args.log_file:
            from rollout_farm.trainer.outputs.console import log_to_file

            log_to_file(args.log_file, cfg.trainer.total_training_steps)
        try:
            train(TrainingRun(cfg, os.environ.get("FARM_API_TOKEN", "")))
        except ProbeRefused as e:  # the farm's engine does not compute the pushed policy: stop, saying so
            sys.exit(f"the run stopped: {e}")
    elif args.cmd == "demo":
        from rollout_farm.trainer.demo import run_demo

        sys.exit(run_demo(args.model, args.steps, args.eval_size, args.out))
    elif hasattr(args, "call"):  # rollout, weights, control, cancel, queue
        sys.exit(_call_service(args))
    elif args.cmd == "build-model":
        from rollout_farm.services.models import DEFAULT_MODEL, build_default, default_model_folder, resolve_model

        if args.force:
            build_default(default_model_folder())
        print(resolve_model(DEFAULT_MODEL))


def _service_parsers(sub) -> None:
    """`farm rollout | weights | control | cancel | adapters | tenants | queue ...`: each makes client calls (set as
    `call`) and prints JSON."""

    def cmd(parent, name: str, call, help: str):
        p = parent.add_parser(name, help=help)
        p.add_argument(
            "--url",
            default=os.environ.get("FARM_URL", "http://127.0.0.1:8000"),
            help="service URL (FARM_URL); token: FARM_API_TOKEN",
        )
        p.set_defaults(call=call)
        return p

    r = cmd(sub, "rollout", _rollout, "request rollouts and print them as JSON")
    r.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    r.add_argument("--ground-truth", action="append", help="one per prompt, for the reward")
    r.add_argument("--n", type=int, default=1)
    r.add_argument("--temperature", type=float, default=1.0)
    r.add_argument("--top-p", type=float, default=1.0)
    r.add_argument("--max-new-tokens", type=int, default=64)
    r.add_argument("--seed", type=int)
    r.add_argument("--reward")
    r.add_argument(
        "--sampler",
        default="plain",
        help="a registered sampler (GET /v1/samplers), or pkg.module:Class from FARM_PLUGINS",
    )
    r.add_argument("--sampler-params", default="{}", help="the sampler's params as JSON, e.g. '{\"target_groups\": 4}'")
    r.add_argument("--min-weight-version", type=int, default=0, help="wait for replicas serving this version")
    r.add_argument("--request-id", help="idempotency key, also for `farm cancel`")
    r.add_argument("--stream", action="store_true", help="print one JSON line per group as it finishes")
    w = cmd(sub, "weights", _weights, "push weights as a new version, or show the served version")
    w.add_argument("action", choices=["push", "version"])
    w.add_argument(
        "file",
        nargs="?",
        help="for push: a safetensors file (uploaded), or a folder of them that every replica can read",
    )
    w.add_argument("--version", type=int, help="for push; default: the served version + 1")
    w.add_argument(
        "--policy",
        choices=["finish", "abort", "partial"],
        default="finish",
        help="for push: what happens to samples in flight",
    )
    c = cmd(
        sub, "control", lambda client, a: client.control(a.action), "pause, resume or abort sampling on every replica"
    )
    c.add_argument("action", choices=["pause", "resume", "abort"])
    c = cmd(sub, "cancel", lambda client, a: client.cancel(a.request_id), "cancel a running rollout by its request id")
    c.add_argument("request_id")
    ad = sub.add_parser("adapters", help="LoRA adapters: push, list, show, retire (docs/tenants.md)")
    ad = ad.add_subparsers(dest="adapters_cmd", required=True)
    p = cmd(ad, "push", _adapters, "push a peft adapter folder as a new version (uploaded, or --by-path)")
    p.add_argument("name")
    p.add_argument("folder", help="adapter_config.json and adapter_model.safetensors, as save_pretrained writes")
    p.add_argument("--version", type=int, help="default: the newest version + 1")
    p.add_argument("--by-path", action="store_true", help="the replicas read the folder (shared storage): no upload")
    cmd(ad, "list", _adapters, "the adapters you may use")
    cmd(ad, "show", _adapters, "one adapter's versions, digests and residency").add_argument("name")
    cmd(ad, "retire", _adapters, "retire every version of an adapter").add_argument("name")
    te = sub.add_parser("tenants", help="tenants and their tokens (the admin token)")
    te = te.add_subparsers(dest="tenants_cmd", required=True)
    cmd(te, "create", _tenants, "create a tenant, or give it another token (printed once)").add_argument("tenant")
    cmd(te, "list", _tenants, "every tenant")
    cmd(te, "revoke", _tenants, "revoke every token of a tenant").add_argument("tenant")
    q = sub.add_parser("queue", help="the pull-mode trajectory queue").add_subparsers(dest="queue_cmd", required=True)
    a = cmd(
        q, "add", _queue, "register a prompt source: a dataset, a JSONL file of prompts, or neither (add prompts later)"
    )
    a.add_argument("name")
    given = a.add_mutually_exclusive_group()
    given.add_argument("--dataset", choices=["arith", "gsm8k"])
    given.add_argument("--jsonl", help='one prompt per line: {"text": ..., "ground_truth": ...}')
    a.add_argument("--n", type=int, default=4, help="samples per prompt")
    a.add_argument("--target-groups", type=int, default=8, help="groups kept ready")
    a.add_argument("--max-new-tokens", type=int, default=128)
    a.add_argument("--temperature", type=float, default=1.0)
    a.add_argument("--reward", help="default: the dataset's")
    cmd(q, "list", _queue, "show every source")
    p = cmd(q, "pull", _queue, "lease groups from a source and print them")
    p.add_argument("name")
    p.add_argument("--max-groups", type=int, default=8)
    p.add_argument("--max-staleness", type=int, help="drop groups this many versions behind the served one")
    p.add_argument("--lease-s", type=float, default=300.0, help="seconds until unacked groups are delivered again")
    p.add_argument("--wait-s", type=float, default=0.0, help="wait this long for at least one group")
    cmd(q, "ack", _queue, "settle pulled groups").add_argument("item_ids", nargs="+", metavar="ITEM_ID")
    cmd(q, "remove", _queue, "remove a source").add_argument("name")


def _call_service(args) -> int | str:
    """Run the command's client calls; print the answer as JSON (a list as one JSON array)."""
    from pydantic import BaseModel, ValidationError

    from rollout_farm.services.client import FarmClient, FarmError

    with FarmClient(args.url, os.environ.get("FARM_API_TOKEN")) as client:
        try:
            out = args.call(client, args)
        except FarmError as e:
            print(json.dumps(e.body, indent=2) if isinstance(e.body, dict) else e.body, file=sys.stderr)
            return 1
        except ValidationError as e:
            return f"invalid arguments:\n{e}"
    if isinstance(out, BaseModel):
        print(out.model_dump_json(indent=2))
    elif isinstance(out, list):
        print(json.dumps([o.model_dump(mode="json") for o in out], indent=2))
    return out if isinstance(out, str) else 0


def _rollout(client, a):
    from rollout_farm.services import protocol as P

    truths = a.ground_truth or [None] * len(a.prompt)
    if len(truths) != len(a.prompt):
        return f"give one --ground-truth per --prompt ({len(a.prompt)}), or none"
    try:
        sampler_params = json.loads(a.sampler_params)
    except json.JSONDecodeError as e:
        return f"--sampler-params is not JSON: {e}"
    params = P.SamplingParams(temperature=a.temperature, top_p=a.top_p, max_new_tokens=a.max_new_tokens, seed=a.seed)
    req = P.RolloutRequest(
        prompts=[P.Prompt(text=p, ground_truth=t) for p, t in zip(a.prompt, truths)],
        n=a.n,
        sampling_params=params,
        sampler=P.SamplerSpec(name=a.sampler, params=sampler_params),
        reward=a.reward,
        min_weight_version=a.min_weight_version,
        request_id=a.request_id,
    )
    if not a.stream:
        return client.rollouts(req)
    for event in client.rollouts_stream(req):
        print(event.model_dump_json(), flush=True)


def _weights(client, a):
    from pathlib import Path

    if a.action == "version":
        return client.weights_version()
    if not a.file:
        return "farm weights push needs a safetensors FILE, or a FOLDER of them"
    # by default one above the newest version any replica serves
    version = a.version or max(client.weights_version().replicas.values(), default=0) + 1
    path = Path(a.file)
    if path.is_dir():  # the service reads it from there: no upload
        return client.push_weights_path(str(path.resolve()), version, a.policy)
    return client.push_weights(path.read_bytes(), version, a.policy)


def _adapters(client, a):
    from pathlib import Path

    from rollout_farm.services.client import FarmError

    if a.adapters_cmd == "list":
        return client.adapters()
    if a.adapters_cmd == "show":
        return client.adapter(a.name)
    if a.adapters_cmd == "retire":
        return client.retire_adapter(a.name)
    version = a.version
    if version is None:
        try:
            version = max((v.version for v in client.adapter(a.name).versions), default=0) + 1
        except FarmError as e:
            if e.status != 404:
                raise
            version = 1
    if a.by_path:
        return client.push_adapter_path(a.name, str(Path(a.folder).resolve()), version)
    return client.push_adapter(a.name, a.folder, version)


def _tenants(client, a):
    if a.tenants_cmd == "create":
        return client.create_tenant(a.tenant)
    if a.tenants_cmd == "list":
        return client.tenants()
    return client.revoke_tenant(a.tenant)


def _queue(client, a):
    from pathlib import Path

    from rollout_farm.services import protocol as P

    if a.queue_cmd == "add":
        lines = Path(a.jsonl).read_text().splitlines() if a.jsonl else []
        prompts = [P.Prompt.model_validate_json(line) for line in lines if line.strip()]
        params = P.SamplingParams(temperature=a.temperature, max_new_tokens=a.max_new_tokens)
        return client.queue_add_source(
            P.QueueSource(
                name=a.name,
                dataset=a.dataset,
                prompts=prompts,
                n=a.n,
                target_groups=a.target_groups,
                sampling_params=params,
                reward=a.reward,
            )
        )
    if a.queue_cmd == "list":
        return client.queue_sources()
    if a.queue_cmd == "pull":
        return client.queue_pull(
            P.PullRequest(
                source=a.name,
                max_groups=a.max_groups,
                max_staleness=a.max_staleness,
                lease_s=a.lease_s,
                wait_s=a.wait_s,
            )
        )
    if a.queue_cmd == "ack":
        return client.queue_ack(a.item_ids)
    return client.queue_remove_source(a.name)


if __name__ == "__main__":
    main()
