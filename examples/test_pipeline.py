"""Testing a pipeline-parallel library of your own (``examples/pipeline.py``): both schedules
train as one process does, their messages go where and when they should, and torch's own
``torch.distributed.pipelining`` runs beside them under the same harness.

Run it with ``pytest examples/test_pipeline.py`` (or ``python examples/test_pipeline.py``).
"""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from pipeline import Stage, full_parameters, gpipe_step, one_f_one_b_step, split

from fsdp_testing.parity import check_parity
from fsdp_testing.recording import record_comms

WIDTH, BATCH, MICROBATCHES = 8, 16, 4
SCHEDULES = {"gpipe": gpipe_step, "1f1b": one_f_one_b_step}


def build() -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(4)])


def batch(i: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Every stage sees the same batch (the first reads the inputs, the last the targets): the
    # DDP reference then trains on it as one process would.
    g = torch.Generator().manual_seed(i)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)


def pipelined(schedule: str, world_size: int):
    """check_parity's wrap, step and full-state functions for one schedule."""
    step = SCHEDULES[schedule]

    def wrap(model: nn.Sequential, group: dist.ProcessGroup) -> Stage:
        rank = dist.get_rank(group)
        stage = Stage(split(model, world_size)[rank], rank, world_size, (BATCH // 4, WIDTH))
        stage.full = model  # the shapes full_parameters gathers into
        return stage

    def step_fn(stage: Stage, data: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return step(stage, *data, nn.functional.mse_loss, MICROBATCHES)

    def full_state(stage: Stage) -> dict[str, torch.Tensor]:
        return full_parameters(stage, stage.full)

    return wrap, step_fn, full_state


def check_schedule(world_size: int, schedule: str) -> None:
    """Train the pipeline and a DDP reference in lockstep; fail at the first divergence."""
    wrap, step_fn, full_state = pipelined(schedule, world_size)
    check_parity(
        build,
        wrap,
        batch,
        loss_fn=lambda model, data: nn.functional.mse_loss(model(data[0]), data[1]),
        step_fn=step_fn,
        full_state=full_state,
        make_optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
        wrapped_optimizer=lambda stage: torch.optim.SGD(
            stage.module.parameters(), lr=0.1, momentum=0.9
        ),
    )


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.distributed(world_size=[2, 4])
def test_schedule_trains_as_one_process(world_size, schedule):
    check_schedule(world_size, schedule)


@pytest.mark.distributed(world_size=4, mode="local")
def test_local_mode_runs_the_same_schedule(world_size):
    # One process, every rank a thread taking turns: the same numbers, on one core.
    check_schedule(world_size, "1f1b")


@pytest.mark.distributed(world_size=2)
def test_1f1b_messages_go_where_they_should(rank, world_size):
    torch.manual_seed(0)
    stage = Stage(split(build(), 2)[rank], rank, 2, (BATCH // 4, WIDTH))
    with record_comms() as rec:
        one_f_one_b_step(stage, *batch(0, rank), nn.functional.mse_loss, MICROBATCHES)
    activation = (BATCH // 4) * WIDTH * 4  # bytes of one microbatch's float32 activations
    if rank == 0:
        # Stage 0 fills the pipeline with one forward, then sends each next activation and
        # receives the oldest gradient together, then drains the last gradient.
        rec.assert_p2p_order([("send", 1)] + [("send", 1), ("recv", 1)] * 3 + [("recv", 1)])
        rec.assert_p2p_bytes({("send", 1): 4 * activation, ("recv", 1): 4 * activation})
        assert {r.batch for r in rec.p2p() if not r.blocking} == {"batch_isend_irecv"}
    else:
        rec.assert_p2p_order([("recv", 0), ("send", 0)] * 4)
    rec.assert_count("broadcast", 1)  # the loss, from the last stage


@pytest.mark.parametrize("schedule", ["ScheduleGPipe", "Schedule1F1B"])
@pytest.mark.distributed(world_size=2)
def test_torch_pipelining_runs_unchanged(rank, world_size, schedule):
    from torch.distributed import pipelining

    torch.manual_seed(0)
    model = build()
    part = copy.deepcopy(split(model, world_size)[rank])
    stage = pipelining.PipelineStage(part, rank, world_size, torch.device("cpu"))
    loss_fn = nn.MSELoss()
    runner = getattr(pipelining, schedule)(
        stage, n_microbatches=MICROBATCHES, loss_fn=loss_fn, scale_grads=False
    )
    x, y = batch(0, rank)
    with record_comms() as rec:
        runner.step(x) if rank == 0 else runner.step(target=y)
    # Each microbatch's activation forward, or its gradient back (torch's first step also
    # sends the stages' shapes, as objects).
    payload = [r for r in rec.p2p("send") if r.shape == (BATCH // MICROBATCHES, WIDTH)]
    assert len(payload) == MICROBATCHES
    # Reference: the whole model on one process, the loss summed over microbatches.
    loss = sum(loss_fn(model(a), b) for a, b in zip(x.chunk(4), y.chunk(4), strict=True))
    loss.backward()
    reference = split(model, world_size)[rank].parameters()
    for got, want in zip(part.parameters(), reference, strict=True):
        torch.testing.assert_close(got.grad, want.grad)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
