"""One slot of a launched job: the process that runs rank ``s`` of every test that needs it.

Every process a launcher starts, except the first (global rank 0), becomes a slot instead of a
pytest session (``plugin.pytest_cmdline_main``); the first process starts a helper process that
is its own slot (``python -m fsdp_testing._launch.job_slot``). A slot imports what its ranks
need (``rank_process.preload``, then what its earlier ranks imported: ``preload_modules``) and
never joins a process group itself: for each world the coordinator asks for, it forks a rank
process (``rank_process.serve``) that joins that world through the job's store. A rank that
hangs or dies is dumped, killed and replaced while its slot keeps talking to the coordinator.
Messages and keys: [Note: job protocol] in ``job_messages.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pickle
import shutil
import signal
import socket
import sys
import time
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

from fsdp_testing import _protocol
from fsdp_testing._launch.fork_server import describe_status
from fsdp_testing._launch.job_child import RankChild, split_dump
from fsdp_testing._launch.job_messages import (
    POLL_S,
    Died,
    DropGeneration,
    Dumped,
    DumpRank,
    Finished,
    Ready,
    Release,
    RunTask,
    SlotHello,
    StartGeneration,
    connect_store,
    take,
)
from fsdp_testing._launch.rank_process import die_with_parent, preload, preload_modules, serve
from fsdp_testing._launch.socket_root import socket_root
from fsdp_testing._launch.torchrun import JobEnv, job_env
from fsdp_testing._protocol import GenerationSpec, RankHello, RankInitFailed, RankReset
from fsdp_testing._rank.context import RankContext
from fsdp_testing._report.hang_report import stack_sources

__all__ = ["COORDINATOR_KEY", "HELPER_ENV", "Coordinator", "Slot", "main", "serve_slot"]

HELPER_ENV = "FSDP_TESTING_JOB_SLOT_HELPER"
"""Set in the helper process that is the first process's own slot."""
COORDINATOR_KEY = "coordinator"
EXITING_KEY = "exiting"
"""Set by the first process as it exits (see [Note: job exit status] in ``job.py``)."""
EXIT_WAIT_S = 10.0
STACK_DUMP_WAIT_S = 0.3
START_TIMEOUT_S = 120.0
"""How long a rank process may take to join its world (every rank of the world must start)."""
BEAT_S = 0.5
IDLE_POLL_S = 0.1
"""Poll interval after two idle seconds (a long stretch of tests that need no slot)."""


@dataclasses.dataclass(frozen=True)
class Coordinator:
    """What the first process tells the slots about itself (for the line other nodes print)."""

    host: str
    node: int | None
    report: str
    """Where the report is: ``"rank 0's terminal"``, with the JUnit XML path when written."""


def _join_world(
    rank: int, spec: GenerationSpec, *, job: JobEnv, gen: int, threads: int
) -> RankContext:
    """Join world ``gen`` as ``rank`` through the job's store (runs in the rank process)."""
    import torch
    import torch.distributed as dist

    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(threads)
    device = torch.device("cpu")
    if spec.backend == "nccl":
        device = torch.device("cuda", job.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    store = dist.PrefixStore(f"gen/{gen}/", connect_store(job, host=False))
    dist.init_process_group(
        spec.backend,
        store=store,
        rank=rank,
        world_size=spec.world_size,
        timeout=timedelta(seconds=spec.pg_timeout_s),
        device_id=device if spec.backend == "nccl" else None,
    )
    return RankContext(rank, spec.world_size, dist.group.WORLD, device, spec.backend)


class Slot:
    """Serves one slot of the job until the coordinator releases it (see module docstring)."""

    def __init__(self, job: JobEnv, store: Any, *, announce: bool, helper: bool) -> None:
        self._job = job
        self._helper = helper
        self._rank = job.rank
        self._store = store
        self._announce = announce
        self._root, self._address = socket_root(f"fsdp-testing-slot{job.rank}-")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self._address)
        self._listener.listen(4)
        self._children: dict[int, RankChild] = {}
        self._next = 0
        self._last_beat = 0.0
        self._last_message = time.monotonic()
        self._stopping = False
        """Set while the rank processes are stopped at the end: the store may be gone."""
        self._imports: dict[str, None] = {}  # see [Note: preloading what ranks import]

    # --- the store ------------------------------------------------------------------------

    def _post(self, key: str, value: object) -> None:
        self._store.set(key, pickle.dumps(value))

    def _beat(self) -> None:
        now = time.monotonic()
        if now - self._last_beat >= BEAT_S and not self._stopping:
            self._store.add(f"alive/{self._rank}", 1)
            self._last_beat = now

    def _message_waiting(self) -> bool:
        return bool(self._store.check([f"slot/{self._rank}/{self._next}"]))

    def _next_message(self) -> object:
        while True:
            self._beat()
            if self._announce and self._store.check([COORDINATOR_KEY]):
                self._say_where_the_report_is()
            if self._message_waiting():
                msg = take(self._store, f"slot/{self._rank}/{self._next}")
                self._next += 1
                self._last_message = time.monotonic()
                return msg
            idle = time.monotonic() - self._last_message
            time.sleep(POLL_S if idle < 2.0 else IDLE_POLL_S)

    def _await_first_process_exit(self) -> None:
        # Only where the launcher hosts the store (torchrun's agent; one that rank 0 hosts goes
        # away with it). The agent may stop, and its store with it, between two reads, or
        # before this process has let go of its connection: c10d would log the broken pipe
        # with a C++ stack trace on stderr, which has nothing else to say by now. It stays
        # silenced until this process exits.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)
        deadline = time.monotonic() + EXIT_WAIT_S
        while time.monotonic() < deadline:
            try:
                if self._store.check([EXITING_KEY]):
                    return
            except Exception:
                return  # its store went with it
            time.sleep(POLL_S)

    def _pause(self, seconds: float) -> None:
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            self._beat()
            time.sleep(min(POLL_S * 5, max(0.0, until - time.monotonic())))

    def _say_where_the_report_is(self) -> None:
        self._announce = False
        coordinator: Coordinator = pickle.loads(self._store.get(COORDINATOR_KEY))
        if self._job.local_rank != 0:
            return  # one line per node: its first process says it
        if self._job.node is not None and coordinator.node is not None:
            if self._job.node == coordinator.node:
                return
        elif socket.gethostname() == coordinator.host:
            return
        node = "" if self._job.node is None else f"node {self._job.node} "
        there = "" if coordinator.node is None else f"node {coordinator.node} "
        print(
            f"fsdp_testing: {node}({socket.gethostname()}) runs ranks of the distributed tests "
            f"of {self._job.describe()}; the report is on {there}({coordinator.host}): "
            f"{coordinator.report}",
            flush=True,
        )

    # --- the main loop --------------------------------------------------------------------

    def serve(self) -> int:
        """Answer the coordinator's messages until it releases this slot; return the session's
        exit status (see [Note: job exit status] in ``job.py``)."""
        hello = SlotHello(
            self._rank, socket.gethostname(), self._job.node, self._job.local_rank, os.getpid()
        )
        self._post(f"hello/{self._rank}", hello)
        try:
            return self._serve_messages()
        except KeyboardInterrupt:
            # Ctrl-C reached every process of the job: say bye so the session need not wait.
            try:
                self._post(f"bye/{self._rank}", True)
            except Exception:
                pass
            return 2
        finally:
            self._stop_children()
            self._listener.close()
            shutil.rmtree(self._root, ignore_errors=True)

    def _serve_messages(self) -> int:
        while True:
            msg = self._next_message()
            if isinstance(msg, Release):
                self._stop_children()
                self._post(f"bye/{self._rank}", True)
                if self._job.agent_store and not self._helper:
                    self._await_first_process_exit()
                return msg.exit_status
            if isinstance(msg, StartGeneration):
                self._start(msg)
            elif isinstance(msg, RunTask):
                self._run(msg)
            elif isinstance(msg, DumpRank):
                self._dump(msg)
            elif isinstance(msg, DropGeneration):
                child = self._children.pop(msg.gen, None)
                if child is not None:
                    self._kill(child)
            else:
                raise AssertionError(f"[rank {self._rank}] unexpected job message {msg!r}")

    # --- rank processes -------------------------------------------------------------------

    def _start(self, msg: StartGeneration) -> None:
        gen_dir = os.path.join(self._root, f"gen{msg.gen}")
        os.mkdir(gen_dir)
        spec = GenerationSpec(
            world_size=msg.world_size,
            backend=msg.backend,
            gen_dir=gen_dir,
            address=self._address,
            pg_timeout_s=msg.pg_timeout_s,
            sys_path=msg.sys_path,
            cwd=msg.cwd,
        )
        preload_modules(self._imports, beat=self._beat)  # what its earlier ranks imported
        pid = os.fork()
        if pid == 0:
            self._become_rank(msg, spec)
        error = self._await_ready(pid, msg.gen, gen_dir)
        if error != "dropped":
            self._post(f"ready/{msg.gen}/{self._rank}", Ready(msg.gen, error))

    def _become_rank(self, msg: StartGeneration, spec: GenerationSpec) -> None:
        try:
            self._listener.close()
            os.setpgid(0, 0)
            own = [p for p in sys.path if p not in msg.sys_path]
            sys.path[:] = [*msg.sys_path, *own]
            if os.path.isdir(msg.cwd):
                os.chdir(msg.cwd)
            os.environ.update(msg.env)
            threads = max(1, (os.cpu_count() or 1) // max(1, msg.ranks_on_host))
            join = functools.partial(_join_world, job=self._job, gen=msg.gen, threads=threads)
            serve(rank=self._rank, spec=spec, join=join)
        finally:
            os._exit(70)

    def _await_ready(self, pid: int, gen: int, gen_dir: str) -> str | None:
        """Wait for the rank process to join its world; its error, None, or ``"dropped"``
        when the coordinator gave up on the world first."""
        deadline = time.monotonic() + START_TIMEOUT_S
        self._listener.settimeout(POLL_S)
        conn: Connection | None = None
        child = RankChild(gen, pid, None, gen_dir, self._rank)
        while time.monotonic() < deadline:
            self._beat()
            if self._message_waiting():
                if conn is not None:
                    child.conn = conn
                self._kill(child)
                return "dropped"
            if conn is None:
                try:
                    sock, _ = self._listener.accept()
                except TimeoutError:
                    pass
                else:
                    sock.setblocking(True)
                    conn = Connection(sock.detach())
                    hello = conn.recv()
                    assert isinstance(hello, RankHello), f"[rank {self._rank}] got {hello!r}"
            elif conn.poll(POLL_S):
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    msg = None
                child.conn = conn
                if isinstance(msg, RankInitFailed):
                    self._kill(child)
                    return f"it could not join the world:\n{msg.traceback}"
                if msg is None:
                    return f"its rank process {self._reap(child)} while joining"
                self._children[gen] = child
                return None
            ended = os.waitpid(pid, os.WNOHANG)
            if ended[0]:
                log = child.read_log(4000)
                return f"its rank process {describe_status(ended[1])} while starting:\n{log}"
        if conn is not None:
            child.conn = conn
        self._kill(child)
        return f"its rank process did not join the world within {START_TIMEOUT_S:.0f} s"

    def _run(self, msg: RunTask) -> None:
        key = f"res/{msg.task_id}/{self._rank}"
        child = self._children.get(msg.gen)
        if child is None or child.conn is None:
            self._post(key, Died("had no rank process for this world", "", []))
            return
        if child.reset_pending:
            failure = self._await_reset(child)
            if failure is not None:
                self._children.pop(msg.gen, None)
                self._post(key, Died(failure, child.read_log(4000), child.records()))
                return
        child.offset = child.log_size()
        try:
            child.conn.send_bytes(self._store.get(f"task/{msg.task_id}"))
        except OSError:
            pass  # it died: recv below says how
        while True:
            self._beat()
            if child.conn.poll(POLL_S):
                try:
                    result = child.conn.recv()
                except (EOFError, OSError):
                    self._children.pop(msg.gen, None)
                    status = self._reap(child)
                    self._post(key, Died(status, child.read_log(4000), child.records()))
                    return
                self._post(key, Finished(result, child.records()))
                if result.message_follows:  # [Note: a rank's report is written off the clock]
                    try:
                        message = self._receive(child, _protocol.REPORT_TIMEOUT_S)
                    except (EOFError, OSError):
                        message = None
                    text = _protocol.message_text(self._rank, result, message)
                    self._post(f"msg/{msg.task_id}/{self._rank}", text)
                self._imports.update(dict.fromkeys(result.imported))
                if result.needs_restart:
                    self._kill(self._children.pop(msg.gen))
                else:
                    child.reset_pending = True
                return
            if self._message_waiting():
                return  # a dump or the end of the session: the main loop answers it

    def _receive(self, child: RankChild, seconds: float) -> object:
        """The next message from ``child`` within ``seconds`` (None if none came), beating while
        it waits; ``EOFError`` or ``OSError`` when its rank process ended."""
        assert child.conn is not None
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self._beat()
            if child.conn.poll(POLL_S):
                return child.conn.recv()
        return None

    def _await_reset(self, child: RankChild) -> str | None:
        """None once ``child`` says it reset itself after its last task; else why it did not
        (it is then ended). See [Note: warm pool isolation] in ``pool.py``."""
        try:
            reset = self._receive(child, _protocol.RESET_TIMEOUT_S)
        except (EOFError, OSError):
            return f"its rank process {self._reap(child)} after the last test"
        if reset is None:
            self._kill(child)
            limit = _protocol.RESET_TIMEOUT_S
            return f"its rank process did not reset its state within {limit:.0f} s"
        child.reset_pending = False
        if isinstance(reset, RankReset) and reset.traceback is None:
            return None
        self._kill(child)
        why = reset.traceback if isinstance(reset, RankReset) else repr(reset)
        return f"its rank process could not reset its state after the last test:\n{why}"

    def _dump(self, msg: DumpRank) -> None:
        key = f"dump/{msg.task_id}/{self._rank}"
        child = self._children.pop(msg.gen, None)
        if child is None:
            self._post(key, Dumped("(its rank process had already ended)", {}, "", []))
            return
        try:
            os.kill(child.pid, signal.SIGUSR1)
        except OSError:
            pass
        self._pause(STACK_DUMP_WAIT_S)
        output, stack = split_dump(child.read_log())
        records = child.records()
        self._kill(child)
        self._post(key, Dumped(stack, stack_sources(stack), output, records))

    def _reap(self, child: RankChild, wait_s: float = 2.0) -> str:
        """How ``child`` ended (it is ending); killed if it has not within ``wait_s``."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                pid, status = os.waitpid(child.pid, os.WNOHANG)
            except ChildProcessError:
                return "exited"
            if pid:
                return describe_status(status)
            if time.monotonic() > deadline:
                self._signal(child.pid, signal.SIGKILL)
                deadline = time.monotonic() + 5.0
            self._beat()
            time.sleep(POLL_S)

    @staticmethod
    def _signal(pid: int, sig: int) -> None:
        try:
            os.killpg(pid, sig)
        except OSError:
            try:
                os.kill(pid, sig)
            except OSError:
                pass

    def _kill(self, child: RankChild) -> None:
        if child.conn is not None:
            child.conn.close()
        self._signal(child.pid, signal.SIGKILL)
        self._reap(child)
        shutil.rmtree(child.gen_dir, ignore_errors=True)

    def _stop_children(self) -> None:
        self._stopping = True
        while self._children:
            self._kill(self._children.popitem()[1])


def serve_slot(job: JobEnv, *, helper: bool = False) -> int:
    """Serve as slot ``job.rank`` until the session releases it; return the exit status (the
    session's; 1 if it vanished first). ``helper``: the first process's own (silent) slot."""
    preload()  # its ranks start warm, as the fork server's do
    lost = "could not start its slot"  # a slot's own folder and socket come first
    try:
        slot = Slot(job, connect_store(job, host=False), announce=not helper, helper=helper)
        lost = "lost the job's store: the session on rank 0 ended without releasing it"
        return slot.serve()
    except KeyboardInterrupt:
        return 2
    except Exception as exc:
        sys.stderr.write(
            f"fsdp_testing: rank {job.rank} {lost} (store {job.master_addr}:{job.master_port}; "
            f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]})\n"
        )
        return 1


def main() -> None:
    """The first process's own slot (a helper it starts)."""
    die_with_parent()
    job = job_env()
    assert job is not None, "job_slot started outside a launched job"
    sys.exit(serve_slot(job, helper=True))


if __name__ == "__main__":
    main()
