"""The FSDP wrapper: sharding layout, names, freeing, invariants, errors, events."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from fsdp_core import (
    FSDP,
    CPUOffload,
    MixedPrecision,
    ShardingStrategy,
    TrainingState,
    events,
)
from fsdp_core._unit import FSDPUnit
from fsdp_core.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy

from ._models import NestedModel, TiedTransformer, build, get_input, wrap_model


@pytest.mark.distributed(world_size=2)
def test_units_hold_padded_dim0_shards(rank, world_size, process_group):
    """The module exposes dim-0 shards under the original names; padding stays internal."""
    model = wrap_model("nested", build("nested", rank), process_group)
    full = dict(build("nested", rank).named_parameters())
    names = [n for n, _ in model.named_parameters()]
    assert names == list(full)  # original names, no _fsdp_wrapped_module
    for name, param in model.named_parameters():
        rows = full[name].shape[0]
        chunk = -(-rows // world_size)
        start = min(rank * chunk, rows)
        expected = full[name][start : min(start + chunk, rows)]
        assert torch.equal(param.to_local(), expected), name
    # inp.weight has 4 rows, inp.bias 4, out.weight 8; block.0.bias 16 ... and one odd case:
    assert isinstance(model.module, NestedModel)
    assert isinstance(model.module.block, FSDP) and isinstance(model.block, FSDP)  # __getattr__
    assert model._unit is not None and model.block._unit is not None
    assert [p.fqn for p in model._unit.params] == [
        "inp.weight",
        "inp.bias",
        "out.weight",
        "out.bias",
    ]


@pytest.mark.distributed(world_size=4)
def test_uneven_rows_are_padded(rank, process_group):
    """5 rows over 4 ranks: chunks of 2, 2, 1, 0 rows; gathers and reduces still match."""
    torch.manual_seed(0)
    lin = nn.Linear(3, 5)
    ref = nn.Linear(3, 5)
    ref.load_state_dict(lin.state_dict())
    model = FSDP(lin, process_group)
    assert model.module.weight.to_local().shape == ((2, 3), (2, 3), (1, 3), (0, 3))[rank]
    assert model.module.weight.shape == (5, 3)  # a DTensor shows the full shape
    x = torch.randn(2, 3)
    out = model(x)
    assert torch.equal(out, ref(x))
    out.sum().backward()
    ref(x).sum().backward()
    rows = ((0, 2), (2, 4), (4, 5), (5, 5))[rank]
    # Every rank used the same input, so the average gradient equals the local one.
    assert torch.equal(model.module.weight.grad.to_local(), ref.weight.grad[rows[0] : rows[1]])


@pytest.mark.distributed(world_size=2)
def test_unsharded_storage_is_freed(rank, process_group):
    """FULL_SHARD frees unsharded storage after forward (non-root) and after backward (all)."""
    model = wrap_model("nested", build("nested", rank), process_group)
    block_unit, root_unit = model.block._unit, model._unit
    out = model(get_input("nested", rank, 0))
    assert all(p.unsharded.untyped_storage().nbytes() == 0 for p in block_unit.params)
    assert root_unit.is_unsharded  # the root keeps its parameters for backward
    out.sum().backward()
    for unit in (block_unit, root_unit):
        assert not unit.is_unsharded
        assert all(p.unsharded.untyped_storage().nbytes() == 0 for p in unit.params)
        assert all(p.unsharded.grad is None for p in unit.params)
    assert all(p.grad is not None for p in model.parameters())
    assert {m.training_state for m in FSDP.fsdp_modules(model)} == {TrainingState.IDLE}


@pytest.mark.distributed(world_size=2)
def test_shard_grad_op_keeps_parameters_until_backward(rank, process_group):
    model = wrap_model(
        "nested",
        build("nested", rank),
        process_group,
        sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,
    )
    out = model(get_input("nested", rank, 0))
    assert model.block._unit.is_unsharded
    out.sum().backward()
    assert not model.block._unit.is_unsharded
    with torch.no_grad():  # no backward follows: everything is resharded after forward
        model(get_input("nested", rank, 1))
    assert not model.block._unit.is_unsharded and not model._unit.is_unsharded


@pytest.mark.distributed(world_size=2)
def test_frozen_parameters_get_no_gradient(rank, process_group):
    """requires_grad=False parameters stay frozen, unreduced and unchanged."""
    model = wrap_model("frozen", build("frozen", rank), process_group)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        model(get_input("nested", rank, step)).sum().backward()
        optim.step()
    for name, param in model.named_parameters():
        frozen = name.startswith("inp.") or name == "block.0.bias"
        assert param.requires_grad is not frozen, name
        assert (param.grad is None) is frozen, name
        assert torch.equal(param, before[name]) is frozen, name


@pytest.mark.distributed(world_size=2)
def test_tied_parameters_stay_tied(rank, process_group):
    """The embedding and projection share one sharded parameter and one gradient."""
    model = wrap_model("transformer", build("transformer", rank), process_group)
    inner = model.module
    assert inner.embed.weight is inner.proj.weight
    names = [n for n, _ in model.named_parameters()]
    assert "embed.weight" in names and "proj.weight" not in names  # deduplicated like nn.Module
    model(get_input("transformer", rank, 0)).sum().backward()
    assert inner.embed.weight is inner.proj.weight and inner.embed.weight.grad is not None


@pytest.mark.distributed(world_size=2)
def test_shared_parameter_across_units_is_rejected(rank, process_group):
    """A tied parameter split between a nested unit and its parent is a clear error."""
    model = TiedTransformer()
    policy = ModuleWrapPolicy({nn.Embedding})
    with pytest.raises(ValueError, match=r"\['proj.weight'\] are shared between a nested"):
        FSDP(model, process_group, auto_wrap_policy=policy)


@pytest.mark.distributed(world_size=2)
def test_idle_check_catches_a_unit_left_unsharded(rank, process_group):
    """If a unit is not resharded by the end of backward, the step fails with [rank N]."""
    model = wrap_model("nested", build("nested", rank), process_group)
    original = FSDPUnit.reshard
    FSDPUnit.reshard = lambda self, reason="explicit": None  # type: ignore[method-assign]
    try:
        out = model(get_input("nested", rank, 0))
        with pytest.raises(AssertionError, match=rf"\[rank {rank}\] .* is not idle after"):
            out.sum().backward()
    finally:
        FSDPUnit.reshard = original  # type: ignore[method-assign]


@pytest.mark.distributed(world_size=2)
def test_unit_methods_are_patchable_by_name(rank, process_group):
    """unshard/reshard/post_backward are looked up on the class at each call."""
    calls: list[str] = []
    originals = {n: getattr(FSDPUnit, n) for n in ("unshard", "reshard", "post_backward")}

    def spy(name):
        def method(self, *args, **kwargs):
            calls.append(f"{name} {self.name}")
            return originals[name](self, *args, **kwargs)

        return method

    model = wrap_model("nested", build("nested", rank), process_group)
    for name in originals:
        setattr(FSDPUnit, name, spy(name))
    try:
        model(get_input("nested", rank, 0)).sum().backward()
    finally:
        for name, original in originals.items():
            setattr(FSDPUnit, name, original)
    assert calls[:3] == ["unshard ", "unshard block", "reshard block"]
    assert "post_backward block" in calls and "post_backward " in calls


@pytest.mark.distributed(world_size=2)
def test_fsdp_modules_and_root(rank, process_group):
    policy = functools.partial(size_based_auto_wrap_policy, min_num_params=0)
    model = FSDP(build("nested", rank), process_group, auto_wrap_policy=policy)
    everything = FSDP.fsdp_modules(model)
    assert everything[0] is model and len(everything) > 1
    assert FSDP.fsdp_modules(model, root_only=True) == [model]
    inner = model.module
    top = [inner.inp, inner.block, inner.out]  # block holds 3 more (min_num_params=0: ReLU too)
    assert all(isinstance(m, FSDP) for m in top) and len(everything) == 7
    assert FSDP.fsdp_modules(inner, root_only=True) == top
    model(get_input("nested", rank, 0)).sum().backward()
    states = [m._fsdp_state for m in everything]
    assert [s.is_root for s in states] == [True] + [False] * (len(states) - 1)
    assert model._fsdp_state.all_states == states  # the cached traversal on the root


@pytest.mark.distributed(world_size=2)
def test_errors_name_the_option_and_the_fix(rank, process_group):
    lin = nn.Linear(2, 2)
    for strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2):
        # One group where a hybrid strategy needs two (tests/core/test_hybrid.py: the rest).
        with pytest.raises(ValueError, match=r"takes process_group=\(shard_group, replicate"):
            FSDP(lin, process_group, sharding_strategy=strategy)
    with pytest.raises(TypeError, match=r"mixed_precision takes a MixedPrecision"):
        FSDP(lin, process_group, mixed_precision=torch.float16)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"cpu_offload takes a CPUOffload"):
        FSDP(lin, process_group, cpu_offload=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"MixedPrecision\(param_dtype=torch.int32\) must be a"):
        MixedPrecision(param_dtype=torch.int32)
    with pytest.raises(TypeError, match=r"MixedPrecision\(cast_forward_inputs=...\) takes a bool"):
        MixedPrecision(cast_forward_inputs=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="sharding_strategy takes a ShardingStrategy"):
        FSDP(lin, process_group, sharding_strategy="FULL_SHARD")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="backward_prefetch takes a BackwardPrefetch"):
        FSDP(lin, process_group, backward_prefetch="pre")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"FullyShardedDataParallel wraps an nn.Module"):
        FSDP(object(), process_group)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="already wrapped"):
        FSDP(FSDP(nn.Linear(2, 2), process_group), process_group)
    scalar = nn.Module()
    scalar.scale = nn.Parameter(torch.tensor(2.0))
    with pytest.raises(ValueError, match=r"scalar parameters \['scale'\].*1D tensor"):
        FSDP(scalar, process_group)
    with pytest.raises(TypeError, match=r"ModuleWrapPolicy.*nn.Module subclasses"):
        ModuleWrapPolicy({"Linear"})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"CPUOffload.*takes a bool"):
        CPUOffload(offload_params="yes")  # type: ignore[arg-type]
    # CPUOffload() (no offload) is accepted.
    assert FSDP(nn.Linear(2, 2), process_group, cpu_offload=CPUOffload()).cpu_offload == (
        CPUOffload()
    )


def test_events_subscribe_and_remove():
    """Subscribers receive published events until removed; none means no work."""
    assert not events.has_subscribers()
    seen: list[events.Event] = []
    handle = events.subscribe(seen.append)
    assert events.has_subscribers()
    event = events.Reshard(unit="a", reason="explicit", devices=("cpu",), rank=0)
    events.publish(event)
    handle.remove()
    handle.remove()  # idempotent
    events.publish(event)
    assert seen == [event] and not events.has_subscribers()
    with pytest.raises(TypeError, match="takes a callable"):
        events.subscribe("not callable")  # type: ignore[arg-type]


@pytest.mark.distributed(world_size=2, mode="thread")
def test_enable_wrap_is_per_thread_rank(rank, process_group):
    """Thread ranks inside ``enable_wrap`` at the same time each wrap with their own arguments.

    Both ranks enter before either wraps, so a context shared between threads would hand one
    rank the other's process group (the failure this pins down).
    """
    import torch.distributed as dist

    from fsdp_core.wrap import enable_wrap, wrap

    def record(module: nn.Module, **kwargs: object) -> nn.Module:
        module.wrapped_with = kwargs  # type: ignore[assignment]
        return module

    with enable_wrap(wrapper_cls=record, process_group=process_group, tag=rank):
        dist.barrier(process_group)
        inner = wrap(nn.Linear(2, 2))
        dist.barrier(process_group)
    assert inner.wrapped_with == {"process_group": process_group, "tag": rank}
    assert wrap(nn.Linear(2, 2)).__dict__.get("wrapped_with") is None
