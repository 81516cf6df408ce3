"""Fault injection: make one rank die, raise, stall or hang at its k-th collective, on purpose,
to test that the code under test (and the harness) handles it.

Two ways to use it::

    @pytest.mark.distributed(world_size=2, faults=[faults.kill(rank=1, at=3)])
    def test_survives_a_dead_peer(rank): ...

    @pytest.mark.distributed(world_size=2)
    def test_slow_rank(rank):
        with faults.inject(faults.delay(rank=0, at=1, ms=200)):
            ...

``at`` is 1-based and counts the rank's calls from the start of the test (marker) or of the
``with`` block: every collective, or only the calls of ``op`` (a family of
:mod:`fsdp_testing.collectives`: ``"all_gather"``, ``"reduce_scatter"``, ``"all_reduce"``,
``"broadcast"``, ...; every spelling of a family counts as that family). Point-to-point ops are
numbered apart: ``op="send"`` counts the rank's sends (``send``, ``isend``, each op of a
``batch_isend_irecv``), ``op="recv"`` its receives, and ``at`` with no ``op`` counts
collectives only. The fault fires just before that call starts; the report names the rank, the
fault and the call as every report and the collective log name it (``<op> #k``: the rank's k-th
call of that family in the test, see [Note: one numbering] in
``fsdp_testing/_report/collective_log.py``), e.g. ``rank 1 killed by SIGKILL at
all_gather_into_tensor #3``.

- :func:`kill`: SIGKILL the rank's process (process mode only: thread ranks share one process
  and cannot be killed, so a kill in thread or fake mode is refused with an error).
- :func:`fail`: raise ``exc`` (default :class:`InjectedFault`) on the rank.
- :func:`delay`: sleep ``ms`` milliseconds, then run the collective: timing changes, results
  do not, and the test passes.
- :func:`hang`: block until the harness stops the rank at the test's timeout.

:func:`expect` decorates a test that must fail with a given report: it passes only when the
named rank failed and the report matches (``xfail(strict=True)`` passes for any failure).

Nothing here imports torch at import time, so faults can be named in markers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

from fsdp_testing._report.expectation import ExpectedFailure, expect
from fsdp_testing.collectives import COLLECTIVE_FAMILIES, family_of

__all__ = [
    "ExpectedFailure",
    "Fault",
    "FaultKind",
    "FaultNeverFired",
    "InjectedFault",
    "delay",
    "expect",
    "fail",
    "hang",
    "inject",
    "kill",
]


class FaultKind(str, enum.Enum):
    """What happens to the rank."""

    KILL = "kill"
    """SIGKILL the rank's process."""
    FAIL = "fail"
    """Raise an exception on the rank."""
    DELAY = "delay"
    """Sleep, then run the collective."""
    HANG = "hang"
    """Block until the harness stops the rank."""

    def __str__(self) -> str:
        return self.value


class InjectedFault(RuntimeError):
    """Raised on a rank by :func:`fail` (unless another exception was given)."""


class FaultNeverFired(ValueError):
    """Raised on a rank whose fault's collective never came: the test or the ``inject`` block
    ended before the rank issued its ``at``-th collective (of family ``op``)."""


@dataclasses.dataclass(frozen=True)
class Fault:
    """One fault: ``kind`` on rank ``rank`` at its ``at``-th collective (of family ``op``).

    Build faults with :func:`kill`, :func:`fail`, :func:`delay` and :func:`hang`.
    """

    kind: FaultKind
    rank: int
    at: int
    op: str | None = None
    """A collective family, or None to count every collective."""
    ms: float = 0.0
    """Delay in milliseconds (delay faults only)."""
    exc: BaseException | None = None
    """What a fail fault raises (None: :class:`InjectedFault`)."""

    def __post_init__(self) -> None:
        api = f"faults.{self.kind.value}"
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"{api}: rank must be a rank number >= 0, got {self.rank!r}")
        if isinstance(self.at, bool) or not isinstance(self.at, int) or self.at < 1:
            raise ValueError(
                f"{api}: at must be the 1-based index of the rank's collective (1 is its first "
                f"collective), got {self.at!r}"
            )
        if self.op is not None and self.op not in COLLECTIVE_FAMILIES:
            family = family_of(self.op) if isinstance(self.op, str) else None
            hint = f" (did you mean op={family!r}?)" if family else ""
            raise ValueError(
                f"{api}: op must be a collective family, one of "
                f"{', '.join(sorted(COLLECTIVE_FAMILIES))}, or None for every collective; got "
                f"{self.op!r}{hint}"
            )
        if self.kind is FaultKind.DELAY and not (
            isinstance(self.ms, (int, float)) and not isinstance(self.ms, bool) and self.ms >= 0
        ):
            raise ValueError(f"{api}: ms must be a number of milliseconds >= 0, got {self.ms!r}")
        if self.exc is not None and not isinstance(self.exc, BaseException):
            raise TypeError(
                f"{api}: exc must be an exception instance (e.g. RuntimeError('boom')), got "
                f"{self.exc!r}"
            )

    def describe(self) -> str:
        """The call that makes this fault, e.g. ``faults.fail(rank=0, at=5, op='all_reduce')``."""
        args = [f"rank={self.rank}", f"at={self.at}"]
        if self.kind is FaultKind.DELAY:
            args.append(f"ms={self.ms:g}")
        if self.op is not None:
            args.append(f"op={self.op!r}")
        if self.exc is not None:
            args.append(f"exc={self.exc!r}")
        return f"faults.{self.kind.value}({', '.join(args)})"


def kill(rank: int, at: int, *, op: str | None = None) -> Fault:
    """SIGKILL rank ``rank`` just before its ``at``-th collective (of family ``op``)."""
    return Fault(FaultKind.KILL, rank, at, op)


def fail(rank: int, at: int, *, op: str | None = None, exc: BaseException | None = None) -> Fault:
    """Raise ``exc`` (default :class:`InjectedFault`) on rank ``rank`` just before its
    ``at``-th collective (of family ``op``)."""
    return Fault(FaultKind.FAIL, rank, at, op, exc=exc)


def delay(rank: int, at: int, ms: float, *, op: str | None = None) -> Fault:
    """Sleep ``ms`` milliseconds on rank ``rank`` before its ``at``-th collective (of family
    ``op``); the collective then runs normally."""
    return Fault(FaultKind.DELAY, rank, at, op, ms=ms)


def hang(rank: int, at: int, *, op: str | None = None) -> Fault:
    """Block rank ``rank`` before its ``at``-th collective (of family ``op``) until the harness
    stops it at the test's timeout."""
    return Fault(FaultKind.HANG, rank, at, op)


def validate_for_mode(faults: tuple[Fault, ...], mode: str, world_size: int) -> None:
    """Refuse faults that cannot happen in ``mode`` at ``world_size`` (decided in the parent)."""
    for fault in faults:
        if fault.kind is FaultKind.KILL and mode != "process":
            raise ValueError(
                f"faults.kill(rank={fault.rank}): {mode} ranks are threads of one process and "
                "cannot be killed; use mode='process', or faults.fail(...) to make the rank "
                "raise instead"
            )
        if fault.rank >= world_size:
            raise ValueError(
                f"faults.{fault.kind.value}(rank={fault.rank}): the test has world_size="
                f"{world_size}, so ranks are 0..{world_size - 1}"
            )


class FaultPlan:
    """The faults of one rank, counting its collectives (installed on its collective log)."""

    def __init__(self, rank: int, faults: tuple[Fault, ...]) -> None:
        self.rank = rank
        self.faults = [f for f in faults if f.rank == rank]
        self._counts: dict[str | None, int] = {}
        self._fired: list[Fault] = []

    def before(self, entry: dict[str, Any], note: Any) -> None:
        """Called just before the call logged as ``entry`` starts (a collective log entry, see
        [Note: one numbering] in ``fsdp_testing/_report/collective_log.py``); ``note(dict)``
        records a fault in the rank's collective log."""
        from fsdp_testing._report.collective_log import call_name

        family = entry["family"]
        p2p = bool(entry.get("p2p"))
        if not p2p:  # point-to-point ops are numbered apart from collectives
            self._counts[None] = self._counts.get(None, 0) + 1
        self._counts[family] = self._counts.get(family, 0) + 1
        for fault in self.faults:
            if fault.op is None and p2p:
                continue
            if fault.op is not None and fault.op != family:
                continue  # only a call of the fault's family can be its at-th
            if self._counts[fault.op] != fault.at:
                continue
            where = call_name(entry)
            note({"fault": fault.kind.value, "op": entry["op"], "where": where, "t": time.time()})
            self._fired.append(fault)
            self._fire(fault, where)

    def check_fired(self, span: str) -> None:
        """Raise :class:`FaultNeverFired` for the first of this rank's faults that did not fire
        by the end of ``span`` (``"the test"``, ``"the faults.inject block"``)."""
        unfired = [f for f in self.faults if not any(f is g for g in self._fired)]
        if not unfired:
            return
        fault = unfired[0]
        total = self._counts.get(None, 0)
        issued = ", ".join(f"{f} x{n}" for f, n in sorted(self._counts.items(), key=str) if f)
        did = f"{total} collective{'s' if total != 1 else ''}" + (f" ({issued})" if issued else "")
        if fault.op is None:
            fix = f"use at=1..{total}" if total else "inject it where the rank issues collectives"
            counted = ""
        else:
            n = self._counts.get(fault.op, 0)
            counted = f", {n} of them {fault.op}"
            fix = f"use at=1..{n}" if n else "name an op the rank issues, or op=None"
        more = f" (and {len(unfired) - 1} more fault(s) of rank {self.rank})" if unfired[1:] else ""
        raise FaultNeverFired(
            f"{fault.describe()} never fired{more}: rank {self.rank} issued {did} in {span}"
            f"{counted}, so it never reached the fault's collective. A fault that never fires "
            f"tests nothing: {fix}."
        )

    def _fire(self, fault: Fault, where: str) -> None:
        if fault.kind is FaultKind.DELAY:
            time.sleep(fault.ms / 1000.0)
        elif fault.kind is FaultKind.FAIL:
            if fault.exc is not None:
                raise fault.exc
            raise InjectedFault(f"rank {self.rank}: injected failure at {where} (faults.fail)")
        elif fault.kind is FaultKind.KILL:
            if threading.current_thread() is not threading.main_thread():
                raise ValueError(
                    f"faults.kill(rank={self.rank}): this rank is a thread and cannot be killed; "
                    "use mode='process', or faults.fail(...)"
                )
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.kind is FaultKind.HANG:
            while True:  # short sleeps: a thread rank can still be stopped by the harness
                time.sleep(0.05)


@contextlib.contextmanager
def inject(*faults: Fault) -> Iterator[None]:
    """Inject ``faults`` into the collectives this rank runs inside the block (call it on every
    rank; each rank takes the faults naming it). Only inside a distributed test."""
    from fsdp_testing._rank.comm_observer import current_recorder

    for fault in faults:
        if not isinstance(fault, Fault):
            raise TypeError(
                f"faults.inject: expected faults made by faults.kill/fail/delay/hang, got {fault!r}"
            )
    recorder = current_recorder()
    if recorder is None:
        raise RuntimeError(
            "faults.inject: no collective log on this rank; inject faults inside a test marked "
            "@pytest.mark.distributed (or a distributed unittest class)"
        )
    import torch.distributed as dist

    rank = dist.get_rank()
    if dist.get_backend() in ("threaded", "fake"):
        validate_for_mode(faults, "thread", dist.get_world_size())
    previous = recorder.faults
    plan = recorder.faults = FaultPlan(rank, tuple(faults))
    try:
        yield
    finally:
        recorder.faults = previous
    plan.check_fired("the faults.inject block")
