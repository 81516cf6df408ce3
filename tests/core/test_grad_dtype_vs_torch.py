"""``param.grad_dtype`` under fsdp_core's ``fully_shard`` and the installed torch's, side by side.

torch 2.15's ``fully_shard`` honours each parameter's ``grad_dtype`` (see [Note: per-parameter
gradient dtypes] in ``src/fsdp_core/_grad_dtype.py``); earlier ones ignore it. fsdp_core follows
the installed torch, so every scenario here runs both engines on two CPU ranks over gloo and
compares what a user sees: each parameter's dtype, ``grad_dtype``, the gradient's dtype and
values (bit for bit: the same arithmetic), pending gradients under
``set_requires_gradient_sync(False)``, and the type of any error. Under torch 2.13 and 2.14
the scenarios check that both ignore ``grad_dtype`` alike (some then fail alike, as a
gradient of the wrong dtype is refused); ``scripts/torch_matrix.sh 2.15.0
tests/core/test_grad_dtype_vs_torch.py`` runs them where both honour it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import fsdp_core

HONOURED = hasattr(torch.Tensor, "_has_grad_dtype_override")  # torch 2.15 and later
bf16, fp32, fp64 = torch.bfloat16, torch.float32, torch.float64


class _Engine:
    def __init__(self, name: str) -> None:
        self.name = name
        self.shard = fsdp_core.fully_shard if name == "fsdp_core" else torch_fully_shard
        self.policy = (
            fsdp_core.MixedPrecisionPolicy if name == "fsdp_core" else TorchMixedPrecisionPolicy
        )


def _full(t: torch.Tensor | None) -> list[Any] | None:
    if t is None:
        return None
    return (t.full_tensor() if isinstance(t, DTensor) else t).double().tolist()


def _seen(model: nn.Module) -> list[Any]:
    """What a user sees of each parameter: its dtype, ``grad_dtype`` (and whether it was set),
    its gradient's type, dtype and values."""
    return [
        (
            name,
            p.dtype,
            p.grad_dtype,
            getattr(p, "_has_grad_dtype_override", None),
            None if p.grad is None else (type(p.grad).__name__, p.grad.dtype),
            _full(p.grad),
        )
        for name, p in model.named_parameters()
    ]


def _inp(rank: int, step: int, *shape: int, dtype: torch.dtype = fp32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(*shape, generator=gen).to(dtype)


def _accumulate(model: Any, rank: int, inp: Callable[[int], torch.Tensor]) -> list[Any]:
    """Two backwards without reduction, then one with, the parameters kept unsharded (so the
    pending gradients show); what the user sees after each, and after the reshard."""
    model.set_reshard_after_backward(False)
    seen = []
    for step in range(3):
        sync = step == 2
        model.set_requires_gradient_sync(sync)
        model.set_is_last_backward(sync)
        model(inp(step)).sum().backward()
        seen.append(_seen(model))
    model.reshard()
    seen.append(_seen(model))
    return seen


class _FloatGrad(torch.autograd.Function):
    """Identity whose backward hands the parameter an fp32 gradient."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor) -> torch.Tensor:
        return weight.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.float()


class _InputDtypeGrad(torch.autograd.Function):
    """``weight * inp`` whose weight gradient takes the input's dtype."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inp)
        return weight * inp

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (inp,) = ctx.saved_tensors
        return grad.to(inp.dtype) * inp, None


class _Scale(nn.Module):
    def __init__(self, op: Any, grad_dtype: Any = "default") -> None:
        super().__init__()
        self.op = op
        self.weight = nn.Parameter(torch.ones(4, dtype=bf16))
        if grad_dtype != "default":
            self.weight.grad_dtype = grad_dtype

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        if self.op is _FloatGrad:
            return _FloatGrad.apply(self.weight) * inp
        return self.op.apply(self.weight, inp)


def _mp_default(e: _Engine, rank: int, mesh: DeviceMesh) -> list[Any]:
    """fp32 parameters computing in bf16, reduce_dtype unset: 2.15 reduces and accumulates in
    fp32 (the parameters' grad dtype), earlier releases in bf16."""
    torch.manual_seed(0)
    model = nn.Linear(4, 6, bias=False)
    e.shard(model, mesh=mesh, mp_policy=e.policy(param_dtype=bf16))
    return _accumulate(model, rank, lambda s: _inp(rank, s, 3, 4, dtype=bf16))


def _explicit_fp32(e: _Engine, rank: int, mesh: DeviceMesh) -> list[Any]:
    """A bf16 model whose weights keep fp32 gradients, biases default, one unit of both."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6, dtype=bf16), nn.Linear(6, 2, dtype=bf16))
    model[0].weight.grad_dtype = fp32
    model[1].weight.grad_dtype = fp32
    e.shard(model, mesh=mesh)
    return _accumulate(model, rank, lambda s: _inp(rank, s, 3, 4, dtype=bf16))


def _mixed_units(e: _Engine, rank: int, mesh: DeviceMesh) -> list[Any]:
    """fp32, fp64 and default gradient dtypes in one unit and across nested units, reduced
    over two backwards."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6, dtype=bf16), nn.Linear(6, 2, dtype=bf16))
    model[0].weight.grad_dtype = fp32
    model[1].bias.grad_dtype = fp64
    e.shard(model[1], mesh=mesh)
    e.shard(model, mesh=mesh)
    for step in range(2):
        model(_inp(rank, step, 3, 4, dtype=bf16)).sum().backward()
    return _seen(model)


def _none_policy(reduce_dtype: torch.dtype | None) -> Callable[..., list[Any]]:
    def scenario(e: _Engine, rank: int, mesh: DeviceMesh) -> list[Any]:
        """``grad_dtype=None``: the gradient keeps the dtype autograd gives it (fp32 here)."""
        model = _Scale(_FloatGrad, grad_dtype=None)
        e.shard(model, mesh=mesh, mp_policy=e.policy(reduce_dtype=reduce_dtype))
        return _accumulate(model, rank, lambda s: _inp(rank, s, 4, dtype=bf16))

    return scenario


def _set_after_sharding(e: _Engine, rank: int, mesh: DeviceMesh) -> list[Any]:
    """A ``grad_dtype`` set on the sharded parameter before the first forward counts."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2, dtype=bf16)
    e.shard(model, mesh=mesh)
    model.weight.grad_dtype = fp32
    model(_inp(rank, 0, 3, 4, dtype=bf16)).sum().backward()
    return _seen(model)


def _conversion(e: _Engine, rank: int, mesh: DeviceMesh) -> list[Any]:
    """Explicit fp32 gradients survive ``module.cpu()``, ``.to(device)`` and a backward, and
    ``module.to(fp32)`` casts the parameters, not the gradients' policy."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4, dtype=bf16)
    for p in model.parameters():
        p.grad_dtype = fp32
    e.shard(model, mesh=mesh)
    for p in model.parameters():
        p.grad = torch.ones_like(p, dtype=fp32)
    model.cpu()
    model.to(device="cpu")
    seen = [_seen(model)]
    model(_inp(rank, 0, 2, 4, dtype=bf16)).sum().backward()
    seen.append(_seen(model))
    model.to(fp32)
    seen.append([(n, p.dtype, p.grad_dtype, p.grad.dtype) for n, p in model.named_parameters()])
    return seen


def _load_state_dict(assign: bool) -> Callable[..., list[Any]]:
    def scenario(e: _Engine, rank: int, mesh: DeviceMesh) -> list[Any]:
        """An explicit policy and ``load_state_dict`` with a replacement of its own."""
        torch.manual_seed(0)
        model = nn.Linear(4, 4, bias=False, dtype=bf16)
        model.weight.grad_dtype = fp32
        e.shard(model, mesh=mesh, mp_policy=e.policy(reduce_dtype=fp32))
        state = model.state_dict()
        replacement = nn.Parameter(state["weight"])
        replacement.grad_dtype = fp64
        state["weight"] = replacement
        model.load_state_dict(state, assign=assign)
        model(_inp(rank, 0, 2, 4, dtype=bf16)).sum().backward()
        return [model.weight is replacement, *_seen(model)]

    return scenario


def _partial_dtypes(first: torch.dtype) -> Callable[..., list[Any]]:
    def scenario(e: _Engine, rank: int, mesh: DeviceMesh) -> list[Any]:
        """HSDP without its all-reduce, then with: a ``grad_dtype=None`` gradient changes dtype
        between the backwards and the pending shard is promoted, not cast down."""
        hsdp = DeviceMesh("cpu", [[0, 1]], mesh_dim_names=("replicate", "shard"))
        model = _Scale(_InputDtypeGrad, grad_dtype=None)
        e.shard(model, mesh=hsdp)
        second = fp32 if first == bf16 else bf16
        seen = []
        for step, dtype in enumerate((first, second)):
            model.set_requires_all_reduce(step == 1)
            model(_inp(rank, step, 4, dtype=dtype)).sum().backward()
            seen.append(_seen(model))
        return seen

    return scenario


def _unused_with_none_policy(e: _Engine, rank: int, mesh: DeviceMesh) -> list[Any]:
    """Zeros for unused parameters need a dtype every rank agrees on: ``grad_dtype=None``
    without ``reduce_dtype`` is refused (fsdp_core when set, torch 2.15 at backward)."""
    model = nn.Linear(2, 2)
    model.weight.grad_dtype = None
    e.shard(model, mesh=mesh)
    try:
        model.set_reduce_scatter_unused_params(True)
        model(_inp(rank, 0, 1, 2)).sum().backward()
    except Exception as error:  # the type is what is compared
        return [type(error).__name__]
    return _seen(model)


SCENARIOS: dict[str, Callable[[_Engine, int, DeviceMesh], list[Any]]] = {
    "mp_default": _mp_default,
    "explicit_fp32": _explicit_fp32,
    "mixed_units": _mixed_units,
    "none_policy": _none_policy(None),
    "none_policy_bf16_reduce": _none_policy(bf16),
    "set_after_sharding": _set_after_sharding,
    "conversion": _conversion,
    "load_state_dict": _load_state_dict(assign=False),
    "load_state_dict_assign": _load_state_dict(assign=True),
    "partial_bf16_then_fp32": _partial_dtypes(bf16),
    "partial_fp32_then_bf16": _partial_dtypes(fp32),
    "unused_with_none_policy": _unused_with_none_policy,
}


def _outcome(name: str, engine: str, rank: int, mesh: DeviceMesh) -> Any:
    try:
        return SCENARIOS[name](_Engine(engine), rank, mesh)
    except Exception as error:  # an error is an outcome to compare
        return ("raised", type(error).__name__)


def _scenario_params() -> list[Any]:
    """Each scenario's name, skipped where the installed torch lacks what it calls."""
    lacks_unused = not hasattr(TorchFSDPModule, "set_reduce_scatter_unused_params")
    return [
        pytest.param(
            name,
            marks=pytest.mark.skipif(
                name == "unused_with_none_policy" and lacks_unused,
                reason=f"torch {torch.__version__} has no set_reduce_scatter_unused_params",
            ),
        )
        for name in SCENARIOS
    ]


@pytest.mark.parametrize("name", _scenario_params())
@pytest.mark.distributed(world_size=2)
def test_grad_dtype_as_the_installed_torch(name, rank, process_group):
    mesh = DeviceMesh.from_group(process_group, "cpu")
    ours = _outcome(name, "fsdp_core", rank, mesh)
    dist.barrier()
    theirs = _outcome(name, "torch", rank, mesh)
    assert ours == theirs, f"{name}:\n fsdp_core {ours}\n torch     {theirs}"
    if HONOURED and name != "unused_with_none_policy":
        assert ours[0] != "raised", ours  # where torch honours it, every scenario runs


@pytest.mark.skipif(not HONOURED, reason=f"torch {torch.__version__} ignores grad_dtype")
@pytest.mark.distributed(world_size=2)
def test_unused_params_with_grad_dtype_none_raise_when_set(rank, process_group):
    """fsdp_core refuses at ``set_reduce_scatter_unused_params`` (before any collective),
    naming the parameter and the fix, and keeps the setting off; a ``reduce_dtype`` makes it
    fine."""
    mesh = DeviceMesh.from_group(process_group, "cpu")
    model = nn.Linear(2, 2)
    model.weight.grad_dtype = None
    fsdp_core.fully_shard(model, mesh=mesh)
    with pytest.raises(ValueError, match=r"grad_dtype=None.*reduce_dtype.*'weight'"):
        model.set_reduce_scatter_unused_params(True)
    model(_inp(rank, 0, 1, 2)).sum().backward()  # still off: a plain backward
    assert model.weight.grad is not None

    other = nn.Linear(2, 2)
    other.weight.grad_dtype = None
    policy = fsdp_core.MixedPrecisionPolicy(reduce_dtype=fp32)
    fsdp_core.fully_shard(other, mesh=mesh, mp_policy=policy)
    other.set_reduce_scatter_unused_params(True)
    other(_inp(rank, 0, 1, 2)).sum().backward()
    assert other.weight.grad is not None and other.weight.grad.dtype == fp32
