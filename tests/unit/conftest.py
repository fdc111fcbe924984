"""Pure functions and in-process objects: no Ray, no service; the folder runs in seconds."""

import pytest

from tests.conftest import mark_folder


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    mark_folder(items, __file__, "unit")
