"""Fake mode: this process plays one rank, any rank, of a world of any size over torch's fake
backend (collectives return at once and move no data).

The rank fixture, ``dist.get_rank()``, every group's rank and hence every sharding decision are
those of the rank played, so a test can look at rank 517 of 1024, at a rank whose shard is
empty, or at a rank in the last replica group of a 2-D mesh, on one core.
"""

from __future__ import annotations

from fsdp_testing._launch.threads import run_rank_threads
from fsdp_testing._protocol import Task
from fsdp_testing._report.observation import Observation

__all__ = ["FakeLauncher"]


def _nothing_to_wake() -> None:
    """Fake collectives never wait."""


class FakeLauncher:
    """Runs a task as rank ``rank`` of a fake world, in a thread of this process.

    Args:
        rank: the rank to play (default 0).
    """

    crosses_processes = False

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank

    def run(
        self, task: Task, *, world_size: int, backend: str, timeout: float, reuse: bool = True
    ) -> Observation:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        if not 0 <= self.rank < world_size:
            raise ValueError(
                f"distributed marker: rank={self.rank} is not a rank of a world of "
                f"{world_size}; use 0..{world_size - 1}"
            )
        return run_rank_threads(
            task,
            ranks=[self.rank],
            world_size=world_size,
            backend=backend,
            timeout=timeout,
            store=FakeStore(),
            wake=_nothing_to_wake,
        )

    def shutdown(self) -> None:
        """Nothing outlives a run in fake mode."""
