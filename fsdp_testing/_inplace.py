"""Running distributed tests in place, when pytest itself was started on every rank of a job
(``torchrun --nproc-per-node N -m pytest ...``).

Every rank runs the test body itself on the job's default process group; the ranks then
exchange their results over a separate gloo group (so a broken nccl communicator cannot hide a
result), every rank judges the same verdict, and only rank 0's terminal shows the session.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from fsdp_testing._rank import RankContext, run_task
from fsdp_testing._report import Observation, Verdict, judge
from fsdp_testing._task import RankResult, Task

__all__ = ["InPlaceJob", "launched_rank", "launched_world_size"]


def launched_rank() -> int:
    return int(os.environ["RANK"])


def launched_world_size() -> int:
    return int(os.environ["WORLD_SIZE"])


class InPlaceJob:
    """The job this process belongs to: its default group and a gloo group for results."""

    def __init__(self, backend: str, timeout: float) -> None:
        import torch
        import torch.distributed as dist

        self.rank = launched_rank()
        self.world_size = launched_world_size()
        self.backend = backend
        if not dist.is_initialized():
            dist.init_process_group(backend, timeout=timedelta(seconds=max(timeout, 30.0)))
        self.results_group: Any = (
            dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
        )
        device = torch.device("cpu")
        if backend == "nccl":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", self.rank)))
            torch.cuda.set_device(device)
        self.ctx = RankContext(self.rank, self.world_size, dist.group.WORLD, device, backend)

    def run(self, task: Task, timeout: float) -> Verdict:
        import torch.distributed as dist

        result = run_task(task, self.ctx, router=None)
        gathered: list[RankResult | None] = [None] * self.world_size
        dist.all_gather_object(gathered, result, group=self.results_group)
        obs = Observation(world_size=self.world_size, timeout=timeout)
        for rank, res in enumerate(gathered):
            if res is None:  # pragma: no cover - all_gather_object fills every slot
                obs.dead.add(rank)
            else:
                obs.results[rank] = res
        return judge(obs)

    def close(self) -> None:
        """Wait for every rank (so rank 0 finishes its report before any rank exits and the
        launcher stops the job), then leave the process group."""
        import torch.distributed as dist

        dist.barrier(group=self.results_group)
        dist.destroy_process_group()
