"""fully_shard as a drop-in for torch's FSDP2 (issue 23): behaviour torch's own FSDP2 tests
rely on, each checked against a reference computed here."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_core import MixedPrecisionPolicy, fully_shard


def _mesh(group: dist.ProcessGroup) -> DeviceMesh:
    return DeviceMesh.from_group(group, "cpu")


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))


@pytest.mark.distributed(world_size=2)
def test_no_sync_accumulates_in_the_reduce_dtype(rank, world_size, process_group):
    """bf16 compute, fp32 reduce_dtype, four micro-batches without gradient sync and one with:
    the micro-batches' bf16 gradients are summed in fp32 (FSDP2's rule), then averaged."""
    plain = _mlp()
    local = copy.deepcopy(plain).to(torch.bfloat16)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mesh = _mesh(process_group)
    fully_shard(plain[0], mesh=mesh, mp_policy=policy)
    model = fully_shard(plain, mesh=mesh, mp_policy=policy)
    batches = [
        torch.randn(4, 8, generator=torch.Generator().manual_seed(rank * 10 + i)) for i in range(5)
    ]

    expected = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in local.named_parameters()}
    for x in batches:
        local.zero_grad()
        local(x.to(torch.bfloat16)).sum().backward()
        for n, p in local.named_parameters():
            expected[n] += p.grad.float()
    for value in expected.values():
        dist.all_reduce(value, group=process_group)
        value.div_(world_size)

    model.set_requires_gradient_sync(False)
    for x in batches[:-1]:
        model(x).sum().backward()
    model.set_requires_gradient_sync(True)
    model(batches[-1]).sum().backward()
    for name, p in model.named_parameters():
        assert p.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad.full_tensor(), expected[name], rtol=0, atol=0, msg=name)
