"""The commands the end-to-end tests run as real processes."""

import sys


def farm_train(service: str, model, *args: str, launcher: tuple[str, ...] = (sys.executable,)) -> list[str]:
    """`farm train` (python -m trainer.cli train) against `service` with the model folder `model`, then `args`."""
    return [*launcher, "-m", "trainer.cli", "train", "--service-url", service, "--model", str(model), *args]
