"""Real processes end to end: `farm serve`, `farm train`, torchrun ranks, the trainer against the service."""

import pytest

from tests.conftest import mark_folder


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    mark_folder(items, __file__, "e2e")
