"""The harness's recorder sees a graph-mode step: its collectives (op, bytes, unit, order), its
unshards and their reasons, so the graph-order and prefetch-order assertions hold on it."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_core import fully_shard
from fsdp_core.graph import trace_train_step
from fsdp_core.graph.passes import bucket_reduce_scatters, prefetch, reshard_after_forward
from fsdp_testing.recording import record_fsdp


@pytest.mark.distributed(world_size=2)
def test_recorder_sees_the_graph_collectives_and_unshards_in_graph_order(
    rank, process_group
) -> None:
    mesh = DeviceMesh.from_group(process_group, "cpu")
    torch.manual_seed(0)
    dim = 8
    model = nn.Sequential(*[nn.Sequential(nn.Linear(dim, dim), nn.Tanh()) for _ in range(3)])
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)  # the root owns no parameter: it is no unit of the graph
    batch = (torch.randn(4, dim),)
    step = trace_train_step(model, lambda m, x: m(x).sum(), batch)
    plain_loss = step(*batch)
    step = step.with_passes(reshard_after_forward, prefetch)
    for param in model.parameters():
        param.grad = None
    with record_fsdp(model) as rec:
        loss = step(*batch)
    assert torch.equal(loss, plain_loss)

    unit_bytes = (dim * dim + dim) * 4  # full weight and bias; 8 rows shard evenly
    gathers = rec.collectives("all_gather")
    # Forward 0, 1, 2; backward 2 and 1 again (block 0's backward reads none of its parameters:
    # the batch needs no gradient).
    assert [r.unit for r in gathers] == ["0", "1", "2", "2", "1"]
    assert {r.bytes for r in gathers} == {unit_bytes}
    scatters = rec.collectives("reduce_scatter")
    assert [r.unit for r in scatters] == ["2", "1", "0"]
    assert {r.bytes for r in scatters} == {unit_bytes}
    assert all(r.group_size == 2 and r.dtype == "float32" for r in [*gathers, *scatters])

    rec.assert_graph_order(model, [model[0], model[1], model[2]])
    # prefetch(depth=1) issues each all-gather after the previous one's wait: all but the first.
    rec.assert_unshard_order(["0"], reason="forward")
    rec.assert_prefetch_order(["1", "2"], direction="forward")
    rec.assert_prefetch_order(["2", "1"], direction="backward")
    with pytest.raises(AssertionError, match="expected graph order"):
        rec.assert_graph_order(model, [model[1], model[0], model[2]])


@pytest.mark.distributed(world_size=2)
def test_a_bucketed_collective_is_recorded_once_for_its_units(rank, process_group) -> None:
    mesh = DeviceMesh.from_group(process_group, "cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    batch = (torch.randn(2, 4),)
    step = trace_train_step(model, lambda m, x: m(x).sum(), batch)
    step = step.with_passes(functools.partial(bucket_reduce_scatters, bucket_bytes=1 << 20))
    with record_fsdp(model) as rec:
        step(*batch)
    assert [r.unit for r in rec.collectives("reduce_scatter")] == ["1+0"]
    assert rec.collectives("reduce_scatter")[0].bytes == 2 * 4 * 4 * 4
    assert rec.unshard_order() == ["0", "1"]
