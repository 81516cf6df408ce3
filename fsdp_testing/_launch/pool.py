"""Process mode, parent side: the warm pool of rank processes (forked by ``fork_server.py``,
each running ``rank_process.py``'s loop).

[Note: warm pool isolation]
Ranks of one (world size, backend) stay alive between tests, with their process group, so a
test costs a few messages and the test body, not an interpreter start and ``import torch``.
What a test may leave behind is undone on every rank after every task (``RankState.restore``,
run after the rank has sent its result, while the parent reports the test):
RNG state, default dtype and device, grad mode, attributes of ``torch.distributed`` that the test
patched, added or that our own flight recorder wraps, and extra process groups; each test's new
groups meet in a store namespace of their own ([Note: a store namespace per test]). A generation of
ranks is thrown away and forked anew from the fork server when it cannot be trusted: a rank
died, timed out or was still running when a peer failed (it may be stuck in a collective), a
rank's test failed or xfailed (it raised, maybe with a collective still in flight that the
next test's first collective would pair with: the process group cannot be checked without
waiting on it), the test destroyed the default group, or the pool is disabled
(``--no-dist-pool``). Per-test state is
reset on the rank by ``fsdp_testing/_rank/state_reset.py``. Each rank then says it reset
itself (:class:`~fsdp_testing._protocol.RankReset`); the parent reads that before it sends the
next task, and a rank that could not reset exits and is replaced by a new generation, with a
warning that carries its traceback.

A generation is reused only by tests whose process-group timeout it satisfies: its group was
created with a timeout of ``pg_timeout_for(test timeout)``, and a later test with a longer
``timeout=`` gets a new generation (otherwise its collectives would raise at the first test's
timeout).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
import signal
import sys
from multiprocessing.connection import Connection, wait
from typing import cast

from fsdp_testing._launch.deadline import Deadline, pg_timeout_for
from fsdp_testing._launch.fork_link import START_TIMEOUT_S, ForkServerLink
from fsdp_testing._launch.generation import (
    Generation,
    ImportWait,
    dump_stacks,
    imports_of,
    read_logs,
)
from fsdp_testing._launch.rank_process import parent_modules
from fsdp_testing._launch.socket_root import socket_root
from fsdp_testing._launch.wait_watch import WaitWatch, note_deadlock, process_asleep
from fsdp_testing._protocol import (
    REPORT_TIMEOUT_S,
    RESET_TIMEOUT_S,
    GenerationSpec,
    Outcome,
    RankHello,
    RankInitFailed,
    RankReset,
    RankResult,
    Stop,
    Task,
    message_text,
)
from fsdp_testing._report import collective_log
from fsdp_testing._report.observation import Observation

__all__ = ["ProcessLauncher"]

STOP_WAIT_S = 5.0
"""How long trusted ranks may take to tear down their broader-scoped fixtures and exit."""
_STOP = pickle.dumps(Stop())


@dataclasses.dataclass
class SentTask:
    """A task on its way on every rank of ``gen``; :meth:`ProcessLauncher.finish` waits for it."""

    gen: Generation
    timeout: float
    deadline: Deadline
    offsets: list[int]
    """Each rank's log size before the task: what it writes from there is this task's."""
    reuse: bool


class ProcessLauncher:
    """Runs tasks on rank processes forked from one fork server, kept warm between tests."""

    crosses_processes = True

    def __init__(self, shared_fork_server: str | None = None) -> None:
        self._shared = shared_fork_server
        """The address of the fork server of this session's xdist workers, if there is one."""
        self._root, self._address = socket_root("fsdp-testing-")
        self._forks = ForkServerLink(self._root, self._address, shared_fork_server)
        self._pools: dict[tuple[int, str], Generation] = {}
        """Warm generations by (world size, backend)."""
        self._gen_counter = 0
        self._rank_imports: dict[str, None] = {}
        """What ranks imported, in order (see [Note: preloading what ranks import])."""

    # --- generations ----------------------------------------------------------------------

    def start_fork_server(self) -> None:
        """See [Note: starting the fork server early] in ``fork_link.py``."""
        self._forks.start()

    def preload(self, names: tuple[str, ...]) -> None:
        """Have the fork server import ``names`` before it forks again; returns at once."""
        self._forks.preload(names)

    def _statuses(self, pids: list[int], timeout: float) -> dict[int, str | None]:
        return self._forks.statuses(pids, timeout)

    def _start_generation(self, world_size: int, backend: str, pg_timeout_s: float) -> Generation:
        self._gen_counter += 1
        gen_dir = os.path.join(self._root, f"gen{self._gen_counter}")
        os.mkdir(gen_dir)
        spec = GenerationSpec(
            world_size=world_size,
            backend=backend,
            gen_dir=gen_dir,
            address=self._address,
            pg_timeout_s=pg_timeout_s,
            sys_path=tuple(sys.path),
            cwd=os.getcwd(),
            preload=(*parent_modules(), *self._rank_imports),
            env=dict(os.environ) if self._shared is not None else None,
        )
        pids = self._forks.fork(spec)
        conns: list[Connection | None] = [None] * world_size
        try:
            for _ in range(world_size):
                accepted = self._forks.accept(START_TIMEOUT_S)
                hello = accepted.recv()
                assert isinstance(hello, RankHello), f"a rank said {hello!r} instead of hello"
                conns[hello.rank] = accepted
            for rank, conn in enumerate(conns):
                assert conn is not None
                if not conn.poll(START_TIMEOUT_S):
                    raise TimeoutError(
                        f"fsdp_testing: rank {rank} did not join its {backend} process group of "
                        f"{world_size} within {START_TIMEOUT_S:.0f} s; its log: "
                        f"{os.path.join(gen_dir, f'rank{rank}.log')}"
                    )
                msg = conn.recv()
                if isinstance(msg, RankInitFailed):
                    raise RuntimeError(
                        f"fsdp_testing: rank {rank} could not join a {backend} process group of "
                        f"{world_size}:\n{msg.traceback}"
                    )
        except BaseException:
            self._kill(pids)
            raise
        return Generation(world_size, backend, gen_dir, [c for c in conns if c], pids, pg_timeout_s)

    def _kill(self, pids: list[int]) -> None:
        for pid in pids:
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass

    def _discard(self, gen: Generation, *, graceful: bool = False) -> None:
        """End ``gen``'s ranks; ``graceful``: ranks that can be trusted get ``STOP_WAIT_S`` to
        tear down the fixtures they keep for a broader scope and exit (see [Note: fixtures on
        the ranks] in ``fsdp_testing/_rank/fixtures.py``), then whatever is left is killed."""
        for conn in gen.conns:
            try:
                conn.send_bytes(_STOP)
            except OSError:
                pass
            conn.close()
        if graceful:
            self._statuses(gen.pids, STOP_WAIT_S)
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
        pg_timeout_s = pg_timeout_for(timeout)
        # A fresh-process test leaves the warm generation (if any) for the tests after it.
        gen = self._take_warm(world_size, backend, pg_timeout_s) if reuse else None
        if gen is None:
            gen = self._start_generation(world_size, backend, pg_timeout_s)
        return self.finish(self._send(gen, task, timeout, reuse))

    def send_to_warm_ranks(
        self, task: Task, *, world_size: int, backend: str, timeout: float
    ) -> SentTask | None:
        """Send ``task`` to the warm ranks of its world and return at once (``finish`` waits
        for them); None when no warm generation is ready for it, whose ranks ``run`` would
        start. See [Note: a test sent at the end of its setup] in ``fsdp_testing/plugin.py``."""
        gen = self._take_warm(world_size, backend, pg_timeout_for(timeout))
        return None if gen is None else self._send(gen, task, timeout, reuse=True)

    def run_on_warm_ranks(self, task: Task, *, timeout: float) -> list[Observation]:
        """Run ``task`` on every warm generation (not one that would need starting), each kept
        warm if it can be trusted after; their observations."""
        observed = []
        for world_size, backend in list(self._pools):
            gen = self._take_warm(world_size, backend, 0.0)
            if gen is not None:
                observed.append(self.finish(self._send(gen, task, timeout, reuse=True)))
        return observed

    def _take_warm(self, world_size: int, backend: str, pg_timeout_s: float) -> Generation | None:
        """The warm generation of (``world_size``, ``backend``), out of the pool and reset, if
        one can serve a test whose group must wait ``pg_timeout_s``; None otherwise."""
        gen = self._pools.pop((world_size, backend), None)
        if gen is not None and gen.pg_timeout_s < pg_timeout_s:
            # Its collectives would raise before this test's timeout: a longer-lived one starts.
            self._discard(gen, graceful=True)
            return None
        if gen is not None and not self._reset(gen):
            return None
        return gen

    def _send(self, gen: Generation, task: Task, timeout: float, reuse: bool) -> SentTask:
        payload = pickle.dumps(task)
        offsets = [gen.log_size(r) for r in range(gen.world_size)]
        deadline = Deadline(timeout)  # the test's time runs from here
        try:
            for conn in gen.conns:
                conn.send_bytes(payload)
        except BaseException:  # some ranks may run it: none of them can be trusted
            self._discard(gen)
            raise
        return SentTask(gen, timeout, deadline, offsets, reuse)

    def finish(self, sent: SentTask) -> Observation:
        """Wait for every rank of a task sent by ``_send`` and observe how each finished."""
        gen = sent.gen
        obs = self._collect(gen, sent.timeout, sent.deadline, sent.offsets)
        # A test that raised may have left a collective in flight on some ranks (issued with
        # ``async_op=True``, never waited on): the next test's first collective would pair
        # with it. See [Note: warm pool isolation].
        trusted = not (obs.stragglers or obs.dead) and not any(
            r.needs_restart or r.outcome in (Outcome.FAILED, Outcome.XFAILED)
            for r in obs.results.values()
        )
        if sent.reuse and trusted:
            self._pools[(gen.world_size, gen.backend)] = gen
        else:
            # Ranks that answered may end as they would: they tear down what they keep.
            self._discard(gen, graceful=not (obs.stragglers or obs.dead))
        return obs

    def _reset(self, gen: Generation) -> bool:
        """Whether every rank of ``gen`` reset itself after its last task (it says so while the
        parent reports that task, so this rarely waits). If one could not, ``gen`` is
        discarded with a warning that carries the rank's traceback."""
        failures = []
        deadline = Deadline(RESET_TIMEOUT_S)
        for rank, conn in enumerate(gen.conns):
            try:
                msg = conn.recv() if conn.poll(deadline.remaining()) else None
            except (EOFError, OSError):
                msg = None
            if not isinstance(msg, RankReset):
                failures.append(f"rank {rank} did not report its reset: it ended or hangs")
            elif msg.traceback is not None:
                failures.append(f"rank {rank}:\n{msg.traceback}")
        if not failures:
            return True
        import warnings

        warnings.warn(
            f"fsdp_testing: the warm ranks of world size {gen.world_size} ({gen.backend}) could "
            "not reset their state after the last test; this test runs on new ranks.\n"
            + "\n".join(failures),
            RuntimeWarning,
            stacklevel=4,
        )
        self._discard(gen)
        return False

    def _collect(
        self, gen: Generation, timeout: float, deadline: Deadline, offsets: list[int]
    ) -> Observation:
        pending = {conn: rank for rank, conn in enumerate(gen.conns)}
        obs = Observation(world_size=gen.world_size, timeout=timeout)
        watch = WaitWatch(lambda: read_logs(gen), process_asleep(dict(enumerate(gen.pids))))
        imports = ImportWait(deadline)
        while pending:
            left = deadline.remaining()
            if not deadline.failed:  # a failure's grace is short: no deadlock to look for
                left = min(left, max(watch.until_next(), 0.001))
            ready = wait(list(pending), timeout=left)
            if not ready:
                if deadline.expired():
                    if not deadline.failed and self._still_importing(gen, pending, imports):
                        continue  # see [Note: importing is not hanging]
                    break
                found = None if deadline.failed else watch.look(obs.results)
                if found is not None:
                    note_deadlock(obs, found, watch.elapsed)
                    break
                continue
            for ready_conn in ready:
                conn = cast(Connection, ready_conn)
                rank = pending.pop(conn)
                try:
                    result: RankResult = conn.recv()
                except (EOFError, OSError):
                    obs.dead.add(rank)
                    deadline.note_failure()
                    continue
                obs.results[rank] = result
                self._rank_imports.update(dict.fromkeys(result.imported))
                if result.outcome is Outcome.FAILED:
                    deadline.note_failure()
        obs.stragglers = set(pending.values())
        obs.timed_out = bool(obs.deadlock) or deadline.timed_out(bool(obs.stragglers))
        obs.import_wait = imports.extended
        if obs.stragglers:
            # See [Note: collective log]: read what every rank was doing; and what it imported,
            # for the next ranks (see [Note: importing is not hanging]).
            stacks = dump_stacks(gen, sorted(obs.stragglers), imports_too=True)
            for rank in obs.stragglers:
                end = imports.first_dump.get(rank, stacks[rank][0])
                obs.last_output[rank] = gen.read_log(rank, offsets[rank], end=end)
                obs.stacks[rank] = stacks[rank][1]
            self._kill([gen.pids[r] for r in obs.stragglers])
            self._rank_imports.update(dict.fromkeys(imports_of(gen, obs.stragglers)))
        self._read_messages(gen, obs)
        failed = any(r.outcome is Outcome.FAILED for r in obs.results.values())
        # Only a report reads them, and the check of the dtypes of each message's two ends.
        p2p = any(r.open_p2p or r.p2p for r in obs.results.values())
        if failed or obs.stragglers or obs.dead or p2p:
            for rank in range(gen.world_size):
                obs.records[rank], obs.channels[rank] = collective_log.read_record_file(
                    os.path.join(gen.gen_dir, f"rank{rank}.flight")
                )
        if obs.dead:
            statuses = self._statuses([gen.pids[r] for r in obs.dead], 2.0)
            for rank in obs.dead:
                obs.exit_status[rank] = statuses.get(gen.pids[rank]) or "exited"
                obs.last_output[rank] = gen.read_log(rank, offsets[rank])
        return obs

    def _still_importing(self, gen: Generation, pending: dict, imports: ImportWait) -> bool:
        """At the deadline: whether a rank still running is importing, and the deadline was
        extended for it (see [Note: importing is not hanging])."""
        if not imports.budget():
            return False
        ranks = sorted(pending.values())
        stacks = dump_stacks(gen, ranks, imports_too=False)
        for rank, (start, _) in stacks.items():
            imports.first_dump.setdefault(rank, start)
        return imports.extend({r: text for r, (_, text) in stacks.items()})

    def _read_messages(self, gen: Generation, obs: Observation) -> None:
        """Fill in the tracebacks ranks formatted after their results, off the test's clock
        (see [Note: a rank's report is written off the clock] in ``_protocol.py``)."""
        deadline = Deadline(REPORT_TIMEOUT_S)
        for rank, result in sorted(obs.results.items()):
            if not result.message_follows:
                continue
            conn = gen.conns[rank]
            try:
                message = conn.recv() if conn.poll(deadline.remaining()) else None
            except (EOFError, OSError):
                message = None
            result.message = message_text(rank, result, message)
            result.message_follows = False

    def shutdown(self) -> None:
        """Stop every rank (warm ones tear down what they keep first) and the fork server;
        remove the session's files."""
        for gen in self._pools.values():
            self._discard(gen, graceful=True)
        self._pools.clear()
        self._forks.stop()
        shutil.rmtree(self._root, ignore_errors=True)
