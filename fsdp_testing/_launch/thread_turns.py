"""Thread mode's turns: the rank threads of one world run their Python one at a time, each
with its own process state.

[Note: thread mode's turns]
torch keeps some state once per process: its CPU generator, the default dtype, the
deterministic-algorithms switch; so do Python's ``random`` and NumPy's global generator. A
process-mode rank owns its copy. Thread-mode ranks are threads of one process, and used to
share one copy while running at the same time: ``torch.manual_seed(0)``, a barrier, then
``torch.randn(4)`` gave the two ranks different numbers (issue 41), so a parity body that
passes in process mode failed in thread mode. torch has no per-thread generator, and one
process state cannot be swapped under threads that run at once, so the ranks take turns: a
rank holds the turn while its test body runs and hands it on only where it waits for its peers
(a collective, the barrier that ends making a group, an injected delay or hang) and when its
body ends; ``time.sleep`` on a rank thread hands it on too (thread mode patches it while its
ranks run), so a rank that sleeps, or hangs in a sleeping loop, lets its peers reach their
collectives as separate processes would. The turn goes to the lowest rank that wants it. Whenever
the turn moves to another rank, the state of the rank leaving is saved and that of the rank
arriving is restored (``fsdp_testing/_rank/process_state.py``, as local mode's baton does):
``torch.manual_seed(0)`` on every rank gives each rank what its own process would have had.

Ranks still overlap while they wait (torch's threaded group moves a collective's data in its
group rank 0's thread, outside any turn: copies and sums only, no process state); their Python
never does. What stays shared, because a process has one of it and a rank's change there is
seen by every rank: module globals and anything a test patches (the patching helpers rely on
it), torch settings outside the list above (intra-op threads, matmul precision, backend flags),
accelerator generators. A body that waits for a peer outside a collective (a store's ``get``
or ``wait``, a ``threading`` primitive, a loop polling what a peer does) holds the turn while
it waits, so the peer never comes and the test fails at its timeout: use process mode there.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

from fsdp_testing._launch.rank_threads import acquire_briefly
from fsdp_testing._rank import process_state

__all__ = ["Turns", "current", "waiting"]

_POLL_S = 0.25
"""How often a rank waiting for its turn looks at a stop flag set without the lock."""

_current: Turns | None = None


def current() -> Turns | None:
    """The turns of the thread-mode world running in this process, if any."""
    return _current


@contextlib.contextmanager
def waiting() -> Iterator[None]:
    """Let the other ranks of a thread-mode world run while the calling rank waits in the
    block (for a peer, or a sleep); a no-op on any other thread."""
    turns = _current
    if turns is None:
        yield
        return
    with turns.waiting():
        yield


class Turns:
    """Which rank thread of a thread-mode world runs its Python; see [Note: thread mode's turns].

    Args:
        ranks: the ranks of the world, each run by one thread.
    """

    def __init__(self, ranks: list[int]) -> None:
        lock = threading.Lock()
        self._cond = threading.Condition(lock)
        # One condition per rank over one lock: a hand-over wakes the new holder only.
        self._turns = {r: threading.Condition(lock) for r in ranks}
        self._to_enter = len(ranks)
        self._holder: int | None = None
        self._wanting: set[int] = set()
        self._stopped = False
        self._initial = process_state.capture()
        self._states = dict.fromkeys(ranks, self._initial)
        self._loaded: int | None = None  # whose state the process holds
        self._mine = threading.local()  # .rank: the rank the calling thread runs

    def __enter__(self) -> Turns:
        global _current
        _current = self
        self._sleep_before = time.sleep
        time.sleep = self._sleep  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        """Stop taking turns and give the process back the state it had before the test."""
        global _current
        _current = None
        time.sleep = self._sleep_before
        self.stop()
        process_state.apply(self._initial)

    def _sleep(self, seconds: float) -> None:
        """``time.sleep`` while the ranks run: a rank that sleeps lets the others run."""
        sleep: Callable[[float], None] = self._sleep_before
        if not self.holds():
            return sleep(seconds)
        with self.waiting():
            sleep(seconds)
        return None

    def holds(self) -> bool:
        """Whether the calling thread is a rank holding its turn."""
        rank = getattr(self._mine, "rank", None)
        return rank is not None and self._holder == rank

    # --- called by rank threads -------------------------------------------------------------

    def enter(self, rank: int) -> None:
        """Start ``rank``'s thread: its first turn comes once every rank thread started."""
        self._mine.rank = rank
        with self._cond:
            self._to_enter -= 1
        self.take()

    def take(self) -> None:
        """Wait for the calling rank's turn (at once once the world is stopped)."""
        rank = getattr(self._mine, "rank", None)
        if rank is None:
            return
        with self._cond:
            self._wanting.add(rank)
            self._dispatch()
            while self._holder != rank:
                if self._stopped:
                    self._wanting.discard(rank)
                    return
                self._turns[rank].wait(_POLL_S)
            if self._loaded != rank:
                if self._loaded is not None:
                    self._states[self._loaded] = process_state.capture()
                process_state.apply(self._states[rank])
                self._loaded = rank

    def give(self) -> None:
        """Hand the calling rank's turn on (it waits, or its body ended)."""
        rank = getattr(self._mine, "rank", None)
        with self._cond:
            if rank is not None and self._holder == rank:
                self._holder = None
                self._dispatch()

    def leave(self) -> None:
        """The calling rank's body ended: hand the turn on for good."""
        self.give()
        self._mine.rank = None

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """The calling rank waits in the block: the others take turns meanwhile."""
        self.give()
        try:
            yield
        finally:
            self.take()

    # --- called by the launcher's thread ------------------------------------------------------

    def stop(self) -> None:
        """Every rank runs without turns from now on (the world is being stopped); never
        blocks. See [Note: stopping rank threads] in ``rank_threads.py``."""
        self._stopped = True
        if acquire_briefly(self._cond):
            try:
                for turn in self._turns.values():
                    turn.notify()
            finally:
                self._cond.release()

    # --- inside the lock ------------------------------------------------------------------------

    def _dispatch(self) -> None:
        if self._holder is None and self._to_enter <= 0 and self._wanting:
            self._holder = min(self._wanting)
            self._wanting.discard(self._holder)
            self._turns[self._holder].notify()
