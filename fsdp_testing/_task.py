"""What travels between the parent and the ranks: tasks, placeholders and per-rank results.

Nothing here imports torch, so the parent can build tasks before any rank exists.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

__all__ = [
    "RANK_FIXTURES",
    "FunctionRef",
    "Outcome",
    "RankFixture",
    "RankResult",
    "Task",
]

RANK_FIXTURES = ("rank", "world_size", "process_group", "device", "dist_backend")


@dataclasses.dataclass(frozen=True)
class RankFixture:
    """Stands in the parent for a fixture whose value only exists on a rank."""

    name: str


@dataclasses.dataclass(frozen=True)
class FunctionRef:
    """Names a function so that a rank process can import it (test modules included).

    Args:
        module: the module's name in ``sys.modules`` of the parent.
        path: the module's file, used when the name alone does not import.
        qualname: the function's qualified name inside the module.
    """

    module: str
    path: str | None
    qualname: str


class Outcome(str, enum.Enum):
    """How one rank finished one task."""

    PASSED = "passed"
    """The body returned."""
    FAILED = "failed"
    """The body raised."""
    SKIPPED = "skipped"
    """The body called ``pytest.skip`` (or raised ``unittest.SkipTest``)."""
    XFAILED = "xfailed"
    """The body called ``pytest.xfail``."""
    ABORTED = "aborted"
    """The parent stopped the rank: a peer failed, or the test timed out."""
    DIED = "died"
    """The rank's process ended without a result (exit code or signal)."""


@dataclasses.dataclass
class Task:
    """One unit of work run on every rank.

    Args:
        target: the function to call, or an object with ``run_on_rank(ctx)`` (unittest methods).
        kwargs: keyword arguments, where :class:`RankFixture` values are filled in on the rank.
        test_id: shown in reports.
        tbstyle: pytest's ``--tb`` style for tracebacks formatted on the rank.
    """

    target: Any
    kwargs: dict[str, Any]
    test_id: str
    tbstyle: str = "auto"


@dataclasses.dataclass
class RankResult:
    """What one rank reports for one task."""

    rank: int
    outcome: Outcome
    message: str = ""
    """Skip/xfail reason, or the formatted traceback of a failure."""
    summary: str = ""
    """One line: the exception type and message of a failure."""
    stdout: str = ""
    stderr: str = ""
    duration: float = 0.0
    finished_at: float = 0.0
    """``time.time()`` when the body ended: orders failures across ranks."""
    comm_error: bool = False
    """The failure came from a collective broken by a peer, not from the test body's logic."""
    needs_restart: bool = False
    """The rank cannot serve another test (e.g. the body destroyed the default group)."""
