"""The deploy files (images, compose, the Helm chart, the dashboard and alert rules) checked without Docker or a
cluster: rendered and validated by the same tools a deploy would use, run as libraries or static binaries."""

import pytest

from tests.conftest import mark_folder


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    mark_folder(items, __file__, "deploy")
