"""Running one task on one rank: filling in rank fixtures, classifying the outcome and
formatting a failure the way pytest would. Shared by every launch mode.
"""

from __future__ import annotations

import contextlib
import time
import unittest
from collections.abc import Iterator

from fsdp_testing._integrations import debugging, seeds
from fsdp_testing._protocol import FunctionRef, Outcome, RankResult, Task
from fsdp_testing._rank import fixtures
from fsdp_testing._rank.capture import CaptureRouter
from fsdp_testing._rank.context import RankContext
from fsdp_testing._rank.resolve import resolve
from fsdp_testing._rank.skips import skip_message_for_exit_code
from fsdp_testing._report import failure

__all__ = ["run_task"]

_COMM_ERROR_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Test termination event occurs",
    "aborted by the harness",
)


def _record_failure(result: RankResult, exc: BaseException, tbstyle: str) -> None:
    """Fill in the failure's summary (unless set), fingerprint and traceback, formatted now or by
    the parent (see [Note: formatting a failure in the parent] in ``_report/failure.py``)."""
    facts = failure.describe(exc)
    result.summary = result.summary or facts.summary
    result.fingerprint, result.place = facts.fingerprint, facts.place
    brief = result.comm_error  # such a rank's report is its summary line
    if failure.formats_in_parent():
        result.pending = failure.Pending(exc, tbstyle, brief=brief)
    else:
        result.message = failure.format_failure(exc, tbstyle, brief=brief)


def _is_comm_error(exc: BaseException) -> bool:
    text = f"{type(exc).__name__}: {exc}"
    if type(exc).__name__ in ("DistBackendError", "DistNetworkError"):
        return True
    return any(marker in text for marker in _COMM_ERROR_MARKERS)


@contextlib.contextmanager
def _faults_injected(task: Task, ctx: RankContext) -> Iterator[None]:
    """Install the marker's faults on this rank's collective log while the body runs; a fault
    that never fired fails the rank (``FaultNeverFired``)."""
    if not task.faults:
        yield
        return
    from fsdp_testing._rank.comm_observer import current_recorder
    from fsdp_testing.faults import FaultPlan

    recorder = current_recorder()
    if recorder is None:  # pragma: no cover - every launcher installs a collective log
        raise AssertionError(f"[rank {ctx.rank}] faults given but no collective log installed")
    plan = recorder.faults = FaultPlan(ctx.rank, task.faults)
    try:
        yield
    finally:
        recorder.faults = None
    plan.check_fired("the test")  # only once the body ended without raising


def _note_open_p2p(result: RankResult) -> None:
    """Point-to-point ops the body left in flight: the verdict fails a test whose ops nobody
    met, and a warm process group with a message in flight cannot serve the next test (it would
    meet that test's first op on the channel). Whether the body sent or received at all: the
    verdict then compares the dtypes of each message's ends."""
    from fsdp_testing._rank.comm_observer import current_recorder

    recorder = current_recorder()
    result.p2p = recorder is not None and bool(recorder.channels)
    if recorder is not None and recorder.open:
        result.open_p2p = tuple(dict(e) for e in recorder.open.values())
        result.needs_restart = True


def run_task(task: Task, ctx: RankContext, router: CaptureRouter | None) -> RankResult:
    """Run ``task`` on the rank described by ``ctx`` and report how it went."""
    from _pytest.outcomes import Skipped, XFailed

    start = time.monotonic()
    result = RankResult(rank=ctx.rank, outcome=Outcome.PASSED)
    if router is not None:
        router.begin()
    try:
        seeds.reseed_rank(task.test_id, ctx.rank)  # see [Note: per-rank seeds]
        target = task.target
        if isinstance(target, FunctionRef):
            target = resolve(target)
        # See [Note: fixtures on the ranks]: set up before the body, torn down after it.
        with fixtures.arguments(task.kwargs, ctx) as kwargs, _faults_injected(task, ctx):
            if hasattr(target, "run_on_rank"):
                target.run_on_rank(ctx, **kwargs)
            else:
                target(**kwargs)
    except (Skipped, unittest.SkipTest) as exc:
        result.outcome = Outcome.SKIPPED
        result.message = str(getattr(exc, "msg", None) or exc)
    except SystemExit as exc:
        # torch's harness skips a test when a rank exits with a TEST_SKIPS code.
        message = skip_message_for_exit_code(exc.code)
        if message is None:
            result.outcome = Outcome.FAILED
            result.summary = f"SystemExit: the test body called sys.exit({exc.code!r})"
            result.comm_error = _is_comm_error(exc)
            _record_failure(result, exc, task.tbstyle)
        else:
            result.outcome = Outcome.SKIPPED
            result.message = message
    except XFailed as exc:
        result.outcome = Outcome.XFAILED
        result.message = str(exc.msg or exc)
    except BaseException as exc:
        result.outcome = Outcome.FAILED
        result.comm_error = _is_comm_error(exc)
        _record_failure(result, exc, task.tbstyle)
        debugging.rank_failed(exc, ctx.rank)  # see [Note: debugging a rank]
        if isinstance(exc, KeyboardInterrupt):
            raise
    finally:
        result.finished_at = time.time()
        result.duration = time.monotonic() - start
        _note_open_p2p(result)
        if router is not None:
            result.stdout = router.end()
    return result
