"""pytest plugin entry point (registered through the ``pytest11`` entry point)."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "distributed(world_size=2, *, backend=None, mode='process', timeout=None): "
        "run the test body once on each rank of a process group.",
    )
