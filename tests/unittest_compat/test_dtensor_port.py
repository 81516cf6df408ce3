"""``fsdp_testing.common_dtensor``, the drop-in for torch's DTensor test harness (issue 48): its
process-rank, thread-rank, continuous and LocalTensorMode classes, ``with_comms``, the skip
decorator, the models, warm ranks without a previous test's DTensor state, and our failure
reports; one scenario file run in a child session. Fast helpers are checked in-process and
against torch's own module in a child process."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fsdp_testing._rank.skips import multi_device_message

from .._scenario import Run, run_scenario

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the scenario's classes are sized for CPU ranks"
)

SCENARIOS = Path(__file__).parent / "scenarios"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return run_scenario(
        tmp_path_factory.mktemp("dtensor"), "test_dtensor_port.py", "-v", scenarios=SCENARIOS
    )


def _passed(run: Run, *names: str) -> None:
    for name in names:
        assert run.cases[name].outcome == "passed", (name, run.cases[name].text)


def test_process_ranks_hold_the_group_and_start_seeded(run: Run) -> None:
    _passed(run, "test_mesh_and_seeded_ranks", "test_with_comms_takes_arguments")


def test_backend_the_machine_lacks_skips_and_a_foreign_one_is_refused(run: Run) -> None:
    skipped = run.cases["test_accelerator_backend_skips_without_devices"]
    assert skipped.outcome == "skipped" and multi_device_message(2) in skipped.message
    refused = run.cases["test_fake_backend_names_the_local_class"]
    assert refused.outcome == "failed"
    assert "init_pg(backend='fake'): the ranks' process group runs gloo" in refused.text
    assert "use a LocalDTensorTestBase" in refused.text
    # with_comms and init_pg are torch's helpers the user calls: their frames stay in the
    # report (not hidden as the harness's machinery), so it says where the error came from.
    assert "dtensor.py:" in refused.text and "in init_pg" in refused.text
    assert "All traceback entries are hidden" not in refused.text


def test_skip_unless_torch_gpu_skips_on_cpu(run: Run) -> None:
    case = run.cases["test_needs_gpus"]
    assert case.outcome == "skipped" and multi_device_message(4) in case.message


def test_failure_names_the_rank(run: Run) -> None:
    case = run.cases["test_fails_on_rank_one"]
    assert case.outcome == "failed"
    assert "rank 1 failed: AssertionError: 1 != 0 : rank one is off" in case.text
    # Rank 0 had passed its check and waited for rank 1 in with_comms' destroy_pg barrier: the
    # report's stack shows that frame, and torch's barrier under it folded to one line.
    aborted = case.text.split("[rank 0] aborted", 1)[1]
    assert "in destroy_pg" in aborted, aborted
    assert "-> barrier (distributed_c10d.py:" in aborted or "in barrier" in aborted, aborted


def test_warm_ranks_forget_the_dtensor_rng_tracker(run: Run) -> None:
    _passed(run, "test_a_leaves_a_dtensor_rng_tracker", "test_b_starts_without_rng_tracker")


def test_models_and_parallel_styles(run: Run) -> None:
    _passed(
        run,
        "test_transformer_parallelize_seq_parallel_False",
        "test_transformer_parallelize_seq_parallel_True",
        "test_mlp_colwise_rowwise",
    )


def test_local_tensor_copy_runs_every_rank_in_fake_mode(run: Run) -> None:
    _passed(run, "test_every_rank_in_one_process")
    assert "TestLocalTensorWithLocalTensor::test_every_rank_in_one_process" in run.stdout
    skipped = run.cases["test_skipped_in_the_copy"]
    assert skipped.outcome == "skipped" and "Skipped test" in skipped.message


def test_op_class_runs_on_thread_ranks(run: Run) -> None:
    _passed(run, "test_op_in_every_sharding")


def test_dist_mode_runs_a_dtensor_class_on_thread_and_local_ranks(run: Run) -> None:
    _passed(run, "test_sharded_and_back", "test_tensor_parallel_mlp_in_local_mode")


def test_continuous_class_shares_its_ranks(run: Run) -> None:
    _passed(run, "test_first", "test_second")


def test_nothing_else_ran_and_the_session_failed_for_the_two_failures(run: Run) -> None:
    assert len(run.cases) == 18, sorted(run.cases)
    failed = sorted(n for n, c in run.cases.items() if c.outcome == "failed")
    assert failed == ["test_fails_on_rank_one", "test_fake_backend_names_the_local_class"]
    assert run.returncode == 1


# -- helpers, in-process and against torch's module ---------------------------------------------


def test_converter_choices_and_shard_orders_match_torchs(tmp_path: Path) -> None:
    """``generate_shard_orders``, ``shard_order_to_placement`` and ``DTensorConverter``'s
    sharding choices of ours and of the installed torch's module, for the same inputs (in a
    child process on a fake world of 4: importing torch's module imports its common_utils)."""
    script = tmp_path / "helpers.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys
            import torch
            import torch.distributed as dist
            from torch.testing._internal.distributed.fake_pg import FakeStore
            from torch.distributed.device_mesh import init_device_mesh

            if sys.argv[1] == "torch":
                from torch.testing._internal.distributed._tensor import common_dtensor as m
            else:
                from fsdp_testing import common_dtensor as m

            dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
            mesh1 = init_device_mesh("cpu", (4,))
            mesh2 = init_device_mesh("cpu", (2, 2))
            for mesh, rank in ((mesh1, 2), (mesh2, 2), (mesh2, 3)):
                orders = list(m.generate_shard_orders(mesh, rank))
                print(len(orders), orders)
                print([m.shard_order_to_placement(o, mesh) for o in orders])
            args = (torch.randn(4, 8), torch.ones(2, 4, dtype=torch.bool), 3)
            converter = m.DTensorConverter(mesh1, args, {"other": torch.randn(8)})
            print([converter.gen_sharding_choices_for_arg(t) for t in args[:2]])
            steps = [(a[0].placements, a[1].placements, k["other"].placements)
                     for a, k in converter]
            print(len(steps), steps, converter.successful())
            """
        )
    )
    outputs = {}
    for which in ("torch", "ours"):
        proc = subprocess.run(
            [sys.executable, str(script), which],
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert proc.returncode == 0, proc.stderr
        outputs[which] = proc.stdout
    assert outputs["ours"] == outputs["torch"]
    # A 1-D mesh and a 2-D tensor: the mesh dim shards tensor dim 0 or 1.
    assert outputs["ours"].splitlines()[0].startswith("2 [(ShardOrderEntry(tensor_dim=0, ")
