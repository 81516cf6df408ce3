"""Process mode inside a launched job (torchrun, srun, a PyTorchJob), coordinator side.

[Note: jobs across nodes]
The first process of the job (global rank 0) runs the pytest session; every other process is a
*slot* (``job_slot.py``) and runs no session. For each process-mode test of world size ``W``
the coordinator asks slots ``0 .. W-1`` to run ranks ``0 .. W-1``: each slot forks a rank
process that joins a world made for that test's generation through the job's c10d
``TCPStore`` (the launcher's, under torchrun; otherwise one rank 0 hosts at ``MASTER_ADDR:
MASTER_PORT``), with a fresh key prefix per world. The launched processes never run a test
body on a group of their own, so they stay healthy whatever a test does: at the timeout the
coordinator asks each straggler's slot for its stack and collective log, the slots kill their
rank processes, and the next test starts a new world. Results and tasks travel as pickled bytes
through store keys ([Note: job protocol] in ``job_messages.py``). Warm worlds are reused by
later tests of the same (world size, backend), as the single-machine pool does
([Note: warm pool isolation] in ``pool.py``).

A slot that stops answering (its process or node is gone) cannot be recovered in place: the
tests that need its rank are skipped, naming the test whose hang or crash lost it.

[Note: job exit status]
Every process of the job exits with pytest's status: srun reports the highest of its tasks',
a PyTorchJob its pods', and torchrun's agents must agree (an agent whose workers all succeed
waits up to five minutes in its exit barrier for agents that failed). Under torchrun the first
process exits first: released slots wait until it is on its way out (``EXITING_KEY``, set at
its exit, or the agent's store gone), so the agent, which stops the other processes of a node
once one fails, names rank 0 as the first failure. Where rank 0 hosts the store, slots leave
as soon as they said bye (the store goes with rank 0; srun waits for every task).
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

from fsdp_testing._launch.deadline import Deadline, pg_timeout_for
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
    liveness_s,
    take,
)
from fsdp_testing._launch.job_slot import (
    COORDINATOR_KEY,
    EXITING_KEY,
    HELPER_ENV,
    START_TIMEOUT_S,
    Coordinator,
)
from fsdp_testing._launch.torchrun import JobEnv
from fsdp_testing._protocol import (
    ENGINE_ENV,
    REPORT_TIMEOUT_S,
    Outcome,
    RankResult,
    Task,
    message_text,
)
from fsdp_testing._report.observation import Observation

__all__ = ["JobLauncher"]

DUMP_WAIT_S = 30.0
"""Longest wait for stragglers' stacks (a slot that is alive answers in well under a second)."""
BYE_WAIT_S = 10.0
_LOST = "was lost: its slot process stopped answering (process or node gone?)"


@dataclasses.dataclass
class _World:
    gen: int
    world_size: int
    backend: str
    pg_timeout_s: float


class JobLauncher:
    """Runs process-mode tests on the ranks of a launched job (see [Note: jobs across nodes])."""

    crosses_processes = True

    def __init__(self, job: JobEnv, *, report: str = "rank 0's terminal") -> None:
        self._job = job
        self._store: Any = connect_store(job, host=not job.agent_store)
        self._root = tempfile.mkdtemp(prefix="fsdp-testing-job-")
        self._sent = [0] * job.world_size
        self._hellos: dict[int, SlotHello] = {}
        self._lost: dict[int, str] = {}
        self._alive: dict[int, tuple[int, float]] = {}
        self._warm: dict[tuple[int, str], _World] = {}
        self._gen = 0
        self._task = 0
        self._released = False
        self.exit_status = 1
        """What the slots exit with unless :meth:`release` is told the session's status."""
        host = socket.gethostname()
        self._post(COORDINATOR_KEY, Coordinator(host, job.node, report))
        log = open(os.path.join(self._root, "slot0.log"), "ab")
        self._helper = subprocess.Popen(
            [sys.executable, "-m", "fsdp_testing._launch.job_slot"],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            env={
                **os.environ,
                HELPER_ENV: "1",
                "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
            },
        )
        log.close()

    # --- the store ------------------------------------------------------------------------

    def _post(self, key: str, value: object) -> None:
        self._store.set(key, pickle.dumps(value))

    def _send(self, slot: int, msg: object) -> None:
        if slot in self._lost:
            return
        self._post(f"slot/{slot}/{self._sent[slot]}", msg)
        self._sent[slot] += 1

    def _is_alive(self, slot: int) -> bool:
        """Whether ``slot`` still bumps its ``alive`` counter; a slot that never said hello
        gets ``START_TIMEOUT_S`` to come up."""
        count = int(self._store.add(f"alive/{slot}", 0))
        now = time.monotonic()
        last = self._alive.get(slot)
        if last is None or last[0] != count:
            self._alive[slot] = (count, now)
            return True
        allowed = liveness_s() if count else START_TIMEOUT_S
        return now - last[1] < allowed

    def _poll(
        self, keys: dict[int, str], seconds: float, lost_because: str, *, delete: bool = True
    ) -> dict[int, Any]:
        """Read ``keys`` (by slot) as they appear, for at most ``seconds`` (and delete them
        unless ``delete`` is False); a slot that stops answering is lost (``lost_because``
        says when)."""
        found: dict[int, Any] = {}
        pending = dict(keys)
        deadline = time.monotonic() + seconds
        next_check = time.monotonic() + 0.5
        while pending and time.monotonic() < deadline:
            for slot, key in list(pending.items()):
                if self._store.check([key]):
                    found[slot] = (
                        take(self._store, key) if delete else pickle.loads(self._store.get(key))
                    )
                    del pending[slot]
            if pending and time.monotonic() >= next_check:
                next_check = time.monotonic() + 0.5
                for slot in [s for s in pending if not self._is_alive(s)]:
                    self._lose(slot, lost_because)
                    del pending[slot]
            time.sleep(POLL_S)
        return found

    def _lose(self, slot: int, because: str) -> None:
        self._lost.setdefault(
            slot,
            f"{self._label(slot)} was lost {because} (its process stopped answering); tests "
            "that need it are skipped",
        )

    # --- where ranks are --------------------------------------------------------------------

    def _hello(self, slot: int) -> SlotHello | None:
        if slot not in self._hellos and self._store.check([f"hello/{slot}"]):
            self._hellos[slot] = pickle.loads(self._store.get(f"hello/{slot}"))
        return self._hellos.get(slot)

    def _place(self, slot: int) -> str:
        hello = self._hello(slot)
        if hello is None:
            return ""
        node = hello.node
        if node is None:  # the launcher does not number nodes: number the hosts by first rank
            hosts: list[str] = []
            for s in range(self._job.world_size):
                h = self._hello(s)
                if h is not None and h.host not in hosts:
                    hosts.append(h.host)
            node = hosts.index(hello.host)
        return f"node {node}, local rank {hello.local_rank}"

    def _label(self, slot: int) -> str:
        place = self._place(slot)
        return f"rank {slot} ({place})" if place else f"rank {slot}"

    def _where(self, world_size: int) -> dict[int, str]:
        """Each rank's place, when the world spans more than one node (on one node, "rank N"
        says it all)."""
        places = {s: self._place(s) for s in range(world_size)}
        nodes = {p.split(",")[0] for p in places.values() if p}
        return places if len(nodes) > 1 else {}

    # --- worlds -----------------------------------------------------------------------------

    def _start_world(self, world_size: int, backend: str, pg_timeout_s: float, test: str) -> _World:
        self._gen += 1
        world = _World(self._gen, world_size, backend, pg_timeout_s)
        hellos = self._poll(
            {s: f"hello/{s}" for s in range(world_size) if s not in self._hellos},
            START_TIMEOUT_S,
            f"before {test} (it never came up)",
            delete=False,
        )
        self._hellos.update(hellos)
        missing = [s for s in range(world_size) if s not in self._hellos]
        if missing:
            raise RuntimeError("; ".join(self._lost.get(s, self._label(s)) for s in missing))
        hosts = [self._hellos[s].host for s in range(world_size)]
        env = {ENGINE_ENV: os.environ[ENGINE_ENV]} if os.environ.get(ENGINE_ENV) else {}
        for slot in range(world_size):
            self._send(
                slot,
                StartGeneration(
                    gen=world.gen,
                    world_size=world_size,
                    backend=backend,
                    pg_timeout_s=pg_timeout_s,
                    sys_path=tuple(sys.path),
                    cwd=os.getcwd(),
                    env=env,
                    ranks_on_host=hosts.count(hosts[slot]),
                ),
            )
        ready: dict[int, Ready] = self._poll(
            {s: f"ready/{world.gen}/{s}" for s in range(world_size)},
            START_TIMEOUT_S + 10.0,
            f"while starting the ranks of {test}",
        )
        errors = {s: r.error for s, r in ready.items() if r.error}
        missing = [s for s in range(world_size) if s not in ready]
        if errors or missing:
            self._drop(world)
            lines = [f"{self._label(s)}: {err}" for s, err in sorted(errors.items())]
            lines += [self._lost.get(s, f"{self._label(s)} did not answer") for s in missing]
            raise RuntimeError(
                f"fsdp_testing: could not start a {backend} world of {world_size} ranks for "
                f"{test} in {self._job.describe()}:\n" + "\n".join(lines)
            )
        return world

    def _drop(self, world: _World) -> None:
        for slot in range(world.world_size):
            self._send(slot, DropGeneration(world.gen))

    # --- running a task ---------------------------------------------------------------------

    def _skipped(self, world_size: int, timeout: float, reason: str) -> Observation:
        obs = Observation(world_size=world_size, timeout=timeout)
        for rank in range(world_size):
            obs.results[rank] = RankResult(rank=rank, outcome=Outcome.SKIPPED, message=reason)
        return obs

    def run(
        self, task: Task, *, world_size: int, backend: str, timeout: float, reuse: bool
    ) -> Observation:
        """Run ``task`` on ranks ``0 .. world_size-1`` of the job and observe how each ended.
        Arguments as :meth:`fsdp_testing._launch.base.Launcher.run`."""
        job_size = self._job.world_size
        if world_size > job_size:
            return self._skipped(
                world_size,
                timeout,
                f"{self._job.describe()} has world size {job_size}; the test needs "
                f"{world_size} (start the job with at least {world_size} processes)",
            )
        lost = [self._lost[s] for s in range(world_size) if s in self._lost]
        if lost:
            return self._skipped(world_size, timeout, "; ".join(lost))
        key = (world_size, backend)
        pg_timeout_s = pg_timeout_for(timeout)
        world = self._warm.pop(key, None) if reuse else None
        if world is not None and world.pg_timeout_s < pg_timeout_s:
            self._drop(world)
            world = None
        if world is None:
            world = self._start_world(world_size, backend, pg_timeout_s, task.test_id)
        self._task += 1
        task_id = self._task
        self._post(f"task/{task_id}", task)
        for slot in range(world_size):
            self._send(slot, RunTask(task_id, world.gen))
        try:
            obs = self._collect(world, task_id, timeout, task.test_id)
        finally:
            self._store.delete_key(f"task/{task_id}")
        trusted = not (obs.stragglers or obs.dead) and not any(  # as in ``pool.py``
            r.needs_restart or r.outcome in (Outcome.FAILED, Outcome.XFAILED)
            for r in obs.results.values()
        )
        if reuse and trusted:
            self._warm[key] = world
        else:
            self._drop(world)
        obs.where = self._where(world_size)
        return obs

    def _collect(self, world: _World, task_id: int, timeout: float, test: str) -> Observation:
        obs = Observation(world_size=world.world_size, timeout=timeout)
        deadline = Deadline(timeout)
        pending = set(range(world.world_size))
        next_check = time.monotonic() + 0.5
        while pending:
            for slot in sorted(pending):
                key = f"res/{task_id}/{slot}"
                if not self._store.check([key]):
                    continue
                pending.discard(slot)
                msg = take(self._store, key)
                if isinstance(msg, Finished):
                    obs.results[slot], obs.records[slot] = msg.result, msg.records
                    if msg.result.outcome is Outcome.FAILED:
                        deadline.note_failure()
                elif isinstance(msg, Died):
                    obs.dead.add(slot)
                    obs.exit_status[slot] = msg.status
                    obs.last_output[slot], obs.records[slot] = msg.last_output, msg.records
                    deadline.note_failure()
            if not pending or deadline.expired():
                break
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + 0.5
                for slot in [s for s in pending if not self._is_alive(s)]:
                    self._lose(slot, f"during {test}")
                    pending.discard(slot)
                    obs.dead.add(slot)
                    obs.exit_status[slot] = _LOST
                    deadline.note_failure()
            time.sleep(POLL_S)
        obs.stragglers = pending
        obs.timed_out = deadline.timed_out(bool(pending))
        if pending:
            self._dump(world, task_id, obs, test)
        # The tracebacks ranks wrote after their results, off the test's clock (see [Note: a
        # rank's report is written off the clock] in _protocol.py).
        follow = {s: f"msg/{task_id}/{s}" for s, r in obs.results.items() if r.message_follows}
        texts = self._poll(follow, REPORT_TIMEOUT_S, f"writing its report of {test}")
        for slot in follow:
            result = obs.results[slot]
            result.message = texts.get(slot) or message_text(slot, result, None)
            result.message_follows = False
        return obs

    def _dump(self, world: _World, task_id: int, obs: Observation, test: str) -> None:
        """Have every straggler's slot dump its stack and collective log, then kill it."""
        for slot in sorted(obs.stragglers):
            self._send(slot, DumpRank(task_id, world.gen))
        what = "timed out" if obs.timed_out else "failed"
        dumps: dict[int, Dumped] = self._poll(
            {s: f"dump/{task_id}/{s}" for s in obs.stragglers},
            DUMP_WAIT_S,
            f"when {test} {what}",
        )
        for slot in sorted(obs.stragglers):
            self._store.delete_key(f"res/{task_id}/{slot}")  # a result that came too late
            dumped = dumps.get(slot)
            if dumped is None and not obs.timed_out:
                # Not a peer stopped after a failure: its loss is what broke the others.
                obs.stragglers.discard(slot)
                obs.dead.add(slot)
                obs.exit_status[slot] = _LOST
                continue
            if dumped is None:
                obs.stacks[slot] = (
                    "(no stack: its slot process stopped answering; the rank is lost for the "
                    "rest of the session)"
                )
                continue
            obs.stacks[slot], obs.sources[slot] = dumped.stack, dumped.sources
            obs.last_output[slot], obs.records[slot] = dumped.last_output, dumped.records

    # --- the end ----------------------------------------------------------------------------

    def release(self, exit_status: int | None = None) -> None:
        """Tell every slot the session is over (they exit with ``exit_status``) and wait for
        each to say bye, so the store can go away under none of them."""
        if self._released:
            return
        self._released = True
        status = self.exit_status if exit_status is None else exit_status
        sys.stdout.flush()
        sys.stderr.flush()
        for slot in range(self._job.world_size):
            self._send(slot, Release(status))
        self._poll(
            {s: f"bye/{s}" for s in range(self._job.world_size) if s not in self._lost},
            BYE_WAIT_S,
            "at the end of the session",
        )
        try:
            self._helper.wait(5)
        except subprocess.TimeoutExpired:
            self._helper.kill()
            self._helper.wait()
        # See [Note: job exit status]: the slots leave once this process is on its way out.
        atexit.register(_say_exiting, self._store)

    def shutdown(self) -> None:
        """Release the slots (with :attr:`exit_status`) and remove this launcher's files."""
        self.release()
        shutil.rmtree(self._root, ignore_errors=True)


def _say_exiting(store: Any) -> None:
    try:
        store.set(EXITING_KEY, b"1")
    except Exception:
        pass  # the launcher's store is gone already: the slots see that too
