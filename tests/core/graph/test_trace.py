"""trace_train_step on reference models sharded by fsdp_core's ``fully_shard`` at world size 2
(gloo): losses and sharded gradients equal eager ``fully_shard`` bitwise with no pass, each pass
alone and all passes; a model sharded by torch's FSDP2 traces to the same step."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from fsdp_core import MixedPrecisionPolicy, events, fully_shard, replicate
from fsdp_core.graph import _meta, peak_memory, trace_train_step
from fsdp_core.graph.passes import (
    bucket_all_gathers,
    bucket_reduce_scatters,
    prefetch,
    reshard_after_forward,
)
from fsdp_testing.models import DEVICEInitMode, MLPStack, TransformerWithSharedParams

BIG = 1 << 30
PASSES: dict[str, tuple] = {
    "none": (),
    "reshard": (reshard_after_forward,),
    "bucket_ag": (functools.partial(bucket_all_gathers, bucket_bytes=BIG),),
    "bucket_rs": (functools.partial(bucket_reduce_scatters, bucket_bytes=BIG),),
    "prefetch": (prefetch,),
    "all": (
        reshard_after_forward,
        functools.partial(bucket_all_gathers, bucket_bytes=BIG),
        functools.partial(bucket_reduce_scatters, bucket_bytes=BIG),
        functools.partial(prefetch, depth=1),
    ),
}


def _mlp_stack(mesh: DeviceMesh, rank: int, shard: Callable = fully_shard) -> tuple:
    torch.manual_seed(0)
    model = MLPStack(8)
    for block in model:
        shard(block, mesh=mesh)
    shard(model, mesh=mesh)
    torch.manual_seed(1 + rank)
    return model, lambda m, x: m(x).square().sum(), (torch.randn(4, 8),)


def _transformer(mesh: DeviceMesh, rank: int) -> tuple[nn.Module, Callable, tuple]:
    model = TransformerWithSharedParams(mesh.get_group(), DEVICEInitMode.DEVICE_NEVER, False, True)
    for layer in [*model.transformer.encoder.layers, *model.transformer.decoder.layers]:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    batch = model.get_input(torch.device("cpu"))
    return model, lambda m, *b: m.get_loss(b, m(*b)), batch


MODELS = {"MLPStack": _mlp_stack, "TransformerWithSharedParams": _transformer}


def _local(grad: torch.Tensor | None) -> torch.Tensor:
    if not isinstance(grad, DTensor):
        raise AssertionError(f"expected a DTensor gradient, got {type(grad).__name__}")
    return grad.to_local()


def _local_grads(model: nn.Module) -> list[torch.Tensor]:
    return [_local(p.grad).clone() for p in model.parameters()]


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("model_name", list(MODELS))
def test_graph_step_equals_eager_fully_shard_bitwise(rank, process_group, model_name) -> None:
    mesh = DeviceMesh.from_group(process_group, "cpu")
    eager, loss_fn, batch = MODELS[model_name](mesh, rank)
    traced, _, _ = MODELS[model_name](mesh, rank)
    expected = loss_fn(eager, *batch)
    expected.backward()
    step = trace_train_step(traced, loss_fn, batch)
    for name, passes in PASSES.items():
        for param in traced.parameters():
            param.grad = None
        loss = step.with_passes(*passes)(*batch)
        assert torch.equal(loss, expected.detach()), name
        for (fqn, want), have in zip(eager.named_parameters(), traced.parameters(), strict=True):
            assert have.grad is not None, (name, fqn)
            assert torch.equal(_local(want.grad), _local(have.grad)), (name, fqn)
    # Observed (events subscribed: collectives through torch.distributed, see [Note: observed
    # graph runs]), the step is the same bitwise.
    observed = _local_grads(traced)
    for param in traced.parameters():
        param.grad = None
    seen: list[events.Event] = []
    with events.subscribe(seen.append):
        loss = step.with_passes(*PASSES["all"])(*batch)
    assert torch.equal(loss, expected.detach())
    assert all(torch.equal(a, b) for a, b in zip(observed, _local_grads(traced), strict=True))
    assert any(isinstance(e, events.Collective) for e in seen)
    # A second step accumulates into .grad, as eager does.
    loss_fn(eager, *batch).backward()
    step(*batch)
    for want, have in zip(eager.parameters(), traced.parameters(), strict=True):
        assert torch.equal(_local(want.grad), _local(have.grad))


@pytest.mark.distributed(world_size=2)
def test_torch_fsdp2_sharded_model_traces_to_the_same_step(rank, process_group) -> None:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = DeviceMesh.from_group(process_group, "cpu")
    ours, loss_fn, batch = _mlp_stack(mesh, rank)
    theirs, _, _ = _mlp_stack(mesh, rank, torch_fully_shard)
    loss = trace_train_step(ours, loss_fn, batch)(*batch)
    assert torch.equal(trace_train_step(theirs, loss_fn, batch)(*batch), loss)
    for mine, other in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(_local(mine.grad), _local(other.grad))


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("door", ["fsdp_core", "torch"])
def test_user_hooks_run_while_tracing_and_are_part_of_the_step(rank, process_group, door):
    """The door's forward hooks are off while tracing, the user's are not: a forward pre-hook
    and a forward hook that change a block's input and output are traced into the step, which
    then equals eager mode with the same hooks; afterwards the door's hooks work again."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = DeviceMesh.from_group(process_group, "cpu")
    shard = fully_shard if door == "fsdp_core" else torch_fully_shard
    calls: list[str] = []

    def build() -> tuple[nn.Module, Callable, tuple]:
        model, loss_fn, batch = _mlp_stack(mesh, rank, shard)
        model[1].register_forward_pre_hook(lambda m, args: (args[0] * 2,))
        model[1].register_forward_hook(lambda m, args, out: calls.append("post") or out + 1)
        return model, loss_fn, batch

    eager, loss_fn, batch = build()
    traced, _, _ = build()
    expected = loss_fn(eager, *batch)
    expected.backward()
    calls.clear()
    step = trace_train_step(traced, loss_fn, batch)
    assert calls == ["post"]  # ran once, while tracing
    assert torch.equal(step(*batch), expected.detach())
    assert calls == ["post"]  # a Python side effect is not part of the graph
    for want, have in zip(eager.parameters(), traced.parameters(), strict=True):
        assert torch.equal(_local(want.grad), _local(have.grad))
    # The door's own hooks are back: an eager step gathers and reduces as before.
    for param in traced.parameters():
        param.grad = None
    assert torch.equal(loss_fn(traced, *batch), expected.detach())


@pytest.mark.distributed(world_size=2)
def test_a_torch_unit_of_several_modules_is_refused_by_name(rank, process_group) -> None:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = DeviceMesh.from_group(process_group, "cpu")
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    torch_fully_shard([model[0], model[1]], mesh=mesh)
    torch_fully_shard(model, mesh=mesh)
    with pytest.raises(NotImplementedError, match=r"torch's FSDP2 forward hooks of units \['0'"):
        trace_train_step(model, lambda m, x: m(x).sum(), (torch.randn(2, 4),))
    model(torch.randn(2, 4)).sum().backward()  # its hooks were left as they were


class _Blocks(nn.Sequential):
    def __init__(self, count: int, dim: int, *, bias: bool = True) -> None:
        super().__init__(
            *[nn.Sequential(nn.Linear(dim, dim, bias=bias), nn.Tanh()) for _ in range(count)]
        )


@pytest.mark.distributed(world_size=2)
def test_reshard_after_forward_gathers_twice_and_lowers_the_peak(rank, process_group) -> None:
    mesh = DeviceMesh.from_group(process_group, "cpu")
    blocks, dim = 6, 32
    torch.manual_seed(0)
    # Bias-free: a bias is never read by backward, so it dies after forward with or without
    # the pass; every parameter here is one the pass frees.
    model = _Blocks(blocks, dim, bias=False)
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    step = trace_train_step(model, lambda m, x: m(x).sum(), (torch.randn(64, dim),))
    resharded = step.with_passes(reshard_after_forward)
    gathers: dict[str, int] = {}
    for node in resharded.gm.graph.nodes:
        if _meta.is_all_gather(node):
            gathers[_meta.unit_of(node) or ""] = gathers.get(_meta.unit_of(node) or "", 0) + 1
    # Block 0's backward reads no parameter of its own (the batch needs no gradient, so only
    # dW0 = dy^T x is computed): nothing to gather again. Every later block is gathered twice.
    assert gathers == {"0": 1, **{str(i): 2 for i in range(1, blocks)}}
    assert resharded.gathers_per_unit() == gathers
    assert step.gathers_per_unit() == {str(i): 1 for i in range(blocks)}
    assert [unit.fqn for unit in resharded.units] == [str(i) for i in range(blocks)]
    unit_bytes = dim * dim * 4
    before, _ = peak_memory(step.gm)
    after, _ = peak_memory(resharded.gm)
    assert before - after >= (blocks - 2) * unit_bytes


@pytest.mark.distributed(world_size=2)
def test_bucketing_two_units_halves_the_collectives(rank, process_group) -> None:
    mesh = DeviceMesh.from_group(process_group, "cpu")
    torch.manual_seed(0)
    model = _Blocks(5, 8)
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    step = trace_train_step(model, lambda m, x: m(x).sum(), (torch.randn(4, 8),))
    unit = (8 * 8 + 8) * 4 + 4 * 2 * 2  # full weight + bias, bias padded to an even row count
    bucketed = step.with_passes(
        functools.partial(bucket_all_gathers, bucket_bytes=2 * unit),
        functools.partial(bucket_reduce_scatters, bucket_bytes=2 * unit),
    )
    count = lambda gm, target: sum(1 for n in gm.graph.nodes if n.target is target)  # noqa: E731
    assert count(step.gm, _meta.ALL_GATHER) == count(step.gm, _meta.REDUCE_SCATTER) == 5
    assert count(bucketed.gm, _meta.ALL_GATHER) == count(bucketed.gm, _meta.REDUCE_SCATTER) == 3
    batch = (torch.randn(4, 8),)
    assert torch.equal(step(*batch), bucketed(*batch))


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        return y if y.sum() > 0 else -y


@pytest.mark.distributed(world_size=2)
def test_clear_errors_for_what_cannot_be_traced(rank, process_group) -> None:
    mesh = DeviceMesh.from_group(process_group, "cpu")
    with pytest.raises(ValueError, match=r"not fully sharded.*Call fully_shard"):
        trace_train_step(nn.Linear(2, 2), lambda m, x: m(x).sum(), (torch.randn(1, 2),))
    model = nn.Sequential(_Branchy())
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    with pytest.raises(
        NotImplementedError, match=r"depend on tensor values in module '0' \((FSDP)?_Branchy\)"
    ):
        trace_train_step(model, lambda m, x: m(x).sum(), (torch.randn(2, 4),))
    with pytest.raises(TypeError, match=r"example_batch=...\) must be a tuple of tensors"):
        trace_train_step(model, lambda m, x: m(x).sum(), [torch.randn(2, 4)])  # type: ignore[arg-type,unused-ignore]
    mixed = nn.Sequential(nn.Linear(4, 4))
    fully_shard(mixed[0], mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    fully_shard(mixed, mesh=mesh)
    with pytest.raises(NotImplementedError, match=r"mixed precision.*\['0 \(mp_policy\)'\]"):
        trace_train_step(mixed, lambda m, x: m(x).sum(), (torch.randn(2, 4),))
    replicated = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    replicate(replicated[0], mesh=mesh)
    fully_shard(replicated, mesh=mesh)
    with pytest.raises(
        NotImplementedError, match=r"hybrid sharding or replicate.*'0 \(replicate\)'"
    ):
        trace_train_step(replicated, lambda m, x: m(x).sum(), (torch.randn(2, 4),))
    two_dtypes = nn.Sequential(nn.Linear(4, 4))
    two_dtypes[0].register_parameter(
        "table", nn.Parameter(torch.ones(4, dtype=torch.float16), requires_grad=False)
    )
    fully_shard(two_dtypes, mesh=mesh)
    with pytest.raises(
        NotImplementedError, match=r"unit '<root>' holds parameters of several dtypes \['float16'"
    ):
        trace_train_step(two_dtypes, lambda m, x: m(x).sum(), (torch.randn(2, 4),))


@pytest.mark.distributed(world_size=4)
def test_a_two_dimensional_mesh_is_not_traced_yet(rank, process_group) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    with pytest.raises(NotImplementedError, match=r"\['<root> \(2-D mesh\)', '0 \(2-D mesh\)'\]"):
        trace_train_step(model, lambda m, x: m(x).sum(), (torch.randn(2, 4),))
