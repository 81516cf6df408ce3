"""Measurements taken on a rank: collectives on the wire, resident memory, and the theoretical
communication volume of a sharded model (which its engine computes: see [Note: theoretical
volume] in ``fsdp_testing/engines/_volume.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import resource
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from fsdp_testing._rank import comm_observer
from fsdp_testing.engines._volume import CommVolume, UnitVolume

if TYPE_CHECKING:
    from fsdp_testing.engines import FSDPEngine

__all__ = [
    "CollectiveCall",
    "CollectiveLog",
    "CommVolume",
    "UnitVolume",
    "current_rss_bytes",
    "peak_rss_bytes",
    "reset_peak_rss",
    "theoretical_volume",
]

_WATCHED_FAMILIES = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all")


@dataclasses.dataclass(frozen=True)
class CollectiveCall:
    """One collective issued through ``torch.distributed`` while a :class:`CollectiveLog`
    watched."""

    op: str
    """The function called, e.g. ``"all_gather_single"``."""
    kind: str
    """The family (:mod:`fsdp_testing.collectives`): ``all_gather``, ``reduce_scatter``,
    ``all_reduce``, ``broadcast`` or ``all_to_all``."""
    bytes: int
    """Size of the unsharded side: all-gather output, reduce-scatter input, all-reduce tensor."""
    group_size: int
    start_ns: int
    end_ns: int
    group_ranks: tuple[int, ...] = ()
    """The global ranks of its process group."""


class _Watcher(comm_observer.Listener):
    """The listener of a :class:`CollectiveLog`."""

    def __init__(self, calls: list[CollectiveCall]) -> None:
        self._calls = calls

    def started(self, call: Any) -> None:
        pass

    def ended(self, call: Any, state: str) -> None:
        if call.family not in _WATCHED_FAMILIES or call.p2p or state == "raised":
            return
        if state == "issued" and call.blocking:
            return  # the rank waits on it next: counted once it completed
        if state == "completed" and not call.blocking:
            return  # counted when issued
        end = time.perf_counter_ns()
        self._calls.append(
            CollectiveCall(
                call.op,
                call.family,
                call.nbytes,
                len(call.group_ranks),
                call.start_ns,
                end,
                call.group_ranks,
            )
        )


class CollectiveLog:
    """Records every collective of the watched families that reaches a process group, as the
    harness observes calls (``fsdp_testing/_rank/comm_observer.py``: no ``torch.distributed``
    function is replaced, and a deprecated name forwarding to the new one is one call), including
    calls an engine does not report through its own events.
    """

    def __init__(self) -> None:
        self.calls: list[CollectiveCall] = []

    @contextlib.contextmanager
    def watching(self) -> Iterator[CollectiveLog]:
        """Record the calls of the ``with`` block."""
        watcher = _Watcher(self.calls)
        ours = not comm_observer.installed()
        comm_observer.install(None)
        comm_observer.add_listener(watcher)
        try:
            yield self
        finally:
            comm_observer.remove_listener(watcher)
            if ours:
                comm_observer.uninstall()

    def clear(self) -> None:
        self.calls.clear()

    def totals(self) -> dict[str, tuple[int, int]]:
        """``kind -> (number of calls, bytes)`` over the recorded calls, leaving out collectives
        over a group of one rank (they move nothing)."""
        out: dict[str, tuple[int, int]] = {}
        for call in self.calls:
            if call.group_size == 1:
                continue
            count, size = out.get(call.kind, (0, 0))
            out[call.kind] = (count + 1, size + call.bytes)
        return out

    def by_group(self) -> dict[str, dict[str, tuple[int, int]]]:
        """``kind -> {"r0,r1,...": (number of calls, bytes)}``: :meth:`totals` split by the
        global ranks of each call's group."""
        out: dict[str, dict[str, tuple[int, int]]] = {}
        for call in self.calls:
            if call.group_size == 1:
                continue
            groups = out.setdefault(call.kind, {})
            key = ",".join(map(str, call.group_ranks))
            count, size = groups.get(key, (0, 0))
            groups[key] = (count + 1, size + call.bytes)
        return out


# -- resident memory ------------------------------------------------------------------------------


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Reset this process's RSS high-water mark to its current RSS (Linux ``clear_refs``).

    Returns False where that is impossible; :func:`peak_rss_bytes` is then the process's peak
    since it started (``getrusage``).
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def peak_rss_bytes() -> int:
    """The RSS high-water mark (``VmHWM``; ``ru_maxrss`` where /proc is missing)."""
    kib = _status_kib("VmHWM")
    if kib is None:
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib * 1024


def current_rss_bytes() -> int:
    kib = _status_kib("VmRSS")
    return (kib or 0) * 1024


# -- theory ---------------------------------------------------------------------------------------


def theoretical_volume(
    model: Any, *, full_shard: bool, engine: FSDPEngine | None = None
) -> CommVolume | None:
    """The theoretical collectives per step of ``model``, as its engine computes them
    (``engine.theoretical_volume``), or None when no engine has a theory for it.

    Args:
        model: the sharded model.
        full_shard: units reshard after forward (``FULL_SHARD``; FSDP2's
            ``reshard_after_forward=True``).
        engine: the engine that sharded ``model`` (default: found with ``engine_for``).
    """
    from fsdp_testing.engines import engine_for

    engine = engine if engine is not None else engine_for(model)
    if engine is None:
        return None
    try:
        return engine.theoretical_volume(model, full_shard=full_shard)
    except (AttributeError, ImportError):
        # The engine's private state moved (another torch): no theory rather than a crash.
        return None
