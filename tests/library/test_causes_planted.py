"""Planted bugs in the ZeRO-2 example wrapper and in fsdp_core: the first line of the report's
likely-cause section names each one; the correct code they were planted in passes. The
tensor-parallel and pipeline bugs are ``test_causes_parallel.py``; the analysis on synthetic
numbers is ``test_causes.py``."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecision

import fsdp_core._unit_grads as unit_grads
from examples.zero2_wrapper import ZeRO2, _collective, batch, build, mse, sgd
from fsdp_core import fully_shard
from fsdp_core._param import ShardedParam
from fsdp_testing.models import DEVICEInitMode, FSDPInitMode, MLPStack, NestedWrappedModule
from fsdp_testing.parity import check_fsdp_parity, check_parity, check_sharded_parity
from fsdp_testing.patching import patch_reduce_scatter

from ._failures import failure_of, first_cause

# -- planted in the ZeRO-2 example --------------------------------------------------------------


class Sums(ZeRO2):
    """Reduce-scatters the gradients without dividing them by the world size."""

    def average(self, flat_grad: torch.Tensor) -> torch.Tensor:
        return flat_grad


class AveragesTwice(ZeRO2):
    """Divides by the world size, and then again."""

    def average(self, flat_grad: torch.Tensor) -> torch.Tensor:
        return flat_grad.div_(self.world_size).div_(self.world_size)


class TakesTheNextRanksSlice(ZeRO2):
    """Its optimizer's slice of the parameters is cut from the next rank's range."""

    def __init__(self, module: torch.nn.Module, group: Any = None, **options: Any) -> None:
        super().__init__(module, group, **options)
        flat = self._flatten([p.detach() for p in self.params])
        other = (self.rank + 1) % self.world_size
        with torch.no_grad():
            self.shard.copy_(flat[other * self.shard_numel : (other + 1) * self.shard_numel])


class FrozenWhileWrapped(ZeRO2):
    """``2.weight`` was frozen while the wrapper listed its parameters, unfrozen afterwards:
    it gets gradients that nothing reduces or steps."""

    def __init__(self, module: torch.nn.Module, group: Any = None, **options: Any) -> None:
        module[2].weight.requires_grad_(False)
        super().__init__(module, group, **options)
        module[2].weight.requires_grad_(True)


class ReducesInBf16(ZeRO2):
    """Casts the flat gradient to bf16 for the reduce-scatter (half the bytes on the wire)."""

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        flat = self.average(self._flatten([p.grad for p in self.params])).bfloat16()  # type: ignore[misc]
        reduced = torch.empty(self.shard.shape, dtype=torch.bfloat16)
        _collective("reduce_scatter")(reduced, flat, group=self.group)
        self.shard.grad = reduced.float()
        for param in self.params:
            param.grad = None


class GathersToRankZero(ZeRO2):
    """Gathers the updated slices on rank 0 only: every other rank keeps its own slice
    updated and the rest as they were."""

    @torch.no_grad()
    def step(self) -> None:
        self.optimizer.step()
        full = self._flatten([p.detach() for p in self.params])
        mine = slice(self.rank * self.shard_numel, (self.rank + 1) * self.shard_numel)
        full[mine] = self.shard.detach()
        slices = list(full.chunk(self.world_size)) if self.rank == 0 else None
        root = dist.get_global_rank(self.group, 0)
        dist.gather(self.shard.detach().clone(), gather_list=slices, dst=root, group=self.group)
        offset = 0
        for param in self.params:
            param.copy_(full[offset : offset + param.numel()].view_as(param))
            offset += param.numel()


#: Clip the gradients' largest element to this (inf-norm clipping): the batches of steps 1
#: and 2 stay below it, step 3's are 10 times larger and are clipped.
MAX_NORM = 1.0


def growing_batch(i: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    inputs, targets = batch(i, rank)
    scale = 1.0 if i < 2 else 10.0
    return inputs * scale, targets * scale


class ClippedSGD(torch.optim.SGD):
    """The reference's optimizer: inf-norm clipping of the full gradients, then ``sgd``'s
    step."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, lr=0.05, momentum=0.9)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM, norm_type=float("inf"))
        return super().step(closure)


class ClipsByTheGlobalMax(ZeRO2):
    """Inf-norm clipping on sharded gradients: each rank's largest element, MAX all-reduced."""

    def agree(self, largest: torch.Tensor) -> None:
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=self.group)

    @torch.no_grad()
    def step(self) -> None:
        assert self.shard.grad is not None
        largest = self.shard.grad.abs().max()
        self.agree(largest)
        self.shard.grad.mul_(torch.clamp(MAX_NORM / (largest + 1e-6), max=1.0))
        super().step()


class ClipsByItsOwnSlice(ClipsByTheGlobalMax):
    """The MAX all-reduce dropped: each rank clips by its own slice's largest element."""

    def agree(self, largest: torch.Tensor) -> None:
        pass


def _zero2(wrapper: type[ZeRO2], get_batch: Any = batch, make_optimizer: Any = sgd, **kw: Any):
    return lambda group: check_parity(
        build,
        lambda module, g: wrapper(module, g, optimizer=sgd),
        get_batch,
        process_group=group,
        loss_fn=mse,
        make_optimizer=make_optimizer,
        wrapped_optimizer=lambda model: model,
        **kw,
    )


ZERO2_BUGS = [
    pytest.param(
        _zero2(Sums),
        "every gradient is 2.000x the reference's (world size 2): gradients summed, not averaged",
        id="summed",
    ),
    pytest.param(
        _zero2(AveragesTwice),
        "every gradient is 0.500x the reference's (1/2, world size 2): gradients divided by "
        "the world size twice",
        id="divided-twice",
    ),
    pytest.param(
        _zero2(TakesTheNextRanksSlice),
        "at step 1, rank 0's slice of the flat parameters (elements 0-403) stepped from the "
        "reference's elements 404-807; rank 1's (elements 404-807) stepped from elements "
        "0-403: a shard taken from the wrong rank's slice",
        id="wrong-slice",
    ),
    pytest.param(
        _zero2(FrozenWhileWrapped),
        "2.weight kept its value through step 1 while the reference's moved by up to "
        "6.545e-03: a parameter the optimizer never steps",
        id="never-stepped",
    ),
    pytest.param(
        _zero2(ReducesInBf16),
        "the gradients applied lie on the bf16 grid (100% of",
        id="bf16-reduction",
    ),
    pytest.param(
        _zero2(ClipsByItsOwnSlice, growing_batch, ClippedSGD),
        "each rank's slice of the gradient (flat elements) scales by its own constant: "
        "elements 0-403 (rank 0) ",
        id="max-all-reduce-dropped",
    ),
    pytest.param(
        _zero2(GathersToRankZero),
        "only rank 1 diverges (0.weight); rank 0 matches the reference: a result that "
        "reached only some ranks",
        id="gather-to-rank-0",
    ),
]


@pytest.mark.parametrize(("check", "expected"), ZERO2_BUGS)
@pytest.mark.distributed(world_size=2, mode="thread")
def test_a_planted_zero2_bug_is_the_first_likely_cause(check, expected, process_group):
    message = failure_of(lambda: check(process_group))
    assert first_cause(message).startswith(expected), message
    assert "diverging tensors:\n  " in message or "of the group diverged" in message  # raw first


@pytest.mark.distributed(world_size=2, mode="thread")
def test_the_clipping_wrapper_with_its_max_all_reduce_passes_and_fails_only_on_large_inputs(
    process_group,
):
    _zero2(ClipsByTheGlobalMax, growing_batch, ClippedSGD)(process_group)
    message = failure_of(
        lambda: _zero2(ClipsByItsOwnSlice, growing_batch, ClippedSGD)(process_group)
    )
    assert "at step 3 of 3" in message  # steps 1 and 2 (small inputs) matched
    assert "1.000x" in first_cause(message)  # the slice with the largest element: unchanged


# -- planted in fsdp_core -----------------------------------------------------------------------


def _nested(group: dist.ProcessGroup, **options: Any) -> None:
    check_fsdp_parity(
        NestedWrappedModule,
        FSDPInitMode.RECURSIVE,
        DEVICEInitMode.DEVICE_BEFORE,
        process_group=group,
        engine="fsdp_core",
        **options,
    )


# The planted bugs patch fsdp_core inside the body, with MonkeyPatch.context(): the
# ``monkeypatch`` fixture's patches are not undone on process-mode ranks today (a patch of
# ShardedParam leaked into the next test on the same warm rank).


@pytest.mark.distributed(world_size=2)
def test_fsdp_core_summing_its_gradients_is_named(process_group):
    """The unit writes its reduce-scatter input without the division by the world size."""
    write = unit_grads.write_grad_rows
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(unit_grads, "write_grad_rows", lambda p, g, out, div: write(p, g, out, 1))
        message = failure_of(lambda: _nested(process_group))
    assert first_cause(message) == (
        "every gradient is 2.000x the reference's (world size 2): gradients summed, not averaged"
    )


@pytest.mark.distributed(world_size=2)
def test_fsdp_core_sharding_the_next_ranks_rows_is_named(process_group):
    """Each rank's shard is cut from the next rank's rows; the all-gather puts it back in rank
    order, so the full parameters start with their row blocks swapped."""

    def next_ranks_rows(self: ShardedParam, full: torch.Tensor) -> torch.Tensor:
        other = (self.start_row // self.chunk_rows + 1) % self.shard_world
        return full.narrow(self.shard_dim, other * self.chunk_rows, self.valid_rows)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ShardedParam, "_my_rows", next_ranks_rows)
        message = failure_of(lambda: _nested(process_group))
    assert first_cause(message) == (
        "before step 1, rank 0's shard of module.0.weight (rows 0-1) equals the reference's "
        "rows 2-3; rank 1's (rows 2-3) equals rows 0-1: a shard taken from the wrong rank's "
        "slice"
    )


BF16_COMPUTE = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


@pytest.mark.distributed(world_size=2)
def test_fsdp_core_reducing_in_bf16_where_fp32_was_asked_is_named(process_group):
    def rounded_to_bf16(output: torch.Tensor, input: torch.Tensor, **kwargs: Any) -> Any:
        work = call_next(output, input, **kwargs)
        output.copy_(output.to(torch.bfloat16))
        return work

    with patch_reduce_scatter(rounded_to_bf16) as call_next:
        message = failure_of(lambda: _nested(process_group, mixed_precision=BF16_COMPUTE))
    cause = first_cause(message)
    assert cause.startswith("the gradients applied lie on the bf16 grid (100% of"), message
    assert cause.endswith(
        "a reduction in bf16 (cast to bf16 before the all-reduce or reduce-scatter)"
    )


@pytest.mark.distributed(world_size=4, mode="thread")
def test_bf16_rounding_that_both_sides_do_names_no_cause(process_group):
    """Reducing in bf16 on both sides (the policy asks for it) at world size 4: the sums'
    order differs, so ``exact`` fails at bf16's rounding scale, which is no bug."""
    policy = MixedPrecision(param_dtype=torch.bfloat16)
    message = failure_of(lambda: _nested(process_group, mixed_precision=policy, exact=True))
    assert first_cause(message) == "none", message


# -- check_sharded_parity -----------------------------------------------------------------------


def _sharded_mlp() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    reference = MLPStack(8)
    model = copy.deepcopy(reference)
    for block in model:
        fully_shard(block)
    fully_shard(model)
    return reference, model


@pytest.mark.distributed(world_size=2)
def test_check_sharded_parity_names_a_shard_cut_from_another_ranks_rows(rank, process_group):
    reference, model = _sharded_mlp()
    name, param = next(iter(model.named_parameters()))
    full = dict(reference.named_parameters())[name].detach()
    rows = full.shape[0] // 2
    other = 1 - rank
    with torch.no_grad():
        param.to_local().copy_(full[other * rows : (other + 1) * rows])
    expected = ["rows 12-23", "rows 0-11"]
    assert first_cause(failure_of(lambda: check_sharded_parity(reference, model))) == (
        f"rank {rank}'s shard of 0.in_proj.weight equals the reference's {expected[rank]}, "
        f"expected {expected[other]}: a shard taken from the wrong rank's slice"
    )


@pytest.mark.distributed(world_size=4)
def test_check_sharded_parity_on_a_sub_mesh_names_the_rank_and_its_coordinate(rank):
    """Sharded on the dp dim of a 2 x 2 (rep, dp) mesh: rank 3 is dp coordinate 1."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "dp"))
    torch.manual_seed(0)
    reference = MLPStack(8)
    model = copy.deepcopy(reference)
    for block in model:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    name, param = next(iter(model.named_parameters()))
    full = dict(reference.named_parameters())[name].detach()
    rows, mine = full.shape[0] // 2, mesh.get_local_rank("dp")
    other = 1 - mine
    with torch.no_grad():
        param.to_local().copy_(full[other * rows : (other + 1) * rows])
    expected = ["rows 0-11", "rows 12-23"]
    assert first_cause(failure_of(lambda: check_sharded_parity(reference, model))) == (
        f"rank {rank} (dp={mine})'s shard of 0.in_proj.weight equals the reference's "
        f"{expected[other]}, expected {expected[mine]}: a shard taken from the wrong rank's slice"
    )


@pytest.mark.distributed(world_size=2)
def test_check_sharded_parity_names_gradients_summed_by_a_divide_factor_of_one(rank, process_group):
    """``set_gradient_divide_factor(1.0)`` on every unit: each reduces to the plain sum."""
    reference, model = _sharded_mlp()
    for module in model.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(1.0)
    model(torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))).sum().backward()
    everyone = [torch.randn(4, 8, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    (reference(torch.cat(everyone)).sum() / 2).backward()
    assert first_cause(failure_of(lambda: check_sharded_parity(reference, model))) == (
        "every gradient is 2.000x the reference's (world size 2): gradients summed, not averaged"
    )


@pytest.mark.distributed(world_size=2)
def test_an_analysis_that_fails_on_one_rank_hides_nothing_and_blocks_no_one(rank, process_group):
    import fsdp_testing.parity._explain as explain_module

    facts_of = explain_module.rank_facts

    def fails_on_rank_1(evidence: Any, **kw: Any) -> Any:
        if evidence.rank == 1:
            raise RuntimeError("planted")
        return facts_of(evidence, **kw)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(explain_module, "rank_facts", fails_on_rank_1)
        message = failure_of(lambda: _zero2(Sums)(process_group))
    assert "diverging tensors:\n  2.bias: max abs diff" in message
    if rank == 1:
        assert message.endswith(
            "likely cause: the analysis failed (RuntimeError: planted); the divergence above stands"
        )
    else:  # its own numbers still speak
        assert first_cause(message).startswith("every gradient is 2.000x the reference's")
