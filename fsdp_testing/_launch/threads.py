"""Thread mode: one thread per rank over torch's threaded process group, in this process.

The threads are started, waited for and stopped by ``rank_threads.py`` (see [Note: stopping
rank threads] there); ``thread_group.py`` sets up torch's threaded group around them and wakes
its waits without blocking; ``thread_turns.py`` gives each rank its own process state (see
[Note: thread mode's turns]).
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from fsdp_testing._launch.rank_threads import Aborted, RankThreads
from fsdp_testing._launch.wait_watch import DeadlockWatch, Snapshot, WaitWatch
from fsdp_testing._protocol import Outcome, RankResult, Task
from fsdp_testing._rank import comm_observer
from fsdp_testing._rank.capture import install_router
from fsdp_testing._rank.context import RankContext
from fsdp_testing._rank.run_task import run_task
from fsdp_testing._rank.state_reset import RankState
from fsdp_testing._report import collective_log, failure
from fsdp_testing._report.observation import Observation

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = ["ThreadLauncher", "run_rank_threads"]


class _QuietCollectiveErrors(logging.Filter):
    """Drops torch's debug record of each collective that raised (``c10d_logger``'s exception
    logger, one line of a few hundred characters per rank) while an in-process world runs.

    The error is the rank's own in the report already; pytest would show every rank's record
    again under "Captured log" (64 such lines for one mismatch at 64 local-mode ranks), which a
    rank process's records never reach."""

    def __init__(self) -> None:
        super().__init__()
        from torch.distributed import c10d_logger

        self._logger = c10d_logger._c10d_logger
        self._logger.addFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, dict) and "error" in record.msg)

    def remove(self) -> None:
        self._logger.removeFilter(self)


def _settle_cuda_device_guard() -> None:
    """Register torch's no-op CUDA device guard from this thread, before any rank thread can.

    ``FakeTensorMode`` registers it on entry when no GPU is there. In torch 2.10 and 2.11's CUDA
    builds, a thread that enters one after another thread that did so has ended crashes the
    process (a segmentation fault in ``_ensureCUDADeviceGuardSet``): two tests whose rank
    threads use fake tensors, one after the other, in one worker. Registered once from the
    thread that outlives the ranks, every later entry finds it set (what the entry would have
    done; CUDA calls fail as before)."""
    import torch

    ensure = getattr(torch._C, "_ensureCUDADeviceGuardSet", None)
    if ensure is not None and not torch.cuda.is_available():
        ensure()


def run_rank_threads(
    task: Task,
    *,
    ranks: list[int],
    world_size: int,
    backend: str,
    timeout: float,
    store: dist.Store,
    wake: Callable[[], None],
    enter: Callable[[int], None] | None = None,
    leave: Callable[[int, RankResult], None] | None = None,
    ended: Callable[[int], None] | None = None,
    wake_on_failure: bool = True,
    watch: Callable[[Callable[[], Snapshot], Callable[[tuple[int, ...]], bool]], DeadlockWatch]
    | None = None,
    recorders: dict[int, collective_log.FlightRecorder] | None = None,
) -> Observation:
    """Run ``task`` on one thread per rank of ``ranks`` in this process, each joining a
    ``backend`` group of ``world_size`` through ``store``; shared by thread, fake and local
    mode. ``enter(rank)`` and ``leave(rank, result)`` run first and last on each rank thread
    (local mode's baton); ``ended(rank)`` right after its test body, before the rank leaves its
    process group (thread mode's turns); ``wake()`` stops the ranks' waits, as soon as a rank
    fails unless ``wake_on_failure`` is False (see [Note: stopping rank threads]);
    ``watch(snapshot, asleep)`` makes what ends the test at a certain deadlock (a
    ``wait_watch.WaitWatch``, which reads the ranks' logs with ``snapshot()`` and asks
    ``asleep(ranks)`` of their threads, or local mode's watch of its baton); ``recorders``
    are the ranks' collective logs (default: new ones)."""
    import torch
    import torch.distributed as dist

    _settle_cuda_device_guard()
    state = RankState()
    saved_streams = (sys.stdout, sys.stderr)
    if recorders is None:
        recorders = {r: collective_log.FlightRecorder() for r in ranks}
    local = threading.local()
    obs = Observation(world_size=world_size, timeout=timeout)
    router = install_router()
    comm_observer.install(lambda: getattr(local, "recorder", None))
    quiet = _QuietCollectiveErrors()

    def body(rank: int) -> None:
        local.recorder = recorders[rank]
        # The parent formats the ranks' tracebacks once the test is over: a rank formatting
        # its own on a busy machine outlived its failed peer's grace and was reported
        # "aborted" instead of failing. See [Note: formatting a failure in the parent].
        failure.format_in_parent()
        result: RankResult
        try:
            if enter is not None:
                enter(rank)
            dist.init_process_group(backend, rank=rank, world_size=world_size, store=store)
            ctx = RankContext(rank, world_size, dist.group.WORLD, torch.device("cpu"), backend)
            result = run_task(task, ctx, router)
        except Aborted:
            result = RankResult(rank, Outcome.FAILED, summary=str(Aborted()), comm_error=True)
        except BaseException:
            result = RankResult.harness_failure(
                rank,
                f"rank {rank} could not join the {backend} process group of {world_size} "
                "threads (see the traceback)",
            )
        obs.results[rank] = result
        if ended is not None:
            ended(rank)
        try:
            dist.destroy_process_group()
        except BaseException:
            pass  # a group the test already destroyed, or a stop arriving here
        finally:
            if leave is not None:
                leave(rank, result)

    def snapshot() -> tuple[dict[int, list[dict]], dict[int, dict[str, int] | None]]:
        records = {r: rec.snapshot() for r, rec in recorders.items()}
        return records, {r: dict(rec.channels) for r, rec in recorders.items()}

    looks = None if watch is None else watch(snapshot, lambda stuck: threads.asleep(stuck))
    threads = RankThreads(ranks, body, obs, wake, wake_on_failure=wake_on_failure, watch=looks)

    try:
        threads.run(timeout, snapshot)
        report = any(
            r.outcome is Outcome.FAILED or r.open_p2p or r.p2p for r in obs.results.values()
        )
        if not obs.records and report:
            # The report names the collective each aborted peer was in and the failed rank's
            # last one, as process mode's does; messages' dtypes are compared on both ends.
            obs.records, obs.channels = snapshot()
    finally:
        quiet.remove()
        comm_observer.uninstall()
        sys.stdout, sys.stderr = saved_streams
        state.restore()
    return obs


class ThreadLauncher:
    """Runs every rank of a task as a thread of this process over torch's threaded group."""

    crosses_processes = False

    def run(
        self, task: Task, *, world_size: int, backend: str, timeout: float, reuse: bool = True
    ) -> Observation:
        import torch.distributed as dist

        from fsdp_testing._launch import thread_group
        from fsdp_testing._launch.thread_turns import Turns

        ranks = list(range(world_size))
        with thread_group.installed(), Turns(ranks) as turns:
            return run_rank_threads(
                task,
                ranks=ranks,
                world_size=world_size,
                backend=backend,
                timeout=timeout,
                store=dist.HashStore(),
                wake=thread_group.wake,
                enter=turns.enter,
                ended=lambda rank: turns.leave(),
                watch=WaitWatch,
            )

    def shutdown(self) -> None:
        """Nothing outlives a run in thread mode."""
