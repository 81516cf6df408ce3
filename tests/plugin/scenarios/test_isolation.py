"""Tests that change process state, each followed by one that checks the state was reset.

Run in order, in one warm pool, by tests/plugin/test_pool.py.
"""

import importlib
import json
import os
import sys

import pytest
import torch
import torch.distributed as dist

RECORD = os.environ["SCENARIO_RECORD"]


def _note(name, rank):
    with open(RECORD, "a") as f:
        f.write(json.dumps({"test": name, "rank": rank, "pid": os.getpid()}) + "\n")


@pytest.mark.distributed(world_size=2)
def test_a_changes_state(rank):
    _note("a", rank)
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(1234 + rank)
    local = dist.new_group([0, 1], use_local_synchronization=True)  # named by its ranks
    dist.all_reduce(torch.ones(1), group=local)
    group = dist.new_group([0, 1])
    assert _dtensor_sum(group) == 24  # leaves an entry in DTensor's sharding caches
    dist.all_reduce = lambda *a, **k: None
    torch.set_grad_enabled(False)
    dist.my_helper = "added by the test"
    importlib.import_module("torch.distributed._functional_collectives")  # a lazy submodule


@pytest.mark.distributed(world_size=2)
def test_b_sees_fresh_state(rank):
    _note("b", rank)
    assert torch.get_default_dtype() == torch.float32
    assert torch.is_grad_enabled()
    import torch.distributed.distributed_c10d as c10d

    assert len(c10d._world.pg_map) == 1, "the extra group was not destroyed"
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2, "all_reduce is still patched"
    assert not hasattr(dist, "my_helper"), "an attribute added by the previous test survived"
    if "torch.distributed._functional_collectives" in sys.modules:
        assert hasattr(dist, "_functional_collectives"), "a submodule lost its attribute"
    first = torch.rand(1).item()
    torch.manual_seed(0)
    gathered = [None, None]
    dist.all_gather_object(gathered, first)
    assert gathered[0] == gathered[1], "ranks do not start from the same RNG state"


@pytest.mark.distributed(world_size=2, timeout=20)
def test_b2_new_group_after_a_reset(rank):
    _note("b2", rank)
    # test_a created a group; its name must not be handed out again on the same warm ranks.
    group = dist.new_group([0, 1])
    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    assert t.item() == 2


@pytest.mark.distributed(world_size=2, timeout=20)
def test_b3_dtensor_on_a_new_group_over_the_same_ranks(rank):
    _note("b3", rank)
    # DTensor's caches compare meshes by ranks: test_a's destroyed group must not come back.
    assert _dtensor_sum(dist.new_group([0, 1])) == 24


@pytest.mark.distributed(world_size=2, timeout=20)
def test_b4_group_named_by_its_ranks_again(rank):
    # test_a made a group over the same ranks named by a hash of them (the same name again):
    # its rendezvous keys must not be found by this test's group.
    group = dist.new_group([0, 1], use_local_synchronization=True)
    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    assert t.item() == 2


def _dtensor_sum(group):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = DeviceMesh.from_group(group, "cpu")
    local = torch.ones(2, 3, dtype=torch.float32)
    return (DTensor.from_local(local, mesh, (Shard(0),)) * 2).detach().full_tensor().sum()


@pytest.mark.distributed(world_size=2)
def test_c_fails_with_stuck_peer(rank):
    _note("c", rank)
    if rank == 0:
        raise RuntimeError("boom")
    dist.barrier()


@pytest.mark.distributed(world_size=2)
def test_d_after_failure(rank):
    _note("d", rank)
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2


@pytest.mark.distributed(world_size=2)
def test_e_destroys_group(rank):
    _note("e", rank)
    dist.destroy_process_group()


@pytest.mark.distributed(world_size=2)
def test_f_after_destroy(rank):
    _note("f", rank)
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2


@pytest.mark.distributed(world_size=2)
def test_g_warm(rank):
    _note("g", rank)


@pytest.mark.no_dist_pool
@pytest.mark.distributed(world_size=2)
def test_h_fresh(rank):
    _note("h", rank)


@pytest.mark.distributed(world_size=2)
def test_i_warm_again(rank):
    _note("i", rank)


def _group_timeout_s():
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    return backend.options._timeout.total_seconds()


@pytest.mark.distributed(world_size=3, timeout=40)
def test_j_short_timeout(rank):
    _note("j", rank)
    assert _group_timeout_s() >= 40


@pytest.mark.distributed(world_size=3, timeout=95)
def test_k_longer_timeout_on_the_same_world(rank):
    _note("k", rank)
    # The warm ranks of test_j joined their group with a 40 s timeout: a collective of this
    # test would raise after 40 s although the test allows 95.
    assert _group_timeout_s() >= 95, f"process group timeout {_group_timeout_s()} s < 95 s"


@pytest.mark.distributed(world_size=3, timeout=40)
def test_l_shorter_timeout_reuses_the_longer_lived_ranks(rank):
    _note("l", rank)


@pytest.mark.distributed(world_size=2)
def test_m_breaks_the_reset_after_it(rank):
    _note("m", rank)
    if rank == 1:
        from fsdp_testing._rank.state_reset import RankState

        def broken(self):
            raise RuntimeError("reset broken on purpose")

        RankState.restore = broken


@pytest.mark.distributed(world_size=2)
def test_n_after_a_broken_reset(rank):
    _note("n", rank)
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2


@pytest.mark.distributed(world_size=2)
def test_o_fails_with_a_collective_in_flight(rank):
    _note("o", rank)
    if rank == 0:
        dist.all_reduce(torch.ones(1), async_op=True)  # never waited on
    raise AssertionError("every rank fails")


@pytest.mark.distributed(world_size=2, timeout=20)
def test_p_after_a_failure_on_every_rank(rank):
    _note("p", rank)
    t = torch.full((1,), float(rank + 1))
    dist.all_reduce(t)
    assert t.item() == 3


@pytest.mark.no_dist_pool  # ranks that say what they imported with their result only
@pytest.mark.distributed(world_size=2)
def test_q_imports_a_module(rank):
    _note("q", rank)
    import torch.distributed.pipelining  # noqa: F401  (imported by nothing before)


@pytest.mark.distributed(world_size=2)
def test_r_fails_on_every_rank(rank):
    _note("r", rank)
    raise AssertionError("every rank fails: the next test gets new ranks, not test_p's")


@pytest.mark.distributed(world_size=2)
def test_s_new_ranks_start_with_what_earlier_ranks_imported(rank):
    _note("s", rank)
    assert "torch.distributed.pipelining" in sys.modules, "the fork server did not preload it"
