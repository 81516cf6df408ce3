"""Running under pytest-xdist and under torchrun."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .._scenario import SCENARIOS, processes_tagged


def _many_tests(n: int) -> str:
    body = ["import pytest, torch, torch.distributed as dist", ""]
    for i in range(n):
        kind = i % 4
        if kind == 3:
            marker = '@pytest.mark.distributed(world_size=2, mode="thread")'
        else:
            marker = f"@pytest.mark.distributed(world_size={2 + kind % 2})"
        body += [
            marker,
            f"def test_{i}(rank, world_size, tmp_path):",
            "    t = torch.ones(1)",
            "    dist.all_reduce(t)",
            "    assert t.item() == world_size",
            "    (tmp_path / str(rank)).write_text('x')",
            "",
        ]
    return "\n".join(body)


def test_xdist_runs_many_distributed_tests(tmp_path: Path) -> None:
    _run_many_under_xdist(tmp_path, attempts=1)


# The same, three sessions in a row (each with its own fork server and ranks): 36 s of the
# default suite's time, kept for --run-slow; the default suite runs one.
@pytest.mark.slow
def test_xdist_runs_many_distributed_tests_three_times(tmp_path: Path) -> None:
    _run_many_under_xdist(tmp_path, attempts=3)


def _run_many_under_xdist(tmp_path: Path, attempts: int) -> None:
    (tmp_path / "test_many.py").write_text(_many_tests(44))
    tag = f"fsdp-testing-xdist-{os.getpid()}"
    for attempt in range(attempts):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-n",
                "2",
                "-q",
                "-p",
                "no:cacheprovider",
                "test_many.py",
            ],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "SCENARIO_TAG": tag},
        )
        assert proc.returncode == 0, (
            f"attempt {attempt + 1}:\n{proc.stdout[-4000:]}{proc.stderr[-2000:]}"
        )
        assert "44 passed" in proc.stdout
    assert processes_tagged(tag) == []


@pytest.mark.skipif(
    shutil.which("torchrun") is None and not Path(sys.executable).with_name("torchrun").exists(),
    reason="torchrun is not installed",
)
def test_torchrun_runs_tests_in_place_and_rank_zero_reports(tmp_path: Path) -> None:
    shutil.copy(SCENARIOS / "test_torchrun.py", tmp_path / "test_torchrun.py")
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    proc = subprocess.run(
        [
            torchrun,
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-rA",
            "test_torchrun.py",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        # torchrun's agent makes a log directory (torchelastic_*) in the temporary directory
        # and leaves it there: keep it under the test's own, and make that too deep for a
        # socket's address (a job's scratch folder can be), where the slots cannot listen.
        env={**os.environ, "TMPDIR": str(deep)},
    )
    out = proc.stdout
    assert proc.returncode != 0  # one test fails on rank 1
    assert out.count("short test summary info") == 1, "only rank 0 reports"
    assert "PASSED test_torchrun.py::test_in_place_all_reduce" in out
    assert "this torchrun job has world size 2; the test needs 4" in out
    # Thread-mode tests need no rank of the job: they run in rank 0's session.
    assert "PASSED test_torchrun.py::test_thread_mode_in_job" in out
    assert "rank 1 failed: AssertionError: rank one disagrees in place" in out
    assert "1 failed, 2 passed, 1 skipped" in out
