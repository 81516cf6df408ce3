"""torch-compatible unittest classes: one class mixing passing, failing, skipping and
subtest-failing methods, run under pytest and under ``python -m unittest``."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fsdp_testing._rank.skips import multi_device_message

from .._scenario import Run, run_scenario

SCENARIOS = Path(__file__).parent / "scenarios"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return run_scenario(tmp_path_factory.mktemp("mixed"), "test_mixed.py", scenarios=SCENARIOS)


def test_each_method_runs_on_every_rank_and_passes(run: Run) -> None:
    for name in ("test_passes", "test_threads", "test_default_world_size"):
        assert run.cases[name].outcome == "passed", run.cases[name].text


def test_failing_rank_is_reported_under_its_heading(run: Run) -> None:
    case = run.cases["test_fails_on_rank_one"]
    assert case.outcome == "failed"
    assert "rank 1 failed: AssertionError: 1 != 0 : rank one is off" in case.text
    assert "[rank 1]" in case.text and "[rank 0]" not in case.text


def test_skips_are_reported_with_their_reason(run: Run) -> None:
    assert run.cases["test_skips"].outcome == "skipped"
    assert "no widgets here" in run.cases["test_skips"].message
    assert run.cases["test_torch_exit_code_skip"].outcome == "skipped"
    assert multi_device_message(8) in run.cases["test_torch_exit_code_skip"].message


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the CPU substitution made where no GPU exists"
)
def test_gpu_decorator_runs_on_cpu_unless_gpus_are_required(run: Run) -> None:
    assert run.cases["test_gpu_decorated_runs_on_cpu"].outcome == "passed"
    case = run.cases["test_needs_real_gpus"]
    import torch

    if torch.cuda.device_count() < 2:
        assert case.outcome == "skipped" and multi_device_message(2) in case.message


def test_failing_subtest_is_labelled(run: Run) -> None:
    case = run.cases["test_subtests"]
    assert case.outcome == "failed"
    assert "AssertionError: a=2 is over the limit 2" in case.text
    assert "subtest a=2, b='y'" in case.text


def test_parameterized_expand_methods_run_and_report_separately(run: Run) -> None:
    assert run.cases["test_expand_0_small"].outcome == "passed"
    assert run.cases["test_expand_1_large"].outcome == "failed"
    assert "n=3 is too large" in run.cases["test_expand_1_large"].text


def test_torch_style_parametrize_is_instantiated(run: Run) -> None:
    assert run.cases["test_torch_style_k_0"].outcome == "passed"
    assert run.cases["test_torch_style_k_1"].outcome == "passed"


def test_failing_rank_setup_is_reported_as_such(run: Run) -> None:
    case = run.cases["test_after_setup"]
    assert case.outcome == "failed"
    assert (
        "rank 1 failed: RuntimeError: rank one cannot set up [in setUpRank on rank 1]" in case.text
    )


def test_torch_style_self_initialised_group_works_on_warm_ranks(run: Run) -> None:
    case = run.cases["test_joins_group_itself"]
    assert case.outcome == "passed", case.text


def test_use_warm_pool_false_forks_fresh_ranks_per_method(run: Run) -> None:
    assert run.cases["test_first"].outcome == "passed", run.cases["test_first"].text
    assert run.cases["test_second"].outcome == "passed", run.cases["test_second"].text


def test_node_ids_and_k_select_methods(tmp_path: Path) -> None:
    run = run_scenario(
        tmp_path, "test_mixed.py", "-k", "test_passes or test_skips", scenarios=SCENARIOS
    )
    assert set(run.cases) == {"test_passes", "test_skips"}
    assert run.returncode == 0


def test_python_m_unittest_runs_the_same_classes(tmp_path: Path) -> None:
    (tmp_path / "test_mixed.py").write_text((SCENARIOS / "test_mixed.py").read_text())
    proc = subprocess.run(
        [sys.executable, "-m", "unittest", "-v", "test_mixed"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stderr
    assert proc.returncode == 1
    assert re.search(r"Ran 17 tests", out)
    # skip_if_lt_x_gpu(2) runs on CPU ranks without a GPU and skips with one GPU; with two,
    # the allow_cpu=False test runs too, and fails as written.
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    failures, skipped = (4, 3) if gpus == 0 else (4, 4) if gpus == 1 else (5, 2)
    assert f"FAILED (failures={failures}, skipped={skipped})" in out
    # Python 3.11 added the method's name to unittest's description of a test.
    assert re.search(r"test_passes \(test_mixed\.TestMixed(\.test_passes)?\) \.\.\. ok", out)
    assert "rank 1 failed: AssertionError: 1 != 0 : rank one is off" in out
