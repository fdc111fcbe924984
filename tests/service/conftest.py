"""Tests against the real service: one Ray Serve app per session on 127.0.0.1 (see tests/conftest.py)."""

import pytest

from tests.conftest import mark_folder


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    mark_folder(items, __file__, "integration")
