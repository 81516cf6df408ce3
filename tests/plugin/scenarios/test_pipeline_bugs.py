"""A user's pipeline suite, with bugs planted on purpose: each planted test must fail with a
report that names the ranks, the ops and their peers, and the correct ones must pass, in
process, thread and local mode. Run by tests/plugin/test_pipeline_bugs.py.

Every test has a 60 s timeout: a wait cycle must end it long before (the busy peer's test,
which no cycle ends, has 4 s).
"""

import copy
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import pipelining

from fsdp_testing.parity import check_parity

D, MB, N_MB = 4, 2, 2  # width, microbatch rows, microbatches


def ring(rank, world_size):
    """One step of a ring exchange with P2POp and batch_isend_irecv."""
    import torch.distributed.distributed_c10d as c10d

    assert dist.isend is c10d.isend and dist.irecv is c10d.irecv  # torch's own functions
    send, recv = torch.full((2,), float(rank)), torch.empty(2)
    ops = [
        dist.P2POp(dist.isend, send, (rank + 1) % world_size),
        dist.P2POp(dist.irecv, recv, (rank - 1) % world_size, tag=0),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    assert recv.tolist() == [float((rank - 1) % world_size)] * 2


def torch_schedule(rank, world_size, name):
    torch.manual_seed(0)
    per_rank = 2 if name == "ScheduleInterleaved1F1B" else 1
    n = world_size * per_rank
    full = nn.Sequential(*[nn.Linear(D, D) for _ in range(n)])
    ids = [rank + k * world_size for k in range(per_rank)]
    stages = [pipelining.PipelineStage(copy.deepcopy(full[i]), i, n, "cpu") for i in ids]
    loss_fn = nn.MSELoss(reduction="sum")
    cls = getattr(pipelining, name)
    sched = cls(stages if per_rank > 1 else stages[0], 4, loss_fn=loss_fn, scale_grads=False)
    x, y = torch.randn(8, D), torch.randn(8, D)
    sched.step(x) if rank == 0 else sched.step(target=y)
    loss_fn(full(x), y).backward()
    for i, stage in zip(ids, stages, strict=True):
        for got, want in zip(stage.submod.parameters(), full[i].parameters(), strict=True):
            torch.testing.assert_close(got.grad, want.grad)


def gpipe(stage_module, rank, batch, target, *, scale=True):
    """A 2-stage GPipe step with blocking send/recv: every forward, then every backward; the
    loss on every rank."""
    outs, ins, parts = [], [], []
    for m in range(N_MB):
        if rank == 0:
            out = stage_module(batch.chunk(N_MB)[m])
            dist.send(out.detach(), 1)
            outs.append(out)
        else:
            x = torch.empty(MB, D)
            dist.recv(x, 0)
            x.requires_grad_(True)
            part = nn.functional.mse_loss(stage_module(x), target.chunk(N_MB)[m])
            parts.append(part / N_MB if scale else part)  # planted: scale=False forgets it
            ins.append(x)
    for m in range(N_MB):
        if rank == 0:
            grad = torch.empty(MB, D)
            dist.recv(grad, 1)
            outs[m].backward(grad)
        else:
            parts[m].backward()
            dist.send(ins[m].grad, 0)
    loss = torch.stack(parts).sum().detach() if parts else torch.zeros(())
    dist.broadcast(loss, 1)
    return loss


def pipeline_parity(rank, *, scale=True):
    def build():
        return nn.Sequential(nn.Linear(D, D), nn.Linear(D, D))

    def batch(i, r):
        g = torch.Generator().manual_seed(i)
        return torch.randn(MB * N_MB, D, generator=g), torch.randn(MB * N_MB, D, generator=g)

    def wrap(model, group):
        stage = model[dist.get_rank(group)]
        stage.full = model
        return stage

    def full_state(stage):
        out = {}
        for name, p in stage.full.named_parameters():
            owner = int(name.split(".")[0])
            value = p.detach().clone()
            dist.broadcast(value, owner)
            out[name] = value
        return out

    check_parity(
        build,
        wrap,
        batch,
        loss_fn=lambda model, data: nn.functional.mse_loss(model(data[0]), data[1]),
        step_fn=lambda stage, data: gpipe(stage, rank, *data, scale=scale),
        full_state=full_state,
        num_steps=2,
    )


def deadlock(rank):
    t = torch.ones(D)
    dist.all_reduce(t)
    dist.recv(t, 1 - rank)  # planted: both ranks receive first
    dist.send(t, 1 - rank)


def wrong_peer(rank):
    t = torch.ones(D)
    if rank == 0:
        dist.send(t, 2)  # planted: stage 0's neighbour is rank 1
    elif rank == 1:
        dist.recv(t, 0)


def order(rank):
    """The last stage sends its gradient back before receiving the next activation, while the
    first stage sends the next activation before receiving the gradient: both sends wait."""
    a = torch.ones(D)
    dist.send(a, 1 - rank)  # planted: the ranks' first ops must pair a send with a recv
    dist.recv(a, 1 - rank)


def size_mismatch(rank):
    if rank == 0:
        dist.send(torch.ones(2 * D), 1)  # planted: twice the receiver's buffer
    else:
        dist.recv(torch.empty(D), 0)


def self_send(rank):
    dist.isend(torch.ones(D), rank).wait()  # planted: (rank + 1) % world_size was meant


def tag_mismatch(rank):
    t = torch.ones(D)
    if rank == 0:
        dist.send(t, 1, tag=1)  # planted: the receiver waits for tag 0
    else:
        dist.recv(t, 0, tag=0)


def busy_peer(rank):
    t = torch.ones(D)
    if rank == 0:
        dist.recv(t, 1)
    else:
        for _ in range(600):
            time.sleep(0.1)  # planted: busy past the timeout before its send
        dist.send(t, 0)


def dtype_mismatch(rank):
    if rank == 0:
        dist.send(torch.ones(D, dtype=torch.float32), 1)
    else:
        got = torch.empty(D // 2, dtype=torch.float64)
        dist.recv(got, 0)  # planted: the sender's 16 bytes, read as float64
        assert got.dtype == torch.float64  # gloo allows it: the test passes, with a warning


def unmet(rank):
    if rank == 0:
        dist.isend(torch.ones(D), 2)  # planted: sent to a rank that never receives
    dist.barrier()


@pytest.mark.distributed(world_size=3)
def test_ring_process(rank, world_size):
    ring(rank, world_size)


@pytest.mark.distributed(world_size=3, mode="thread")
def test_ring_thread(rank, world_size):
    ring(rank, world_size)


@pytest.mark.distributed(world_size=3, mode="local")
def test_ring_local(rank, world_size):
    ring(rank, world_size)


SCHEDULES = ["ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B"]


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.distributed(world_size=2)
def test_torch_schedule_process(rank, world_size, name):
    torch_schedule(rank, world_size, name)


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.distributed(world_size=2, mode="thread")
def test_torch_schedule_thread(rank, world_size, name):
    torch_schedule(rank, world_size, name)


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.distributed(world_size=2, mode="local")
def test_torch_schedule_local(rank, world_size, name):
    torch_schedule(rank, world_size, name)


@pytest.mark.distributed(world_size=2)
def test_gpipe_parity_process(rank):
    pipeline_parity(rank)


@pytest.mark.distributed(world_size=2, mode="local")
def test_gpipe_parity_local(rank):
    pipeline_parity(rank)


@pytest.mark.distributed(world_size=2, timeout=60)
def test_grad_scale_process(rank):
    pipeline_parity(rank, scale=False)


@pytest.mark.distributed(world_size=2, mode="local", timeout=60)
def test_grad_scale_local(rank):
    pipeline_parity(rank, scale=False)


@pytest.mark.distributed(world_size=2, timeout=60)
def test_deadlock_process(rank):
    deadlock(rank)


@pytest.mark.distributed(world_size=2, mode="thread", timeout=60)
def test_deadlock_thread(rank):
    deadlock(rank)


@pytest.mark.distributed(world_size=2, mode="local", timeout=60)
def test_deadlock_local(rank):
    deadlock(rank)


@pytest.mark.distributed(world_size=3, timeout=60)
def test_wrong_peer_process(rank):
    wrong_peer(rank)


@pytest.mark.distributed(world_size=3, mode="thread", timeout=60)
def test_wrong_peer_thread(rank):
    wrong_peer(rank)


@pytest.mark.distributed(world_size=3, mode="local", timeout=60)
def test_wrong_peer_local(rank):
    wrong_peer(rank)


@pytest.mark.distributed(world_size=2, timeout=60)
def test_order_process(rank):
    order(rank)


@pytest.mark.distributed(world_size=2, mode="local", timeout=60)
def test_order_local(rank):
    order(rank)


@pytest.mark.distributed(world_size=2, timeout=60)
def test_size_process(rank):
    size_mismatch(rank)


@pytest.mark.distributed(world_size=2, mode="local", timeout=60)
def test_size_local(rank):
    size_mismatch(rank)


@pytest.mark.distributed(world_size=2, timeout=60)
def test_self_send_process(rank):
    self_send(rank)


@pytest.mark.distributed(world_size=2, mode="local", timeout=60)
def test_self_send_local(rank):
    self_send(rank)


@pytest.mark.distributed(world_size=3, timeout=60)
def test_unmet_process(rank):
    unmet(rank)


@pytest.mark.distributed(world_size=3, mode="local", timeout=60)
def test_unmet_local(rank):
    unmet(rank)


@pytest.mark.distributed(world_size=2, timeout=60)
def test_tag_process(rank):
    tag_mismatch(rank)


@pytest.mark.distributed(world_size=2, mode="thread", timeout=60)
def test_tag_thread(rank):
    tag_mismatch(rank)


@pytest.mark.distributed(world_size=2, mode="local", timeout=60)
def test_tag_local(rank):
    tag_mismatch(rank)


@pytest.mark.distributed(world_size=2, timeout=4)
def test_busy_process(rank):
    busy_peer(rank)


@pytest.mark.distributed(world_size=2, mode="thread", timeout=4)
def test_busy_thread(rank):
    busy_peer(rank)


@pytest.mark.distributed(world_size=2)
def test_dtype_process(rank):
    dtype_mismatch(rank)


@pytest.mark.distributed(world_size=2, mode="thread")
def test_dtype_thread(rank):
    dtype_mismatch(rank)


@pytest.mark.distributed(world_size=2, mode="local")
def test_dtype_local(rank):
    dtype_mismatch(rank)


@pytest.mark.distributed(world_size=2)
def test_after_the_bugs(rank, world_size):
    ring(rank, world_size)  # the ranks after a crash, a kill and stuck ranks serve normally
