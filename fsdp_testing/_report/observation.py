"""Everything a launcher saw of one distributed task: the input of the verdict."""

from __future__ import annotations

import dataclasses

from fsdp_testing._protocol import RankResult

__all__ = ["Observation"]


@dataclasses.dataclass
class Observation:
    """Everything the launcher saw of one distributed task."""

    world_size: int
    timeout: float
    results: dict[int, RankResult] = dataclasses.field(default_factory=dict)
    dead: set[int] = dataclasses.field(default_factory=set)
    """Ranks whose process ended without sending a result."""
    stragglers: set[int] = dataclasses.field(default_factory=set)
    """Ranks still running when the parent gave up on them (timeout or failed peer)."""
    timed_out: bool = False
    exit_status: dict[int, str] = dataclasses.field(default_factory=dict)
    stacks: dict[int, str] = dataclasses.field(default_factory=dict)
    records: dict[int, list[dict]] = dataclasses.field(default_factory=dict)
    """Each rank's collective log (``collective_log.py``): its last calls, oldest first."""
    channels: dict[int, dict[str, int] | None] = dataclasses.field(default_factory=dict)
    """Each rank's message counts per point-to-point channel (None: unknown), which its log's
    ring may have lost (see [Note: collective log])."""
    import_wait: float = 0.0
    """Seconds the test's deadline was extended because ranks were importing."""
    deadlock: list[str] = dataclasses.field(default_factory=list)
    """The wait cycle that ended the test before its timeout (``deadlock.py``), in words; empty
    when none did."""
    deadlock_ranks: tuple[int, ...] = ()
    """The ranks of that deadlock."""
    deadlock_after: float = 0.0
    """Seconds into the test when the deadlock was certain."""
    last_output: dict[int, str] = dataclasses.field(default_factory=dict)
    unstoppable: set[int] = dataclasses.field(default_factory=set)
    """Thread ranks that could not be stopped (blocked outside Python)."""
    where: dict[int, str] = dataclasses.field(default_factory=dict)
    """Where each rank ran, in a job across nodes (``"node 1, local rank 1"``); empty on one
    machine, where ``rank N`` says it all."""
    sources: dict[int, dict[str, str]] = dataclasses.field(default_factory=dict)
    """Per rank, the source line of each frame of its stack (``"path:line"``), read where the
    rank ran: another node's files need not exist here."""
