"""What travels between the parent, the fork server and the ranks: tasks, placeholders, per-rank
results and the small control messages of the process pool.

Nothing here imports torch, so the parent can build tasks before any rank exists.

[Note: pool protocol]
Three kinds of process talk over ``multiprocessing`` connections on one Unix socket:

- parent -> fork server: :class:`ForkRanks` (answered by :class:`Forked`),
  :class:`StatusQuery` (answered by :class:`Statuses`), :class:`Preload` and :class:`Stop`;
  the fork server greets the parent with :class:`ServerHello`. A fork server shared by the
  xdist workers of a session serves each worker so, on a connection of its own.
- rank -> parent, once: :class:`RankHello` on connecting, then :class:`RankReady` or
  :class:`RankInitFailed` after joining the process group.
- parent -> rank, per test: a pickled :class:`Task` (answered by a :class:`RankResult`, then,
  from a rank that stays, by :class:`RankReset` once it has reset itself), or :class:`Stop`.
"""

from __future__ import annotations

import dataclasses
import enum
import time
import traceback
from typing import Any

__all__ = [
    "ENGINE_ENV",
    "PROCESS_FIXTURES",
    "RANK_FIXTURES",
    "REPORT_TIMEOUT_S",
    "RESET_TIMEOUT_S",
    "ForkRanks",
    "Forked",
    "FunctionRef",
    "GenerationSpec",
    "Outcome",
    "Preload",
    "RankFixture",
    "RankHello",
    "RankInitFailed",
    "RankMessage",
    "RankReady",
    "RankReset",
    "RankResult",
    "RankSideFixture",
    "ServerHello",
    "StatusQuery",
    "Statuses",
    "Stop",
    "Task",
    "message_text",
]

RANK_FIXTURES = ("rank", "world_size", "process_group", "device", "dist_backend")

ENGINE_ENV = "FSDP_TESTING_ENGINE"
"""Carries ``--fsdp-engine`` from the pytest process to the rank processes it forks."""


@dataclasses.dataclass(frozen=True)
class RankFixture:
    """Stands in the parent for a fixture whose value only exists on a rank."""

    name: str


#: pytest's own fixtures that act on the process they run in; a process-mode rank makes its own
#: (``fsdp_testing/_rank/fixtures.py``) and undoes it when the test ends.
PROCESS_FIXTURES = ("monkeypatch", "recwarn", "caplog", "capsys")


@dataclasses.dataclass(frozen=True)
class RankSideFixture:
    """Stands in the parent for a fixture of the user's that requests a rank fixture (``rank``,
    ``process_group``, ``device``, or another such fixture): it is set up and torn down on each
    rank (see [Note: fixtures on the ranks] in ``fsdp_testing/_rank/fixtures.py``).

    Args:
        name: the fixture's name.
        func: the fixture function (a :class:`FunctionRef` for rank processes).
        kwargs: its arguments: values, :class:`RankFixture` and :class:`RankSideFixture`.
        scope: pytest's scope name.
        key: equal for the same fixture set up for the same scope and parameter: a rank keeps
            a value of a scope broader than ``function`` under it.
        param: ``request.param`` of a parametrized fixture.
    """

    name: str
    func: Any
    kwargs: dict[str, Any]
    scope: str = "function"
    key: str = ""
    param: Any = None


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
        faults: ``fsdp_testing.faults.Fault`` objects to inject while the body runs.
    """

    target: Any
    kwargs: dict[str, Any]
    test_id: str
    tbstyle: str = "auto"
    faults: tuple[Any, ...] = ()


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
    fingerprint: str = ""
    """Equal for ranks that failed with the same error (type, message, frames): the report shows
    it once for all of them (``fsdp_testing/_report/failure.py``)."""
    place: str = ""
    """Equal for ranks that failed at the same place (type, frames), whatever the message."""
    pending: Any = dataclasses.field(default=None, repr=False, compare=False)
    """A failure the parent formats into ``message`` (a rank thread of the parent's process);
    see [Note: formatting a failure in the parent] in ``fsdp_testing/_report/failure.py``."""
    message_follows: bool = False
    """A rank process formats its failure after it sent this result, and sends the text as a
    :class:`RankMessage` (see [Note: a rank's report is written off the clock])."""
    needs_restart: bool = False
    """The rank cannot serve another test (e.g. the body destroyed the default group)."""
    open_p2p: tuple[dict[str, Any], ...] = ()
    """The rank's point-to-point ops not completed when its body ended (their collective log
    entries): a send or receive nobody met fails the test (``_report/verdict.py``)."""
    p2p: bool = False
    """The rank sent or received a message to or from a given rank: the verdict reads the
    collective logs to compare the dtypes of the messages' two ends (``_report/p2p.py``)."""
    notes: tuple[str, ...] = ()
    """What the harness noticed on the rank that the report should mention without failing the
    test (state the test left that made its ranks be replaced)."""
    imported: tuple[str, ...] = ()
    """Preloadable modules the rank imported since its last result (see [Note: preloading what
    ranks import] in ``fsdp_testing/_launch/rank_process.py``)."""

    @classmethod
    def harness_failure(cls, rank: int, summary: str) -> RankResult:
        """A failure of the harness around the test body (call inside ``except``): ``summary``
        says what could not be done and how to fix it; the current exception's traceback is
        the message."""
        return cls(
            rank=rank,
            outcome=Outcome.FAILED,
            summary=summary,
            message=traceback.format_exc(),
            finished_at=time.time(),
        )


# --- control messages of the process pool (see [Note: pool protocol]) --------------------------


@dataclasses.dataclass(frozen=True)
class GenerationSpec:
    """Everything a forked rank needs to join one generation of the warm pool."""

    world_size: int
    backend: str
    gen_dir: str
    """Holds the ranks' logs, collective logs and the file store."""
    address: str
    """The parent's Unix socket."""
    pg_timeout_s: float
    """The process group's timeout: collectives raise after it."""
    sys_path: tuple[str, ...]
    cwd: str
    preload: tuple[str, ...] = ()
    """Modules that earlier ranks imported, for the forking process to import before it forks
    these (see [Note: preloading what ranks import] in ``rank_process.py``)."""
    env: dict[str, str] | None = None
    """The environment the ranks run in (None: the forking process's): a fork server that
    serves every xdist worker of a session was started by none of them."""


@dataclasses.dataclass(frozen=True)
class ForkRanks:
    spec: GenerationSpec


@dataclasses.dataclass(frozen=True)
class Preload:
    """Import these modules now, before the next fork (no answer)."""

    names: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Forked:
    pids: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class StatusQuery:
    """How did these processes end? Wait up to ``timeout`` seconds for each to be reaped."""

    pids: tuple[int, ...]
    timeout: float


@dataclasses.dataclass(frozen=True)
class Statuses:
    by_pid: dict[int, str | None]
    """``"exited with code N"`` / ``"killed by SIGNAME"``, or None while still running."""


@dataclasses.dataclass(frozen=True)
class Stop:
    """Exit now (to the fork server: kill every rank first)."""


@dataclasses.dataclass(frozen=True)
class ServerHello:
    pid: int


@dataclasses.dataclass(frozen=True)
class RankHello:
    rank: int
    pid: int


@dataclasses.dataclass(frozen=True)
class RankReady:
    rank: int
    pid: int


@dataclasses.dataclass(frozen=True)
class RankInitFailed:
    rank: int
    traceback: str


RESET_TIMEOUT_S = 30.0
"""How long a warm rank may take to send :class:`RankReset` after its result (it restores a few
attributes and destroys the groups the test made: milliseconds) before it counts as hung."""


REPORT_TIMEOUT_S = 60.0
"""How long a rank process may take to format its failure after its result (outside the test's
timeout; see [Note: a rank's report is written off the clock])."""


@dataclasses.dataclass(frozen=True)
class RankMessage:
    """The formatted failure of a rank whose :class:`RankResult` said ``message_follows``.

    [Note: a rank's report is written off the clock]
    A rank process sends its result as soon as its test body ends, the failure unformatted, and
    formats the traceback (reading source files, pytest's repr machinery: seconds for a large
    module on a loaded machine) after that. The parent counts a rank as reported when its result
    comes, so writing the report neither counts against the test's timeout nor makes a rank
    still writing it look "aborted" when a peer failed first; the parent then reads each
    message, waiting up to ``REPORT_TIMEOUT_S``. Rank threads (thread and local mode) leave the
    formatting to the parent itself ([Note: formatting a failure in the parent]).
    """

    rank: int
    text: str


def message_text(rank: int, result: RankResult, message: object) -> str:
    """The traceback a rank sent after ``result``, or why there is none."""
    if isinstance(message, RankMessage):
        return message.text
    return (
        f"{result.summary}\n(rank {rank} sent no traceback within {REPORT_TIMEOUT_S:.0f} s of its "
        "result: it ended or hung while formatting it)"
    )


@dataclasses.dataclass(frozen=True)
class RankReset:
    """A warm rank reset its state after a task (``traceback`` None) or could not, and exits."""

    rank: int
    traceback: str | None = None
