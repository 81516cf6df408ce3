"""The one small interface every launch strategy implements (one module per strategy:
``pool.py`` for process mode, ``threads.py`` for thread and fake mode, ``torchrun.py`` for
tests run in place inside a torchrun job)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from fsdp_testing._protocol import Task
    from fsdp_testing._report.observation import Observation

__all__ = ["Launcher"]


class Launcher(Protocol):
    """Runs one task on every rank of a world and reports what it observed."""

    crosses_processes: bool
    """Whether tasks travel to other processes (then they must pickle and be importable)."""

    def run(
        self, task: Task, *, world_size: int, backend: str, timeout: float, reuse: bool
    ) -> Observation:
        """Run ``task`` on ``world_size`` ranks over ``backend``; give up on a rank after
        ``timeout`` seconds (see [Note: deadline and failure grace]); ``reuse`` keeps the
        ranks warm for the next task when the strategy can."""
        ...

    def shutdown(self) -> None:
        """Stop everything this launcher started."""
        ...
