"""Frozen parameters of another dtype in one composable unit (issue 23; [Note: mixed dtypes in
one unit] in ``fsdp_core/_flat.py``): they are sharded, all-gathered and shown at their values
and dtype, beside parameters that train as they would alone."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from fsdp_core import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard, replicate

FROZEN_DTYPES = [torch.float16, torch.int64, torch.float8_e4m3fn]


class _Frozen(nn.Module):
    """A trained ``lin`` (float32) scaled by a frozen ``table`` of another dtype and shape,
    its rows not a multiple of the world size (so every rank's shard is padded differently).
    Records the dtype ``table`` had in each forward."""

    def __init__(self, frozen_dtype: torch.dtype) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 5)
        values = torch.linspace(-2, 2, 5 * 3).reshape(5, 3)
        self.table = nn.Parameter(values.to(frozen_dtype), requires_grad=False)
        self.out = nn.Linear(5, 2)
        self.seen: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(self.table.dtype)
        scale = self.table.to(self.lin.weight.dtype).sum(1)
        return self.out(torch.relu(self.lin(x)) * scale)


def _model(frozen_dtype: torch.dtype) -> _Frozen:
    torch.manual_seed(0)
    return _Frozen(frozen_dtype)


def _train(model: nn.Module, rank: int, steps: int = 3) -> list[float]:
    optim = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    losses = []
    for step in range(steps):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank * 10 + step))
        loss = model(x).square().sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def _full_bytes(model: _Frozen) -> torch.Tensor:
    """``model.table``'s full value as bytes, gathered by the unit (DTensor's own
    ``full_tensor`` cannot all-gather float8 over gloo)."""
    model.unshard()
    full = model.table.detach().clone()
    model.reshard()
    return full.view(torch.uint8)


def _reference_losses(frozen_dtype: torch.dtype, world_size: int, rank: int) -> list[float]:
    """Each rank's losses of the same steps by a local model whose gradients are averaged
    over the ranks, as a sharded step's are."""
    local = _model(frozen_dtype)
    optim = torch.optim.SGD([p for p in local.parameters() if p.requires_grad], lr=0.1)
    losses = []
    for step in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank * 10 + step))
        loss = local(x).square().sum()
        loss.backward()
        for p in local.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad.div_(world_size)
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.distributed(world_size=[2, 3])
@pytest.mark.parametrize("frozen_dtype", FROZEN_DTYPES, ids=str)
@pytest.mark.parametrize(
    "options",
    [{}, {"reshard_after_forward": False}, {"offload_policy": CPUOffloadPolicy(pin_memory=False)}],
    ids=["default", "keep_after_forward", "offload"],
)
def test_a_frozen_parameter_of_another_dtype_shares_the_unit(
    rank, world_size, process_group, frozen_dtype, options
):
    """One unit holds float32 parameters that train and a frozen one of ``frozen_dtype``:
    the frozen one's shard and full value keep its dtype and bits, each forward sees it in its
    own dtype, and the others train to the losses of an averaged local run."""
    mesh = DeviceMesh.from_group(process_group, "cpu")
    original = _model(frozen_dtype).table.detach().clone()
    model = fully_shard(_model(frozen_dtype), mesh=mesh, **options)
    table = model.table
    assert isinstance(table, DTensor) and table.dtype == frozen_dtype
    assert model.lin.weight.dtype == torch.float32
    assert torch.equal(_full_bytes(model), original.view(torch.uint8))

    losses = _train(model, rank)

    assert model.seen == [frozen_dtype] * 3
    assert model.table.grad is None
    assert torch.equal(_full_bytes(model), original.view(torch.uint8))
    torch.testing.assert_close(
        losses, _reference_losses(frozen_dtype, world_size, rank), rtol=1e-6, atol=1e-6
    )


@pytest.mark.distributed(world_size=2)
def test_a_frozen_parameter_of_another_dtype_follows_a_named_param_dtype(rank, process_group):
    """FSDP2's rule: a policy that names ``param_dtype`` casts every parameter to it, frozen
    ones of other dtypes too; one that names only ``reduce_dtype`` leaves them theirs."""
    mesh = DeviceMesh.from_group(process_group, "cpu")
    cast = fully_shard(
        _model(torch.float16),
        mesh=mesh,
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16),
    )
    cast(torch.ones(2, 6))
    assert cast.seen == [torch.bfloat16]
    cast.reshard()  # the root keeps its parameters unsharded after forward
    assert cast.table.dtype == torch.float16  # the sharded parameter keeps its own

    kept = fully_shard(
        _model(torch.float16),
        mesh=mesh,
        mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float64),
    )
    kept(torch.ones(2, 6)).sum().backward()
    assert kept.seen == [torch.float16]
    assert kept.lin.weight.grad.dtype == torch.float32


@pytest.mark.distributed(world_size=2)
def test_meta_init_and_a_cast_after_sharding_keep_the_frozen_dtype(rank, world_size, process_group):
    """Built on the meta device, sharded, materialized with ``to_empty`` and filled by a
    state dict: the unit adopts parameters of two dtypes. ``replicate`` takes them too, and
    ``module.to(torch.float64)`` afterwards casts the frozen one with the others (one dtype
    again)."""
    mesh = DeviceMesh.from_group(process_group, "cpu")
    state = _model(torch.float16).state_dict()
    with torch.device("meta"):
        model = _Frozen(torch.float16)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    model.load_state_dict(copy.deepcopy(state))
    assert model.table.dtype == torch.float16
    losses = _train(model, rank)
    torch.testing.assert_close(
        losses, _reference_losses(torch.float16, world_size, rank), rtol=1e-6, atol=1e-6
    )

    copied = replicate(_model(torch.float16), mesh=mesh)
    assert copied.table.dtype == torch.float16
    copied.to(torch.float64)
    assert copied.table.dtype == copied.lin.weight.dtype == torch.float64
    copied(torch.ones(2, 6, dtype=torch.float64)).sum().backward()
    assert copied.seen == [torch.float64]
    assert copied.lin.weight.grad.dtype == torch.float64
