"""Running one task on one rank: filling in rank fixtures, classifying the outcome and
formatting a failure the way pytest would. Shared by every launch mode.
"""

from __future__ import annotations

import contextlib
import os
import time
import unittest
from collections.abc import Iterator

from fsdp_testing._protocol import FunctionRef, Outcome, RankFixture, RankResult, Task
from fsdp_testing._rank.capture import CaptureRouter
from fsdp_testing._rank.context import RankContext
from fsdp_testing._rank.resolve import resolve
from fsdp_testing._rank.skips import skip_message_for_exit_code

__all__ = ["run_task"]

_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_COMM_ERROR_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Test termination event occurs",
    "aborted by the harness",
)


def _format_failure(exc: BaseException, tbstyle: str) -> str:
    try:
        from _pytest._code import ExceptionInfo

        info = ExceptionInfo.from_exception(exc)
        info.traceback = info.traceback.filter(
            lambda entry: not str(entry.path).startswith(_PKG_DIR)
        )
        style = {"auto": "long", "no": "short"}.get(tbstyle, tbstyle)
        return str(info.getrepr(style=style, chain=True, truncate_locals=True))  # type: ignore[arg-type]
    except Exception:  # pragma: no cover - fall back on the standard library's format
        import traceback

        return "".join(traceback.format_exception(exc))


def _is_comm_error(exc: BaseException) -> bool:
    text = f"{type(exc).__name__}: {exc}"
    if type(exc).__name__ in ("DistBackendError", "DistNetworkError"):
        return True
    return any(marker in text for marker in _COMM_ERROR_MARKERS)


@contextlib.contextmanager
def _faults_injected(task: Task, ctx: RankContext) -> Iterator[None]:
    """Install the marker's faults on this rank's collective log while the body runs."""
    if not task.faults:
        yield
        return
    from fsdp_testing._report.collective_log import current_recorder
    from fsdp_testing.faults import FaultPlan

    recorder = current_recorder()
    if recorder is None:  # pragma: no cover - every launcher installs a collective log
        raise AssertionError(f"[rank {ctx.rank}] faults given but no collective log installed")
    recorder.faults = FaultPlan(ctx.rank, task.faults)
    try:
        yield
    finally:
        recorder.faults = None


def run_task(task: Task, ctx: RankContext, router: CaptureRouter | None) -> RankResult:
    """Run ``task`` on the rank described by ``ctx`` and report how it went."""
    from _pytest.outcomes import Skipped, XFailed

    start = time.monotonic()
    result = RankResult(rank=ctx.rank, outcome=Outcome.PASSED)
    if router is not None:
        router.begin()
    try:
        target = task.target
        if isinstance(target, FunctionRef):
            target = resolve(target)
        kwargs = {
            k: ctx.value(v.name) if isinstance(v, RankFixture) else v
            for k, v in task.kwargs.items()
        }
        with _faults_injected(task, ctx):
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
            result.message = _format_failure(exc, task.tbstyle)
            result.comm_error = _is_comm_error(exc)
        else:
            result.outcome = Outcome.SKIPPED
            result.message = message
    except XFailed as exc:
        result.outcome = Outcome.XFAILED
        result.message = str(exc.msg or exc)
    except BaseException as exc:
        result.outcome = Outcome.FAILED
        notes = getattr(exc, "__notes__", None) or []
        first_line = (str(exc).splitlines() or [""])[0]
        result.summary = f"{type(exc).__name__}: {first_line}"[:300]
        if notes:
            result.summary += " [" + "; ".join(notes) + "]"
        result.message = _format_failure(exc, task.tbstyle)
        result.comm_error = _is_comm_error(exc)
        if isinstance(exc, KeyboardInterrupt):
            raise
    finally:
        result.finished_at = time.time()
        result.duration = time.monotonic() - start
        if router is not None:
            result.stdout = router.end()
    return result
