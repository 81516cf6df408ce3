"""A test file run as a script (``python test_x.py`` ending in ``run_tests()`` or
``unittest.main()``, as torch's distributed test files are run) gives, in every mode, the
outcomes pytest gives; and every file under examples/ runs as a script and exits 0."""

from __future__ import annotations

import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

SCENARIOS = Path(__file__).parent / "scenarios"
EXAMPLES = Path(__file__).parents[2] / "examples"

# unittest -v: "test_all_reduce (__main__.TestProcess.test_all_reduce) ... ok"
_LINE = re.compile(r"^(test_\w+) \(__main__\.(\w+)(?:\.\w+)?\) \.\.\. (ok|FAIL|ERROR|skipped)")
_PYTEST_WORD = {"ok": "passed", "FAIL": "failed", "ERROR": "failed", "skipped": "skipped"}

_EACH = {"test_all_reduce": "passed", "test_fails_on_last_rank": "failed", "test_skips": "skipped"}
EXPECTED = {
    **{
        (cls, name): outcome
        for cls in ("TestProcess", "TestThread", "TestLocal")
        for name, outcome in _EACH.items()
    },
    ("TestFake", "test_plays_its_rank"): "passed",
}


def _run_script(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, path.name, "-v"],
        cwd=path.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _script_outcomes(stderr: str) -> dict[tuple[str, str], str]:
    return {
        (m[2], m[1]): _PYTEST_WORD[m[3]]
        for m in (_LINE.match(line) for line in stderr.splitlines())
        if m
    }


@pytest.mark.parametrize("main", ["run_tests()", "unittest.main()"])
def test_script_gives_pytests_outcomes_in_every_mode(tmp_path: Path, main: str) -> None:
    source = (SCENARIOS / "test_as_script.py").read_text()
    if main != "run_tests()":
        source = source.replace("    run_tests()", f"    import unittest\n\n    {main}")
    script = tmp_path / "test_as_script.py"
    script.write_text(source)
    proc = _run_script(script)
    got = _script_outcomes(proc.stderr)
    assert got == EXPECTED, proc.stderr[-3000:]
    assert "Ran 10 tests" in proc.stderr and "FAILED (failures=3, skipped=3)" in proc.stderr
    assert proc.returncode == 1
    # The rank processes never ran the script's `if __name__ == "__main__":` block.
    assert "has no attribute" not in proc.stderr
    assert "the last rank is off" in proc.stderr


def test_pytest_gives_the_same_outcomes(tmp_path: Path) -> None:
    (tmp_path / "test_as_script.py").write_text((SCENARIOS / "test_as_script.py").read_text())
    assert _pytest_outcomes(tmp_path) == EXPECTED


def _pytest_outcomes(tmp_path: Path) -> dict[tuple[str, str], str]:
    xml_path = tmp_path / "report.xml"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            f"--junitxml={xml_path}",
            "test_as_script.py",
        ],
        cwd=tmp_path,
        capture_output=True,
        timeout=300,
    )
    outcomes = {}
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        tags = {child.tag for child in case}
        outcome = "failed" if tags & {"failure", "error"} else "skipped" if tags else "passed"
        outcomes[(case.get("classname", "").rpartition(".")[2], case.get("name", ""))] = outcome
    return outcomes


@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_every_example_runs_as_a_script(example: str) -> None:
    proc = _run_script(EXAMPLES / example)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
