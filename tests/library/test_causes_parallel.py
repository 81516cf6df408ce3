"""Planted bugs in a tensor-parallel MLP and a two-stage GPipe schedule (``_parallel_code.py``),
checked by ``check_parity`` against a single process: the first likely cause names each one,
the correct code passes, and at world sizes 8 to 64 (local mode) a rounding-level divergence
(``exact=True``) names none."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from examples.zero2_wrapper import ZeRO2, batch, build, sgd
from examples.zero2_wrapper import mse as zero2_mse
from fsdp_testing.parity import check_parity

from ._failures import failure_of, first_cause
from ._parallel_code import (
    ColumnParallelLinear,
    GPipe,
    TensorParallelMLP,
    build_mlp,
    build_stages,
    mse,
    same_batch,
)

# -- tensor parallel ----------------------------------------------------------------------------


class ForgetsTheBackwardAllReduce(ColumnParallelLinear):
    """Megatron's ``f`` as the identity both ways: the input's gradient stays partial."""

    def copy_to_parallel(self, x: torch.Tensor) -> torch.Tensor:
        return x


class CutsTheNextRanksRows(ColumnParallelLinear):
    def my_rows(self, features: int, rank: int, world: int) -> slice:
        return super().my_rows(features, (rank + 1) % world, world)


class WithoutTheBackwardAllReduce(TensorParallelMLP):
    column_class = ForgetsTheBackwardAllReduce


class WithTheNextRanksRows(TensorParallelMLP):
    column_class = CutsTheNextRanksRows


class BiasFromTheRanksOwnSeed(TensorParallelMLP):
    """The row-parallel layer's replicated bias is re-initialized from a per-rank generator
    (seeded per rank, as for dropout) and never broadcast."""

    def __init__(self, module: nn.Sequential, group: dist.ProcessGroup) -> None:
        super().__init__(module, group)
        generator = torch.Generator().manual_seed(1000 + dist.get_rank(group))
        with torch.no_grad():
            self.layers[4].bias.uniform_(-0.1, 0.1, generator=generator)


def _tensor_parallel(wrapper: type[TensorParallelMLP], group: dist.ProcessGroup, **kw):
    return check_parity(
        build_mlp,
        wrapper,
        same_batch,
        process_group=group,
        reference="local",
        loss_fn=mse,
        full_state=lambda model: model.full_state(),
        **kw,
    )


TENSOR_PARALLEL_BUGS = [
    pytest.param(
        WithoutTheBackwardAllReduce,
        "only the 2 parameters before 2.weight diverge (0.weight, 0.bias); 2.weight and the 5 "
        "after it match: the gradient reaching them is wrong: a missing all-reduce (or send) "
        "of the backward's gradient at the layer of 2.weight",
        id="missing-backward-all-reduce",
    ),
    pytest.param(
        WithTheNextRanksRows,
        "before step 1, rank 0's shard of 2.weight (rows 0-31) equals the reference's rows "
        "32-63; rank 1's (rows 32-63) equals rows 0-31: a shard taken from the wrong rank's "
        "slice",
        id="wrong-slice",
    ),
    pytest.param(
        BiasFromTheRanksOwnSeed,
        "before step 1 the ranks held different 4.bias (rank 1's differs from rank 0's by up to ",
        id="ranks-started-apart",
    ),
]


@pytest.mark.parametrize(("wrapper", "expected"), TENSOR_PARALLEL_BUGS)
@pytest.mark.distributed(world_size=2, mode="thread")
def test_a_planted_tensor_parallel_bug_is_the_first_likely_cause(wrapper, expected, process_group):
    message = failure_of(lambda: _tensor_parallel(wrapper, process_group))
    assert first_cause(message).startswith(expected), message


@pytest.mark.distributed(world_size=2, mode="thread")
def test_the_tensor_parallel_mlp_matches_one_process(process_group):
    _tensor_parallel(TensorParallelMLP, process_group)


@pytest.mark.distributed(world_size=2, mode="thread")
def test_without_the_backward_all_reduce_the_partial_sums_come_second(process_group):
    """Each rank's gradient of the layers before ``f`` is its partial sum; the ranks' sum is the
    reference's."""
    message = failure_of(lambda: _tensor_parallel(WithoutTheBackwardAllReduce, process_group))
    lines = message.splitlines()
    second = lines[lines.index("likely causes, first the strongest:") + 2].strip()
    assert second.startswith(
        "the ranks' gradients of 0.weight, 0.bias differ from each other but sum to the "
        "reference's (within "
    ), message
    assert second.endswith("gradients not all-reduced: each rank stepped on its partial sum "
                           "(e.g. a tensor-parallel input's gradient)")  # fmt: skip


# -- pipeline -----------------------------------------------------------------------------------


class ForgetsTheAccumulation(GPipe):
    """Divides each micro-batch loss by the micro-batches, not by ``accum_steps`` too."""

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss / 2


class NeverSendsTheGradient(GPipe):
    """Stage 1 keeps its input's gradient; stage 0 runs no backward."""

    def send_input_gradient(self, h: torch.Tensor) -> None:
        pass

    def receive_output_gradient(self, out: torch.Tensor) -> None:
        pass


def _pipeline(schedule: type[GPipe], group: dist.ProcessGroup, accum_steps: int = 1) -> None:
    pipe = schedule(group, accum_steps=accum_steps)
    check_parity(
        build_stages,
        None,
        same_batch,
        process_group=group,
        reference="local",
        loss_fn=mse,
        step_fn=pipe.step,
        full_state=pipe.full_state,
        accum_steps=accum_steps,
    )


# Pipeline tests run as processes: the thread backend has no CPU send/recv.
@pytest.mark.distributed(world_size=2)
def test_planted_pipeline_bugs_are_the_first_likely_cause(process_group):
    _pipeline(GPipe, process_group, accum_steps=3)
    assert first_cause(failure_of(lambda: _pipeline(ForgetsTheAccumulation, process_group, 3))) == (
        "every gradient is 3.000x the reference's (accum_steps 3): gradient accumulation not "
        "scaled (each of the 3 micro-batch losses must be divided by 3)"
    )
    message = failure_of(lambda: _pipeline(NeverSendsTheGradient, process_group))
    assert first_cause(message) == (
        "only the 2 parameters before 2.weight diverge (0.weight, 0.bias) and none of them "
        "moved; 2.weight and the 3 after it match: no gradient reached them: a missing "
        "all-reduce (or send) of the backward's gradient at the layer of 2.weight"
    )


# -- rounding at larger worlds ------------------------------------------------------------------


def _zero2_exact(group: dist.ProcessGroup) -> None:
    check_parity(
        build,
        lambda module, g: ZeRO2(module, g, optimizer=sgd),
        batch,
        process_group=group,
        reference="local",
        loss_fn=zero2_mse,
        make_optimizer=sgd,
        wrapped_optimizer=lambda model: model,
        exact=True,
    )


def _assert_rounding_names_none(group: dist.ProcessGroup) -> None:
    """Correct code, compared bitwise with one process: the sums run in another order, so
    ``exact`` fails in the last bits; no cause is claimed."""
    for check in (_zero2_exact, lambda g: _tensor_parallel(TensorParallelMLP, g, exact=True)):
        message = failure_of(lambda: check(group))  # noqa: B023 (called at once)
        assert "diverged from the reference" in message
        assert first_cause(message) == "none", message


@pytest.mark.distributed(world_size=[8, 16], mode="local")
def test_rounding_level_divergence_at_larger_worlds_names_no_cause(process_group):
    _assert_rounding_names_none(process_group)


@pytest.mark.slow
@pytest.mark.distributed(world_size=64, mode="local")
def test_rounding_level_divergence_at_64_ranks_names_no_cause(process_group):
    _assert_rounding_names_none(process_group)
