"""Debugging a rank: ``--pdb`` on the failing rank's own frames, ``breakpoint()`` in a rank body.

[Note: debugging a rank]
With ``--pdb``, pytest opens its post-mortem on the exception of the failed call: for a
distributed test, the parent's ``pytest.fail`` of the harness's report, whose frames say nothing.

- Thread, local and fake mode: the ranks are threads of the pytest process, so their
  exceptions are objects here. While ``--pdb`` is on, each rank's failure is noted
  (:func:`rank_failed`, called by ``run_task``), and the plugin hands pytest's post-mortem the
  first failing rank's exception in place of its own (:func:`first_failure`): ``up``, ``p``
  and ``ll`` see the rank's frames and locals.
- Process mode: a rank's exception cannot travel. The first rank of a test to fail forks a copy
  of itself that keeps the failure's frames, and sends its result as usual; the harness judges
  the test and stops its ranks within the test's timeout, and the copy (in a process group of
  its own, so untouched by that) opens the post-mortem on the session's terminal
  (``/dev/tty``), taking the terminal's foreground while it reads. The pytest process waits for
  it where pytest would open its own debugger (:func:`wait_for_rank_sessions`); pytest's own
  post-mortem on the parent's frames follows (``c`` continues past it; ``q`` in the rank's
  session ends the run, as in pytest's). A session without a terminal (CI) is told so, in the
  report, with the alternative: ``mode="thread"`` runs the same body on threads.
- ``breakpoint()`` in a process-mode rank opens pdb on the same terminal for the first rank
  of the world that calls it (the others go on, with a line in their output); with no terminal
  it raises an error that says so. The test's timeout keeps running while pdb waits: give the
  test a longer one (``timeout=`` on the marker, ``--dist-timeout``) to debug at leisure.
- ``breakpoint()`` on a rank thread (thread, local, fake mode) is pytest's own while pytest
  captures output: pytest suspends its capture for the session. Under ``-s`` nothing is
  suspended, and a rank thread's ``sys.stdout`` is the harness's router, which keeps each
  rank's output for its report: pdb's prompt would go there and the session would wait, unseen.
  So, under ``-s``, while rank threads run, ``breakpoint()`` opens pdb on the process's own
  standard streams (:func:`rank_thread_breakpoints`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from types import FrameType, TracebackType
from typing import Any

__all__ = [
    "ENV",
    "enable_in_process",
    "first_failure",
    "forget_sessions",
    "rank_failed",
    "rank_thread_breakpoints",
    "serve_rank",
    "wait_for_rank_sessions",
]

ENV = "FSDP_TESTING_PDB"
"""Set (to a folder) for the rank processes of a session run with ``--pdb``: a rank's copy
that debugs writes its pid there, a rank that cannot says why."""
_TTY = "/dev/tty"
_WAIT_FOR_PARENT_S = 3600.0
"""How long a rank's copy waits to be asked for its post-mortem."""

_lock = threading.Lock()
_failures: list[tuple[int, BaseException]] = []
_in_process = False
_gen_dir: str | None = None
"""Set in a rank process: its generation's folder (one debugger per generation)."""
_rank: int | None = None
"""Set in a rank process: its rank."""


def enable_in_process() -> None:
    """In the pytest process with ``--pdb``: note the failures of in-process ranks."""
    global _in_process
    _in_process = True


def rank_failed(exc: BaseException, rank: int) -> None:
    """A rank's test body raised ``exc`` (called by ``run_task`` in every mode)."""
    if _in_process and _gen_dir is None:
        with _lock:
            _failures.append((rank, exc))
    elif _gen_dir is not None and os.environ.get(ENV):
        _debug_in_a_copy(exc, rank, os.environ[ENV])


def first_failure() -> tuple[int, BaseException] | None:
    """The first in-process rank failure noted since the last call (which forgets them)."""
    with _lock:
        first = _failures[0] if _failures else None
        _failures.clear()
    return first


# --- process mode ---------------------------------------------------------------------------


def serve_rank(gen_dir: str, rank: int) -> None:
    """In rank ``rank``'s process about to serve tasks: failures may be debugged (under
    ``--pdb``) and ``breakpoint()`` opens on the terminal."""
    global _gen_dir, _rank
    _gen_dir, _rank = gen_dir, rank
    sys.breakpointhook = _breakpoint


def _take_terminal_turn(what: str) -> bool:
    """Whether this rank is the first of its generation to ``what`` (debug, breakpoint)."""
    assert _gen_dir is not None
    try:
        os.close(os.open(os.path.join(_gen_dir, f"{what}.lock"), os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    return True


class _Terminal:
    """The session's terminal, opened for reading and writing."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.reader = open(fd, encoding="utf-8", errors="replace", closefd=False)
        self.writer = open(fd, "w", encoding="utf-8", buffering=1, closefd=False)

    def write(self, text: str) -> None:
        self.writer.write(text)

    def close(self) -> None:
        os.close(self.fd)


def _terminal_pdb(tty: _Terminal) -> Any:
    """pdb on the session's terminal, in its foreground while it reads (pdb is imported here:
    ranks that never debug do not pay for it)."""
    import pdb

    class TerminalPdb(pdb.Pdb):
        def interaction(self, frame: FrameType | None, tb: Any) -> None:
            with _foreground(tty.fd):
                super().interaction(frame, tb)

    debugger = TerminalPdb(stdin=tty.reader, stdout=tty.writer)
    debugger.use_rawinput = False
    return debugger


@contextlib.contextmanager
def _foreground(fd: int) -> Iterator[None]:
    """Make this process's group the terminal's foreground (a background group reading it
    would be stopped by SIGTTIN), and give the terminal back after."""
    previous = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    try:
        before = os.tcgetpgrp(fd)
        os.tcsetpgrp(fd, os.getpgrp())
    except OSError:
        signal.signal(signal.SIGTTOU, previous)
        yield
        return
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.tcsetpgrp(fd, before)
        signal.signal(signal.SIGTTOU, previous)


def _open_terminal() -> tuple[_Terminal | None, str]:
    try:
        return _Terminal(os.open(_TTY, os.O_RDWR | os.O_NOCTTY)), ""
    except OSError as exc:
        return None, f"{_TTY} cannot be opened ({exc.strerror or exc}): no terminal"


def _debug_in_a_copy(exc: BaseException, rank: int, folder: str) -> None:
    if not _take_terminal_turn("pdb"):
        return
    tty, why = _open_terminal()
    if tty is None:
        with open(os.path.join(folder, f"rank{rank}.none"), "w") as f:
            f.write(why)
        return
    pid = os.fork()
    if pid:
        # Out of the rank's process group before this rank reports its failure: the child's
        # own setpgid may come later, on a busy machine after the pool killed the rank's group
        # (the copy died with it, and pytest's post-mortem opened on the parent instead).
        with contextlib.suppress(OSError):
            os.setpgid(pid, pid)
        tty.close()
        with open(os.path.join(folder, f"{pid}.pid"), "w") as f:
            f.write(str(rank))
        return
    # The copy: out of the rank's process group, which the harness kills with the test. It
    # waits for the pytest process to reach the point where pytest opens its debugger.
    code = 0
    try:
        os.setpgid(0, 0)
        go = os.path.join(folder, f"{os.getpid()}.go")
        until = time.monotonic() + _WAIT_FOR_PARENT_S
        while not os.path.exists(go):
            if not os.path.isdir(folder) or time.monotonic() > until:
                os._exit(0)  # the session ended without asking for it
            time.sleep(0.02)
        tty.write(
            f"\n>>>>>>>>>> fsdp_testing: rank {rank} failed: post-mortem on its own frames "
            f"(a copy of the rank process, pid {os.getpid()}) >>>>>>>>>>\n"
            f"{type(exc).__name__}: {exc}\n"
        )
        debugger = _terminal_pdb(tty)
        debugger.reset()
        tb: TracebackType | None = exc.__traceback__
        debugger.interaction(None, tb)
        code = 3 if debugger.quitting else 0
    finally:
        with contextlib.suppress(OSError):
            with open(os.path.join(folder, f"{os.getpid()}.done"), "w") as f:
                f.write(str(code))
            os.remove(os.path.join(folder, f"{os.getpid()}.pid"))
        os._exit(code)


@contextlib.contextmanager
def rank_thread_breakpoints() -> Iterator[None]:
    """While in-process rank threads run under ``-s``: ``breakpoint()`` on one of them opens
    pdb on ``sys.__stdout__``, past the harness's capture of the rank's output (see [Note:
    debugging a rank])."""
    previous = sys.breakpointhook

    def hook(*args: Any, **kwargs: Any) -> None:
        import pdb

        frame = sys._getframe(1)  # the caller of breakpoint(), as pdb.set_trace() finds it
        out, inp = sys.__stdout__, sys.__stdin__
        if out is None or inp is None:
            raise RuntimeError("breakpoint() on a rank thread: this process has no stdin/stdout")
        out.write(
            f"\n>>>>>>>>>> fsdp_testing: breakpoint() on a rank thread "
            f"({threading.current_thread().name}) >>>>>>>>>>\n"
        )
        pdb.Pdb(stdin=inp, stdout=out).set_trace(frame)

    sys.breakpointhook = hook
    try:
        yield
    finally:
        sys.breakpointhook = previous


def _breakpoint(*args: Any, **kwargs: Any) -> None:
    frame = sys._getframe(1)  # the caller of breakpoint(), as pdb.set_trace() finds it
    if not _take_terminal_turn("breakpoint"):
        print(f"fsdp_testing: breakpoint() skipped on rank {_rank}: another rank has the terminal")
        return
    tty, why = _open_terminal()
    if tty is None:
        raise RuntimeError(
            f"breakpoint() in a process-mode rank: {why}. Run pytest from a terminal, or run "
            "the test with mode='thread' (its ranks are threads of the pytest process, where "
            "breakpoint() is pytest's own; add -s)"
        )
    tty.write(
        f"\n>>>>>>>>>> fsdp_testing: breakpoint() on rank {_rank} (pid {os.getpid()}; the other "
        "ranks go on) >>>>>>>>>>\n"
    )
    _terminal_pdb(tty).set_trace(frame)


def wait_for_rank_sessions(folder: str, write: Any) -> bool:
    """In the pytest process: wait for the rank post-mortem sessions started in ``folder``
    (see [Note: debugging a rank]); say why a rank could not open one. Returns whether a
    session ended with ``q`` (quit)."""
    quit_ = False
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name.endswith(".none"):
            with open(path) as f:
                why = f.read()
            write(
                f"fsdp_testing: --pdb: no post-mortem on {name[:-5].replace('rank', 'rank ')}: "
                f"{why}. Run pytest from a terminal, or use mode='thread' for a post-mortem on "
                "the rank's frames in this process."
            )
            os.remove(path)
    for name in [n for n in os.listdir(folder) if n.endswith(".pid")]:
        with open(os.path.join(folder, name[:-4] + ".go"), "w"):
            pass
    while True:
        pending = [n for n in os.listdir(folder) if n.endswith(".pid")]
        if not pending:
            break
        for name in pending:
            pid = int(name[:-4])
            try:
                os.kill(pid, 0)
            except ProcessLookupError:  # ended without cleaning up (killed)
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(folder, name))
        time.sleep(0.05)
    for name in [n for n in os.listdir(folder) if n.endswith(".done")]:
        with open(os.path.join(folder, name)) as f:
            quit_ = quit_ or f.read().strip() == "3"
    forget_sessions(folder)
    return quit_


def forget_sessions(folder: str) -> None:
    """Before a test: end the copies of earlier tests' ranks that nobody asked for (a failure
    that a test expected), so the next post-mortem is this test's."""
    for name in os.listdir(folder):
        if name.endswith(".pid"):
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(name[:-4]), signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.remove(os.path.join(folder, name))
