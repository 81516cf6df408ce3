"""The fork server: one process per test session that imports torch once and forks ranks.

Forking a process that has imported torch but started no threads, no OpenMP pool and no CUDA
context is safe and takes milliseconds, where starting an interpreter and importing torch takes
seconds. The server also reaps its children, so it is the one that knows how a rank died.
Messages: see [Note: pool protocol] in ``fsdp_testing/_protocol.py``.

Two ways to run it:

- ``fork_server ADDRESS``: the session's own. It connects to the session's socket, imports torch
  (then what the session asks it to preload, see [Note: starting the fork server early] in
  ``fork_link.py``) and serves that one session; it exits with it.
- ``fork_server --shared ADDRESS``: one for every xdist worker of a session, started by the
  controller (see [Note: one fork server for the xdist workers] in ``shared_fork_server.py``).
  It listens on ``ADDRESS``; each worker connects and is served on its own connection, and the
  ranks a worker had forked are killed when it leaves. It imports torch when the first worker
  asks it to fork or preload, so that a session with no process-mode test never pays for it.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from multiprocessing.connection import Connection, wait

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

__all__ = ["describe_status", "main"]


def describe_status(status: int) -> str:
    """``"killed by SIGKILL"`` or ``"exited with code 3"`` for a ``waitpid`` status."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return f"killed by {name}"
    return f"exited with code {os.waitstatus_to_exitcode(status)}"


def _fork_rank(spec: GenerationSpec, rank: int, close_in_child: list[object]) -> int:
    """Start one rank process: fork, and run the rank's main loop in the child."""
    pid = os.fork()
    if pid:
        return pid
    # The child: forget the server's connections and become a rank.
    try:
        for item in close_in_child:
            item.close()  # type: ignore[attr-defined]
        os.setpgid(0, 0)
        if spec.env is not None:
            os.environ.clear()
            os.environ.update(spec.env)
        sys.path[:] = spec.sys_path
        os.chdir(spec.cwd)
        from fsdp_testing._launch.rank_process import serve

        serve(rank=rank, spec=spec)
    finally:
        os._exit(70)


class _Server:
    """The children and the clients (sessions or xdist workers) they were forked for."""

    def __init__(self, *, shared: bool) -> None:
        self.shared = shared
        self.clients: dict[Connection, set[int]] = {}
        self.children: set[int] = set()
        self.reaped: dict[int, str] = {}
        self.warm = False
        self.listener: socket.socket | None = None

    def warm_up(self) -> None:
        from fsdp_testing._launch.rank_process import preload

        if not self.warm:
            preload()  # so that forks start warm
            self.warm = True

    def reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.children.discard(pid)
            self.reaped[pid] = describe_status(status)

    def handle(self, conn: Connection, msg: object) -> None:
        from fsdp_testing._launch.rank_process import preload_modules

        if isinstance(msg, ForkRanks):
            self.warm_up()
            preload_modules(msg.spec.preload)  # what earlier ranks imported
            close = [*self.clients, *([self.listener] if self.listener else [])]
            pids = tuple(_fork_rank(msg.spec, r, close) for r in range(msg.spec.world_size))
            self.children.update(pids)
            self.clients[conn].update(pids)
            conn.send(Forked(pids))
        elif isinstance(msg, Preload):
            self.warm_up()
            preload_modules(msg.names)
        elif isinstance(msg, StatusQuery):
            deadline = time.monotonic() + msg.timeout
            while any(p not in self.reaped for p in msg.pids) and time.monotonic() < deadline:
                time.sleep(0.01)
                self.reap()
            conn.send(Statuses({p: self.reaped.pop(p, None) for p in msg.pids}))
        elif isinstance(msg, Stop):
            self.drop(conn)
        else:
            raise AssertionError(f"fork server: unexpected message {msg!r}")

    def drop(self, conn: Connection) -> None:
        """A client is done (or gone): end the ranks forked for it; a session's own server
        ends with its session."""
        for pid in self.clients.pop(conn, set()):
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
        conn.close()
        if not self.shared:
            os._exit(0)

    def serve(self) -> None:
        while True:
            self.reap()
            waitables: list[Connection | socket.socket] = list(self.clients)
            if self.listener is not None:
                waitables.append(self.listener)
            for ready in wait(waitables, timeout=0.05):
                if ready is self.listener:
                    sock, _ = self.listener.accept()
                    sock.setblocking(True)
                    conn = Connection(sock.detach())
                    conn.send(ServerHello(os.getpid()))
                    self.clients[conn] = set()
                    continue
                assert isinstance(ready, Connection)
                try:
                    msg = ready.recv()
                except (EOFError, OSError):
                    msg = Stop()
                self.handle(ready, msg)


def main(*argv: str) -> None:
    from fsdp_testing._launch.rank_process import connect, die_with_parent

    die_with_parent()
    if argv[0] == "--shared":
        server = _Server(shared=True)
        server.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.listener.bind(argv[1])
        server.listener.listen(64)
        print("listening", flush=True)  # the controller waits for this line
        os.dup2(2, 1)  # then what it prints goes to its log, not to a pipe no one reads
        server.serve()
        return
    server = _Server(shared=False)
    conn = connect(argv[0])  # first: the session need not wait for torch to accept it
    conn.send(ServerHello(os.getpid()))
    server.clients[conn] = set()
    server.warm_up()
    server.serve()


if __name__ == "__main__":
    main(*sys.argv[1:])
