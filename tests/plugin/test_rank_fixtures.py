"""Fixtures on the ranks (issue 49): a fixture that requests ``rank``, ``world_size``,
``process_group`` or ``device`` is set up and torn down on each rank, with pytest's scopes, parameters, ``request``
and yield teardown; its errors are the rank's; broader scopes stay on warm ranks until they end;
what cannot work is found at collection and fails that test at setup, naming the fixture
and the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .._scenario import Run, run_scenario


@pytest.fixture(scope="module")
def record(tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, list[dict]]:
    work = tmp_path_factory.mktemp("rank_fixtures")
    path = work / "record.jsonl"
    run = run_scenario(work, "test_rank_fixtures.py", env={"SCENARIO_RECORD": str(path)})
    notes = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return run, notes


@pytest.mark.parametrize(
    "name",
    [
        "test_a_fixture_builds_the_model_on_each_rank",
        "test_parametrized_fixture[sum]",
        "test_parametrized_fixture[max]",
        "test_module_scope_first",
        "test_module_scope_second",
        "test_thread_mode[sum]",
        "test_thread_mode[max]",
        "test_local_mode",
        "test_a_mesh_from_world_size_alone",
        "test_a_mesh_from_world_size_alone_thread_mode",
    ],
)
def test_fixtures_run_on_each_rank(record: tuple[Run, list[dict]], name: str) -> None:
    case = record[0].cases[name]
    assert case.outcome == "passed", case.text


def test_teardown_and_finalizers_run_on_each_rank(record: tuple[Run, list[dict]]) -> None:
    notes = record[1]
    for rank in (0, 1):
        mine = [n["what"] for n in notes if n["rank"] == rank]
        assert mine.count("ddp_model up") == mine.count("ddp_model down") >= 2, mine
        assert "finalizer sum" in mine and "finalizer max" in mine
        # The module-scoped fixture: set up once, torn down when the warm ranks end.
        assert mine.count("table up") == 1 and mine.count("table down") == 1, mine


def test_errors_in_a_fixture_are_the_ranks_failure(record: tuple[Run, list[dict]]) -> None:
    run = record[0]
    setup = run.cases["test_setup_error_is_the_ranks_failure"]
    assert setup.message.startswith(
        "rank 1 failed: RuntimeError: rank 1 cannot set this up [(in the setup of fixture "
        "'broken_on_one' on rank 1)]"
    ), setup.message
    teardown = run.cases["test_teardown_error_is_the_ranks_failure"]
    assert teardown.message.startswith(
        "rank 0 failed: ValueError: rank 0's teardown broke [(in the teardown of fixture "
        "'fails_teardown' on rank 0)]"
    ), teardown.message


def test_outside_a_distributed_test_the_fixture_names_the_marker(
    record: tuple[Run, list[dict]],
) -> None:
    case = record[0].cases["test_not_distributed"]
    assert case.outcome == "error"
    assert "fixture 'rank' is only available in distributed tests" in case.message


SCOPE_IN_THREAD_MODE = """
import pytest


@pytest.fixture(scope="module")
def table(process_group):
    return {}


@pytest.mark.distributed(world_size=2, mode="thread")
def test_uses_it(table):
    pass
"""


def test_a_broader_scope_in_thread_mode_fails_that_test_alone(pytester: pytest.Pytester) -> None:
    """Found at collection, reported at the test's setup: a collection error would stop the
    whole session (the test beside it would not run)."""
    pytester.makepyfile(
        SCOPE_IN_THREAD_MODE
        + """

@pytest.mark.distributed(world_size=2, mode="thread")
def test_beside_it(rank):
    pass
"""
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*test_uses_it: fixture 'table' (scope='module') requests a rank fixture, so it runs "
            "on each rank; in mode='thread' a rank's process group lives for one test. Make it "
            "scope='function', or use mode='process'*"
        ]
    )
    out = result.stdout.str()
    assert "fsdp_testing/" not in out and "Interrupted" not in out  # no plugin frames


BAD_MARKER = """
import pytest


@pytest.mark.distributed(world_size=0)
def test_bad(rank):
    pass


@pytest.mark.distributed(world_size=2, mode="nonsense")
def test_bad_mode(rank):
    pass


@pytest.mark.distributed(world_size=2)
def test_good(rank):
    pass
"""


def test_a_bad_marker_fails_its_test_alone(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(BAD_MARKER)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rA")
    result.assert_outcomes(passed=1, errors=2)
    result.stdout.fnmatch_lines(
        [
            "*::test_bad: distributed marker: world_size must be at least 1, got 0*",
            "*::test_bad_mode: distributed marker: unknown mode 'nonsense'*",
        ]
    )
    out = result.stdout.str()
    assert "Interrupted" not in out and "plugin.py" not in out and "marker_items" not in out


def test_record_file_exists(record: tuple[Run, list[dict]]) -> None:
    assert Path(record[0].tag)  # the session ran (its outcomes are checked above)
    assert record[1], record[0].stdout[-3000:]


SCOPE_ENDS_A = """
import pytest

LOG = {log!r}


def _log(line):
    with open(LOG, "a") as f:
        f.write(line + "\\n")


@pytest.fixture(scope="module", params=["p1", "p2"])
def resource(request, rank):
    _log(f"setup {{request.param}} {{rank}}")
    yield request.param
    _log(f"teardown {{request.param}} {{rank}}")


@pytest.mark.distributed(world_size=2)
def test_a1(resource, rank):
    _log(f"a1 {{resource}} {{rank}}")


@pytest.mark.distributed(world_size=2)
def test_a2(resource, rank):
    _log(f"a2 {{resource}} {{rank}}")
"""

SCOPE_ENDS_B = """
import pytest

LOG = {log!r}


@pytest.fixture(scope="module")
def broken(rank):
    yield
    raise RuntimeError(f"teardown broke on rank {{rank}}")


@pytest.mark.distributed(world_size=2)
def test_b1(rank):
    with open(LOG, "a") as f:
        f.write(f"b1 {{rank}}\\n")


@pytest.mark.distributed(world_size=2)
def test_b2(broken):
    pass


@pytest.mark.distributed(world_size=2)
def test_b3(rank):
    pass
"""


def test_a_broader_scope_ends_on_the_ranks_when_pytest_ends_it(
    pytester: pytest.Pytester,
) -> None:
    """As pytest does in one process: a module fixture's parameter is torn down before the next
    one is set up, and its teardown runs at the end of its module (not when the warm ranks end);
    an error there is the error of the test whose teardown ended the scope (the module's last)."""
    log = pytester.path / "log.txt"
    pytester.makepyfile(
        test_a=SCOPE_ENDS_A.format(log=str(log)), test_b=SCOPE_ENDS_B.format(log=str(log))
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:randomly")
    result.assert_outcomes(passed=7, errors=1)
    result.stdout.fnmatch_lines(
        ["*ERROR at teardown of test_b3*", "*RuntimeError: teardown broke on rank *"]
    )
    assert "launcher.py" not in result.stdout.str()  # the ranks' report, no harness frames
    lines = log.read_text().splitlines()
    for rank in (0, 1):
        mine = [line.rsplit(" ", 1)[0] for line in lines if line.endswith(f" {rank}")]
        assert mine == [
            "setup p1",
            "a1 p1",
            "a2 p1",
            "teardown p1",
            "setup p2",
            "a1 p2",
            "a2 p2",
            "teardown p2",
            "b1",  # module test_a's fixture is gone before module test_b starts
        ], lines
