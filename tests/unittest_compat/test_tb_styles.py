"""The unittest classes honour pytest's --tb as the marker's tests do (issue 47): the ranks'
tracebacks in that style, the failure's report their report alone (no traceback of the
harness around it), one line with --tb=line, nothing with --tb=no."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from .._scenario import Run, run_scenario

SCENARIOS = Path(__file__).parent / "scenarios"
FILE = "test_tb_styles.py"


def _failure_sections(run: Run) -> dict[str, str]:
    """The FAILURES section of each test (``___ name ___`` headings), by test name."""
    body = run.stdout.split("= FAILURES =", 1)[-1].split("= short test summary info =")[0]
    parts = re.split(r"^_{3,} (\S+) _{3,}$", body, flags=re.M)
    return {parts[i].split(".")[-1]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    return {
        style: run_scenario(
            tmp_path_factory.mktemp(style), FILE, f"--tb={style}", scenarios=SCENARIOS
        )
        for style in ("short", "line", "no", "native")
    }


def test_short_style_gives_short_rank_tracebacks_and_no_harness_frames(
    runs: dict[str, Run],
) -> None:
    sections = _failure_sections(runs["short"])
    mine = sections["test_unittest_class"]
    assert "test_tb_styles.py:20: in test_unittest_class\n    check(self.rank)" in mine
    assert "test_tb_styles.py:12: in check" in mine
    assert "def test_unittest_class(self):" not in mine  # no source listing
    for harness_word in ("DistributedTestFailure", "testcase.py", "unittest/case.py"):
        assert harness_word not in mine, mine
    # The marker's test, for comparison: the same short form.
    marker = sections["test_marker"]
    assert "test_tb_styles.py:26: in test_marker\n    check(rank)" in marker
    assert "def test_marker(rank):" not in marker


def test_line_style_gives_the_test_and_the_ranks_in_a_few_lines(runs: dict[str, Run]) -> None:
    out = runs["line"].stdout
    assert "def test_unittest_class" not in out and "check(self.rank)" not in out
    assert re.search(
        r"test_tb_styles\.py:18: DistributedTestFailure: ranks 0, 1 \(2 of 2\) failed: "
        r"AssertionError: rank \d computed \d",
        out,
    ), out
    # The unittest class's whole failure: the report (each rank's line) and the crash line.
    failures = out.split("= FAILURES =", 1)[1]
    mine = failures.split("DistributedTestFailure: ranks", 1)[0]
    assert len(mine.strip().splitlines()) <= 10, mine


def test_no_style_prints_no_failure_section(runs: dict[str, Run]) -> None:
    run = runs["no"]
    assert "= FAILURES =" not in run.stdout
    case = run.cases["test_unittest_class"]
    assert case.outcome == "failed"
    # The short summary and JUnit's message: the report's first line.
    assert case.message.startswith("DistributedTestFailure: ranks 0, 1 (2 of 2) failed: "), case
    assert "FAILED test_tb_styles.py::TestStyles::test_unittest_class - DistributedTest" in (
        run.stdout
    )


def test_native_style_gives_pythons_own_tracebacks(runs: dict[str, Run]) -> None:
    mine = _failure_sections(runs["native"])["test_unittest_class"]
    assert "Traceback (most recent call last):" in mine
    assert re.search(r'File ".*test_tb_styles\.py", line 20, in test_unittest_class', mine)
