"""Thread mode (one thread per rank over torch's threaded process group) and fake mode (one
thread playing rank 0 of a world of any size over torch's fake backend), both in this process.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import time
import traceback
from collections.abc import Callable

from fsdp_testing._launch.deadline import Deadline
from fsdp_testing._protocol import Outcome, RankResult, Task
from fsdp_testing._rank.capture import install_router
from fsdp_testing._rank.context import RankContext
from fsdp_testing._rank.run_task import run_task
from fsdp_testing._rank.state_reset import RankState
from fsdp_testing._report import collective_log
from fsdp_testing._report.observation import Observation

__all__ = ["ThreadLauncher"]

STOP_WAIT_S = 2.0
"""How long a stopped rank thread may take to unwind before it counts as unstoppable."""


class _Aborted(BaseException):
    """Raised asynchronously in a rank thread that the harness stops."""

    def __str__(self) -> str:
        return "aborted by the harness"


def _set_thread_isolation(enabled: bool) -> None:
    import torch

    # Private in torch: gives each thread its own view of the default process group.
    torch._C._distributed_c10d._set_thread_isolation_mode(enabled)  # type: ignore[attr-defined]


def _raise_in(thread: threading.Thread) -> None:
    if thread.ident is not None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(thread.ident), ctypes.py_object(_Aborted)
        )


class ThreadLauncher:
    """Runs every rank of a task as a thread of this process."""

    crosses_processes = False

    def run(
        self, task: Task, *, world_size: int, backend: str, timeout: float, reuse: bool = True
    ) -> Observation:
        import torch
        import torch.distributed as dist

        fake = backend == "fake"
        ranks = [0] if fake else list(range(world_size))
        state = RankState()
        saved_streams = (sys.stdout, sys.stderr)
        recorders = {r: collective_log.FlightRecorder() for r in ranks}
        local = threading.local()
        obs = Observation(world_size=world_size, timeout=timeout)
        teardown: Callable[[], None]
        if fake:
            from torch.testing._internal.distributed.fake_pg import FakeStore

            store: dist.Store = FakeStore()
            teardown = lambda: None  # noqa: E731
        else:
            from torch.testing._internal.distributed import multi_threaded_pg as mtpg

            _set_thread_isolation(True)
            mtpg._install_threaded_pg()
            store = dist.HashStore()

            def teardown() -> None:
                mtpg.ProcessLocalGroup.reset()
                mtpg._uninstall_threaded_pg()
                _set_thread_isolation(False)

        def wake_peers() -> None:
            if not fake:
                from torch.testing._internal.distributed import multi_threaded_pg as mtpg

                mtpg.ProcessLocalGroup.exception_handle(RuntimeError("peer failed"))

        router = install_router()
        collective_log.install(lambda: getattr(local, "recorder", None))

        def body(rank: int) -> None:
            local.recorder = recorders[rank]
            try:
                dist.init_process_group(backend, rank=rank, world_size=world_size, store=store)
                ctx = RankContext(rank, world_size, dist.group.WORLD, torch.device("cpu"), backend)
                result = run_task(task, ctx, router)
            except BaseException:
                result = RankResult.harness_failure(
                    rank,
                    f"rank {rank} could not join the {backend} process group of {world_size} "
                    "threads (see the traceback)",
                )
            obs.results[rank] = result
            if result.outcome is Outcome.FAILED:
                wake_peers()
            try:
                dist.destroy_process_group()
            except BaseException:
                pass

        threads = {
            r: threading.Thread(target=body, args=(r,), name=f"fsdp-testing-rank{r}", daemon=True)
            for r in ranks
        }
        try:
            for t in threads.values():
                t.start()
            self._join(threads, obs, timeout)
            if obs.stragglers:
                frames = sys._current_frames()
                for rank in obs.stragglers:
                    frame = frames.get(threads[rank].ident or -1)
                    obs.stacks[rank] = "".join(traceback.format_stack(frame)) if frame else ""
                obs.records = {r: rec.snapshot() for r, rec in recorders.items()}
                wake_peers()
                for rank in obs.stragglers:
                    _raise_in(threads[rank])
                deadline = time.monotonic() + STOP_WAIT_S
                for rank in obs.stragglers:
                    threads[rank].join(max(0.0, deadline - time.monotonic()))
                    if threads[rank].is_alive():
                        obs.unstoppable.add(rank)
                    obs.results.pop(rank, None)
        finally:
            collective_log.uninstall()
            teardown()
            sys.stdout, sys.stderr = saved_streams
            state.restore()
        return obs

    @staticmethod
    def _join(threads: dict[int, threading.Thread], obs: Observation, timeout: float) -> None:
        deadline = Deadline(timeout)
        while True:
            alive = [r for r, t in threads.items() if t.is_alive()]
            if not alive:
                break
            if any(res.outcome is Outcome.FAILED for res in list(obs.results.values())):
                deadline.note_failure()
            if deadline.expired():
                obs.stragglers = set(alive)
                obs.timed_out = deadline.timed_out(True)
                return
            threads[alive[0]].join(min(0.02, deadline.remaining()))

    def shutdown(self) -> None:
        """Nothing outlives a run in thread mode."""
