"""Running distributed tests in place, when pytest itself was started on every rank of a job
(``torchrun --nproc-per-node N -m pytest ...``).

Every rank runs the test body itself on the job's default process group; the ranks then
exchange their results over a separate gloo group (so a broken nccl communicator cannot hide a
result), every rank judges the same verdict, and only rank 0's terminal shows the session (the
plugin silences the others at import).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from fsdp_testing._protocol import RankResult, Task
from fsdp_testing._rank.context import RankContext
from fsdp_testing._rank.run_task import run_task
from fsdp_testing._report import collective_log
from fsdp_testing._report.observation import Observation

__all__ = ["TorchrunLauncher", "in_launched_job", "launched_rank", "launched_world_size"]


def in_launched_job() -> bool:
    """Whether this process is one rank of a job started by torchrun."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ


def launched_rank() -> int:
    return int(os.environ["RANK"])


def launched_world_size() -> int:
    return int(os.environ["WORLD_SIZE"])


class TorchrunLauncher:
    """Runs each task in this process, which is one rank of the torchrun job; joins the job's
    default group on first use and leaves it at shutdown."""

    crosses_processes = False
    """Tasks run in this process: the test function itself, nothing pickled."""

    def __init__(self) -> None:
        self._ctx: RankContext | None = None
        self._results_group: Any = None
        self._recorder: collective_log.FlightRecorder = collective_log.FlightRecorder()

    def _join(self, backend: str, timeout: float) -> RankContext:
        import torch
        import torch.distributed as dist

        rank, world_size = launched_rank(), launched_world_size()
        if not dist.is_initialized():
            dist.init_process_group(backend, timeout=timedelta(seconds=max(timeout, 30.0)))
        self._results_group = (
            dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
        )
        device = torch.device("cpu")
        if backend == "nccl":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
            torch.cuda.set_device(device)
        recorder = collective_log.FlightRecorder()
        collective_log.install(lambda: recorder)
        self._recorder = recorder
        return RankContext(rank, world_size, dist.group.WORLD, device, backend)

    def run(
        self, task: Task, *, world_size: int, backend: str, timeout: float, reuse: bool = True
    ) -> Observation:
        """Run ``task`` here and gather every rank's result. ``world_size`` must be the job's
        (the plugin skips other tests before they get here); ``reuse`` does not apply."""
        import torch.distributed as dist

        if world_size != launched_world_size():
            raise ValueError(
                f"{task.test_id}: this torchrun job has world size {launched_world_size()}; the "
                f"test needs {world_size} (run it with --nproc-per-node {world_size})"
            )
        if self._ctx is None:
            self._ctx = self._join(backend, timeout)
        self._recorder.reset()
        result = run_task(task, self._ctx, router=None)
        gathered: list[RankResult | None] = [None] * world_size
        dist.all_gather_object(gathered, result, group=self._results_group)
        obs = Observation(world_size=world_size, timeout=timeout)
        for rank, res in enumerate(gathered):
            if res is None:  # pragma: no cover - all_gather_object fills every slot
                obs.dead.add(rank)
            else:
                obs.results[rank] = res
        return obs

    def shutdown(self) -> None:
        """Wait for every rank (so rank 0 finishes its report before any rank exits and the
        launcher stops the job), then leave the process group."""
        import torch.distributed as dist

        if self._ctx is None:
            return
        dist.barrier(group=self._results_group)
        dist.destroy_process_group()
        self._ctx = None
