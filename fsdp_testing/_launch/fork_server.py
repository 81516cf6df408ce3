"""The fork server: one process per test session that imports torch once and forks ranks.

Forking a process that has imported torch but started no threads, no OpenMP pool and no CUDA
context is safe and takes milliseconds, where starting an interpreter and importing torch takes
seconds. The server also reaps its children, so it is the one that knows how a rank died.
Messages: see [Note: pool protocol] in ``fsdp_testing/_protocol.py``.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from fsdp_testing._protocol import (
    Forked,
    ForkRanks,
    GenerationSpec,
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


def _fork_rank(spec: GenerationSpec, rank: int, close_in_child: object) -> int:
    """Start one rank process: fork, and run the rank's main loop in the child."""
    pid = os.fork()
    if pid:
        return pid
    # The child: forget the server's connection and become a rank.
    try:
        close_in_child.close()  # type: ignore[attr-defined]
        os.setpgid(0, 0)
        sys.path[:] = spec.sys_path
        os.chdir(spec.cwd)
        from fsdp_testing._launch.rank_process import serve

        serve(rank=rank, spec=spec)
    finally:
        os._exit(70)


def main(address: str) -> None:
    from fsdp_testing._launch.rank_process import (
        connect,
        die_with_parent,
        preload,
        preload_modules,
    )

    die_with_parent()
    preload()  # so that forks start warm

    conn = connect(address)
    conn.send(ServerHello(os.getpid()))
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
            msg = Stop()
        if isinstance(msg, ForkRanks):
            preload_modules(msg.spec.preload)  # what earlier ranks imported
            pids = tuple(_fork_rank(msg.spec, r, conn) for r in range(msg.spec.world_size))
            children.update(pids)
            conn.send(Forked(pids))
        elif isinstance(msg, StatusQuery):
            deadline = time.monotonic() + msg.timeout
            while any(p not in reaped for p in msg.pids) and time.monotonic() < deadline:
                time.sleep(0.01)
                reap()
            conn.send(Statuses({p: reaped.pop(p, None) for p in msg.pids}))
        elif isinstance(msg, Stop):
            for pid in list(children):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except OSError:
                    pass
            os._exit(0)
        else:
            raise AssertionError(f"fork server: unexpected message {msg!r}")


if __name__ == "__main__":
    main(sys.argv[1])
