"""The CUDA path: side streams for all-gather, reduce-scatter and offload copies (NCCL).

They run on two ranks where two GPUs exist and on one rank with one GPU (NCCL puts one rank on
each device; one rank still runs every stream, pinned copy and low-precision cast, through
NCCL's one-rank collectives), and skip cleanly without a GPU; the CPU path's lack of streams is
checked in test_offload_precision.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel as DDP

from fsdp_core import (
    FSDP,
    CPUOffload,
    CPUOffloadPolicy,
    MixedPrecision,
    MixedPrecisionPolicy,
    fully_shard,
)

from ._models import build, get_input, wrap_model

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
WORLD_SIZE = max(1, min(2, GPUS))

pytestmark = pytest.mark.skipif(GPUS == 0, reason="the CUDA stream path needs a GPU")


def _train(model, rank, device) -> list[float]:
    """Three SGD+momentum steps on the nested model's batches; the losses."""
    optim = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(3):
        loss = model(get_input("nested", rank, step).to(device)).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.distributed(world_size=WORLD_SIZE, backend="nccl")
@pytest.mark.parametrize("offload", [False, True])
def test_cuda_streams_match_ddp(rank, process_group, device, offload):
    """Training with side streams (and pinned offload copies) equals DDP on the same GPUs."""
    ddp = DDP(
        build("nested", rank).to(device), device_ids=[device.index], process_group=process_group
    )
    model = wrap_model(
        "nested",
        build("nested", rank),
        process_group,
        device_id=device,
        cpu_offload=CPUOffload(offload_params=offload),
    )
    # One or two ranks: sums of at most two terms, bitwise equal (see test_parity).
    assert _train(model, rank, device) == _train(ddp, rank, device)
    streams = model._fsdp_state.streams
    assert streams is not None
    units = [m._unit for m in FSDP.fsdp_modules(model) if m._unit is not None]
    assert all(u.streams is streams for u in units)
    assert all(u._flat_shard.is_pinned() is offload for u in units)
    with FSDP.summon_full_params(model, writeback=False):
        for (name, param), ref in zip(
            model.named_parameters(), ddp.module.parameters(), strict=True
        ):
            assert torch.equal(param, ref), name


@pytest.mark.distributed(world_size=WORLD_SIZE, backend="nccl")
def test_cuda_mixed_precision_gathers_low_precision(rank, process_group, device):
    model = wrap_model(
        "nested",
        build("nested", rank),
        process_group,
        device_id=device,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    )
    out = model(get_input("nested", rank, 0).to(device))
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


@pytest.mark.distributed(world_size=WORLD_SIZE, backend="nccl")
@pytest.mark.parametrize("offload", [False, True])
def test_cuda_fully_shard_matches_ddp(rank, process_group, device, offload):
    """The composable door on a CUDA mesh (pinned host shards when offloading) trains as DDP;
    bf16 parameters with fp32 reduction give bf16 activations and fp32 gradients."""
    ddp = DDP(
        build("nested", rank).to(device), device_ids=[device.index], process_group=process_group
    )
    mesh = DeviceMesh.from_group(process_group, "cuda")
    policy = CPUOffloadPolicy(pin_memory=True) if offload else None
    model = build("nested", rank).to(device)
    kw = {"mesh": mesh, "offload_policy": policy} if offload else {"mesh": mesh}
    fully_shard(model.block, **kw)
    fully_shard(model, **kw)
    model.set_reduce_scatter_max_input_buffers(2)  # two reductions in flight: same numbers
    assert _train(model, rank, device) == _train(ddp, rank, device)
    assert model._get_fsdp_state().streams.max_pending_reduces == 2
    for param in model.parameters():
        local = param.to_local()
        assert local.device.type == ("cpu" if offload else "cuda")
        assert local.is_pinned() is offload
    for (name, param), ref in zip(model.named_parameters(), ddp.module.parameters(), strict=True):
        assert torch.equal(param.full_tensor().to(device), ref), name

    low = build("nested", rank).to(device)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(low.block, mesh=mesh, mp_policy=mp)
    fully_shard(low, mesh=mesh, mp_policy=mp)
    out = low(get_input("nested", rank, 0).to(device))
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in low.parameters())


@pytest.mark.distributed(world_size=WORLD_SIZE, backend="nccl")
def test_cuda_symm_mem_for_comm_keeps_the_numbers(rank, process_group, device):
    """``set_symm_mem_for_comm()``: all-gathers from torch's symmetric memory train to the same
    losses as plain buffers, and as torch's FSDP2 with the same setting (skipped where the
    installed torch's own call cannot run here: no such method, or no symmetric memory for
    this GPU or build)."""
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    if not hasattr(TorchFSDPModule, "set_symm_mem_for_comm"):
        pytest.skip(f"torch {torch.__version__} has no set_symm_mem_for_comm")
    mesh = DeviceMesh.from_group(process_group, "cuda")

    def losses(shard, symm_mem: bool) -> list[float]:
        model = build("nested", rank).to(device)
        shard(model.block, mesh=mesh)
        shard(model, mesh=mesh)
        if symm_mem:
            model.set_symm_mem_for_comm()
        return _train(model, rank, device)

    try:
        theirs = losses(torch_fully_shard, True)
    except (RuntimeError, NotImplementedError, ImportError) as error:
        pytest.skip(f"torch's own set_symm_mem_for_comm cannot run here: {error}")
    ours = losses(fully_shard, True)
    assert ours == losses(fully_shard, False)
    assert ours == pytest.approx(theirs, rel=1e-6)
