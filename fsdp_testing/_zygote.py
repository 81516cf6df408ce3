"""The fork server: one process per test session that imports torch once and forks ranks.

Forking a process that has imported torch but started no threads, no OpenMP pool and no CUDA
context is safe and takes milliseconds, where starting an interpreter and importing torch takes
seconds. The server also reaps its children, so it is the one that knows how a rank died.

Protocol (over a ``multiprocessing`` connection to the parent):
- ``("fork", spec)`` -> ``("forked", [pid, ...])``: start one rank per entry of ``spec["ranks"]``.
- ``("status", [pid, ...], timeout)`` -> ``("status", {pid: description or None})``.
- ``("stop",)``: kill every child and exit.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

__all__ = ["describe_status", "main"]


def describe_status(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return f"killed by {name}"
    return f"exited with code {os.waitstatus_to_exitcode(status)}"


def _fork_rank(spec: dict[str, Any], rank: int, conn: Connection) -> int:
    pid = os.fork()
    if pid:
        return pid
    # The child: forget the server's connection and become a rank.
    try:
        conn.close()
        os.setpgid(0, 0)
        sys.path[:] = spec["sys_path"]
        os.chdir(spec["cwd"])
        from fsdp_testing._worker import serve

        serve(
            rank=rank,
            world_size=spec["world_size"],
            backend=spec["backend"],
            gen_dir=spec["gen_dir"],
            address=spec["address"],
            pg_timeout_s=spec["pg_timeout_s"],
        )
    finally:
        os._exit(70)


def main(address: str) -> None:
    from fsdp_testing._worker import connect, die_with_parent

    die_with_parent()
    # Preload what every rank needs, so forks start warm.
    import _pytest._code
    import _pytest.assertion.rewrite  # noqa: F401
    import torch
    import torch.distributed  # noqa: F401

    import fsdp_testing._rank  # noqa: F401

    conn = connect(address)
    conn.send(("zygote", os.getpid()))
    children: set[int] = set()
    reaped: dict[int, str] = {}

    def reap() -> None:
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            children.discard(pid)
            reaped[pid] = describe_status(status)

    while True:
        reap()
        if not conn.poll(0.05):
            continue
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            msg = ("stop",)
        if msg[0] == "fork":
            spec = msg[1]
            pids = [_fork_rank(spec, rank, conn) for rank in spec["ranks"]]
            children.update(pids)
            conn.send(("forked", pids))
        elif msg[0] == "status":
            _, pids, timeout = msg
            deadline = time.monotonic() + timeout
            while any(p not in reaped for p in pids) and time.monotonic() < deadline:
                time.sleep(0.01)
                reap()
            conn.send(("status", {p: reaped.pop(p, None) for p in pids}))
        elif msg[0] == "stop":
            for pid in list(children):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except OSError:
                    pass
            os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
