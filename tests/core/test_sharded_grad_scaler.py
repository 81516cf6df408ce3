"""``fsdp_core.ShardedGradScaler``: every rank skips the same steps and keeps the same scale, on
the CPU with gloo, even when only one rank's gradient shard holds an inf."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_core import (
    FSDP,
    MixedPrecision,
    MixedPrecisionPolicy,
    ShardedGradScaler,
    fully_shard,
)


def _gathered(flag: bool, group: dist.ProcessGroup) -> list[bool]:
    out: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, flag, group=group)
    return [bool(f) for f in out]


def _fp16_linear(group: dist.ProcessGroup, door: str = "fully_shard") -> nn.Module:
    torch.manual_seed(0)
    model = nn.Linear(4, 4, bias=False)  # rows 0-1 on rank 0, rows 2-3 on rank 1
    if door == "wrapper":
        return FSDP(
            model, process_group=group, mixed_precision=MixedPrecision(param_dtype=torch.float16)
        )
    fully_shard(
        model,
        mesh=DeviceMesh.from_group(group, "cpu"),
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16),
    )
    return model


def _shard(model: nn.Module) -> torch.Tensor:
    """This rank's shard of the weight: a DTensor's local tensor, or the wrapper's flat shard."""
    (param,) = model.parameters()
    return param.to_local() if hasattr(param, "to_local") else param


def _grad_shard(model: nn.Module) -> torch.Tensor:
    (param,) = model.parameters()
    assert param.grad is not None
    return param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad


def _step(model: nn.Module, optim: torch.optim.Optimizer, scaler, x: torch.Tensor) -> None:
    optim.zero_grad()
    # Only output 3 feeds the loss, so only row 3 of the weight gets a gradient: with x[0] =
    # 6e4 and a scale of 1024, dW[3, 0] = 6e7 overflows fp16 on rank 1 alone.
    loss = model(x)[:, 3].sum()
    scaler.scale(loss).backward()
    scaler.step(optim)
    scaler.update()


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("door", ["fully_shard", "wrapper"])
def test_an_inf_on_one_rank_skips_the_step_on_every_rank(rank, process_group, door) -> None:
    model = _fp16_linear(process_group, door)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler(device="cpu", init_scale=1024.0, process_group=process_group)
    before = _shard(model).detach().clone()
    overflow = torch.tensor([[6e4, 1.0, 1.0, 1.0]])

    optim.zero_grad()
    scaler.scale(model(overflow)[:, 3].sum()).backward()
    sees_inf = not bool(torch.isfinite(_grad_shard(model)).all())
    assert _gathered(sees_inf, process_group) == [False, True]  # only rank 1 sees it
    scaler.step(optim)
    scaler.update()
    assert torch.equal(_shard(model), before)  # skipped on rank 0 too
    assert scaler.get_scale() == 512.0  # backed off on every rank

    _step(model, optim, scaler, torch.tensor([[1.0, 2.0, 3.0, 4.0]]))
    changed = not torch.equal(_shard(model), before)
    assert _gathered(changed, process_group) == [False, True]  # rank 0's rows get no gradient
    assert scaler.get_scale() == 512.0


@pytest.mark.distributed(world_size=2)
def test_a_rank_without_gradients_still_agrees(rank, process_group) -> None:
    param = nn.Parameter(torch.ones(3))
    optim = torch.optim.SGD([param], lr=1.0)
    scaler = ShardedGradScaler(device="cpu", init_scale=4.0, process_group=process_group)
    scaler.scale(param.sum()).backward()
    if rank == 0:
        param.grad = torch.tensor([1.0, float("nan"), 1.0])
    else:
        param.grad = None  # e.g. every shard of this rank is empty
    scaler.step(optim)  # must neither hang nor step
    scaler.update()
    assert torch.equal(param.detach(), torch.ones(3))
    assert scaler.get_scale() == 2.0


@pytest.mark.distributed(world_size=2)
def test_fused_optimizer_path_agrees_too(rank, process_group) -> None:
    param = nn.Parameter(torch.ones(3))
    optim = torch.optim.AdamW([param], lr=1.0, fused=True)
    scaler = ShardedGradScaler(device="cpu", init_scale=4.0, process_group=process_group)
    scaler.scale(param.sum()).backward()
    if rank == 1:
        assert param.grad is not None
        param.grad[0] = float("inf")
    scaler.step(optim)
    scaler.update()
    assert torch.equal(param.detach(), torch.ones(3))
    assert scaler.get_scale() == 2.0


@pytest.mark.distributed(world_size=2)
def test_unscale_then_clip_sees_unscaled_local_shards(rank, process_group) -> None:
    model = _fp16_linear(process_group)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler(device="cpu", init_scale=8.0, process_group=process_group)
    optim.zero_grad()
    scaler.scale(model(torch.tensor([[1.0, 2.0, 3.0, 4.0]]))[:, 3].sum()).backward()
    scaler.unscale_(optim)
    grad = model.weight.grad.full_tensor()
    expected = torch.zeros(4, 4)
    expected[3] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert torch.equal(grad, expected)
    with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called"):
        scaler.unscale_(optim)


def test_default_device_is_the_cpu_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is present: the default device is cuda")
    scaler = ShardedGradScaler()
    assert scaler.is_enabled()
    assert scaler.scale(torch.tensor(1.0)).item() == 2.0**16
