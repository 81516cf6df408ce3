"""benchmarks/torch_compat.py --bare runs one method of an original torch-style file on plain gloo
CPU processes with no harness, so a failure seen under ours can be checked against the body alone:
torch's GPU gate lets the body run, every rank reports, a failing rank makes the exit status 1."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "torch_compat.py"

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="the bare run sizes its world by CUDA devices; this file checks the machine without any",
)

# A file as torch writes it: torch's own harness imports, a world sized by CUDA devices (0 here).
ORIGINAL = """
import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import skip_if_lt_x_gpu
from torch.testing._internal.common_fsdp import FSDPTest


class TestBare(FSDPTest):
    @property
    def world_size(self):
        return torch.cuda.device_count()

    @skip_if_lt_x_gpu(2)
    def test_all_reduce(self):
        t = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(t)
        assert t.item() == sum(range(1, self.world_size + 1)), t
        assert dist.get_world_size() == self.world_size == 3

    @skip_if_lt_x_gpu(2)
    def test_rank_one_differs(self):
        assert self.rank != 1, "rank 1 was asked to fail"
"""


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bare") / "test_original.py"
    path.write_text(ORIGINAL)
    return path


def _bare(original: Path, method: str) -> subprocess.CompletedProcess[str]:
    target = f"{original}::TestBare::{method}"
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--bare", target, "--world-size", "3"],
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_gated_body_runs_on_every_rank_of_the_asked_world(original: Path) -> None:
    proc = _bare(original, "test_all_reduce")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[rank")]
    assert lines == ["[rank 0] PASSED", "[rank 1] PASSED", "[rank 2] PASSED"]


def test_a_failing_rank_is_named_and_fails_the_run(original: Path) -> None:
    proc = _bare(original, "test_rank_one_differs")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "[rank 0] PASSED" in proc.stdout
    assert "[rank 1] FAILED AssertionError: rank 1 was asked to fail" in proc.stdout
    assert "[rank 2] PASSED" in proc.stdout


def test_bare_needs_file_class_and_method() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--bare", "test_x.py::TestX"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "--bare takes FILE::CLASS::METHOD" in proc.stderr
