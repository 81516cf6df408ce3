"""Running one task on one rank: filling in rank fixtures, capturing output, classifying the
outcome and formatting a failure the way pytest would. Shared by every launch mode.
"""

from __future__ import annotations

import dataclasses
import io
import os
import random
import sys
import threading
import time
import types
import unittest
from typing import Any, TextIO

from fsdp_testing._loader import resolve
from fsdp_testing._skips import skip_message_for_exit_code
from fsdp_testing._task import FunctionRef, Outcome, RankFixture, RankResult, Task

__all__ = ["CaptureRouter", "RankContext", "RankState", "run_task"]

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
_COMM_ERROR_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Test termination event occurs",
    "aborted by the harness",
)


@dataclasses.dataclass
class RankContext:
    """The values of the rank fixtures on one rank."""

    rank: int
    world_size: int
    process_group: Any
    device: Any
    dist_backend: str

    def value(self, name: str) -> Any:
        return getattr(self, name)


class CaptureRouter(io.TextIOBase):
    """A ``sys.stdout``/``sys.stderr`` stand-in that sends each thread's writes to that thread's
    buffer while one is registered (thread ranks share one ``sys.stdout``), and to ``tee``
    as well, so a rank that crashes still leaves its last output behind."""

    def __init__(self, fallback: TextIO, tee: TextIO | None = None) -> None:
        self._fallback = fallback
        self._tee = tee
        self._buffers: dict[int, io.StringIO] = {}

    def begin(self) -> None:
        self._buffers[threading.get_ident()] = io.StringIO()

    def end(self) -> str:
        buf = self._buffers.pop(threading.get_ident(), None)
        return buf.getvalue() if buf is not None else ""

    def write(self, s: str) -> int:
        buf = self._buffers.get(threading.get_ident())
        if buf is None:
            return self._fallback.write(s)
        buf.write(s)
        if self._tee is not None:
            self._tee.write(s)
            self._tee.flush()
        return len(s)

    def flush(self) -> None:
        self._fallback.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._fallback.fileno()


class RankState:
    """Process-wide state a test may change, captured once and restored after every test so that
    a warm rank serves the next test as a fresh process would (see [Note: warm pool isolation]
    in ``_pool.py``)."""

    def __init__(self) -> None:
        import torch
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        self._rng = torch.get_rng_state()
        self._py_rng = random.getstate()
        self._dtype = torch.get_default_dtype()
        self._modules = [dist, c10d]
        self._attrs = [dict(vars(m)) for m in self._modules]
        self._groups = set(c10d._world.pg_map)

    def restore(self) -> list[str]:
        """Restore the captured state; return what had to be undone (for diagnostics)."""
        import torch
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        undone: list[str] = []
        for module, attrs in zip(self._modules, self._attrs, strict=True):
            current = vars(module)
            for key in [k for k in current if k not in attrs]:
                if isinstance(current[key], types.ModuleType):
                    continue  # a submodule imported during the test stays imported
                delattr(module, key)
                undone.append(f"{module.__name__}.{key} (added)")
            for key, value in attrs.items():
                if current.get(key, _MISSING) is not value:
                    setattr(module, key, value)
                    undone.append(f"{module.__name__}.{key} (patched)")
        for pg in [pg for pg in list(c10d._world.pg_map) if pg not in self._groups]:
            try:
                dist.destroy_process_group(pg)
            except Exception:  # a group the test already broke: drop it all the same
                c10d._world.pg_map.pop(pg, None)
            undone.append("extra process group")
        torch.set_rng_state(self._rng)
        random.setstate(self._py_rng)
        torch.set_default_dtype(self._dtype)
        torch.set_grad_enabled(True)
        if hasattr(torch, "set_default_device"):
            torch.set_default_device(None)
        return undone


_MISSING = object()


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


def install_router(tee: TextIO | None = None) -> CaptureRouter:
    """Route ``sys.stdout`` and ``sys.stderr`` of this process through one router."""
    router = CaptureRouter(sys.stdout, tee)
    sys.stdout = router
    sys.stderr = router
    return router
