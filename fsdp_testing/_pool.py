"""Process mode, parent side: the warm pool of rank processes.

[Note: warm pool isolation]
Ranks of one (world size, backend) stay alive between tests, with their process group, so a
test costs a few messages and the test body, not an interpreter start and ``import torch``.
What a test may leave behind is undone on every rank after every task (``RankState.restore``):
RNG state, default dtype and device, grad mode, attributes of ``torch.distributed`` that the test
patched, added or that our own flight recorder wraps, and extra process groups. A generation of
ranks is thrown away and forked anew from the fork server when it cannot be trusted: a rank
died, timed out or was still running when a peer failed (it may be stuck in a collective), the
test destroyed the default group, or the pool is disabled (``--no-dist-pool``).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection, wait
from typing import cast

from fsdp_testing import _flight
from fsdp_testing._report import Observation
from fsdp_testing._task import Outcome, RankResult, Task

__all__ = ["ProcessLauncher"]

FAILURE_GRACE_S = 1.0
"""How long peers of a failed rank may take to finish before they count as aborted."""
STACK_DUMP_WAIT_S = 0.3
START_TIMEOUT_S = 60.0


@dataclasses.dataclass
class _Generation:
    world_size: int
    backend: str
    gen_dir: str
    conns: list[Connection]
    pids: list[int]
    tests_served: int = 0

    def log_path(self, rank: int) -> str:
        return os.path.join(self.gen_dir, f"rank{rank}.log")

    def log_size(self, rank: int) -> int:
        try:
            return os.path.getsize(self.log_path(rank))
        except OSError:
            return 0

    def read_log(self, rank: int, offset: int, limit: int = 20000) -> str:
        try:
            with open(self.log_path(rank), "rb") as f:
                f.seek(offset)
                data = f.read()
        except OSError:
            return ""
        text = data.decode(errors="replace")
        return text if len(text) <= limit else "...\n" + text[-limit:]


class ProcessLauncher:
    """Runs tasks on rank processes forked from one fork server, kept warm between tests."""

    def __init__(self) -> None:
        self._root = tempfile.mkdtemp(prefix="fsdp-testing-")
        self._address = os.path.join(self._root, "ctl.sock")
        self._server: socket.socket | None = None
        self._zygote: subprocess.Popen[bytes] | None = None
        self._zconn: Connection | None = None
        self._pools: dict[tuple[int, str], _Generation] = {}
        self._gen_counter = 0
        self.generations_started = 0

    # --- the fork server ----------------------------------------------------------------------

    def _accept(self, timeout: float) -> Connection:
        assert self._server is not None
        self._server.settimeout(timeout)
        sock, _ = self._server.accept()
        sock.setblocking(True)
        return Connection(sock.detach())

    def _ensure_zygote(self) -> Connection:
        if self._zconn is not None and self._zygote is not None and self._zygote.poll() is None:
            return self._zconn
        if self._server is None:
            self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._server.bind(self._address)
            self._server.listen(256)
        log = open(os.path.join(self._root, "zygote.log"), "ab")
        self._zygote = subprocess.Popen(
            [sys.executable, "-m", "fsdp_testing._zygote", self._address],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
        )
        log.close()
        try:
            conn = self._accept(START_TIMEOUT_S)
        except TimeoutError:
            self._zygote.kill()
            raise RuntimeError(
                "fsdp_testing: the rank fork server did not start within "
                f"{START_TIMEOUT_S:.0f} s; its log: {os.path.join(self._root, 'zygote.log')}"
            ) from None
        kind, _pid = conn.recv()
        if kind != "zygote":
            raise AssertionError(f"fork server said {kind!r} instead of hello")
        self._zconn = conn
        return conn

    def _statuses(self, pids: list[int], timeout: float) -> dict[int, str | None]:
        conn = self._ensure_zygote()
        conn.send(("status", pids, timeout))
        _, statuses = conn.recv()
        return statuses

    # --- generations ----------------------------------------------------------------------

    def _start_generation(self, world_size: int, backend: str, pg_timeout_s: float) -> _Generation:
        zconn = self._ensure_zygote()
        self._gen_counter += 1
        gen_dir = os.path.join(self._root, f"gen{self._gen_counter}")
        os.mkdir(gen_dir)
        spec = {
            "ranks": list(range(world_size)),
            "world_size": world_size,
            "backend": backend,
            "gen_dir": gen_dir,
            "address": self._address,
            "pg_timeout_s": pg_timeout_s,
            "sys_path": list(sys.path),
            "cwd": os.getcwd(),
        }
        zconn.send(("fork", spec))
        _, pids = zconn.recv()
        conns: list[Connection | None] = [None] * world_size
        try:
            for _ in range(world_size):
                accepted = self._accept(START_TIMEOUT_S)
                _, rank, _pid = accepted.recv()
                conns[rank] = accepted
            for rank, conn in enumerate(conns):
                assert conn is not None
                if not conn.poll(START_TIMEOUT_S):
                    raise TimeoutError(f"rank {rank} did not join its process group")
                msg = conn.recv()
                if msg[0] == "init_failed":
                    raise RuntimeError(
                        f"fsdp_testing: rank {rank} could not join a {backend} process group of "
                        f"{world_size}:\n{msg[2]}"
                    )
        except BaseException:
            self._kill(pids)
            raise
        self.generations_started += 1
        return _Generation(world_size, backend, gen_dir, [c for c in conns if c], pids)

    def _kill(self, pids: list[int]) -> None:
        for pid in pids:
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass

    def _discard(self, gen: _Generation) -> None:
        for conn in gen.conns:
            try:
                conn.send_bytes(b"stop")
            except OSError:
                pass
            conn.close()
        self._kill(gen.pids)
        self._statuses(gen.pids, 1.0)
        shutil.rmtree(gen.gen_dir, ignore_errors=True)

    # --- running a task -------------------------------------------------------------------

    def run(
        self,
        task: Task,
        *,
        world_size: int,
        backend: str,
        timeout: float,
        reuse: bool,
    ) -> Observation:
        """Run ``task`` on every rank and observe how each finished.

        Args:
            task: what to run.
            world_size: number of ranks.
            backend: ``"gloo"`` or ``"nccl"``.
            timeout: seconds until the test counts as hung.
            reuse: keep the ranks warm for the next test when they can be trusted.
        """
        key = (world_size, backend)
        # A fresh-process test leaves the warm generation (if any) for the tests after it.
        gen = self._pools.pop(key, None) if reuse else None
        if gen is None:
            gen = self._start_generation(world_size, backend, pg_timeout_s=max(timeout, 30.0))
        payload = pickle.dumps(task)
        offsets = [gen.log_size(r) for r in range(world_size)]
        for conn in gen.conns:
            conn.send_bytes(payload)
        obs = self._collect(gen, timeout, offsets)
        gen.tests_served += 1
        trusted = not (obs.stragglers or obs.dead) and not any(
            r.needs_restart for r in obs.results.values()
        )
        if reuse and trusted:
            self._pools[key] = gen
        else:
            self._discard(gen)
        return obs

    def _collect(self, gen: _Generation, timeout: float, offsets: list[int]) -> Observation:
        start = time.monotonic()
        deadline = start + timeout
        pending = {conn: rank for rank, conn in enumerate(gen.conns)}
        obs = Observation(world_size=gen.world_size, timeout=timeout)
        first_failure: float | None = None
        while pending:
            until = (
                deadline
                if first_failure is None
                else min(deadline, first_failure + FAILURE_GRACE_S)
            )
            ready = wait(list(pending), timeout=max(0.0, until - time.monotonic()))
            if not ready:
                break
            for ready_conn in ready:
                conn = cast(Connection, ready_conn)
                rank = pending.pop(conn)
                try:
                    result: RankResult = conn.recv()
                except (EOFError, OSError):
                    obs.dead.add(rank)
                    first_failure = first_failure or time.monotonic()
                    continue
                obs.results[rank] = result
                if result.outcome is Outcome.FAILED:
                    first_failure = first_failure or time.monotonic()
        obs.stragglers = set(pending.values())
        obs.timed_out = bool(obs.stragglers) and first_failure is None
        if obs.stragglers:
            # See [Note: flight record] in _flight.py: read what every rank was doing.
            for rank in obs.stragglers:
                try:
                    os.kill(gen.pids[rank], signal.SIGUSR1)
                except OSError:
                    pass
            time.sleep(STACK_DUMP_WAIT_S)
            for rank in obs.stragglers:
                obs.stacks[rank] = _strip_output(gen.read_log(rank, offsets[rank]), rank, obs)
            self._kill([gen.pids[r] for r in obs.stragglers])
        for rank in range(gen.world_size):
            obs.records[rank] = _flight.read_record_file(
                os.path.join(gen.gen_dir, f"rank{rank}.flight")
            )
        if obs.dead:
            statuses = self._statuses([gen.pids[r] for r in obs.dead], 2.0)
            for rank in obs.dead:
                obs.exit_status[rank] = statuses.get(gen.pids[rank]) or "exited"
                obs.last_output[rank] = gen.read_log(rank, offsets[rank], limit=4000)
        return obs

    def shutdown(self) -> None:
        """Stop every rank and the fork server; remove the session's files."""
        for gen in self._pools.values():
            for conn in gen.conns:
                try:
                    conn.send_bytes(b"stop")
                except OSError:
                    pass
            self._kill(gen.pids)
        self._pools.clear()
        if self._zconn is not None:
            try:
                self._zconn.send(("stop",))
            except OSError:
                pass
        if self._zygote is not None:
            try:
                self._zygote.wait(5)
            except subprocess.TimeoutExpired:
                self._zygote.kill()
                self._zygote.wait()
        if self._server is not None:
            self._server.close()
        shutil.rmtree(self._root, ignore_errors=True)


def _strip_output(log: str, rank: int, obs: Observation) -> str:
    """Split a straggler's log into its output and the stack dump that SIGUSR1 appended."""
    marker = log.find("Thread 0x")
    if marker < 0:
        marker = log.find("Current thread 0x")
    if marker < 0:
        return log
    obs.last_output[rank] = log[:marker]
    return log[marker:]
