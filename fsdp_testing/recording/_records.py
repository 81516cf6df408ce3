"""What a recorder keeps: the frozen record dataclasses, and the log that numbers them (``seq``,
``step``) for one rank and answers queries over them."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterable
from typing import Any

from ..collectives import COLLECTIVE_FAMILIES

__all__ = [
    "CollectiveRecord",
    "ForwardRecord",
    "OffloadRecord",
    "P2PRecord",
    "PostBackwardRecord",
    "Record",
    "RecordLog",
    "ReshardRecord",
    "UnshardRecord",
    "now_us",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Record:
    """Fields every record has.

    Args:
        seq: position in this recorder's records.
        step: the value of :meth:`FSDPRecorder.next_step`'s counter when recorded (from 0).
        rank: global rank that recorded it.
        unit: FQN of the unit (``""``: the root, or unknown for a collective).
        ts_us: host time (microseconds, ``time.perf_counter``) when it started.
        dur_us: duration in microseconds, or None for an instant.
    """

    seq: int
    step: int
    rank: int
    unit: str
    ts_us: float
    dur_us: float | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class CollectiveRecord(Record):
    """One collective call. ``bytes``: the unsharded buffer (all-gather output, reduce-scatter
    input, all-reduce tensor); ``shapes``: the tensors in call order (output first);
    ``group_ranks``: the global ranks of its process group (``()`` when not known), which
    tells the shard group of hybrid sharding from its replicate group."""

    op: str
    shapes: tuple[tuple[int, ...], ...]
    dtype: str
    group_size: int
    bytes: int
    async_op: bool = False
    group_ranks: tuple[int, ...] = ()
    reduce_op: str | None = None
    """Reductions: the reduce op (``"SUM"``, ``"AVG"``, ``"MAX"``, ...); None otherwise."""
    root: int | None = None
    """broadcast, reduce, gather, scatter: the root's global rank."""
    phase: str = "outside"
    """forward, backward, optimizer or outside (see [Note: the phase of a call])."""
    mesh_dims: tuple[str, ...] = ()
    """The dims of the recorder's device mesh its group spans (``()``: no mesh, or another
    group)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class P2PRecord(Record):
    """One point-to-point op (a send or a receive, alone or in a ``batch_isend_irecv``).
    ``op``: the function called (``send``, ``isend``, ``recv``, ``irecv``); ``kind``:
    ``"send"`` or ``"recv"``; ``peer``: the other rank (global; None: a receive from any rank);
    ``bytes``: the message; ``blocking``: the call waited for it (``send``/``recv``);
    ``batch``: the batching call (``"batch_isend_irecv"``) or None; ``completed_us``: when it
    completed (``ts_us``'s clock; None: not waited on in the block)."""

    op: str
    kind: str
    peer: int | None
    tag: int
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    blocking: bool
    group_ranks: tuple[int, ...] = ()
    batch: str | None = None
    completed_us: float | None = None
    phase: str = "outside"
    mesh_dims: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class UnshardRecord(Record):
    """A unit's parameters became unsharded. ``reason``: forward, forward_prefetch, backward,
    backward_prefetch or explicit; ``devices``: of the unsharded parameters; ``offload``: whether
    the engine offloads this unit (None: not reported); ``inferred``: the reason was inferred
    (see [Note: what is exact and what is inferred])."""

    reason: str
    devices: tuple[str, ...]
    offload: bool | None = None
    inferred: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReshardRecord(UnshardRecord):
    """A unit's unsharded parameters were freed; ``devices``: of the sharded parameters."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PostBackwardRecord(Record):
    """A call of the engine's post-backward step for one unit (span only)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ForwardRecord(Record):
    """A sharded module's forward returned (``unit``: its FQN); gives the graph order."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class OffloadRecord(Record):
    """An offload copy published by ``fsdp_core`` (``direction``: to_device or to_host)."""

    direction: str
    bytes: int


def now_us() -> float:
    """Host time in microseconds (``time.perf_counter``), the clock of ``ts_us``/``dur_us``."""
    return time.perf_counter_ns() / 1000.0


class RecordLog:
    """One rank's records in the order recorded, grouped into steps, with the queries over them.

    Args:
        rank: the global rank stamped on every record (-1 outside a process group).
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.records: list[Record] = []
        self._step = 0
        self._lock = threading.Lock()

    def next_step(self) -> None:
        """Starts a new step: later records get ``step`` one higher."""
        self._step += 1

    def _add(self, cls: type[Record], **fields: Any) -> int:
        with self._lock:
            fields.setdefault("rank", self.rank)
            self.records.append(cls(seq=len(self.records), step=self._step, **fields))
            return len(self.records) - 1

    def _amend(self, index: int, **fields: Any) -> None:
        """Fill in fields of the record at ``index`` known only later (a completion time)."""
        with self._lock:
            self.records[index] = dataclasses.replace(self.records[index], **fields)

    def select(
        self,
        cls: type[Record] = Record,
        *,
        step: int | None = None,
        unit: str | None = None,
    ) -> list[Any]:
        """Records of type ``cls`` (default: all), optionally of one ``step`` and ``unit``."""
        return [
            r
            for r in self.records
            if isinstance(r, cls)
            and (step is None or r.step == step)
            and (unit is None or r.unit == unit)
        ]

    def collectives(
        self,
        op: str | None = None,
        *,
        step: int | None = None,
        unit: str | None = None,
        phase: str | None = None,
        mesh_dim: str | None = None,
    ) -> list[CollectiveRecord]:
        """Collective records; ``op`` is a torch name (``"all_gather_single"``) or a family
        that covers both spellings (``"all_gather"``, ``"reduce_scatter"``); ``phase``: only
        those of one phase; ``mesh_dim``: only those over a group spanning that mesh dim."""
        names = _op_names(op)
        return [
            r
            for r in self.select(CollectiveRecord, step=step, unit=unit)
            if (names is None or r.op in names)
            and (phase is None or r.phase == phase)
            and (mesh_dim is None or mesh_dim in r.mesh_dims)
        ]

    def bytes_by_group(
        self, op: str | None = None, *, step: int | None = None
    ) -> dict[tuple[int, ...], int]:
        """Bytes of the collectives (``op`` as in :meth:`collectives`) per process group, by
        the group's global ranks."""
        out: dict[tuple[int, ...], int] = {}
        for record in self.collectives(op, step=step):
            out[record.group_ranks] = out.get(record.group_ranks, 0) + record.bytes
        return out

    def count(
        self,
        op: str,
        *,
        step: int | None = None,
        unit: str | None = None,
        phase: str | None = None,
        mesh_dim: str | None = None,
    ) -> int:
        """Number of calls of ``op``: a collective (a name or a family, see
        :meth:`collectives`), or a point-to-point op (``"send"``, ``"recv"`` count every
        spelling; ``"isend"``, ``"irecv"`` only their own)."""
        if op in ("send", "recv", "isend", "irecv"):
            return len([r for r in self.p2p(op, step=step) if phase is None or r.phase == phase])
        return len(self.collectives(op, step=step, unit=unit, phase=phase, mesh_dim=mesh_dim))

    def p2p(
        self, op: str | None = None, *, peer: int | None = None, step: int | None = None
    ) -> list[P2PRecord]:
        """Point-to-point records, in the order issued; ``op``: ``"send"`` or ``"recv"`` (every
        spelling of the kind) or a function's name (``"isend"``); ``peer``: only those with that
        rank."""
        return [
            r
            for r in self.select(P2PRecord, step=step)
            if (op is None or op in (r.kind, r.op)) and (peer is None or r.peer == peer)
        ]

    def p2p_order(self, *, step: int | None = None) -> list[tuple[str, int | None]]:
        """``[("send", 1), ("recv", 1), ...]``: this rank's messages in the order issued, each
        as its kind and peer."""
        return [(r.kind, r.peer) for r in self.p2p(step=step)]

    def p2p_bytes(self, *, step: int | None = None) -> dict[tuple[str, int | None], int]:
        """Bytes this rank sent to and received from each peer: ``{("send", 1): 4096, ...}``."""
        out: dict[tuple[str, int | None], int] = {}
        for r in self.p2p(step=step):
            out[(r.kind, r.peer)] = out.get((r.kind, r.peer), 0) + r.bytes
        return out

    def unshards(
        self, reason: str | Iterable[str] | None = None, *, step: int | None = None
    ) -> list[UnshardRecord]:
        """Unshard records, optionally only those with ``reason`` (one or several)."""
        found = self._transitions(UnshardRecord, reason, step)
        return [r for r in found if not isinstance(r, ReshardRecord)]

    def reshards(
        self, reason: str | Iterable[str] | None = None, *, step: int | None = None
    ) -> list[ReshardRecord]:
        """Reshard records, optionally only those with ``reason``."""
        return self._transitions(ReshardRecord, reason, step)

    def _transitions(
        self, cls: type[UnshardRecord], reason: str | Iterable[str] | None, step: int | None
    ) -> list[Any]:
        if reason is None:
            return self.select(cls, step=step)
        reasons = {reason} if isinstance(reason, str) else set(reason)
        return [r for r in self.select(cls, step=step) if r.reason in reasons]

    def unshard_order(
        self, reason: str | Iterable[str] | None = None, *, step: int | None = None
    ) -> list[str]:
        """The units in the order they were unsharded (for ``reason``, in ``step``)."""
        return [r.unit for r in self.unshards(reason, step=step)]

    def graph_order(self, *, step: int | None = None) -> list[str]:
        """Sharded modules in the order their forward returned, first time each (needs
        ``model``); ``step`` defaults to the first step with a forward. Where no module forward
        ran (a graph-mode step runs one traced graph instead), the order in which the units
        were first unsharded for forward."""
        forwards = self.select(ForwardRecord)
        if not forwards:
            return self._forward_unshard_order(step)
        if step is None and forwards:
            step = forwards[0].step
        order: list[str] = []
        for record in forwards:
            if record.step == step and record.unit not in order:
                order.append(record.unit)
        return order

    def _forward_unshard_order(self, step: int | None) -> list[str]:
        unshards = self.unshards(("forward", "forward_prefetch"))
        if step is None and unshards:
            step = unshards[0].step
        order: list[str] = []
        for record in unshards:
            if record.step == step and record.unit not in order:
                order.append(record.unit)
        return order


def _op_names(op: str | None) -> set[str] | None:
    if op is None:
        return None
    if op in COLLECTIVE_FAMILIES:
        return set(COLLECTIVE_FAMILIES[op])
    return {op}
