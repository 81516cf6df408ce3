"""Local mode's scheduler: the rank threads of one world take turns, one at a time.

[Note: local mode]
Local mode runs every rank of a world in this process, each in its own thread (so each has its
own ``rank`` fixture, its own Python control flow, autograd graph and hooks, as in thread
mode), but only the thread holding the *baton* runs. A rank hands the baton on only where it
must wait: in a collective that not every rank of the group has reached, or when its test ends.
The baton then goes to the lowest rank that can run, so a run is deterministic and uses one
core. Whenever the baton moves to another rank, the process-wide state a rank may change
(torch's CPU RNG, ``random``, NumPy's global RNG, the default dtype, deterministic mode; see
``fsdp_testing/_rank/process_state.py``) is saved for the rank leaving and restored for the rank
arriving, so ``torch.manual_seed(0)`` on every rank gives each what its own process would have
had, and ranks never race. The collectives themselves (``local_group.py``) complete when the
last rank of the group arrives, with gloo's arithmetic (``local_reduce.py``).

Waiting can end four ways: the collective completed (the rank takes the baton again when its
turn comes); no rank can run any more while some wait (a real run would hang there: the baton
keeps what each rank waits in as :attr:`Baton.deadlock`, and the launcher, which looks for it
while the ranks run, reports it as a deadlock the way the other modes do, from the ranks' logs
and stacks, then stops the world); a peer failed and no rank can run (the ranks waiting are
aborted, as their peers would be by a real backend); or the launcher stops the world (timeout,
deadlock): the waiting ranks raise at once. Nothing waits without the launcher's deadline above
it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from fsdp_testing._launch.rank_threads import Aborted, acquire_briefly
from fsdp_testing._rank import process_state

__all__ = ["Baton"]

_POLL_S = 0.25
"""How often a waiting rank looks at an abort flag set without the lock (see ``abort``)."""


class Baton:
    """Which rank thread of a local world runs; see [Note: local mode].

    Args:
        world_size: number of ranks.
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        lock = threading.Lock()
        self._cond = threading.Condition(lock)
        # One condition per rank over the same lock: a hand-over wakes the new holder only (a
        # shared condition woke every rank thread at each hand-over, W^2 wake-ups per
        # collective, which dominated the step at 64+ ranks).
        self._turns = [threading.Condition(lock) for _ in range(world_size)]
        self._holder: int | None = None
        self._entered = 0  # the first turn is given once every rank thread has started
        self._ready: set[int] = set()
        self._waiting: dict[int, str] = {}  # rank -> what it waits in
        self._finished: dict[int, bool] = {}  # rank -> whether its test failed
        self._deadlock: dict[int, str] | None = None
        self._aborted = False
        initial = process_state.capture()
        self._states = dict.fromkeys(range(world_size), initial)
        self._loaded: int | None = None  # whose state the process holds

    # --- called by rank threads -----------------------------------------------------------

    def enter(self, rank: int) -> None:
        """Wait for ``rank``'s first turn."""
        with self._cond:
            self._ready.add(rank)
            self._entered += 1
            self._dispatch()
            self._wait_turn(rank)

    def block(self, rank: int, what: str, done: Callable[[], bool]) -> None:
        """The holder ``rank`` waits (in ``what``) until ``done()``; others run meanwhile. When
        no rank can run any more, it waits until the launcher, which reports the deadlock,
        stops the world.

        Raises:
            Aborted: a peer failed and nothing can run, or the launcher stopped the world.
        """
        while not done():
            with self._cond:
                if self._aborted:
                    raise Aborted()
                self._waiting[rank] = what
                self._holder = None
                self._dispatch()
                self._wait_turn(rank)
            if not done() and self.broken:
                raise Aborted()
            # else: woken for a message that was not the one awaited (a receive): wait again

    def wake(self, ranks: list[int]) -> None:
        """The holder completed a collective: ``ranks`` that waited in it can run again."""
        with self._cond:
            for rank in ranks:
                if self._waiting.pop(rank, None) is not None:
                    self._ready.add(rank)

    def leave(self, rank: int, failed: bool) -> None:
        """``rank``'s thread ends (its test ``failed`` or not); the baton moves on."""
        with self._cond:
            self._finished[rank] = failed
            self._ready.discard(rank)
            self._waiting.pop(rank, None)
            if self._holder == rank:
                self._holder = None
                self._dispatch()

    @property
    def broken(self) -> bool:
        """A deadlock was found or the world was stopped: no collective can complete."""
        return self._deadlock is not None or self._aborted

    @property
    def deadlock(self) -> dict[int, str] | None:
        """Once no rank can run while some wait (and none failed): what each waiting rank
        waits in (``"send #1 to rank 2 (at tests/test_pipe.py:26)"``); else None."""
        return self._deadlock

    @property
    def finished(self) -> dict[int, bool]:
        """The ranks whose thread ended, and whether their test failed."""
        return dict(self._finished)

    # --- called by the launcher's thread ----------------------------------------------------

    def abort(self) -> None:
        """Stop the world: every rank waiting raises :class:`Aborted` (never blocks)."""
        self._aborted = True
        if acquire_briefly(self._cond):
            try:
                for turn in self._turns:
                    turn.notify()
            finally:
                self._cond.release()

    # --- inside the lock ------------------------------------------------------------------------

    def _dispatch(self) -> None:
        if self._holder is not None or self._entered < self.world_size:
            return
        if self._ready:
            self._holder = min(self._ready)
            self._ready.discard(self._holder)
        elif self._waiting and self._deadlock is None:
            # Nothing can run and someone waits: every waiting rank is stuck for good. After a
            # failure its peers are aborted; otherwise it is a deadlock, which the launcher
            # reports (the ranks wait, asleep, until it stops the world).
            if any(self._finished.values()):
                self._aborted = True
                self._holder = min(self._waiting)
            else:
                self._deadlock = dict(self._waiting)
        if self._holder is not None:
            self._turns[self._holder].notify()

    def _wait_turn(self, rank: int) -> None:
        while self._holder != rank:
            if self._aborted:
                self._waiting.pop(rank, None)
                raise Aborted()
            self._turns[rank].wait(_POLL_S)
        self._swap_state(rank)

    def _swap_state(self, rank: int) -> None:
        if self._loaded == rank:
            return
        if self._loaded is not None:
            self._states[self._loaded] = process_state.capture()
        process_state.apply(self._states[rank])
        self._loaded = rank
