"""Fixtures that request rank fixtures run on the ranks: scopes, parameters, yield teardown,
``request``, errors per rank. Run by tests/plugin/test_rank_fixtures.py, which reads the
teardown record (SCENARIO_RECORD) after the session."""

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

RECORD = os.environ["SCENARIO_RECORD"]


def _note(what, rank):
    with open(RECORD, "a") as f:
        f.write(json.dumps({"what": what, "rank": rank, "pid": os.getpid()}) + "\n")


@pytest.fixture
def ddp_model(process_group, device, rank):
    # The idiomatic way to build the sharded model once per test: it used to get a placeholder
    # and fail deep in torch ('RankFixture' object has no attribute 'size').
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        nn.Linear(4, 2).to(device), process_group=process_group
    )
    _note("ddp_model up", rank)
    yield model
    _note("ddp_model down", rank)


@pytest.fixture
def trained(ddp_model, rank):
    loss = ddp_model(torch.full((3, 4), float(rank))).sum()
    loss.backward()
    return ddp_model


@pytest.fixture(params=["sum", "max"])
def reduced(request, rank, process_group):
    t = torch.tensor([float(rank + 1)])
    op = dist.ReduceOp.SUM if request.param == "sum" else dist.ReduceOp.MAX
    dist.all_reduce(t, op=op, group=process_group)
    request.addfinalizer(lambda: _note(f"finalizer {request.param}", rank))
    return request.param, t.item()


@pytest.fixture(scope="module")
def warm_table(process_group, rank):
    _note("table up", rank)
    table = {"uses": 0, "world": dist.get_world_size(process_group)}
    yield table
    _note("table down", rank)


@pytest.fixture
def broken_on_one(rank):
    if rank == 1:
        raise RuntimeError("rank 1 cannot set this up")
    return rank


@pytest.fixture
def fails_teardown(rank):
    yield rank
    if rank == 0:
        raise ValueError("rank 0's teardown broke")


@pytest.mark.distributed(world_size=2)
def test_a_fixture_builds_the_model_on_each_rank(trained, rank):
    grad = trained.module.weight.grad
    assert torch.equal(grad, torch.full((2, 4), 1.5))  # averaged over ranks 0 and 1


@pytest.mark.distributed(world_size=2)
def test_parametrized_fixture(reduced, rank):
    op, value = reduced
    assert value == (3.0 if op == "sum" else 2.0)


@pytest.mark.distributed(world_size=2)
def test_module_scope_first(warm_table):
    warm_table["uses"] += 1
    assert warm_table == {"uses": 1, "world": 2}


@pytest.mark.distributed(world_size=2)
def test_module_scope_second(warm_table):
    warm_table["uses"] += 1
    assert warm_table["uses"] == 2  # the same value, kept on the warm ranks


@pytest.mark.distributed(world_size=2)
def test_setup_error_is_the_ranks_failure(broken_on_one):
    pass


@pytest.mark.distributed(world_size=2)
def test_teardown_error_is_the_ranks_failure(fails_teardown):
    pass


@pytest.mark.distributed(world_size=2, mode="thread")
def test_thread_mode(reduced, rank):
    assert reduced[1] in (3.0, 2.0)


@pytest.mark.distributed(world_size=2, mode="local")
def test_local_mode(trained, rank):
    assert trained.module.weight.grad is not None


@pytest.fixture
def mesh(world_size):
    # Only world_size requested: a mesh is a rank's, so this runs on the ranks too.
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world_size,))


@pytest.mark.distributed(world_size=2)
def test_a_mesh_from_world_size_alone(mesh, rank):
    assert mesh.get_local_rank() == rank and mesh.size() == 2


@pytest.mark.distributed(world_size=2, mode="thread")
def test_a_mesh_from_world_size_alone_thread_mode(mesh, rank):
    assert mesh.get_local_rank() == rank and mesh.size() == 2


def test_not_distributed(ddp_model):
    pass
