"""The CUDA path: side streams for all-gather, reduce-scatter and offload copies (NCCL).

These need two GPUs and skip cleanly elsewhere; the CPU path's lack of streams is checked in
test_offload_precision.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from fsdp_core import FSDP, CPUOffload, MixedPrecision

from ._models import build, get_input, wrap_model

pytestmark = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="the CUDA stream path needs two GPUs for NCCL"
)


@pytest.mark.distributed(world_size=2, backend="nccl")
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
    for m in (ddp, model):
        optim = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
        losses = []
        for step in range(3):
            loss = m(get_input("nested", rank, step).to(device)).pow(2).mean()
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.detach().cpu())
        m.losses = losses  # type: ignore[assignment]
    # Two ranks: two-term sums, bitwise equal (see test_parity).
    assert all(torch.equal(a, b) for a, b in zip(model.losses, ddp.losses, strict=True))
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


@pytest.mark.distributed(world_size=2, backend="nccl")
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
