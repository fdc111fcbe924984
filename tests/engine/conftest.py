"""The torch engine in process, on a tiny random Llama: no Ray."""

import pytest
import torch

from tests.conftest import mark_folder


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    mark_folder(items, __file__, "engine")


@pytest.fixture(scope="session")
def sharp_model(tiny_model, tmp_path_factory):
    """The tiny random Llama with its weights scaled up: at the default init its next token hardly depends on what
    came before, so a row given another prompt's cache, or a wrong draft kept, would go unnoticed."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(12)
    out = tmp_path_factory.mktemp("sharp")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(out)
    return out
