"""The one waiting rule every launcher follows while the ranks of a test run.

[Note: deadline and failure grace]
A test ends when every rank has reported. It is cut short in two ways: at ``timeout`` seconds
(the test hung: every rank still running is a straggler, and the report is a timeout report),
or ``FAILURE_GRACE_S`` after the first rank failed or died (its peers usually break out of their
collectives within milliseconds; those that do not are stopped and reported as aborted, not as
a timeout). A launcher that sees peers still reporting (128 thread ranks formatting their
tracebacks on two cores) restarts the grace at each report (``note_progress``); the timeout
stays the bound. Process and thread launchers wait on different things (connections, threads) but
ask this one object how long they may still wait.
"""

from __future__ import annotations

import time

__all__ = ["FAILURE_GRACE_S", "PG_TIMEOUT_MARGIN_S", "Deadline", "pg_timeout_for"]

FAILURE_GRACE_S = 1.0
"""How long peers of a failed rank may take to finish before they count as aborted."""

MIN_PG_TIMEOUT_S = 30.0
"""Floor of a rank process group's timeout (a test's own timeout may be shorter: the
parent stops its ranks at the test's timeout whatever the group's is)."""
PG_TIMEOUT_MARGIN_S = 30.0
"""How much longer than the test's timeout a collective may wait before gloo raises: the
harness's timeout comes first, so a hung collective is reported as a hang, with every rank's
stack in it. (With gloo's timeout equal to the test's, a hang at the default 120 s raised on the
ranks at about the moment their stacks were taken: the report showed them in pytest's
traceback formatting and said the hang was outside any collective.)"""


def pg_timeout_for(timeout: float) -> float:
    """The process-group timeout for a test of ``timeout`` seconds."""
    return max(timeout, MIN_PG_TIMEOUT_S) + PG_TIMEOUT_MARGIN_S


class Deadline:
    """The moment the launcher stops waiting for the ranks of one test."""

    def __init__(self, timeout: float, grace: float = FAILURE_GRACE_S) -> None:
        self._deadline = time.monotonic() + timeout
        self._grace = grace
        self._first_failure: float | None = None

    def note_failure(self) -> None:
        """A rank failed or died: its peers get ``grace`` seconds more, not the full timeout."""
        if self._first_failure is None:
            self._first_failure = time.monotonic()

    def note_progress(self) -> None:
        """After a failure, another rank reported: the grace starts again from now."""
        if self._first_failure is not None:
            self._first_failure = time.monotonic()

    def extend(self, seconds: float) -> None:
        """Move the timeout ``seconds`` later (see [Note: importing is not hanging] in
        ``fsdp_testing/_report/imports.py``)."""
        self._deadline = max(self._deadline, time.monotonic()) + seconds

    def timeout_remaining(self) -> float:
        """Seconds left until the timeout itself, whatever failed."""
        return max(0.0, self._deadline - time.monotonic())

    @property
    def failed(self) -> bool:
        return self._first_failure is not None

    def remaining(self) -> float:
        """Seconds left to wait (0 when the wait is over)."""
        until = self._deadline
        if self._first_failure is not None:
            until = min(until, self._first_failure + self._grace)
        return max(0.0, until - time.monotonic())

    def expired(self) -> bool:
        return self.remaining() <= 0.0

    def timed_out(self, stragglers: bool) -> bool:
        """Ranks still running at the end count as a hang only when nothing failed first."""
        return stragglers and self._first_failure is None
