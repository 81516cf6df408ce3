"""Every fenced ``python`` block in README.md and docs/ is complete and runs.

A block is one of three kinds, told apart by its text:

- cut from an example: its first line is ``# cut from examples/NAME.py``; every other line of
  the block stands in that file, in order (the example itself runs as a script in
  ``tests/unittest_compat/test_as_script.py``);
- a test file: it defines ``test_*`` functions or ``Test*`` classes; all such blocks run in one
  pytest session (each its own file, the rank pool shared) and every test in them passes;
- a script: anything else, run with ``python`` on its own.

Text that is not Python to run (signatures, output) goes in ``text`` blocks.
"""

from __future__ import annotations

import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_CUT = re.compile(r"^# cut from (examples/[\w./-]+\.py)\n")
_TEST = re.compile(r"^(def test_\w+|class Test\w*)", re.M)


def _blocks() -> list[tuple[str, str]]:
    blocks = []
    for page in PAGES:
        for i, match in enumerate(_FENCE.finditer(page.read_text())):
            blocks.append((f"{page.relative_to(ROOT)}#{i}", match.group(1)))
    return blocks


BLOCKS = _blocks()
CUT = [(name, text) for name, text in BLOCKS if _CUT.match(text)]
TESTS = [(name, text) for name, text in BLOCKS if not _CUT.match(text) and _TEST.search(text)]
SCRIPTS = [(name, text) for name, text in BLOCKS if not _CUT.match(text) and not _TEST.search(text)]


def _module_name(block: str) -> str:
    return "test_doc_" + re.sub(r"\W", "_", block.removesuffix(".md").replace(".md#", "_"))


def test_blocks_are_found() -> None:
    assert len(BLOCKS) >= 20 and TESTS and SCRIPTS, [name for name, _ in BLOCKS]


@pytest.mark.parametrize(("block", "text"), CUT, ids=[name for name, _ in CUT])
def test_block_cut_from_an_example_stands_in_it(block: str, text: str) -> None:
    match = _CUT.match(text)
    assert match
    source = (ROOT / match.group(1)).read_text().splitlines()
    at = 0
    for line in text[match.end() :].splitlines():
        if not line.strip() or line.strip() == "...":
            continue
        try:
            at = source.index(line, at) + 1
        except ValueError:
            pytest.fail(f"{block}: {line!r} is not in {match.group(1)} (after line {at})")


@pytest.fixture(scope="module")
def doc_test_outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    """Run every test-file block in one pytest session: block name -> its tests' outcomes."""
    folder = tmp_path_factory.mktemp("doc_tests")
    for name, text in TESTS:
        (folder / f"{_module_name(name)}.py").write_text(text)
    xml_path = folder / "report.xml"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            f"--junitxml={xml_path}",
            "-q",
            "--continue-on-collection-errors",
        ],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=600,
    )
    outcomes: dict[str, list[str]] = {}
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        # A block that cannot be imported is reported under its module's name alone.
        module = case.get("classname", "").split(".")[0] or case.get("name", "")
        tags = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        text = "".join(child.get("message", "") for child in case)
        outcome = tags[0] if tags else "passed"
        outcomes.setdefault(module, []).append(
            f"{case.get('name')}: {outcome}" + (f" ({text[:2000]})" if tags else "")
        )
    outcomes["__output__"] = [proc.stdout[-5000:]]
    return outcomes


@pytest.mark.parametrize(("block", "text"), TESTS, ids=[name for name, _ in TESTS])
def test_block_that_is_a_test_file_passes(
    block: str, text: str, doc_test_outcomes: dict[str, list[str]]
) -> None:
    results = doc_test_outcomes.get(_module_name(block))
    assert results, (
        f"{block}: pytest collected no test from it\n{doc_test_outcomes['__output__'][0]}"
    )
    assert all(r.endswith(": passed") for r in results), "\n".join(results)


@pytest.mark.parametrize(("block", "text"), SCRIPTS, ids=[name for name, _ in SCRIPTS])
def test_block_that_is_a_script_runs(block: str, text: str, tmp_path: Path) -> None:
    script = tmp_path / "block.py"
    script.write_text(text)
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"{block}:\n{text}\n{proc.stderr[-3000:]}"
