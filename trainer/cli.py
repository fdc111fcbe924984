"""`farm`: serve, train, demo, build-model."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout, force=True)
    for noisy in ("httpx", "urllib3", "ray", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _train_parser(sub) -> None:
    from trainer.loop import TrainConfig

    p = sub.add_parser("train", help="run the trainer against a running service")
    for f in dataclasses.fields(TrainConfig):
        kind = {"int": int, "float": float, "str": str}.get(str(f.type).split(" |")[0], str)
        p.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=None, help=f"default: {f.default!r}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="farm", description="rollout-farm: a rollout service and trainer for LLM RL")
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run the rollout service (settings from FARM_* environment variables)")
    s.add_argument("--model", help="HF model folder or 'arith-tiny' (FARM_MODEL)")
    s.add_argument("--port", type=int, help="HTTP port (FARM_PORT)")
    s.add_argument("--replicas", type=int, help="engine replicas (FARM_REPLICAS)")
    _train_parser(sub)
    d = sub.add_parser("demo", help="start the service, train on the embedded model, report held-out accuracy")
    d.add_argument("--model", default="arith-tiny")
    d.add_argument("--steps", type=int, default=None)
    d.add_argument("--eval-size", type=int, default=None)
    d.add_argument("--out", default="runs/demo")
    url = {"default": os.environ.get("FARM_URL", "http://127.0.0.1:8000"), "help": "service URL (FARM_URL)"}
    r = sub.add_parser("rollout", help="request rollouts and print them as JSON")
    r.add_argument("--url", **url)
    r.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    r.add_argument("--ground-truth", action="append", help="one per prompt, for the reward")
    r.add_argument("--n", type=int, default=1)
    r.add_argument("--temperature", type=float, default=1.0)
    r.add_argument("--top-p", type=float, default=1.0)
    r.add_argument("--max-new-tokens", type=int, default=64)
    r.add_argument("--seed", type=int)
    r.add_argument("--reward")
    w = sub.add_parser("weights", help="push a safetensors file as a new version, or show the served version")
    w.add_argument("action", choices=["push", "version"])
    w.add_argument("file", nargs="?", help="safetensors file, for push")
    w.add_argument("--version", type=int, help="for push; default: the served version + 1")
    w.add_argument("--url", **url)
    c = sub.add_parser("control", help="pause, resume or abort sampling on every replica")
    c.add_argument("action", choices=["pause", "resume", "abort"])
    c.add_argument("--url", **url)
    b = sub.add_parser("build-model", help="build the embedded default model into the cache (done on first use anyway)")
    b.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    _setup_logging()

    if args.cmd == "serve":
        from services.server import run_forever
        from services.settings import ServiceSettings

        from pydantic import ValidationError

        overrides = {k: v for k, v in {"model": args.model, "port": args.port, "replicas": args.replicas}.items() if v is not None}
        try:
            settings = ServiceSettings(**overrides)
        except ValidationError as e:
            sys.exit(f"invalid service settings; set the FARM_<FIELD> environment variables named below:\n{e}")
        run_forever(settings)
    elif args.cmd == "train":
        from trainer.loop import TrainConfig, Trainer

        given = {k: v for k, v in vars(args).items() if k != "cmd" and v is not None}
        given.setdefault("token", os.environ.get("FARM_API_TOKEN", ""))
        Trainer(TrainConfig(**given)).run()
    elif args.cmd == "demo":
        from trainer.demo import run_demo

        sys.exit(run_demo(args.model, args.steps, args.eval_size, args.out))
    elif args.cmd in ("rollout", "weights", "control"):
        sys.exit(_call_service(args))
    elif args.cmd == "build-model":
        from services.models import CACHE, DEFAULT_MODEL, build_default, resolve_model

        if args.force:
            build_default(CACHE / "models" / f"{DEFAULT_MODEL}-v1")
        print(resolve_model(DEFAULT_MODEL))


def _call_service(args) -> int:
    """`farm rollout | weights | control`: one client call, its answer printed as JSON."""
    from pathlib import Path

    from services import protocol as P
    from services.client import FarmClient, FarmError

    with FarmClient(args.url, os.environ.get("FARM_API_TOKEN")) as client:
        try:
            if args.cmd == "rollout":
                truths = args.ground_truth or [None] * len(args.prompt)
                if len(truths) != len(args.prompt):
                    return f"give one --ground-truth per --prompt ({len(args.prompt)}), or none"
                params = P.SamplingParams(temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens, seed=args.seed)
                prompts = [P.Prompt(text=p, ground_truth=t) for p, t in zip(args.prompt, truths)]
                out = client.rollouts(P.RolloutRequest(prompts=prompts, n=args.n, sampling_params=params, reward=args.reward))
            elif args.cmd == "control":
                out = client.control(args.action)
            elif args.action == "version":
                out = client.weights_version()
            elif not args.file:
                return "farm weights push needs a safetensors FILE"
            else:
                version = args.version or client.weights_version().version + 1
                out = client.push_weights(Path(args.file).read_bytes(), version)
        except FarmError as e:
            print(json.dumps(e.body, indent=2) if isinstance(e.body, dict) else e.body, file=sys.stderr)
            return 1
    print(out.model_dump_json(indent=2))
    return 0


if __name__ == "__main__":
    main()
