"""CPU offload and mixed precision: copies, devices, dtypes in flight, buffers, input casts."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from fsdp_core import FSDP, CPUOffload, MixedPrecision, ShardingStrategy, events

from ._models import build, get_input, wrap_model
from ._parity import assert_same_losses, train

BF16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


@contextlib.contextmanager
def _recording() -> Iterator[list[events.Event]]:
    seen: list[events.Event] = []
    with events.subscribe(seen.append):
        yield seen


def _units(model: nn.Module) -> list:
    return [m._unit for m in FSDP.fsdp_modules(model) if m._unit is not None]


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("strategy", [ShardingStrategy.FULL_SHARD, ShardingStrategy.NO_SHARD])
def test_cpu_offload_copies_every_gather_and_reduction(rank, process_group, strategy):
    """One to_device copy of the flat shard per unshard, one to_host copy of the reduced
    gradient per reduction; shards and gradients stay on the CPU, unpinned without CUDA."""
    model = wrap_model(
        "nested",
        build("nested", rank),
        process_group,
        sharding_strategy=strategy,
        cpu_offload=CPUOffload(offload_params=True),
    )
    with _recording() as seen:
        out = model(get_input("nested", rank, 0))
        assert all(p.device.type == "cpu" for p in model.parameters())
        out.sum().backward()
    units = {u.name: u for u in _units(model)}  # named by FQN at the first forward
    mine = [e for e in seen if e.rank == rank]
    copies = [e for e in mine if isinstance(e, events.OffloadCopy)]
    unshards = Counter(e.unit for e in mine if isinstance(e, events.Unshard))
    reductions = Counter(
        e.unit
        for e in mine
        if isinstance(e, events.Collective) and e.op.startswith(("reduce", "all_r"))
    )
    to_device = Counter(e.unit for e in copies if e.direction == "to_device")
    to_host = Counter(e.unit for e in copies if e.direction == "to_host")
    assert to_device == unshards
    # FULL_SHARD gathers the non-root unit again for backward; NO_SHARD keeps it.
    assert unshards["block"] == (2 if strategy is ShardingStrategy.FULL_SHARD else 1)
    assert to_host == Counter(dict.fromkeys(units, 1))  # every unit reduces once
    if strategy is ShardingStrategy.FULL_SHARD:
        assert reductions == to_host
    for copy in copies:
        unit = units[copy.unit]
        numel = unit._flat_shard.numel() if copy.direction == "to_device" else unit._grad_numel
        assert copy.bytes == numel * 4, copy
    assert all(
        e.devices == ("cpu",) * len(units[e.unit].params)
        for e in mine
        if isinstance(e, events.Reshard)
    )
    for name, param in model.named_parameters():
        assert param.device.type == "cpu" and param.grad is not None, name
        assert param.grad.device.type == "cpu", name
    assert not any(u._flat_shard.is_pinned() for u in units.values())  # no accelerator here
    assert all(u.streams is None for u in units.values())  # See [Note: streams and events].

    # Without offload there is no copy at all.
    plain = wrap_model("nested", build("nested", rank), process_group, sharding_strategy=strategy)
    with _recording() as seen:
        plain(get_input("nested", rank, 0)).sum().backward()
    assert not any(isinstance(e, events.OffloadCopy) for e in seen)


@pytest.mark.distributed(world_size=2)
def test_cpu_offload_rejects_parameters_moved_off_the_cpu(rank, process_group):
    """Moving an offloaded model after wrapping fails at the first forward, naming the device."""
    model = wrap_model(
        "nested", build("nested", rank), process_group, cpu_offload=CPUOffload(offload_params=True)
    )
    model.to("meta")
    with pytest.raises(
        RuntimeError,
        match="An FSDP-managed module with parameter CPU offloading enabled has parameters on meta",
    ):
        model(get_input("nested", rank, 0).to("meta"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.distributed(world_size=2, backend="gloo")
def test_cpu_offload_rejects_parameters_on_cuda(rank, process_group):
    model = wrap_model(
        "nested", build("nested", rank), process_group, cpu_offload=CPUOffload(offload_params=True)
    )
    model.to("cuda")
    with pytest.raises(
        RuntimeError,
        match="An FSDP-managed module with parameter CPU offloading enabled has parameters on cuda",
    ):
        model(get_input("nested", rank, 0).cuda())


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("keep_low_precision_grads", [False, True])
def test_mixed_precision_dtypes_in_flight(rank, process_group, keep_low_precision_grads):
    """Gathers move param_dtype; reductions use reduce_dtype, or param_dtype when only that is
    set; gradients end in the parameters' dtype unless keep_low_precision_grads."""
    for policy, reduce_dtype in [
        (MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32), "float32"),
        (MixedPrecision(param_dtype=torch.bfloat16), "bfloat16"),
    ]:
        policy = MixedPrecision(
            param_dtype=policy.param_dtype,
            reduce_dtype=policy.reduce_dtype,
            keep_low_precision_grads=keep_low_precision_grads,
        )
        model = wrap_model("nested", build("nested", rank), process_group, mixed_precision=policy)
        with _recording() as seen:
            out = model(get_input("nested", rank, 0))
            assert out.dtype == policy.param_dtype
            out.float().sum().backward()
        collectives = [e for e in seen if isinstance(e, events.Collective) and e.rank == rank]
        gathers = {e.dtype for e in collectives if e.op.startswith("all_gather")}
        reduces = {e.dtype for e in collectives if e.op.startswith("reduce_scatter")}
        assert gathers == {str(policy.param_dtype).removeprefix("torch.")}
        assert reduces == {reduce_dtype}
        grad_dtype = getattr(torch, reduce_dtype) if keep_low_precision_grads else torch.float32
        for name, param in model.named_parameters():
            assert param.dtype == torch.float32, name
            assert param.grad is not None and param.grad.dtype == grad_dtype, name
        torch.optim.SGD(model.parameters(), lr=0.1).step()  # the optimizer accepts them


@pytest.mark.distributed(world_size=2)
def test_same_dtype_policy_is_a_no_op(rank, process_group):
    """A policy naming the parameters' own dtype casts nothing and trains bitwise the same."""
    policy = MixedPrecision(
        param_dtype=torch.float32, reduce_dtype=torch.float32, buffer_dtype=torch.float32
    )
    plain = train(wrap_model("nested", build("nested", rank), process_group), "nested", rank)
    model = wrap_model("nested", build("nested", rank), process_group, mixed_precision=policy)
    assert all(not u.precision.casts_params for u in _units(model))
    with _recording() as seen:
        losses = train(model, "nested", rank)
    assert {e.dtype for e in seen if isinstance(e, events.Collective)} <= {"float32", "int64"}
    assert_same_losses(losses, plain, tolerance=None, what="fp32 policy")


class _Scaled(nn.Module):
    """Linear whose output is scaled by a buffer; records the buffer dtype seen in forward."""

    def __init__(self, buffer_name: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.buffer_name = buffer_name
        self.register_buffer(buffer_name, torch.full((4,), 0.5, dtype=dtype))
        self.seen: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        buffer = getattr(self, self.buffer_name)
        self.seen.append(buffer.dtype)
        return self.lin(x) * buffer.to(x.dtype)


class _TwoScaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = _Scaled("scale", torch.float64)
        self.second = _Scaled("shift", torch.float32)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


@pytest.mark.distributed(world_size=2)
def test_buffers_cast_per_instance_and_restored_in_state_dict(rank, process_group):
    """Each instance casts the buffers it owns to its buffer_dtype for compute; the full state
    dict restores each buffer's own original dtype (fp64 and fp32 here, distinct names)."""
    torch.manual_seed(0)
    module = _TwoScaled()
    expected = {k: v.clone() for k, v in module.state_dict().items()}
    module.second = FSDP(
        module.second, process_group, mixed_precision=MixedPrecision(buffer_dtype=torch.float16)
    )
    model = FSDP(module, process_group, mixed_precision=MixedPrecision(buffer_dtype=torch.bfloat16))
    model(torch.ones(2, 4)).sum().backward()
    assert module.first.seen == [torch.bfloat16] and module.second.module.seen == [torch.float16]
    assert module.steps.dtype == torch.int64  # not floating point: never cast
    state = model.state_dict()
    assert list(state) == list(expected)
    for key, value in expected.items():
        assert state[key].dtype == value.dtype, key
        if "lin" not in key:
            assert torch.equal(state[key], value), key
    model.load_state_dict(state)  # loads into the compute-dtype buffers, casting
    assert module.first.scale.dtype == torch.bfloat16
    assert model.state_dict()["first.scale"].dtype == torch.float64


class _Outer(nn.Module):
    """Feeds its child an fp32 tensor whatever dtype it computes in itself."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.child = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.child(self.inp(x).float())


@pytest.mark.distributed(world_size=2)
def test_cast_forward_inputs(rank, process_group):
    """cast_forward_inputs makes each instance cast its floating inputs to param_dtype; the
    root casts its own inputs by default (cast_root_forward_inputs)."""
    for cast in (False, True):
        policy = MixedPrecision(param_dtype=torch.bfloat16, cast_forward_inputs=cast)
        module = _Outer()
        module.child = FSDP(module.child, process_group, mixed_precision=policy)
        model = FSDP(module, process_group, mixed_precision=policy)
        batch = torch.ones(2, 4)  # fp32: the root casts it (cast_root_forward_inputs=True)
        if cast:
            assert model(batch).dtype == torch.bfloat16
        else:
            with pytest.raises(RuntimeError, match="dtype"):
                model(batch)
    policy = MixedPrecision(param_dtype=torch.bfloat16, cast_root_forward_inputs=False)
    with pytest.raises(RuntimeError, match="dtype"):
        FSDP(nn.Linear(4, 4), process_group, mixed_precision=policy)(torch.ones(2, 4))


class _KeywordInputs(nn.Module):
    """Takes every input by keyword and records the dtypes it receives."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen: dict[str, torch.dtype] = {}

    def forward(
        self, *, x: torch.Tensor, mask: torch.Tensor, extra: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        self.seen = {"x": x.dtype, "mask": mask.dtype, "extra.y": extra["y"].dtype}
        return self.lin(x) * mask + self.lin(extra["y"])


class _PassesKeywords(nn.Module):
    """Calls its child with fp32 keyword inputs, whatever dtype it computes in."""

    def __init__(self) -> None:
        super().__init__()
        self.child = _KeywordInputs()

    def forward(self, *, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.child(
            x=x.float(), mask=mask, extra={"y": torch.ones_like(x, dtype=torch.float32)}
        )


@pytest.mark.distributed(world_size=2)
def test_cast_forward_inputs_casts_keyword_arguments(rank, process_group):
    """Floating-point inputs passed as keyword arguments (nested in containers too) are cast to
    param_dtype like positional ones, by the root (cast_root_forward_inputs) and by a nested
    instance (cast_forward_inputs); a boolean mask keeps its dtype."""
    expected = {"x": torch.bfloat16, "mask": torch.bool, "extra.y": torch.bfloat16}
    x, mask = torch.ones(2, 4), torch.ones(2, 4, dtype=torch.bool)
    # The root: cast_root_forward_inputs (on by default), cast_forward_inputs off.
    root_policy = MixedPrecision(param_dtype=torch.bfloat16, cast_forward_inputs=False)
    root = FSDP(_KeywordInputs(), process_group, mixed_precision=root_policy)
    out = root(x=x, mask=mask, extra={"y": torch.ones(2, 4)})
    assert root.module.seen == expected and out.dtype == torch.bfloat16
    # A nested instance with cast_forward_inputs, called with fp32 keywords by its parent.
    policy = MixedPrecision(param_dtype=torch.bfloat16, cast_forward_inputs=True)
    module = _PassesKeywords()
    module.child = FSDP(module.child, process_group, mixed_precision=policy)
    model = FSDP(module, process_group, mixed_precision=policy)
    out = model(x=x, mask=mask)
    assert module.child.module.seen == expected and out.dtype == torch.bfloat16
