"""fsdp_core's composable door, ``fully_shard``: parity with DDP and with torch's FSDP2, the
collectives each ``reshard_after_forward`` value sends, and its public surface."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

import fsdp_core
from fsdp_core import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from fsdp_testing.parity import TrainingLoop

from ._models import MixtureOfExperts, NestedModel, _own_rank_group, build
from ._parity import (
    FP32_TOLERANCE,
    LR,
    STEPS,
    _Batches,
    assert_same,
    assert_same_losses,
    precision_reference,
    reference,
)

KINDS = ["nested", "always_wrap", "frozen", "transformer", "moe"]


def _mesh(group: dist.ProcessGroup) -> DeviceMesh:
    return DeviceMesh.from_group(group, "cpu")


def shard(kind: str, model: nn.Module, group: dist.ProcessGroup, shard_fn=fully_shard, **kw):
    """Apply ``shard_fn`` bottom-up the way model ``kind`` is meant to be nested."""
    mesh = _mesh(group)
    if kind == "always_wrap":
        for module in _post_order(model):
            if module is not model:
                shard_fn(module, mesh=mesh, **kw)
    elif kind == "transformer":
        for layer in model.layers:
            shard_fn(layer, mesh=mesh, **kw)
    elif kind == "moe":
        assert isinstance(model, MixtureOfExperts)
        # A one-rank mesh: an int reshard_after_forward cannot divide it.
        own = {k: v for k, v in kw.items() if not (k == "reshard_after_forward" and type(v) is int)}
        shard_fn(model.expert, mesh=_mesh(_own_rank_group(group)), **own)
    else:
        assert isinstance(model, NestedModel)
        shard_fn(model.block, mesh=mesh, **kw)
    shard_fn(model, mesh=mesh, **kw)
    return model


def _post_order(module: nn.Module):
    for child in module.children():
        yield from _post_order(child)
    yield module


def train(model, kind, rank, *, steps=STEPS, policy=None, after_backward=None):
    loop = TrainingLoop(
        model,
        workload=_Batches(kind, rank, after_backward),
        lr=LR,
        mixed_precision=policy,
        device=torch.device("cpu"),
    )
    losses = [loop.step() for _ in range(steps)]
    return losses, dict(loop.named_full_params())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.distributed(world_size=[2, 4])
def test_parity_with_data_parallel(kind, rank, world_size, process_group):
    """Losses and full parameters match DDP with reshard_after_forward True, False (and 2 at
    world size 4), with CPU offload; bitwise at two ranks."""
    ref_losses, ref_params = reference(kind, build(kind, rank), rank, process_group)
    tolerance = None if world_size == 2 else FP32_TOLERANCE
    values: list[object] = [None, True, False] + ([2] if world_size == 4 else [])
    for rsf in values:
        for offload in (False, True):
            kwargs: dict = {"reshard_after_forward": rsf}
            if offload:
                kwargs["offload_policy"] = CPUOffloadPolicy()
            model = shard(kind, build(kind, rank), process_group, **kwargs)
            losses, params = train(model, kind, rank)
            what = f"{kind} reshard_after_forward={rsf} offload={offload}"
            assert_same_losses(ref_losses, losses, what=what, tolerance=tolerance)
            assert_same(ref_params, params, what=what, tolerance=tolerance)


@pytest.mark.parametrize("kind", ["nested", "transformer"])
@pytest.mark.distributed(world_size=2)
def test_mixed_precision_matches_the_precision_reference(kind, rank, process_group):
    """bf16 parameters with fp32 reduction train like the library's precision reference."""
    from fsdp_core import MixedPrecision

    policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    ref_losses, ref_params = precision_reference(
        kind, build(kind, rank), rank, process_group, policy
    )
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = shard(kind, build(kind, rank), process_group, mp_policy=mp)
    losses, params = train(model, kind, rank, policy=policy)
    assert all(loss.dtype == torch.bfloat16 for loss in losses)
    # Two ranks: the same arithmetic as the reference, so bitwise (as for the wrapper door).
    assert_same_losses(losses, ref_losses, what=kind, tolerance=None)
    assert_same(params, ref_params, what=kind, tolerance=None)


@pytest.mark.parametrize("kind", ["nested", "transformer", "always_wrap"])
@pytest.mark.distributed(world_size=2)
def test_same_numbers_as_torch_fsdp2(kind, rank, process_group):
    """fsdp_core's fully_shard and torch's, side by side on the same model and data, give
    bitwise equal losses and parameters."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    ours = shard(kind, build(kind, rank), process_group)
    theirs = shard(kind, build(kind, rank), process_group, shard_fn=torch_fully_shard)
    our_losses, our_params = train(ours, kind, rank)
    their_losses, their_params = train(theirs, kind, rank)
    assert_same_losses(their_losses, our_losses, what=kind, tolerance=None)
    assert_same(their_params, our_params, what=kind, tolerance=None)


@pytest.mark.distributed(world_size=2)
def test_gradient_accumulation_with_the_sync_switch(rank, process_group):
    """Two micro-batches with set_requires_gradient_sync(False), then one with it on, equal
    DDP accumulating the same three backwards; no reduce-scatter runs while it is off."""
    from fsdp_core import events

    kind = "nested"
    plain = build(kind, rank)
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(plain), process_group=process_group)
    model = shard(kind, plain, process_group)
    batches = [
        torch.randn(4, 8, generator=torch.Generator().manual_seed(rank * 10 + i)) for i in range(3)
    ]
    with ddp.no_sync():
        for x in batches[:2]:
            ddp(x).pow(2).mean().backward()
    ddp(batches[2]).pow(2).mean().backward()
    seen: list = []
    model.set_requires_gradient_sync(False)
    with events.subscribe(seen.append):
        for x in batches[:2]:
            model(x).pow(2).mean().backward()
    assert not [e for e in seen if isinstance(e, events.Collective) and "reduce" in e.op]
    model.set_requires_gradient_sync(True)
    model(batches[2]).pow(2).mean().backward()
    for (name, p), (_, q) in zip(
        ddp.module.named_parameters(), model.named_parameters(), strict=True
    ):
        assert isinstance(q.grad, DTensor), name
        torch.testing.assert_close(q.grad.full_tensor(), p.grad, rtol=0, atol=0, msg=name)


@pytest.mark.distributed(world_size=2)
def test_parameters_are_dtensors_and_the_class_is_swapped(rank, process_group):
    """Sharded parameters are Shard(0) DTensors under the original names; the module is both
    an FSDPModule and its original class; state_dict() gives DTensors and load_state_dict
    takes full tensors."""
    model = shard("nested", build("nested", rank), process_group)
    assert isinstance(model, FSDPModule) and isinstance(model, NestedModel)
    assert isinstance(model.block, FSDPModule) and isinstance(model.block, nn.Sequential)
    names = [n for n, _ in model.named_parameters()]
    assert names == [n for n, _ in NestedModel().named_parameters()]
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.placements == (Shard(0),), name
    state = model.state_dict()
    full = {k: v.full_tensor() for k, v in state.items()}
    saved = {k: v.clone() for k, v in state.items()}
    assert all(isinstance(v, DTensor) for v in state.values())
    zeroed = {k: torch.zeros_like(v) for k, v in full.items()}
    model.load_state_dict(zeroed)
    assert all(v.full_tensor().abs().sum() == 0 for v in model.state_dict().values())
    model.load_state_dict(full)  # full tensors
    for key, value in model.state_dict().items():
        assert torch.equal(value.full_tensor(), full[key]), key
    model.load_state_dict(zeroed)
    model.load_state_dict(saved)  # DTensors
    for key, value in model.state_dict().items():
        assert torch.equal(value.full_tensor(), full[key]), key


@pytest.mark.distributed(world_size=2)
def test_unshard_reshard_and_async_handle(rank, process_group):
    """unshard() shows full plain parameters until reshard(); async_op returns a handle."""
    model = shard("nested", build("nested", rank), process_group)
    handle = model.block.unshard(async_op=True)
    assert isinstance(handle, fsdp_core.UnshardHandle)
    handle.wait()
    assert model.block[0].weight.shape == (16, 4) and not isinstance(model.block[0].weight, DTensor)
    model.block.reshard()
    assert isinstance(model.block[0].weight, DTensor)
