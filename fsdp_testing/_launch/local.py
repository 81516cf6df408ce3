"""Local mode: every rank of a world in this process, one rank thread running at a time, with
collectives whose numbers equal a real (gloo) run's. See [Note: local mode] in ``baton.py``.

Why not torch's ``LocalTensorMode``: it runs the body once for all ranks, so Python control
flow on the rank cannot work, module hooks and autograd state are shared, and in torch 2.13 it
cannot train FSDP2 on CPU at all (``resize_()`` on an invalid python storage when FSDP frees
unsharded parameters). Threads that take turns run any body a rank process would run, on one
core, with each rank's own RNG; ``docs/scale.md`` compares the options.
"""

from __future__ import annotations

import os

from fsdp_testing._launch.baton import Baton
from fsdp_testing._launch.threads import run_rank_threads
from fsdp_testing._protocol import Outcome, RankResult, Task
from fsdp_testing._report import collective_log
from fsdp_testing._report.observation import Observation
from fsdp_testing._report.p2p import describe_p2p

__all__ = ["LocalLauncher"]


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
        recorders = {r: collective_log.FlightRecorder() for r in range(world_size)}

        def explain() -> list[str]:
            # The baton found a deadlock: every rank thread is blocked, the logs hold still.
            records = {r: rec.snapshot() for r, rec in recorders.items()}
            channels = {r: dict(rec.channels) for r, rec in recorders.items()}
            return describe_p2p(records, channels)

        baton.explain = explain
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
                recorders=recorders,
            )
        finally:
            mtpg._uninstall_threaded_pg()
            _set_thread_isolation(False)
            local_group.set_current_world(None)
            torch.set_num_threads(threads_before)

    def shutdown(self) -> None:
        """Nothing outlives a run in local mode."""
