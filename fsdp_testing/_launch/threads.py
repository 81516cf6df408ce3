"""Thread mode: one thread per rank over torch's threaded process group, in this process.

The threads are started, waited for and stopped by ``rank_threads.py`` (see [Note: stopping
rank threads] there); this module sets up torch's threaded group around them and knows how to
wake its waits without blocking.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fsdp_testing._launch.rank_threads import Aborted, RankThreads, acquire_briefly
from fsdp_testing._protocol import Outcome, RankResult, Task
from fsdp_testing._rank.capture import install_router
from fsdp_testing._rank.context import RankContext
from fsdp_testing._rank.run_task import run_task
from fsdp_testing._rank.state_reset import RankState
from fsdp_testing._report import collective_log
from fsdp_testing._report.observation import Observation

if TYPE_CHECKING:
    from datetime import timedelta

    import torch.distributed as dist

__all__ = ["ThreadLauncher", "run_rank_threads"]


def _set_thread_isolation(enabled: bool) -> None:
    import torch

    # Private in torch: gives each thread its own view of the default process group.
    torch._C._distributed_c10d._set_thread_isolation_mode(enabled)  # type: ignore[attr-defined]


def _fresh_threaded_group_state() -> None:
    """Give torch's threaded group new locks, a new termination event and no collectives in
    flight, by assignment: ``ProcessLocalGroup.reset()`` would wait for locks that a rank
    stopped in the previous run may hold forever. See [Note: stopping rank threads]."""
    from torch.testing._internal.distributed import multi_threaded_pg as mtpg

    group = mtpg.ProcessLocalGroup
    group._coll_lock = threading.Lock()
    group._cur_coll_on_pgs = _CollectivesByGroup()
    group._terminate = threading.Event()


# [Note: the threaded group's barrier]
# torch's threaded backend ends the creation of every group with a store-based barrier
# (``_create_threaded_pg`` in ``multi_threaded_pg``). In thread mode each rank counts its
# groups on its own (thread isolation), so a group's name is the same on every rank that made
# as many groups before it, whatever its members: when each rank makes a group of its own
# (``new_group([rank])``, as torch's ``MixtureOfExperts`` does for its experts), the ranks'
# different groups share one name, and so one barrier key in the test's store. torch's barrier
# adds 1 to the key and then reads the count again in a second call; when another rank's add
# comes between the two, no rank reads exactly its group's size, no rank marks the barrier
# done, and every rank waits until the test's timeout (seen in CI: a hang in
# ``MixtureOfExperts.init`` once in some thousands of such groups). While thread mode runs,
# the threaded backend's barrier is this one, which decides on the count its own add returned:
# the rank whose arrival completes the count marks it done, and a group of one never waits.
#
# The same names met again in the group's collectives: torch's threaded group matches the
# ranks' calls of a collective by group name (``ProcessLocalGroup._cur_coll_on_pgs``), so the
# ranks' groups of one joined one collective and waited for each other forever. In thread mode
# that table is a :class:`_CollectivesByGroup`, which tells the groups apart by their members
# too, as process mode's separate processes do. The names themselves, which a test can read,
# stay torch's.


class _CollectivesByGroup(dict):
    """torch's threaded group's collectives in flight, keyed by group name as torch asks, but
    stored by name and members: see [Note: the threaded group's barrier]. A name is read in
    the calling rank's own world (thread isolation), as the group's name was."""

    def __init__(self) -> None:
        super().__init__()
        # By rank thread and name: the group and its members (a name is unique in a rank's
        # world until ``destroy_process_group()`` starts the count again, hence the check).
        self._groups: dict[tuple[int, str], tuple[Any, tuple[int, ...] | None]] = {}

    def _key(self, name: str) -> tuple[str, tuple[int, ...] | None]:
        import torch.distributed as dist

        world = dist.distributed_c10d._world
        me = (threading.get_ident(), name)
        known = self._groups.get(me)
        if known is None or world.pg_names.get(known[0]) != name:
            group = next((pg for pg, n in world.pg_names.items() if n == name), None)
            ranks = world.pg_group_ranks.get(group) if group is not None else None
            known = self._groups[me] = (group, tuple(sorted(ranks)) if ranks else None)
        return name, known[1]

    def __contains__(self, name: object) -> bool:
        return super().__contains__(self._key(str(name)))

    def __getitem__(self, name: str) -> Any:
        return super().__getitem__(self._key(name))

    def __setitem__(self, name: str, collective: Any) -> None:
        super().__setitem__(self._key(name), collective)

    def pop(self, name: str, *default: Any) -> Any:
        return super().pop(self._key(name), *default)


def _threaded_group_barrier(
    rank: int,
    store: dist.Store,
    group_name: str,
    rendezvous_count: int,
    timeout: timedelta,
    logging_interval: timedelta | None = None,
) -> None:
    """The threaded backend's barrier after making a group of ``rendezvous_count`` ranks,
    deciding on the count ``store.add`` returns; see [Note: the threaded group's barrier]. The
    signature is torch's ``_store_based_barrier``'s (it logs who is missing every
    ``logging_interval``; here a rank that never comes is the test's timeout to report)."""
    key = f"fsdp_testing_group_barrier:{group_name}"
    if store.add(key, 1) == rendezvous_count:
        store.set(f"{key}:done", "1")
    store.wait([f"{key}:done"], timeout)


def _wake_threaded_group() -> None:
    """Make every rank waiting in a threaded-group collective leave it (torch's collectives
    exit their rank with "Test termination event occurs"), without blocking."""
    from torch.testing._internal.distributed import multi_threaded_pg as mtpg

    group = mtpg.ProcessLocalGroup
    # A set event in place of the old one: Event.set() would take the old event's lock, which
    # a rank stopped inside it may hold forever. The waits read it through the class.
    terminate = threading.Event()
    terminate.set()
    group._terminate = terminate
    for coll in list(group._cur_coll_on_pgs.values()):
        for cond in (coll._start_cond, coll._done_cond):
            if acquire_briefly(cond):
                try:
                    cond.notify_all()
                finally:
                    cond.release()


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
    wake_on_failure: bool = True,
) -> Observation:
    """Run ``task`` on one thread per rank of ``ranks`` in this process, each joining a
    ``backend`` group of ``world_size`` through ``store``; shared by thread, fake and local
    mode. ``enter(rank)`` and ``leave(rank, result)`` run first and last on each rank thread
    (local mode's baton); ``wake()`` stops the ranks' waits, as soon as a rank fails unless
    ``wake_on_failure`` is False (see [Note: stopping rank threads])."""
    import torch
    import torch.distributed as dist

    state = RankState()
    saved_streams = (sys.stdout, sys.stderr)
    recorders = {r: collective_log.FlightRecorder() for r in ranks}
    local = threading.local()
    obs = Observation(world_size=world_size, timeout=timeout)
    router = install_router()
    collective_log.install(lambda: getattr(local, "recorder", None))

    def body(rank: int) -> None:
        local.recorder = recorders[rank]
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
        try:
            dist.destroy_process_group()
        except BaseException:
            pass  # a group the test already destroyed, or a stop arriving here
        finally:
            if leave is not None:
                leave(rank, result)

    threads = RankThreads(ranks, body, obs, wake, wake_on_failure=wake_on_failure)
    try:
        threads.run(timeout, lambda: {r: rec.snapshot() for r, rec in recorders.items()})
    finally:
        collective_log.uninstall()
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
        from torch.testing._internal.distributed import multi_threaded_pg as mtpg

        _set_thread_isolation(True)
        _fresh_threaded_group_state()
        mtpg._install_threaded_pg()
        torch_barrier = mtpg._store_based_barrier  # see [Note: the threaded group's barrier]
        mtpg._store_based_barrier = _threaded_group_barrier
        try:
            return run_rank_threads(
                task,
                ranks=list(range(world_size)),
                world_size=world_size,
                backend=backend,
                timeout=timeout,
                store=dist.HashStore(),
                wake=_wake_threaded_group,
            )
        finally:
            # Never blocks: see [Note: stopping rank threads].
            mtpg._store_based_barrier = torch_barrier
            _fresh_threaded_group_state()
            mtpg._uninstall_threaded_pg()
            _set_thread_isolation(False)

    def shutdown(self) -> None:
        """Nothing outlives a run in thread mode."""
