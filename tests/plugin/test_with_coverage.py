"""Coverage counts the lines the ranks run (issue 43): pytest-cov and ``coverage run -m pytest``
see every line a rank ran, in process mode (warm pool and fresh processes), thread, local and
fake mode, and under pytest-xdist; the ranks' data files are combined and none is left behind.
See [Note: coverage on rank processes] in fsdp_testing/_integrations/rank_coverage.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# Each function runs only on the ranks of one test, so a line the ranks ran but the session did
# not count shows as missed in the report.
MYLIB = """
import torch
import torch.distributed as dist


def warm_only(rank):
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def fresh_only(rank):
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def on_rank_one(x):
    y = x * 2
    return y + 1


def thread_only(rank):
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def local_only(t):
    u = t + 1
    dist.all_reduce(u)
    return u


def fake_only(rank):
    v = rank + 1
    return v
"""

TESTS = """
import pytest
import torch
from mylib import ops


@pytest.mark.distributed(world_size=2)
def test_warm(rank):
    assert ops.warm_only(rank) == 2.0
    if rank == 1:
        assert ops.on_rank_one(1) == 3


@pytest.mark.no_dist_pool
@pytest.mark.distributed(world_size=2)
def test_fresh(rank):
    assert ops.fresh_only(rank) == 2.0


@pytest.mark.distributed(world_size=2, mode="thread")
def test_thread(rank):
    assert ops.thread_only(rank) == 2.0


@pytest.mark.distributed(world_size=2, mode="local")
def test_local(rank):
    ops.local_only(torch.ones(1))


@pytest.mark.distributed(world_size=8, mode="fake", rank=5)
def test_fake(rank):
    assert ops.fake_only(rank) == 6
"""


def _project(pytester: pytest.Pytester) -> None:
    pytester.mkpydir("mylib")
    (pytester.path / "mylib" / "ops.py").write_text(MYLIB)
    pytester.makepyfile(test_modes=TESTS)


def _lines_of(*functions: str) -> set[int]:
    """The line numbers of the bodies of ``functions`` in MYLIB."""
    lines = MYLIB.splitlines()  # as written: line 1 is the empty first line
    found: set[int] = set()
    inside = False
    for number, text in enumerate(lines, 1):
        if text.startswith("def "):
            inside = text[4:].split("(")[0] in functions
        elif inside and text.strip():
            found.add(number)
    return found


def _missed(report_line: str) -> set[int]:
    """The "Missing" column of a term-missing report line as line numbers."""
    missed: set[int] = set()
    for part in report_line.split("%", 1)[1].replace(",", " ").split():
        first, _, last = part.partition("-")
        missed.update(range(int(first), int(last or first) + 1))
    return missed


def _left_behind(path: Path) -> list[str]:
    return sorted(p.name for p in path.glob(".coverage.*"))


def test_pytest_cov_counts_the_lines_ranks_run_in_every_mode(pytester: pytest.Pytester) -> None:
    _project(pytester)
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--cov=mylib", "--cov-report=term-missing"
    )
    result.assert_outcomes(passed=5)
    # Every line of mylib/ops.py ran on a rank (on_rank_one only on rank 1 of a warm world).
    result.stdout.re_match_lines([r"mylib/ops\.py\s+\d+\s+0\s+100%\s*$"])
    assert _left_behind(pytester.path) == []


def test_pytest_cov_under_xdist(pytester: pytest.Pytester) -> None:
    pytester.mkpydir("mylib")
    (pytester.path / "mylib" / "ops.py").write_text(MYLIB)
    warm, fresh = TESTS.split("@pytest.mark.no_dist_pool")
    pytester.makepyfile(test_a=warm, test_b="import pytest\nfrom mylib import ops\n\n" + fresh)
    result = pytester.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        "-n",
        "2",
        "--dist",
        "loadfile",
        "--cov=mylib",
        "--cov-report=term-missing",
        "-k",
        "warm or fresh",
    )
    result.assert_outcomes(passed=2)
    # The workers' ranks each wrote a file; the controller combined them all: only the
    # functions of the other modes' tests (deselected) are missed.
    line = next(x for x in result.stdout.lines if x.startswith("mylib/ops.py"))
    assert _missed(line) == _lines_of("thread_only", "local_only", "fake_only"), line
    assert _left_behind(pytester.path) == []


def test_coverage_run_combines_the_ranks_data_itself(pytester: pytest.Pytester) -> None:
    _project(pytester)
    (pytester.path / ".coveragerc").write_text("[run]\nsource = mylib\n")
    result = pytester.run(
        sys.executable, "-m", "coverage", "run", "-m", "pytest", "-p", "no:cacheprovider", "-q"
    )
    assert result.ret == 0, result.stdout.str()
    assert "5 passed" in result.stdout.str()
    # Nothing printed after pytest's summary: the ranks' files were combined quietly.
    assert "Combined" not in result.stdout.str() + result.stderr.str()
    assert _left_behind(pytester.path) == []
    report = pytester.run(sys.executable, "-m", "coverage", "report", "-m")
    report.stdout.re_match_lines([r"mylib/ops\.py\s+\d+\s+0\s+100%\s*$"])


def test_the_cost_benchmark_reports_each_mode_with_and_without_coverage() -> None:
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "coverage_cost.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--tests", "2", "--repeat", "1", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    figures = json.loads(proc.stdout)
    assert set(figures["modes"]) == {"process", "thread", "local"}
    for row in figures["modes"].values():
        assert row["without: per test"] > 0 and row["with --cov: per test"] > 0
        assert row["ratio"] == row["with --cov: per test"] / row["without: per test"]
    assert set(figures["session_wall_s"]) == {"without", "with --cov"}
