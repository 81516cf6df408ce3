"""The recorder: what it records per engine, and each assertion failing on a broken engine or
model with a message that says what is wrong."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_testing.engines import get_engine
from fsdp_testing.patching import patch_reshard
from fsdp_testing.recording import (
    CollectiveRecord,
    OffloadRecord,
    ReshardRecord,
    UnshardRecord,
    record_comms,
    record_fsdp,
)

from .._spellings import REDUCE_SCATTER

ENGINES = ["fsdp_core", "torch_fsdp1", "torch_fsdp2"]
UNITS = ["0", "2", "4"]  # the three linears of the stack, by FQN


def _mlp_stack(engine_name: str, group: dist.ProcessGroup, **fsdp_kwargs: Any) -> nn.Module:
    engine = get_engine(engine_name)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    policy = engine.module_wrap_policy({nn.Linear})
    return engine.wrap(model, group, auto_wrap_policy=policy, **fsdp_kwargs)


def _train(model: nn.Module, rank: int, rec: Any = None, steps: int = 2) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    for _ in range(steps):
        model(x).sum().backward()
        if rec is not None:
            rec.next_step()


def _check_stack_recording(engine_name: str, rank: int, world_size: int, group: Any) -> None:
    model = _mlp_stack(engine_name, group)
    with record_fsdp(model) as rec:
        _train(model, rank, rec)
    # Same counts for all three engines (FULL_SHARD, three non-root units).
    rec.assert_count("all_gather", 6, step=1)
    rec.assert_count("reduce_scatter", 3, step=1)
    assert {r.rank for r in rec.records} == {rank}
    gathers = rec.collectives("all_gather", step=1)
    assert all(g.group_size == world_size and g.dtype == "float32" for g in gathers)
    # Unit 0 (8x8 + 8 params): the all-gather output is the full padded unit (fsdp_core: plus
    # its order tag, two elements per rank; see [Note: order check] in fsdp_core).
    tag = 2 * world_size if engine_name == "fsdp_core" else 0
    assert sorted({(g.unit, g.bytes) for g in gathers})[0] == ("0", (64 + 8 + tag) * 4)
    assert rec.unshard_order("forward", step=1) == UNITS
    rec.assert_resharded(after="forward")
    rec.assert_resharded(after="backward")
    # Backward prefetch (BACKWARD_PRE for FSDP1 by default and FSDP2 always; the core's
    # default is None): the units before the last, in reverse.
    if engine_name != "fsdp_core":
        rec.assert_prefetch_order(["2", "0"], step=1)
    rec.assert_params_on("cpu", when="unsharded")
    rec.assert_params_on("cpu", when="resharded")
    inferred = {r.inferred for r in rec.select(UnshardRecord)}
    assert inferred == ({False} if engine_name == "fsdp_core" else {True})


@pytest.mark.parametrize("engine_name", ENGINES)
@pytest.mark.distributed(world_size=2)
def test_records_agree_across_engines_process_ranks(engine_name, rank, world_size, process_group):
    _check_stack_recording(engine_name, rank, world_size, process_group)


@pytest.mark.parametrize("engine_name", ENGINES)
@pytest.mark.distributed(world_size=2, mode="thread")
def test_records_agree_across_engines_thread_ranks(engine_name, rank, world_size, process_group):
    _check_stack_recording(engine_name, rank, world_size, process_group)


@pytest.mark.distributed(world_size=4, mode="thread")
def test_core_backward_prefetch_order_at_world_size_4(rank, process_group):
    from fsdp_core import BackwardPrefetch

    model = _mlp_stack("fsdp_core", process_group, backward_prefetch=BackwardPrefetch.BACKWARD_PRE)
    with record_fsdp(model) as rec:
        _train(model, rank, rec)
    rec.assert_prefetch_order(["2", "0"], step=1)
    rec.assert_unshard_order(["4", "2", "0"], reason=("backward", "backward_prefetch"), step=1)
    assert rec.collectives("all_gather")[0].group_size == 4


@pytest.mark.distributed(world_size=2, mode="thread")
def test_prefetch_out_of_order_fails_naming_both_orders(rank, process_group):
    # Deliberately wrong explicit prefetching: unit 4's backward prefetches unit 0, skipping 2.
    model = _mlp_stack("torch_fsdp2", process_group)
    model[4].set_modules_to_backward_prefetch([model[0]])
    model[2].set_modules_to_backward_prefetch([])
    with record_fsdp(model) as rec:
        _train(model, rank, rec)
    with pytest.raises(
        AssertionError,
        match=r"\[rank \d\] expected units unsharded \(reason backward_prefetch in step 1\) "
        r"in the order \['2', '0'\], recorded \['0'\]",
    ):
        rec.assert_prefetch_order(["2", "0"], step=1)


@pytest.mark.distributed(world_size=2, mode="thread")
def test_skipped_reshard_fails_naming_the_unit(rank, process_group):
    from fsdp_core._unit import FSDPUnit

    original = FSDPUnit.reshard

    def keeps_unit_2_after_forward(unit: FSDPUnit, reason: str = "explicit") -> None:
        if unit.name == "2" and reason == "forward":
            return  # the deliberate bug: unit 2 stays unsharded until backward
        original(unit, reason)

    model = _mlp_stack("fsdp_core", process_group)
    with patch_reshard(keeps_unit_2_after_forward, engine="fsdp_core"), record_fsdp(model) as rec:
        _train(model, rank, rec)
    rec.assert_resharded(after="backward")
    with pytest.raises(
        AssertionError,
        match=r"unit '2' unsharded for forward in step 0 was never resharded after forward",
    ):
        rec.assert_resharded(after="forward")
    # The same bug shows in the communication: unit 2 is not gathered again for backward.
    with pytest.raises(AssertionError, match=r"expected 6 all_gather collective\(s\) in step 1, "):
        rec.assert_count("all_gather", 6, step=1)


@pytest.mark.parametrize("engine_name", ["fsdp_core", "torch_fsdp1"])
@pytest.mark.distributed(world_size=2, mode="thread")
def test_graph_order(engine_name, rank, process_group):
    class Crossed(nn.Module):
        """Defines a before b but runs b first: the graph order is [b, a, root]."""

        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(self.b(x))

    engine = get_engine(engine_name)
    torch.manual_seed(0)
    policy = engine.module_wrap_policy({nn.Linear})
    model = engine.wrap(Crossed(), process_group, auto_wrap_policy=policy)
    with record_fsdp(model) as rec:
        model(torch.ones(2, 4)).sum().backward()
    rec.assert_graph_order(model, [model.b, model.a, model])
    source = "_fsdp_graph_order" if engine_name == "fsdp_core" else "recorded forwards"
    with pytest.raises(
        AssertionError,
        match=rf"expected graph order \['a', 'b', ''\]; according to .*{source} it is "
        r"\['b', 'a', ''\]",
    ):
        rec.assert_graph_order(model, [model.a, model.b, model])


@pytest.mark.distributed(world_size=2, mode="thread")
def test_offload_checks_on_fsdp2(rank, process_group):
    from torch.distributed.fsdp import CPUOffload

    offloaded = _mlp_stack("torch_fsdp2", process_group, cpu_offload=CPUOffload(True))
    with record_fsdp(offloaded) as rec:
        _train(offloaded, rank, steps=1)
    rec.assert_offloaded()
    kept = _mlp_stack("torch_fsdp2", process_group)
    with record_fsdp(kept) as rec:
        _train(kept, rank, steps=1)
    with pytest.raises(AssertionError, match=r"units \['0', '2', '4'\] are not offloaded"):
        rec.assert_offloaded()


@pytest.mark.distributed(world_size=2, mode="thread")
def test_params_left_on_the_wrong_device_fail_with_the_devices(rank):
    # A deliberately broken engine: it reports its sharded parameters still on the GPU after
    # a reshard (published through fsdp_core's event hook, as the core would).
    from fsdp_core import events

    with record_fsdp(engine="fsdp_core") as rec:
        events.publish(events.Unshard(unit="0", reason="forward", devices=("cuda:0",), rank=rank))
        events.publish(events.Reshard(unit="0", reason="forward", devices=("cuda:0",), rank=rank))
        # Another thread's event (no rank of this world): a recorder keeps only its own rank's.
        events.publish(events.Reshard(unit="9", reason="forward", devices=("cpu",), rank=99))
    assert [type(r) for r in rec.records] == [UnshardRecord, ReshardRecord]
    rec.assert_params_on("cuda", when="unsharded")
    with pytest.raises(
        AssertionError,
        match=r"expected parameters on cpu when resharded, but 1 of 1 transitions left them "
        r"elsewhere: '0' \(forward, step 0\): \['cuda:0'\]",
    ):
        rec.assert_offloaded()


@pytest.mark.distributed(world_size=2, mode="thread")
def test_core_offload_copies_are_recorded(rank, process_group):
    from fsdp_core import CPUOffload

    model = _mlp_stack("fsdp_core", process_group, cpu_offload=CPUOffload(offload_params=True))
    with record_fsdp(model) as rec:
        _train(model, rank, steps=1)
    rec.assert_offloaded()
    directions = {r.direction for r in rec.select(OffloadRecord)}
    assert directions == {"to_device", "to_host"}
    # Without offload the shards stay where they are (here the CPU too): only the missing
    # copies give it away.
    kept = _mlp_stack("fsdp_core", process_group)
    with record_fsdp(kept) as rec:
        _train(kept, rank, steps=1)
    with pytest.raises(
        AssertionError, match=r"unshards with no copy of the CPU shard to the device before them"
    ):
        rec.assert_offloaded()


@pytest.mark.distributed(world_size=2, mode="thread")
def test_count_failure_lists_what_ran(rank, process_group):
    model = _mlp_stack("fsdp_core", process_group)
    with record_fsdp(model) as rec:
        _train(model, rank, steps=1)
    with pytest.raises(
        AssertionError,
        match=r"\[rank \d\] expected 2 reduce_scatter collective\(s\), recorded 3; all "
        rf"collectives: \{{.*'{REDUCE_SCATTER}': 3",
    ):
        rec.assert_count("reduce_scatter", 2)


@pytest.mark.distributed(world_size=2)
def test_chrome_trace_has_a_track_per_rank(rank, process_group, tmp_path):
    model = _mlp_stack("torch_fsdp2", process_group)
    with record_fsdp(model) as rec:
        _train(model, rank, steps=1)
    path = rec.export_chrome_trace(tmp_path / "trace.json", all_ranks=True)
    if rank != 0:
        return
    trace = json.loads(path.read_text())["traceEvents"]
    spans = [e for e in trace if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    names = {e["args"]["name"] for e in trace if e["name"] == "process_name"}
    assert names == {"rank 0", "rank 1"}
    gathers = [e for e in spans if e["cat"] == "collective" and e["pid"] == 1]
    assert len(gathers) == 9 and all(e["dur"] > 0 and e["ts"] > 0 for e in gathers)
    assert any(e["name"] == "unshard 0 (forward)" for e in spans)
    assert all(isinstance(e["args"].get("seq"), int) for e in spans)
    assert len([r for r in rec.records if isinstance(r, CollectiveRecord)]) == 9


def _exchange(rank: int) -> None:
    t = torch.ones(3)
    if rank == 0:
        dist.send(t, 1, tag=7)
        dist.irecv(t, 1).wait()
    else:
        dist.recv(t, 0, tag=7)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, t * 2, 0)]):
            work.wait()
    dist.broadcast(t, 0)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)


def _check_p2p_records(rank: int) -> None:
    with record_comms() as rec:
        _exchange(rank)
    if rank == 0:
        assert rec.p2p_order() == [("send", 1), ("recv", 1)]
        send, recv = rec.p2p()
        assert (send.op, send.tag, send.blocking, send.bytes, send.shape) == (
            "send",
            7,
            True,
            12,
            (3,),
        )
        assert (recv.op, recv.blocking, recv.batch) == ("irecv", False, None)
        assert recv.completed_us is not None and recv.completed_us >= recv.ts_us
        rec.assert_p2p_bytes({("send", 1): 12, ("recv", 1): 12})
    else:
        rec.assert_p2p_order([("recv", 0), ("send", 0)])
        assert rec.p2p("send")[0].batch == "batch_isend_irecv"
        assert rec.count("send") == 1 and rec.count("isend") == 1 and rec.count("recv") == 1
    (bcast,) = rec.collectives("broadcast")
    (reduced,) = rec.collectives("all_reduce")
    assert (bcast.root, reduced.reduce_op, reduced.root) == (0, "MAX", None)
    with pytest.raises(AssertionError, match=r"expected point-to-point ops \[\('send', 5\)\]"):
        rec.assert_p2p_order([("send", 5)])
    with pytest.raises(
        AssertionError, match=r"bytes differ: .*send to rank 9: expected 1, recorded 0"
    ):
        rec.assert_p2p_bytes({("send", 9): 1})


@pytest.mark.distributed(world_size=2)
def test_point_to_point_ops_are_recorded_process_ranks(rank):
    _check_p2p_records(rank)


@pytest.mark.distributed(world_size=2, mode="thread")
def test_point_to_point_ops_are_recorded_thread_ranks(rank):
    _check_p2p_records(rank)


@pytest.mark.distributed(world_size=2, mode="local")
def test_point_to_point_ops_are_recorded_local_ranks(rank):
    _check_p2p_records(rank)


@pytest.mark.distributed(world_size=2)
def test_recording_keeps_torch_distributed_functions_as_they_are(rank):
    import torch.distributed.distributed_c10d as c10d

    functions = {name: getattr(dist, name) for name in ("isend", "irecv", "all_reduce", "send")}
    with record_comms():
        # torch checks P2POp's op by identity: a recorder that wrapped dist.isend broke it.
        assert all(getattr(dist, n) is f for n, f in functions.items())
        assert dist.isend is c10d.isend
        _exchange(rank)


class _AllReduceInForward(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x


@pytest.mark.distributed(world_size=4)
def test_records_name_the_phase_and_the_mesh_dims(rank):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    linear = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(linear.parameters(), lr=0.1)

    def reduce_over_dp(grad: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(grad, group=mesh.get_group("dp"))
        return grad

    linear.weight.register_hook(reduce_over_dp)
    with record_comms(mesh=mesh) as rec:
        x = _AllReduceInForward()(torch.ones(2, 4))
        linear(x).sum().backward()
        optimizer.step()
        dist.broadcast(torch.ones(1), group=mesh.get_group("tp"), group_src=0)
    assert [(r.op, r.phase, r.mesh_dims) for r in rec.collectives()] == [
        ("all_reduce", "forward", ("dp", "tp")),
        ("all_reduce", "backward", ("dp",)),
        ("broadcast", "outside", ("tp",)),
    ]
    rec.assert_count("all_reduce", 1, phase="backward", mesh_dim="dp")
    with pytest.raises(AssertionError, match=r"in the forward phase over mesh dim 'tp'"):
        rec.assert_count("all_reduce", 2, phase="forward", mesh_dim="tp")


@pytest.mark.distributed(world_size=2, mode="thread")
def test_dtensor_redistributions_are_counted_on_request(rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    sharded = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
    with record_comms(dtensor=True) as rec:
        sharded.redistribute(mesh, [Replicate()])
    rec.assert_dtensor_comms({"all_gather_into_tensor": 1})
    with pytest.raises(AssertionError, match=r"expected DTensor collectives \{'all_reduce': 1\}"):
        rec.assert_dtensor_comms({"all_reduce": 1})
    with record_comms() as plain, pytest.raises(ValueError, match="dtensor=True"):
        plain.dtensor_comms()


def _count_a_tp_mlp():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    with record_comms(dtensor=True) as rec:
        model(torch.randn(4, 8, requires_grad=True)).sum().backward()
    rec.assert_dtensor_comms({"all_reduce": 1}, module="2", phase="forward")
    rec.assert_dtensor_comms({}, module="0", phase="forward")


# CommDebugMode learns the running module from torch's process-wide module hooks: with ranks as
# threads, each rank's tracker heard the other ranks' modules too, warned "The module hierarchy
# tracking maybe be messed up" (an error under -W error) and could count a collective for
# another rank's module. Each rank hears its own thread only.
@pytest.mark.filterwarnings("error:The module hierarchy tracking")
@pytest.mark.distributed(world_size=2, mode="thread")
def test_dtensor_counts_per_module_in_thread_mode():
    _count_a_tp_mlp()


@pytest.mark.filterwarnings("error:The module hierarchy tracking")
@pytest.mark.distributed(world_size=2, mode="local")
def test_dtensor_counts_per_module_in_local_mode():
    _count_a_tp_mlp()
