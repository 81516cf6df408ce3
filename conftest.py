"""Repo-root conftest for the project's own test suite.

Tests marked ``slow`` (e.g. the planner against the recorder on every row of the check
matrix, minutes on two cores) are skipped unless ``--run-slow`` is given; the default suite
runs a representative part of each.

The files that take longest are collected first (``LONGEST_FIRST``), so that
``scripts/test.sh``'s two xdist workers, which take whole files in collection order
(``--dist loadfile --no-loadscope-reorder``), end together rather than one waiting for the
other's last long file.
"""

import pytest

pytest_plugins = ["pytester"]

LONGEST_FIRST = (
    # Each file's time in the suite on two workers, November 27 (seconds, rounded): a scheduling
    # hint only; a file missing here runs after these, in collection order.
    "tests/core/test_parity.py",  # 73
    "tests/cli/test_cli.py",  # 68
    "tests/cli/test_benchmarks.py",  # 60
    "tests/plugin/test_multinode.py",  # 58
    "tests/cli/test_check_hybrid.py",  # 57
    "tests/plugin/test_pool.py",  # 53
    "tests/plugin/test_with_coverage.py",  # 47 (November 29, run alone)
    "tests/unittest_compat/test_torch_port.py",  # 45
    "tests/library/test_parity.py",  # 35
    "tests/plugin/test_pipeline_bugs.py",  # 34 (December 6, run alone)
    "tests/unittest_compat/test_testcase.py",  # 34
    "tests/plugin/test_options.py",  # 32
    "tests/plugin/test_with_timeout.py",  # 31 (November 29, run alone)
    "tests/plugin/test_isolation.py",  # 30 (December 6, run alone)
    "tests/cli/test_trace.py",  # 30
    "tests/plugin/test_rank_fixtures.py",  # 28 (December 6, run alone)
    "tests/plugin/test_with_other_plugins.py",  # 26 (November 29, run alone)
    "tests/core/graph/test_trace.py",  # 26
    "tests/scale/test_local_exact.py",  # 26
    "tests/cli/test_plan.py",  # 26
    "tests/cli/test_plan_vs_recorder.py",  # 24
    "tests/unittest_compat/test_dtensor_port.py",  # 24 (December 6, run alone)
    "tests/core/test_dcp_wrapper.py",  # 23
    "tests/plugin/test_fork_server_start.py",  # 23 (December 6, run alone)
    "tests/plugin/test_outcomes.py",  # 23
    "tests/core/graph/test_engine.py",  # 23
    "tests/core/test_fully_shard.py",  # 21
    "tests/plugin/test_faults.py",  # 21
    "tests/core/test_checkpoint_reshard.py",  # 21
    "tests/plugin/test_launchers.py",  # 20 (44 before its xdist session ran once, December 6)
    "tests/core/test_hybrid.py",  # 19
    "tests/plugin/test_partial.py",  # 18
    "tests/plugin/test_soak.py",  # 16
    "tests/plugin/test_with_debugger.py",  # 15 (November 29, run alone)
)


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


@pytest.fixture(autouse=True)
def _child_sessions_without_randomly(request: pytest.FixtureRequest) -> None:
    # pytest-randomly (in the test extra) would shuffle and reseed the child sessions that
    # pytester runs, in process or not (pytester clears PYTEST_ADDOPTS as it starts: this comes
    # after). The tests of how the plugin plays with it pass `-p randomly`, which comes later
    # on the command line and wins.
    if "pytester" in request.fixturenames:
        request.getfixturevalue("pytester")
        request.getfixturevalue("monkeypatch").setenv("PYTEST_ADDOPTS", "-p no:randomly")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Whole files move, each keeping its own order (its module-scoped fixtures rely on it).
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow")
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(skip)
