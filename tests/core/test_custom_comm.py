"""FSDP2's custom-collective API on the composable door (issue 23; [Note: custom collectives]
in ``fsdp_core/_collectives.py``): ``set_custom_all_gather``, ``set_custom_reduce_scatter`` and
``set_allocate_memory_from_process_group_for_comm``."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_core import fully_shard


class _RecordingAllGather:
    """An all-gather that counts its buffers and calls, run asynchronously so that the engine
    must wait on the returned work."""

    def __init__(self) -> None:
        self.allocated: list[tuple[tuple[int, ...], torch.dtype]] = []
        self.calls = 0

    def allocate(self, size, *, dtype, device):
        self.allocated.append((tuple(size), dtype))
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output, input, group, async_op=False):
        self.calls += 1
        return dist.all_gather_into_tensor(output, input, group=group, async_op=True)


class _RecordingReduceScatter:
    def __init__(self) -> None:
        self.allocated: list[tuple[tuple[int, ...], torch.dtype]] = []
        self.ops: list[object] = []

    def allocate(self, size, *, dtype, device):
        self.allocated.append((tuple(size), dtype))
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output, input, group, op, async_op=False):
        self.ops.append(op)
        dist.reduce_scatter_tensor(output, input, op=op, group=group)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 7), nn.ReLU(), nn.Linear(7, 5))


def _shard(model: nn.Sequential, group: dist.ProcessGroup) -> nn.Sequential:
    mesh = DeviceMesh.from_group(group, "cpu")
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _train(model: nn.Module, rank: int) -> tuple[list[float], list[torch.Tensor]]:
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank * 10 + step))
        loss = model(x).square().sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses, [p.full_tensor() for p in model.parameters()]


@pytest.mark.distributed(world_size=2)
def test_custom_collectives_carry_the_units_traffic_with_the_same_numbers(
    rank, world_size, process_group
):
    """Custom all-gather and reduce-scatter on one unit: each of its collectives goes through
    them, on buffers they allocate, summing, and training gives the default path's numbers."""
    expected_losses, expected_params = _train(_shard(_model(), process_group), rank)

    model = _shard(_model(), process_group)
    gather, scatter = _RecordingAllGather(), _RecordingReduceScatter()
    model[0].set_custom_all_gather(gather)
    model[0].set_custom_reduce_scatter(scatter)
    losses, params = _train(model, rank)

    assert losses == expected_losses
    for got, want in zip(params, expected_params, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # model[0]: one all-gather in forward and one in backward per step (it reshards after
    # forward); one reduce-scatter per step, whose input and output come from ``allocate``.
    assert gather.calls == 6 and len(gather.allocated) == 6
    assert scatter.ops == [dist.ReduceOp.SUM] * 3 and len(scatter.allocated) == 6
    numel = 7 * 6 + 7  # model[0]'s parameters; padded shards and tags make the buffers larger
    assert all(size[0] >= numel and dtype == torch.float32 for size, dtype in gather.allocated)


@pytest.mark.distributed(world_size=2)
def test_allocating_from_the_process_group_keeps_the_numbers_and_yields_to_custom_comms(
    rank, process_group
):
    """``set_allocate_memory_from_process_group_for_comm``: gloo has no allocator of its own,
    so buffers come from ``torch.empty`` and the numbers stay the same. A custom comm set
    afterwards replaces it; set before, it makes the call raise FSDP2's AssertionError."""
    expected_losses, _ = _train(_shard(_model(), process_group), rank)
    model = _shard(_model(), process_group)
    for module in (model, model[0], model[2]):
        module.set_allocate_memory_from_process_group_for_comm(True)
    assert _train(model, rank)[0] == expected_losses

    model[0].set_custom_all_gather(_RecordingAllGather())
    with pytest.raises(AssertionError, match=r"all-gather is custom \(_RecordingAllGather\)"):
        model[0].set_allocate_memory_from_process_group_for_comm(True)
    model[2].set_custom_reduce_scatter(_RecordingReduceScatter())
    with pytest.raises(AssertionError, match=r"reduce-scatter is custom"):
        model[2].set_allocate_memory_from_process_group_for_comm(False)
    model.set_allocate_memory_from_process_group_for_comm(False)  # the root's own: no custom


@pytest.mark.distributed(world_size=2)
def test_bad_custom_comms_raise_naming_the_method(rank, process_group):
    model = _shard(_model(), process_group)
    with pytest.raises(TypeError, match=r"^set_custom_all_gather: expected an object with alloc"):
        model.set_custom_all_gather(dist.all_gather_into_tensor)
    with pytest.raises(TypeError, match=r"^set_custom_reduce_scatter: .* got int"):
        model.set_custom_reduce_scatter(3)

    class Short(_RecordingAllGather):
        def allocate(self, size, *, dtype, device):
            return torch.empty(size[0] - 1, dtype=dtype, device=device)

    broken = copy.deepcopy(_model())
    broken = _shard(broken, process_group)
    broken[0].set_custom_all_gather(Short())
    with pytest.raises(ValueError, match=r"Short.allocate\(\(\d+,\), dtype=torch.float32.*must"):
        broken(torch.ones(2, 6))
