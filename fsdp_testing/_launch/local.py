"""Local mode: every rank of a world in this process, one rank thread running at a time, with
collectives whose numbers equal a real (gloo) run's. See [Note: local mode] in ``baton.py``.

Why not torch's ``LocalTensorMode``: it runs the body once for all ranks, so Python control
flow on the rank cannot work, module hooks and autograd state are shared, and in torch 2.13 it
cannot train FSDP2 on CPU at all (``resize_()`` on an invalid python storage when FSDP frees
unsharded parameters). Threads that take turns run any body a rank process would run, on one
core, with each rank's own RNG; ``docs/scale.md`` compares the options.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterable, Mapping

from fsdp_testing._launch.baton import Baton
from fsdp_testing._launch.threads import run_rank_threads
from fsdp_testing._launch.wait_watch import Snapshot
from fsdp_testing._protocol import Outcome, RankResult, Task
from fsdp_testing._report.deadlock import Deadlock, find_deadlock
from fsdp_testing._report.observation import Observation
from fsdp_testing._report.text import ranks_phrase

__all__ = ["LocalLauncher"]


@dataclasses.dataclass(frozen=True)
class _BatonDeadlock:
    """A deadlock the baton found that the ranks' logs do not show whole (a receive from any
    rank, a wait the logs cannot tell): the logs' lines for the ranks they show, then what each
    other rank waits in, as the baton saw it."""

    ranks: tuple[int, ...]
    shown: Deadlock | None
    """What the logs prove, for some of the ranks."""
    others: dict[int, str]
    """The other ranks: what each waits in."""
    ended: dict[int, bool]
    """Ranks that ended their test: whether it failed."""

    def lines(
        self, finished: Mapping[int, str] | None = None, where: Mapping[int, str] | None = None
    ) -> list[str]:
        out = self.shown.lines(finished, where) if self.shown is not None else []
        by_what: dict[str, list[int]] = {}
        for rank, what in sorted(self.others.items()):
            by_what.setdefault(what, []).append(rank)
        for what, ranks in by_what.items():
            out.append(f"{ranks_phrase(ranks, where)} wait{'s' * (len(ranks) == 1)} in {what}")
        for failed, how in ((False, "returned"), (True, "failed")):
            ended = [r for r, f in sorted(self.ended.items()) if f is failed]
            if ended:
                out.append(f"{ranks_phrase(ended, where)} finished the test ({how})")
        return out


class _BatonWatch:
    """Local mode's deadlock watch: the baton knows the moment no rank can go on, and every
    rank's log holds still from then on, so the deadlock is reported at once, in the words of
    the other modes' (``_report/deadlock.py``), where the logs show it.

    Args:
        baton: the world's scheduler.
        read: every rank's collective log and message counts.
    """

    def __init__(self, baton: Baton, read: Callable[[], Snapshot]) -> None:
        self._baton = baton
        self._read = read
        self._start = time.monotonic()

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self._start

    def look(self, finished: Iterable[int]) -> Deadlock | _BatonDeadlock | None:
        waiting = self._baton.deadlock
        if not waiting:
            return None
        records, channels = self._read()
        found = find_deadlock(records, channels, frozenset(finished))
        if found is not None and set(found.ranks) == set(waiting):
            return found
        shown = found if found is not None and set(found.ranks) < set(waiting) else None
        others = {r: w for r, w in waiting.items() if shown is None or r not in shown.ranks}
        ended = {} if shown is not None else self._baton.finished
        return _BatonDeadlock(tuple(sorted(waiting)), shown, others, ended)


def _set_thread_isolation(enabled: bool) -> None:
    import torch

    # Private in torch: gives each thread its own view of the default process group.
    torch._C._distributed_c10d._set_thread_isolation_mode(enabled)  # type: ignore[attr-defined]


class LocalLauncher:
    """Runs every rank of a task as a thread of this process, one at a time."""

    crosses_processes = False

    def run(
        self, task: Task, *, world_size: int, backend: str, timeout: float, reuse: bool = True
    ) -> Observation:
        import torch
        import torch.distributed as dist
        from torch.testing._internal.distributed import multi_threaded_pg as mtpg

        from fsdp_testing._launch import local_group

        try:
            import numpy  # noqa: F401  (so that every rank's NumPy RNG is its own from the start)
        except ImportError:  # pragma: no cover - numpy is a dependency
            pass
        local_group.register_backend()
        threads_before = torch.get_num_threads()
        if "OMP_NUM_THREADS" not in os.environ:
            # As many intra-op threads as a process-mode rank has (rank_process.py): kernels
            # that split work by thread count then add up the same way.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        baton = Baton(world_size)
        local_group.set_current_world(local_group.LocalWorld(baton))
        _set_thread_isolation(True)
        mtpg._install_threaded_pg()  # per-thread c10d state; autograd runs on the rank's thread

        def enter(rank: int) -> None:
            baton.enter(rank)

        def leave(rank: int, result: RankResult) -> None:
            baton.leave(rank, failed=result.outcome is Outcome.FAILED)

        try:
            return run_rank_threads(
                task,
                ranks=list(range(world_size)),
                world_size=world_size,
                backend=backend,
                timeout=timeout,
                store=dist.HashStore(),
                wake=baton.abort,
                enter=enter,
                leave=leave,
                wake_on_failure=False,  # the baton aborts a failed rank's peers itself
                watch=lambda read, asleep: _BatonWatch(baton, read),
            )
        finally:
            mtpg._uninstall_threaded_pg()
            _set_thread_isolation(False)
            local_group.set_current_world(None)
            torch.set_num_threads(threads_before)

    def shutdown(self) -> None:
        """Nothing outlives a run in local mode."""
