"""One rank's failure as the report shows it: the summary line, the traceback, and what makes
two ranks' failures the same error (so a report shows it once, for all of them).

[Note: formatting a failure in the parent]
pytest's long traceback costs milliseconds to seconds a rank (it reads and parses the source
file of every frame: ``distributed_c10d.py`` is 6,000 lines). A rank of a world in this process
(local mode) keeps its exception instead (:class:`Pending`) and the parent formats it once the
test is over, and only for the ranks the report shows: one per distinct error. So formatting
never counts against the test's timeout, a rank is never "still running" because it is writing
its report, and 64 ranks failing alike cost one traceback, not 64. A rank in another process
formats its own (an exception's traceback cannot travel).
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading
from typing import Any

__all__ = [
    "USER_FACING_PRIVATE",
    "Facts",
    "Pending",
    "describe",
    "explanation",
    "format_failure",
    "format_in_parent",
    "formats_in_parent",
    "is_machinery",
    "mask",
    "message_of",
]

_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_MACHINERY_FILES = ("plugin.py", "launcher.py", "testcase.py")
"""Public modules of the package that are harness machinery (run the test, not the user's
checks); every private module (``_launch``, ``_rank``, ``_report``, ...) is machinery too,
but for those in :data:`USER_FACING_PRIVATE`."""
USER_FACING_PRIVATE = tuple(
    os.path.join("_compat", f"{name}.py")
    for name in ("dtensor", "dtensor_helpers", "dtensor_local", "dtensor_rules")
)
"""Private modules whose code the user calls as torch's (``with_comms``, ``init_pg``,
``_test_op``, ``DTensorConverter``): a failure there keeps its frames, a hang shows them."""
_TORCH_DIR = os.sep + "torch" + os.sep
SUMMARY_CHARS = 1000
"""The longest summary a rank sends (the report's headline bounds it further)."""

_ADDRESS = re.compile(r"0x[0-9a-fA-F]{4,}")
_RANK_TAG = re.compile(r"\[rank \d+\]")


def is_machinery(path: str) -> bool:
    """Whether a frame in ``path`` is the harness's own machinery (hidden from tracebacks). The
    package's user-facing helpers (parity, resume, patching, recording, models, faults) are not:
    an error raised inside them keeps their frames."""
    path = os.path.abspath(path)
    if not path.startswith(_PKG_DIR + os.sep):
        return False
    relative = os.path.relpath(path, _PKG_DIR)
    if relative in USER_FACING_PRIVATE:
        return False
    first = relative.split(os.sep)[0]
    return first.startswith("_") or first in _MACHINERY_FILES


def _is_torch(path: str) -> bool:
    return _TORCH_DIR in path


_STDLIB_DIR = os.path.join(os.path.dirname(os.__file__), "")


def _not_users(path: str) -> bool:
    """Whether a frame in ``path`` is code the user did not write and shows in short form:
    torch, the standard library, the package's user-facing helpers (``check_parity``'s 200-line
    body once per traceback would make the report of one bug longer than the bug's code)."""
    path = os.path.abspath(path)
    return _is_torch(path) or path.startswith((_STDLIB_DIR, _PKG_DIR + os.sep))


def mask(text: str) -> str:
    """``text`` without what differs between ranks failing alike: memory addresses
    (``<object at 0x7f...>``) and the ``[rank N]`` tag a message may start with."""
    return _RANK_TAG.sub("[rank N]", _ADDRESS.sub("0x?", text))


@dataclasses.dataclass(frozen=True)
class Facts:
    """What a report needs of a failure before (or without) its traceback."""

    summary: str
    """``Type: message`` on one line, with the whole first assertion message."""
    fingerprint: str
    """Equal for ranks that failed with the same error: type, message (masked) and frames."""
    place: str
    """Equal for ranks that failed at the same place: type and frames (messages may differ)."""


def _message_lines(exc: BaseException) -> list[str]:
    """The exception's own message, without pytest's assertion explanation: a rewritten
    ``assert x, msg`` reads ``msg`` then ``assert ...`` lines; a bare assert only the latter."""
    lines = [line.strip() for line in str(exc).splitlines()]
    if isinstance(exc, AssertionError):
        for i, line in enumerate(lines):
            if i > 0 and line.startswith("assert "):
                lines = lines[:i]
                break
        else:
            if lines and lines[0].startswith("assert "):
                lines = lines[:1]
    return [line for line in lines if line]


def explanation(result: Any) -> str:
    """The first line of pytest's explanation of a failed ``assert x, msg`` (``assert 0 == 5``)
    that a :class:`~fsdp_testing._protocol.RankResult`'s summary leaves out, read from its
    fingerprint (which holds the whole message); empty when there is none."""
    place, fingerprint = getattr(result, "place", ""), getattr(result, "fingerprint", "")
    if not place or not fingerprint.startswith(place + "\n"):
        return ""
    lines = [line.strip() for line in fingerprint[len(place) + 1 :].splitlines()]
    return next((line for line in lines[1:] if line.startswith("assert ")), "")


def _frames(exc: BaseException) -> list[str]:
    found = []
    tb = exc.__traceback__
    while tb is not None:
        path = tb.tb_frame.f_code.co_filename
        if not is_machinery(path):
            found.append(f"{path}:{tb.tb_lineno}")
        tb = tb.tb_next
    return found


def describe(exc: BaseException) -> Facts:
    """The summary, fingerprint and place of ``exc`` (cheap: no source is read)."""
    name = type(exc).__name__
    summary = f"{name}: {' '.join(_message_lines(exc))}".rstrip(": ")
    notes = getattr(exc, "__notes__", None) or []
    if notes:
        summary += " [" + "; ".join(map(str, notes)) + "]"
    if len(summary) > SUMMARY_CHARS:
        summary = summary[: SUMMARY_CHARS - 3] + "..."
    frames = "\n".join(_frames(exc))
    place = f"{type(exc).__module__}.{type(exc).__qualname__}\n{frames}"
    return Facts(summary, f"{place}\n{mask(str(exc))}", place)


def format_failure(exc: BaseException, tbstyle: str, *, brief: bool = False) -> str:
    """``exc``'s traceback as pytest shows it, without the harness's machinery (see
    :func:`is_machinery`), the frames of torch, the standard library and the package's helpers
    in pytest's short form (one line and the call, not the function's whole source); the same
    for every exception of its chain (``__cause__``, ``__context__``).
    ``brief``: the standard library's plain format, for a rank whose collective broke because
    a peer failed (reports show its one-line summary)."""
    import traceback

    if brief:
        return "".join(traceback.format_exception(exc))
    try:
        from _pytest._code import ExceptionInfo

        style = {"auto": "long", "no": "short"}.get(tbstyle, tbstyle)

        def shown(info: Any) -> Any:
            # pytest calls this for each exception of the chain, each with its own traceback.
            kept = info.traceback.filter(info)  # __tracebackhide__, as pytest's default does
            kept = kept.filter(lambda entry: not is_machinery(str(entry.path)))
            if style == "long" and hasattr(kept[0] if kept else None, "with_repr_style"):
                kept = type(kept)(
                    entry.with_repr_style("short") if _not_users(str(entry.path)) else entry
                    for entry in kept
                )
            return kept

        info = ExceptionInfo.from_exception(exc)
        return str(
            info.getrepr(style=style, chain=True, truncate_locals=True, tbfilter=shown)  # type: ignore[arg-type]
        )
    except Exception:  # pragma: no cover - fall back on the standard library's format
        return "".join(traceback.format_exception(exc))


@dataclasses.dataclass
class Pending:
    """A failure that the parent formats (see [Note: formatting a failure in the parent])."""

    exc: BaseException
    tbstyle: str
    brief: bool = False

    def format(self) -> str:
        return format_failure(self.exc, self.tbstyle, brief=self.brief)


_thread = threading.local()


def format_in_parent() -> None:
    """Failures raised on the calling thread (a rank thread of a world in the parent's
    process) are kept as :class:`Pending` for the parent to format. See [Note: formatting a
    failure in the parent]."""
    _thread.in_parent = True


def formats_in_parent() -> bool:
    """Whether :func:`format_in_parent` was called on this thread."""
    return bool(getattr(_thread, "in_parent", False))


def message_of(result: Any) -> str:
    """A :class:`~fsdp_testing._protocol.RankResult`'s message, formatting a pending failure
    now (once)."""
    pending = getattr(result, "pending", None)
    if pending is not None:
        result.message = pending.format()
        result.pending = None
    return str(result.message)
