"""Repo-root conftest for the project's own test suite.

Tests marked ``slow`` (e.g. the planner against the recorder on every row of the check
matrix, minutes on two cores) are skipped unless ``--run-slow`` is given; the default suite
runs a representative part of each.
"""

import pytest

pytest_plugins = ["pytester"]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--run-slow",
        action="store_true",
        default=False,
        help="also run the project's tests marked slow (skipped by default)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "slow: a test of minutes, skipped unless --run-slow is given"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow")
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(skip)
