"""CUDA and SGLang paths; every test here is skipped, with the reason, where torch sees no GPU."""

import pytest

from tests.conftest import mark_folder


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    mark_folder(items, __file__, "gpu")
