"""benchmarks/torch_compat.py runs test files that import modules from their own folder and read
data files beside them (torch's test/distributed/pipelining: ``model_registry``,
``schedule_registry``, ``artifacts/*.csv``): the other files of the folder are copied next to
the tests for both harnesses, the Python ones ported for ours."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "torch_compat.py"

HELPER = """
from torch.testing._internal.common_utils import TestCase

SCALE = 3
"""

TEST = """
import os

from helper_registry import SCALE
import helper_registry

from torch.testing._internal.common_utils import TestCase, run_tests


class TestBeside(TestCase):
    def test_helper_and_data_beside_the_file(self):
        here = os.path.dirname(os.path.abspath(__file__))
        with open(os.path.join(here, "artifacts", "numbers.csv")) as f:
            self.assertEqual(f.read().split(","), ["1", "2", "3"])
        self.assertEqual(SCALE, 3)
        # the helper imports the harness the test imports: ported with it, or both torch's
        self.assertIs(helper_registry.TestCase, TestCase)


if __name__ == "__main__":
    run_tests()
"""


@pytest.fixture(scope="module")
def torch_compat() -> ModuleType:
    spec = importlib.util.spec_from_file_location("torch_compat_under_test", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    root = tmp_path / "pipelining"
    (root / "artifacts").mkdir(parents=True)
    (root / "__pycache__").mkdir()
    (root / "helper_registry.py").write_text(HELPER)
    (root / "test_beside.py").write_text(TEST)
    (root / "artifacts" / "numbers.csv").write_text("1,2,3")
    (root / "__pycache__" / "helper_registry.cpython-311.pyc").write_bytes(b"\0")
    return root


def test_helpers_and_data_are_copied_and_ported_for_ours(
    torch_compat: ModuleType, folder: Path, tmp_path: Path
) -> None:
    ours, theirs = tmp_path / "ours", tmp_path / "torch"
    written = torch_compat.copy_helpers(folder, ours, port=True)
    assert sorted(p.relative_to(ours).as_posix() for p in written) == [
        "artifacts/numbers.csv",
        "helper_registry.py",
    ]
    assert (
        "from fsdp_testing.common_utils import TestCase"
        in (ours / "helper_registry.py").read_text()
    )
    assert (ours / "artifacts" / "numbers.csv").read_text() == "1,2,3"
    torch_compat.copy_helpers(folder, theirs, port=False)
    assert (theirs / "helper_registry.py").read_text() == HELPER
    assert not (theirs / "test_beside.py").exists()


def test_the_ported_file_imports_its_neighbours_under_our_harness(
    folder: Path, tmp_path: Path
) -> None:
    # torch's harness runs the same copy unported (the test above); one pytest session is
    # enough to show the ported file finds its neighbours.
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(folder), "--harness", "ours", "--json", str(report)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (result,) = json.loads(report.read_text())
    outcome = {k: result[k] for k in ("harness", "passed", "failed", "skipped", "errors")}
    expected = {"harness": "ours", "passed": 1, "failed": 0, "skipped": 0, "errors": 0}
    assert outcome == expected, result["failures"]
