"""SGLang on GPUs: the NCCL weight transport."""

import pytest
import torch
from safetensors.torch import load_file

from tests.service.helpers import in_thread


@pytest.mark.gpu
def test_sglang_receives_weights_over_nccl_and_bumps_its_version(tmp_path):
    """SGLang engine on cuda:0, a trainer rank on cuda:1 broadcasting a changed lm_head (NCCL needs two devices)."""
    pytest.importorskip("sglang", reason="needs the sglang extra: pip install 'rollout-farm[sglang]'")
    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs the trainer and the engine on different GPUs: needs 2")
    from sglang.srt.utils import init_custom_process_group

    from rollout_farm.services.engine.sglang_engine import SGLangEngine
    from rollout_farm.services.models import tiny_llama
    from rollout_farm.services.net import free_port
    from rollout_farm.services.protocol import SamplingParams

    torch.cuda.set_device(1)  # the trainer's rank; SGLang takes GPU 0
    model = tiny_llama(
        tmp_path / "m", hidden=256, layers=2, seed=0
    )  # head_dim 64: SGLang's attention kernels support it
    engine = SGLangEngine(str(model), "cuda", "bfloat16")
    try:
        params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
        before = engine.generate([[40, 41, 42]], params)[0].token_ids
        port = free_port()
        t, out = in_thread(lambda: engine.init_weights_update_group("127.0.0.1", port, 1, 2, "farm_test", "nccl"))
        group = init_custom_process_group(
            backend="nccl", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=0, group_name="farm_test"
        )
        t.join(300)
        assert out == [None]
        head = load_file(model / "model.safetensors")["lm_head.weight"].to("cuda:1", torch.bfloat16)
        head = torch.roll(head, 1, dims=0)  # every logit moves one token id along: greedy tokens change
        t, out = in_thread(
            lambda: engine.update_weights_from_distributed(
                ["lm_head.weight"], ["BF16"], [list(head.shape)], 7, "farm_test"
            )
        )
        torch.distributed.broadcast(head, src=0, group=group)
        t.join(300)
        assert out == [None] and engine.weight_version == 7
        after = engine.generate([[40, 41, 42]], params)[0]
        assert after.weight_version == 7 and after.token_ids != before
    finally:
        engine.llm.shutdown()
