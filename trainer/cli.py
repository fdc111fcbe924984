"""`farm`: serve, train, demo, build-model."""

from __future__ import annotations

import argparse
import dataclasses
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
    elif args.cmd == "build-model":
        from services.models import CACHE, DEFAULT_MODEL, build_default, resolve_model

        if args.force:
            build_default(CACHE / "models" / f"{DEFAULT_MODEL}-v1")
        print(resolve_model(DEFAULT_MODEL))


if __name__ == "__main__":
    main()
