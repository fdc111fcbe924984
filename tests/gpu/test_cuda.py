"""The torch CUDA paths: the engine and the trainer on a GPU match the CPU."""

import json

import pytest

from rollout_farm.services.engine.torch import TorchEngine
from rollout_farm.services.protocol import SamplingParams
from tests.conftest import TOKEN
from tests.e2e.test_trainer import config
from tests.engine.test_torch_engine import engine, prompts  # noqa: F401  (engine: a fixture)


@pytest.mark.gpu
def test_engine_on_cuda_matches_cpu_greedy(engine, tiny_model):  # noqa: F811  (engine: the imported fixture)
    gpu = TorchEngine(str(tiny_model), device="cuda")
    ids = prompts(engine, ["Q: 12+3\nA:", "hello there"])
    params = SamplingParams(temperature=0, max_new_tokens=12)
    cpu_out, gpu_out = engine.generate(ids, params), gpu.generate(ids, params)
    assert [o.token_ids for o in gpu_out] == [o.token_ids for o in cpu_out]
    for a, b in zip(cpu_out, gpu_out):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-3


@pytest.mark.gpu
def test_a_trainer_on_cuda_takes_the_same_first_step_as_on_the_cpu(service, tiny_model, tmp_path):
    """trainer.device=cuda: models, batch and collectives on the GPU; the service may stay on the CPU. The first
    step's losses match a CPU trainer's: both start from the model's weights and draw with the same seed, so the service
    returns them the same rollouts."""
    from rollout_farm.trainer.loop import train
    from rollout_farm.trainer.run import TrainingRun

    rows = []
    for device in ("cpu", "cuda"):
        trainer = TrainingRun(
            config(
                service,
                tiny_model,
                tmp_path / device,
                f"trainer.device={device}",
                "trainer.resume_mode=disable",
                "algorithm.adv_estimator=control_variate",
            ),
            TOKEN,
        )
        assert next(trainer.policy.parameters()).device.type == device
        train(trainer)
        rows.append(json.loads((tmp_path / device / "metrics.jsonl").read_text().splitlines()[-1]))
    for key in ("reward_mean", "pg_loss", "vf_loss"):
        assert rows[1][key] == pytest.approx(rows[0][key], rel=1e-3, abs=1e-5), key
