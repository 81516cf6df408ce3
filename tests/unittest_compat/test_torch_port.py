"""A torch-style file moved by its imports alone (issue 12): GPU-sized worlds run on CPU ranks and
say so, skip_if_lt_x_gpu guarantees its ranks, CUDA calls skip with the reason, torch's
assertions, names and keywords work, and a failure does not poison a continuous class."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .._scenario import Run, run_scenario

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="GPU-sized worlds run on CPU ranks only where no GPU exists"
)

SCENARIOS = Path(__file__).parent / "scenarios"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return run_scenario(
        tmp_path_factory.mktemp("port"), "test_torch_port.py", "-v", scenarios=SCENARIOS
    )


def test_gpu_sized_world_runs_on_cpu_ranks_and_says_so(run: Run) -> None:
    case = run.cases["test_world_comes_from_the_cpu_world_size"]
    assert case.outcome == "passed", case.text
    assert "PASSED (ran on 2 CPU ranks (no GPU: TestSizedByGpus.world_size came out as 0" in (
        run.stdout
    )


def test_skip_if_lt_x_gpu_runs_on_at_least_its_ranks(run: Run) -> None:
    case = run.cases["test_skip_if_lt_x_gpu_guarantees_its_ranks"]
    assert case.outcome == "passed", case.text
    assert "PASSED (ran on 3 CPU ranks" in run.stdout


def test_cuda_call_is_a_skip_naming_the_error(run: Run) -> None:
    case = run.cases["test_cuda_call_skips_with_the_reason"]
    assert case.outcome == "skipped", case.text
    assert "needs an accelerator" in case.message
    # The error torch raises here: "Torch not compiled with CUDA enabled" from a CPU wheel,
    # "Found no NVIDIA driver on your system" from a CUDA one on a machine without a driver.
    with pytest.raises((AssertionError, RuntimeError)) as error:
        torch.ones(2).cuda()
    assert str(error.value).splitlines()[0][:60] in case.message


def test_torch_assertions_keyword_and_engine_defaults(run: Run) -> None:
    for name in (
        "test_tensor_assertions_are_torchs",
        "test_models_shard_with_torchs_fsdp_by_default",
        "test_parity_accepts_the_old_keyword",
    ):
        assert run.cases[name].outcome == "passed", run.cases[name].text


def test_subtest_cases_get_torchs_names_and_decorators(run: Run) -> None:
    names = {n for n in run.cases if n.startswith("test_subtest_values")}
    assert names == {
        "test_subtest_values_first",
        "test_subtest_values_config1",
        "test_subtest_values_expected_to_fail",
    }
    assert run.cases["test_subtest_values_first"].outcome == "passed"
    assert run.cases["test_subtest_values_config1"].outcome == "passed"
    assert run.cases["test_subtest_values_expected_to_fail"].outcome == "xfailed"


def test_compiled_fsdp_test_runs_eager_then_compiled_on_cpu(run: Run) -> None:
    case = run.cases["test_eager_then_compiled"]
    assert case.outcome == "passed", case.text


def test_continuous_class_failure_does_not_poison_the_next_test(run: Run) -> None:
    assert run.cases["test_a_fails"].outcome == "failed"
    assert run.cases["test_b_still_runs"].outcome == "passed", run.cases["test_b_still_runs"].text


def test_continuous_class_forwards_a_skip_from_its_ranks(run: Run) -> None:
    # torch forwards a rank's SkipTest from 2.14 (before, it failed the class); here always.
    case = run.cases["test_c_skips_on_the_ranks"]
    assert case.outcome == "skipped" and "has no widget" in case.message, case.text
    assert run.cases["test_d_runs_after_the_skip"].outcome == "passed"


def test_continuous_class_with_a_missing_backend_is_skipped(run: Run) -> None:
    import torch.distributed as dist

    assert not dist.is_mpi_available()
    case = run.cases["test_never_runs"]
    assert case.outcome == "skipped" and "Backend 'mpi' is not available" in case.message


def test_create_pg_takes_torch_2_15s_backend_argument(run: Run) -> None:
    case = run.cases["test_create_pg_with_a_backend"]
    assert case.outcome == "passed", case.text


def test_cpu_world_size_option_sets_the_substituted_world(tmp_path: Path) -> None:
    run = run_scenario(
        tmp_path,
        "test_torch_port.py",
        "--cpu-world-size",
        "3",
        "-k",
        "test_world_comes_from",
        scenarios=SCENARIOS,
        env={"EXPECTED_WORLD": "3"},
    )
    assert run.cases["test_world_comes_from_the_cpu_world_size"].outcome == "passed"


def test_bad_cpu_world_size_is_a_usage_error(tmp_path: Path) -> None:
    (tmp_path / "test_nothing.py").write_text("def test_x():\n    pass\n")
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--cpu-world-size", "0"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 4
    assert "--cpu-world-size / cpu_world_size must be a positive number of ranks, got '0'" in (
        proc.stderr
    )
