"""The ranks of an in-process world (thread, fake and local mode) as threads: started together,
waited for under one deadline, and stopped without the launcher's thread ever blocking.

[Note: stopping rank threads]
A rank thread cannot be killed; it can be asked to stop (its process group's waits are woken
and raise) or, as a last resort, be sent an asynchronous exception
(``PyThreadState_SetAsyncExc``), which Python raises at the next bytecode boundary of that
thread, wherever that is. If that is inside ``threading``'s own code (``Event.set``,
``Condition.__enter__`` right after it took its lock), the lock stays taken forever and every
thread that needs it blocks, the launcher's thread included: this is how a thread-mode world
of 128 ranks once deadlocked in teardown (issue 23). The rules that keep that from happening:

- Only the launcher's thread wakes the ranks' waits, once, when it first sees a failure or
  gives up; a rank that failed does not (128 ranks failing together used to wake each other
  128 times, each taking the process group's locks while the launcher stopped them).
- Waking never blocks: every lock the launcher takes is taken with a timeout.
- Only a rank still running its test body, or one stuck past the deadline in its teardown,
  is sent the exception, and only while its innermost frame is outside ``threading`` (checked
  again every few milliseconds until the stop window closes). Ranks blocked in a collective
  leave it on being woken and are never interrupted inside the wait.
- Every wait of the launcher is bounded: by the test's deadline, then by the stop window
  (``STOP_WAIT_S`` after the last stopped rank that ended, ``_STOP_LIMIT_S`` at most). A rank
  that cannot be stopped is reported as such and left behind (a daemon thread), never waited
  for. A rank that finished its body but not its teardown by the test's timeout fails the
  test, named, with its stack.
"""

from __future__ import annotations

import ctypes
import math
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable

from fsdp_testing._launch.deadline import FAILURE_GRACE_S, Deadline
from fsdp_testing._launch.wait_watch import DeadlockWatch, note_deadlock, threads_asleep
from fsdp_testing._protocol import Outcome, RankResult
from fsdp_testing._report.observation import Observation

__all__ = ["STOP_WAIT_S", "Aborted", "RankThreads", "acquire_briefly"]

STOP_WAIT_S = 2.0
"""How long stopped rank threads may take to unwind, after the last one that did, before the
rest count as unstoppable."""
_STOP_LIMIT_S = 20.0
"""The longest the launcher waits for stopped ranks in all."""
_POLL_S = 0.02
_THREADING_FILE = threading.__file__


class Aborted(BaseException):
    """Raised in a rank thread that the harness stops."""

    def __str__(self) -> str:
        return "aborted by the harness"


def acquire_briefly(lock: threading.Lock | threading.RLock | threading.Condition) -> bool:
    """Take ``lock`` if that takes under 0.1 s (a lock a stopped thread died holding is never
    released: the caller then goes on without it). See [Note: stopping rank threads]."""
    return bool(lock.acquire(timeout=0.1))


def _in_threading(thread: threading.Thread) -> bool:
    frame = sys._current_frames().get(thread.ident or -1)
    return frame is None or frame.f_code.co_filename == _THREADING_FILE


def _raise_in(thread: threading.Thread) -> None:
    if thread.ident is not None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(thread.ident), ctypes.py_object(Aborted)
        )


class RankThreads:
    """One daemon thread per rank running ``target(rank)``, which must store the rank's result
    in ``obs.results[rank]`` once its test body ended (teardown may follow).

    Args:
        ranks: the ranks this process runs.
        target: the body of each rank thread.
        obs: where results, stragglers, stacks and unstoppable ranks are written.
        wake: makes every rank blocked in a collective give up (called from this thread only,
            at most once per run; must not block). See [Note: stopping rank threads].
        watch: looks for a certain deadlock while ranks run (default: none).
        wake_on_failure: call ``wake`` as soon as a rank fails (default True); False when the
            world stops the failed rank's peers by itself (local mode), so ``wake`` only comes
            when the wait gives up, and no failure grace applies: a rank of such a world still
            running after a peer failed is running, not stuck (on a loaded machine it may be
            formatting its own traceback past the grace), so only the timeout bounds it.
    """

    def __init__(
        self,
        ranks: Iterable[int],
        target: Callable[[int], None],
        obs: Observation,
        wake: Callable[[], None],
        *,
        wake_on_failure: bool = True,
        watch: DeadlockWatch | None = None,
    ) -> None:
        self.obs = obs
        self._watch = watch
        self._wake = wake
        self._wake_on_failure = wake_on_failure
        self._woken = False
        self.threads = {
            r: threading.Thread(target=target, args=(r,), name=f"fsdp-testing-rank{r}", daemon=True)
            for r in ranks
        }

    def run(
        self,
        timeout: float,
        snapshot: Callable[[], tuple[dict[int, list[dict]], dict[int, dict[str, int] | None]]],
    ) -> None:
        """Start the threads and wait for them under the deadline of ``timeout`` seconds (see
        [Note: deadline and failure grace]); stop the ones still running at the end.
        ``snapshot()`` gives each rank's collective log, read when the wait gives up."""
        for thread in self.threads.values():
            thread.start()
        grace = FAILURE_GRACE_S if self._wake_on_failure else math.inf
        stuck = self._wait(Deadline(timeout, grace=grace))
        if not stuck:
            return
        obs = self.obs
        in_body = [r for r in stuck if r not in obs.results]
        # Ranks that reported are stopped only when their teardown alone outlived the timeout.
        to_stop = in_body or stuck
        frames = sys._current_frames()
        for rank in to_stop:
            frame = frames.get(self.threads[rank].ident or -1)
            obs.stacks[rank] = "".join(traceback.format_stack(frame)) if frame else ""
        obs.records, obs.channels = snapshot()
        obs.stragglers = set(in_body)
        self._stop(stuck, interrupt=set(to_stop))
        for rank in in_body:
            obs.results.pop(rank, None)
        if not in_body:
            for rank in stuck:
                obs.results[rank] = _teardown_failure(rank, obs)

    def asleep(self, ranks: tuple[int, ...]) -> bool:
        """Whether the threads of ``ranks`` are asleep (for a ``WaitWatch``)."""
        return threads_asleep(
            t.native_id for r, t in self.threads.items() if r in ranks and t.native_id
        )

    def wake_once(self) -> None:
        """Wake the ranks' waits (the first call only). See [Note: stopping rank threads]."""
        if not self._woken:
            self._woken = True
            self._wake()

    def _wait(self, deadline: Deadline) -> list[int]:
        """Wait until every thread ended; return the ranks still running when it gave up.

        Ranks still in their test body are waited for under ``deadline`` (the failure grace
        restarting whenever another rank reports); ranks that reported and are only tearing
        down, until the timeout itself."""
        results = self.obs.results
        reported = 0
        while True:
            alive = [r for r, t in self.threads.items() if t.is_alive()]
            if not alive:
                return []
            in_body = [r for r in alive if r not in results]
            if not deadline.failed and any(
                res.outcome is Outcome.FAILED for res in list(results.values())
            ):
                deadline.note_failure()
                if self._wake_on_failure:
                    self.wake_once()
            elif len(results) > reported:
                deadline.note_progress()
            reported = len(results)
            left = deadline.remaining() if in_body else deadline.timeout_remaining()
            if left <= 0.0:
                self.obs.timed_out = deadline.timed_out(bool(in_body))
                return alive
            if self._watch is not None and in_body and not deadline.failed:
                found = self._watch.look(list(results))
                if found is not None:
                    note_deadlock(self.obs, found, self._watch.elapsed)
                    self.obs.timed_out = True
                    return alive
            self.threads[alive[0]].join(min(_POLL_S, left))

    def _stop(self, ranks: list[int], interrupt: set[int]) -> None:
        """Wake the waits, interrupt the ranks in ``interrupt`` (see [Note: stopping rank
        threads]) and wait for ``ranks`` until ``STOP_WAIT_S`` after the last one ended
        (``_STOP_LIMIT_S`` at most); interrupted ranks still running are unstoppable."""
        self.wake_once()
        pending = {r: self.threads[r] for r in ranks}
        interrupted: set[int] = set()
        start = time.monotonic()
        until = start + STOP_WAIT_S
        while pending and time.monotonic() < until:
            for rank, thread in list(pending.items()):
                if not thread.is_alive():
                    del pending[rank]
                    until = min(start + _STOP_LIMIT_S, time.monotonic() + STOP_WAIT_S)
                elif rank in interrupt and rank not in interrupted and not _in_threading(thread):
                    _raise_in(thread)
                    interrupted.add(rank)
            time.sleep(_POLL_S)
        self.obs.unstoppable.update(
            r for r, t in pending.items() if r in interrupt and t.is_alive()
        )


def _teardown_failure(rank: int, obs: Observation) -> RankResult:
    finished = obs.results.get(rank)
    what = f"its test body {finished.outcome.value}" if finished else "it reported"
    return RankResult(
        rank=rank,
        outcome=Outcome.FAILED,
        summary=(
            f"rank {rank} did not finish tearing down its process group within the test's "
            f"deadline ({obs.timeout:g} s) after {what}; it was stopped"
        ),
        message="where it was:\n" + obs.stacks.get(rank, "(no stack)"),
        finished_at=time.time(),
    )
