"""Process mode, parent side: the session's link to the fork server that forks its ranks, and the
Unix socket its ranks connect to. The fork server is the session's own (started here) or, in an
xdist worker, the one the controller started for all its workers (``shared_fork_server.py``).

[Note: starting the fork server early]
A session's first process-mode test used to start the fork server (import torch, ~2 s of CPU)
and wait for it; then its ranks imported, each for itself, what the test module and torch's
lazy imports need (DDP, fully_shard and DTensor import torch._dynamo on first use: ~180 modules
a rank): 10 to 20 s on a busy 2-core machine, per xdist worker. Now the plugin starts the fork
server as soon as collection meets a test that runs on rank processes (``warm_start.py``), so
that it imports torch while pytest collects the rest; when collection ends it sends
``Preload(parent_modules())``: what the session imported (the test modules' imports, which the
ranks import too) and dynamo where they will need it. The fork server imports them before it
forks the first generation, once, instead of once per rank. If every such test was deselected,
the fork server ends there. Each generation also names them in ``GenerationSpec.preload``
(with what earlier ranks reported), for modules imported since. What cannot be imported before
a fork is not: see [Note: no CUDA before a fork] in ``rank_process.py``. Figures:
docs/benchmarks.md, "pytest-xdist and the first test".
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from multiprocessing.connection import Connection

from fsdp_testing._launch.deadline import Deadline
from fsdp_testing._launch.rank_process import connect
from fsdp_testing._protocol import (
    Forked,
    ForkRanks,
    GenerationSpec,
    Preload,
    ServerHello,
    Statuses,
    StatusQuery,
    Stop,
)

__all__ = ["PRELOAD_LIMIT_S", "START_TIMEOUT_S", "ForkServerLink"]

START_TIMEOUT_S = 60.0
PRELOAD_LIMIT_S = 300.0
"""How long the fork server may take to import what ranks will import and fork a generation
(minutes only on a machine loaded many times over)."""


class ForkServerLink:
    """The fork server of one session (its own, or the xdist workers' ``shared`` one at that
    address) and the socket ``address`` in ``root`` that the ranks connect to."""

    def __init__(self, root: str, address: str, shared: str | None = None) -> None:
        self._root = root
        self._address = address
        self._shared = shared
        self._listener: socket.socket | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None

    def start(self) -> None:
        """Start the fork server now, without waiting for it (it imports torch while pytest
        goes on); a shared one: connect to it. See [Note: starting the fork server early]."""
        self._listen()
        if self._shared is not None:
            if self._conn is None:
                self._conn = self._connect_shared()
            return
        if self._proc is not None and self._proc.poll() is None:
            return
        self._conn = None
        log = open(self.log_path(), "ab")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "fsdp_testing._launch.fork_server", self._address],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
        )
        log.close()

    def preload(self, names: tuple[str, ...]) -> None:
        """Ask the fork server to import ``names`` before it forks again (no answer: this
        returns at once)."""
        self._connection().send(Preload(names))

    def fork(self, spec: GenerationSpec) -> list[int]:
        """Fork the ranks of ``spec`` (they connect to :meth:`accept`); their pids."""
        conn = self._connection()
        conn.send(ForkRanks(spec))
        self._wait_for(conn)
        forked = conn.recv()
        assert isinstance(forked, Forked), f"fork server answered {forked!r} to ForkRanks"
        return list(forked.pids)

    def statuses(self, pids: list[int], timeout: float) -> dict[int, str | None]:
        """How each of ``pids`` ended (None: still running), waiting up to ``timeout``."""
        conn = self._connection()
        conn.send(StatusQuery(tuple(pids), timeout))
        answer = conn.recv()
        assert isinstance(answer, Statuses), f"fork server answered {answer!r} to StatusQuery"
        return answer.by_pid

    def accept(self, timeout: float) -> Connection:
        """The next process to connect to the session's socket (a rank, or its own server)."""
        assert self._listener is not None
        self._listener.settimeout(timeout)
        sock, _ = self._listener.accept()
        sock.setblocking(True)
        return Connection(sock.detach())

    def stop(self) -> None:
        """End the session's own fork server (every rank it forked with it); a shared one ends
        the ranks it forked for this session. Close the socket."""
        if self._conn is not None:
            try:
                self._conn.send(Stop())
            except OSError:
                pass
            self._conn.close()
        elif self._proc is not None:  # started early, never needed
            self._proc.kill()
        if self._proc is not None:
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._listener is not None:
            self._listener.close()

    def log_path(self) -> str:
        if self._shared is not None:
            return os.path.join(os.path.dirname(self._shared), "fork_server.log")
        return os.path.join(self._root, "fork_server.log")

    # --- internals ------------------------------------------------------------------------

    def _listen(self) -> None:
        if self._listener is None:
            self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._listener.bind(self._address)
            self._listener.listen(256)

    def _connect_shared(self) -> Connection:
        assert self._shared is not None
        try:
            conn = connect(self._shared)
        except OSError as exc:
            raise RuntimeError(
                f"fsdp_testing: could not reach the fork server of this session's xdist "
                f"workers at {self._shared}: {exc}"
            ) from None
        _expect_hello(conn)
        return conn

    def _alive(self) -> bool:
        if self._shared is not None:
            return self._conn is not None and not self._conn.closed
        return self._proc is not None and self._proc.poll() is None

    def _connection(self) -> Connection:
        if self._conn is not None and self._alive():
            return self._conn
        if self._shared is not None or not self._alive():
            self.start()
        if self._shared is not None:
            assert self._conn is not None
            return self._conn
        assert self._proc is not None
        try:
            conn = self.accept(START_TIMEOUT_S)
        except TimeoutError:
            self._proc.kill()
            raise RuntimeError(
                "fsdp_testing: the rank fork server did not start within "
                f"{START_TIMEOUT_S:.0f} s; see its log for why: {self.log_path()}"
            ) from None
        _expect_hello(conn)
        self._conn = conn
        return conn

    def _wait_for(self, conn: Connection) -> None:
        """Wait while the fork server imports what it was asked to preload and forks: as long
        as it takes on a busy machine (it is alive and working), up to ``PRELOAD_LIMIT_S``."""
        deadline = Deadline(PRELOAD_LIMIT_S)
        while not conn.poll(min(1.0, max(deadline.remaining(), 0.0))):
            if self._alive() and not deadline.expired():
                continue
            if self._proc is not None:
                self._proc.kill()
            why = "ended" if not self._alive() else f"did not fork within {PRELOAD_LIMIT_S:.0f} s"
            raise RuntimeError(
                f"fsdp_testing: the rank fork server {why}; its log: {self.log_path()}"
            )


def _expect_hello(conn: Connection) -> None:
    hello = conn.recv()
    if not isinstance(hello, ServerHello):
        raise AssertionError(f"fork server said {hello!r} instead of ServerHello")
