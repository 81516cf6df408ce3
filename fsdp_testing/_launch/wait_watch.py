"""Watching the ranks of a running test for a certain deadlock, so that a wait cycle ends the test
at once instead of at its timeout (see [Note: a certain deadlock] in
``fsdp_testing/_report/deadlock.py``).

A launcher asks :meth:`WaitWatch.look` while it waits for its ranks; every ``POLL_S`` the watch
reads every rank's collective log. A deadlock counts as certain only when the same ranks are
found stuck in the same calls in looks at least ``CONFIRM_S`` apart, each of those calls entered
at least ``CONFIRM_S`` before, and (where the launcher can tell) the ranks' threads asleep in the
operating system: a rank that left its call and has not yet logged it is running, not asleep.
Tests that end within ``FIRST_LOOK_S`` are never looked at, so most tests pay nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from fsdp_testing._report.deadlock import find_deadlock

__all__ = [
    "CONFIRM_S",
    "FIRST_LOOK_S",
    "POLL_S",
    "DeadlockWatch",
    "FoundDeadlock",
    "WaitWatch",
    "note_deadlock",
    "process_asleep",
    "threads_asleep",
]

FIRST_LOOK_S = 0.5
"""How long a test runs before its ranks' logs are first read."""
POLL_S = 0.25
"""How often they are read after that."""
CONFIRM_S = 0.5
"""How long a wait cycle must stay as it is before it counts as certain."""

Snapshot = tuple[Mapping[int, list[dict[str, Any]]], Mapping[int, Mapping[str, int] | None]]


class FoundDeadlock(Protocol):
    """A deadlock a watch found (``_report/deadlock.py``'s :class:`Deadlock`, or local mode's)."""

    @property
    def ranks(self) -> tuple[int, ...]:
        """The ranks that can never go on."""
        ...

    def lines(
        self, finished: Mapping[int, str] | None = None, where: Mapping[int, str] | None = None
    ) -> list[str]:
        """The deadlock in words (``finished``: ranks that ended their test, and how)."""
        ...


class DeadlockWatch(Protocol):
    """What a launcher asks while its ranks run: :class:`WaitWatch` reads the ranks' logs;
    local mode's scheduler knows at once (``_launch/local.py``)."""

    @property
    def elapsed(self) -> float:
        """Seconds since the test started."""
        ...

    def look(self, finished: Iterable[int]) -> FoundDeadlock | None:
        """The certain deadlock among the ranks not in ``finished``, if one is found now."""
        ...


def threads_asleep(tids: Iterable[int]) -> bool:
    """Whether every thread of ``tids`` (OS thread ids of this machine) is asleep or in an
    uninterruptible wait (``/proc``'s ``S`` or ``D``); True where ``/proc`` cannot tell."""
    for tid in tids:
        try:
            with open(f"/proc/{tid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # gone, or no /proc: the other checks decide
        state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
        if state not in (b"S", b"D"):
            return False
    return True


class WaitWatch:
    """Looks at the ranks' logs while a test runs; says when a deadlock is certain.

    Args:
        read: every rank's collective log and message counts, read now.
        asleep: whether the given ranks' threads are asleep (see :func:`threads_asleep`).
    """

    def __init__(
        self,
        read: Callable[[], Snapshot],
        asleep: Callable[[tuple[int, ...]], bool] = lambda ranks: True,
    ) -> None:
        self._read = read
        self._asleep = asleep
        self._start = time.monotonic()
        self._next = self._start + FIRST_LOOK_S
        self._seen: tuple[Any, float] | None = None
        self.snapshot: Snapshot | None = None
        """The logs of the look that found the deadlock."""

    @property
    def elapsed(self) -> float:
        """Seconds since the watch started (the test's start)."""
        return time.monotonic() - self._start

    def until_next(self) -> float:
        """Seconds until the next look is due (0: now)."""
        return max(0.0, self._next - time.monotonic())

    def look(self, finished: Iterable[int]) -> FoundDeadlock | None:
        """The certain deadlock among the ranks not in ``finished``, if one is found now (a look
        happens only when due; between looks this returns None at once)."""
        now = time.monotonic()
        if now < self._next:
            return None
        self._next = now + POLL_S
        records, channels = self._read()
        found = find_deadlock(records, channels, frozenset(finished))
        if found is None:
            self._seen = None
            return None
        if self._seen is None or self._seen[0] != found.key:
            self._seen = (found.key, now)
            return None
        wall = time.time()
        settled = all(wall - float(e.get("t", wall)) >= CONFIRM_S for e, _ in found.waits.values())
        if now - self._seen[1] < CONFIRM_S or not settled or not self._asleep(found.ranks):
            return None
        self.snapshot = (records, channels)
        return found


def note_deadlock(obs: Any, found: FoundDeadlock, elapsed: float) -> None:
    """Write a certain deadlock into the test's observation (its report is a hang report that
    says so)."""
    finished = {r: _how(res) for r, res in obs.results.items()}
    obs.deadlock = found.lines(finished, obs.where)
    obs.deadlock_ranks = found.ranks
    obs.deadlock_after = elapsed


def _how(result: Any) -> str:
    outcome = getattr(result.outcome, "value", str(result.outcome))
    return {"passed": "returned"}.get(outcome, outcome)


def process_asleep(pids: Mapping[int, int]) -> Callable[[tuple[int, ...]], bool]:
    """``asleep`` for rank processes (``pids``: rank -> pid): each one's main thread."""
    return lambda ranks: threads_asleep(pids[r] for r in ranks if r in pids)
