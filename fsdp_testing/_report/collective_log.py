"""The collective log: a cheap per-rank record of the rank's collectives and point-to-point ops,
readable while the rank is blocked (``divergence.py`` and ``p2p.py`` read the logs of all ranks;
``deadlock.py`` finds a wait cycle in them while the test runs).

[Note: collective log]
A rank stuck in a gloo or threaded-PG call cannot run Python code (its main thread waits in C++
or on a condition), so the record must be readable from outside: in process mode each update is
written to a small memory-mapped file that the parent reads; in thread and local mode the
parent reads the recorder object directly. Entries come from the observer
(``fsdp_testing/_rank/comm_observer.py``), one per call the rank made.

The file is a ring of fixed-size slots, one per entry, after a header that counts the entries
written since the test began: an update rewrites its own slot only. (Rewriting the whole record
as one JSON text cost about 0.3 ms a collective once it held 32 entries: more than a gloo
collective itself, on every collective of every test.) After the ring, one more region holds the
rank's point-to-point counts per channel, which the ring may have lost: how many messages the
rank sent and received on each (group, source, destination, tag) since the test began.

[Note: one numbering]
Every report names a call ``<op> #k``: the rank's k-th call of that family since the test began
(every spelling of a family counts as it; ``send`` and ``isend`` are sends, ``recv`` and
``irecv`` receives), over all its groups. A fault's ``at=k, op=F`` is ``F #k`` of the rank (its
``faults.inject`` block counts from the block's start, and the report names the log's number);
``at=k`` with no op is the rank's k-th collective of any family, point-to-point ops apart.
Internally each entry also carries where it meets its peers' calls: a collective's position on
its group (``seq``), a message's position on its channel (``seq``, the k-th send on a channel
meets the k-th receive), which is how ranks are compared.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import time
from typing import Any

__all__ = [
    "FlightRecorder",
    "call_name",
    "channel_key",
    "compact_ranks",
    "expand_ranks",
    "is_inside",
    "read_record_file",
]

_SLOT_BYTES = 2048
_COUNTS_BYTES = 16384
_HEADER = struct.Struct("<II")  # entries written since the last reset, slots in the ring
_LENGTH = struct.Struct("<I")  # a slot: the length of its JSON text, then the text


def channel_key(group: str, src: int, dst: int, tag: int) -> str:
    """The key of a point-to-point channel in a log's counts: ``"default|0>1|0"``."""
    return f"{group}|{src}>{dst}|{tag}"


def compact_ranks(ranks: tuple[int, ...] | list[int]) -> str:
    """``"0-3,6"``: a group's ranks in a few characters (order kept)."""
    parts: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ",".join(parts)


def expand_ranks(text: str) -> list[int]:
    """The ranks of :func:`compact_ranks`' text."""
    ranks: list[int] = []
    for part in text.split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        ranks.extend(range(int(first), int(last or first) + 1))
    return ranks


class FlightRecorder:
    """The last ``capacity`` calls of one rank, oldest first, and its message counts.

    Each entry (a dict, JSON in the file): ``op`` (as called), ``family``, ``n`` (the family's
    number, see [Note: one numbering]), ``seq`` (where it meets its peers' calls), ``group``,
    ``shapes``, ``dtype``, ``bytes``, ``state`` (``entered``: inside the call; ``issued``: it
    returned a work nobody waits on yet; ``waiting``: the rank waits on that work;
    ``completed``; ``raised``), ``t`` and ``t_end`` (wall clock), ``at`` (``path:line`` of the
    call). A collective adds ``c`` (the rank's count of collectives), ``ranks`` (its group's
    ranks, :func:`compact_ranks`), ``reduce``, ``root``; a point-to-point op adds ``p2p``,
    ``peer`` (global rank; absent: any), ``tag``, ``blocking`` and ``batch``.
    """

    def __init__(self, capacity: int = 32, path: str | None = None) -> None:
        self.capacity = capacity
        self.entries: list[dict[str, Any]] = []
        self.counts: dict[str, int] = {}
        """Per family, the rank's calls since the test began (``None``-free; see ``c``)."""
        self.channels: dict[str, int] = {}
        """Per channel (:func:`channel_key`), messages sent (source = this rank) or received."""
        self._seq: dict[str, int] = {}
        self._collectives = 0
        self.open: dict[int, dict[str, Any]] = {}
        """The point-to-point ops issued and not completed (no ring limit), by ``id``."""
        self.faults: Any = None
        """The rank's :class:`fsdp_testing.faults.FaultPlan` while faults are injected."""
        self._written = 0
        """Entries written since the last reset; entry ``i`` lives in slot ``i % capacity``."""
        self._mm: mmap.mmap | None = None
        if path is not None:
            size = _HEADER.size + capacity * _SLOT_BYTES + _COUNTS_BYTES
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.ftruncate(fd, size)
                self._mm = mmap.mmap(fd, size)
            finally:
                os.close(fd)

    def reset(self) -> None:
        """Forget the entries, numbers and counts (a new test starts)."""
        self.entries.clear()
        self.counts.clear()
        self.channels.clear()
        self._seq.clear()
        self._collectives = 0
        self.open.clear()
        self.faults = None
        self._written = 0
        if self._mm is not None:
            self._mm[: _HEADER.size] = _HEADER.pack(0, self.capacity)
            self._write_counts()

    def enter(self, call: Any) -> dict[str, Any]:
        """Log ``call`` (a :class:`~fsdp_testing._rank.comm_observer.CommCall`) as entered;
        the rank's faults fire here, before the call starts. Returns its entry (also set as
        ``call.entry``)."""
        family = call.family
        n = self.counts.get(family, 0) + 1
        entry: dict[str, Any] = {
            "op": call.op,
            "family": family,
            "n": n,
            "group": call.group_name,
            "shapes": call.shapes,
            "dtype": call.dtype,
            "bytes": call.nbytes,
            "state": "entered",
            "t": time.time(),
            "at": call.where,
        }
        key = None
        if call.p2p:
            src, dst = (call.rank, call.peer) if family == "send" else (call.peer, call.rank)
            entry.update(p2p=True, tag=call.tag, blocking=call.blocking)
            if call.peer is not None:
                entry["peer"] = call.peer
                key = channel_key(call.group_name, src, dst, call.tag)
                entry["seq"] = self.channels.get(key, 0) + 1
            if call.batch:
                entry["batch"] = call.batch
        else:
            seq = self._seq.get(call.group_name, 0) + 1
            c = self._collectives + 1
            entry.update(seq=seq, c=c, ranks=compact_ranks(call.group_ranks))
            if not call.blocking:
                entry["async"] = True
            if call.reduce_op:
                entry["reduce"] = call.reduce_op
            if call.root is not None:
                entry["root"] = call.root
        if self.faults is not None:
            # May raise (faults.fail), never return (kill, hang) or sleep (delay): the call
            # has not started, so nothing is counted until it does.
            self.faults.before(entry, self.note_fault)
        self.counts[family] = n
        if key is not None:
            self.channels[key] = entry["seq"]
        elif not call.p2p:
            self._seq[call.group_name] = entry["seq"]
            self._collectives = entry["c"]
        call.entry = entry
        self._append(entry)
        if call.p2p:
            self.open[id(entry)] = entry
        if key is not None:
            self._write_counts()
        return entry

    def note_fault(self, entry: dict[str, Any]) -> None:
        """Record an injected fault (an entry with a ``"fault"`` key, outside the numbering)."""
        self._append(entry)

    def update(self, entry: dict[str, Any], state: str) -> None:
        """``entry`` moved to ``state`` (see the class docstring)."""
        entry["state"] = state
        if state in ("completed", "raised"):
            entry["t_end"] = time.time()
            self.open.pop(id(entry), None)
        first = self._written - len(self.entries)  # the number of ``entries[0]``
        for i in range(len(self.entries) - 1, -1, -1):  # nearly always among the newest
            if self.entries[i] is entry:
                self._write_slot((first + i) % self.capacity, entry)
                return

    def snapshot(self) -> list[dict[str, Any]]:
        return [dict(e) for e in self.entries]

    def _append(self, entry: dict[str, Any]) -> None:
        slot = self._written % self.capacity
        self._written += 1
        self.entries.append(entry)
        if len(self.entries) > self.capacity:
            del self.entries[0]
        self._write_slot(slot, entry)
        if self._mm is not None:
            self._mm[: _HEADER.size] = _HEADER.pack(self._written, self.capacity)

    def _write_slot(self, slot: int, entry: dict[str, Any]) -> None:
        if self._mm is None:
            return
        data = json.dumps(entry).encode()
        room = _SLOT_BYTES - _LENGTH.size
        if len(data) > room:  # e.g. a list collective over hundreds of tensors
            shapes = [*entry.get("shapes", [])[:8], ["..."]]
            data = json.dumps({**entry, "shapes": shapes}).encode()
            data = data if len(data) <= room else json.dumps({**entry, "shapes": []}).encode()
        start = _HEADER.size + slot * _SLOT_BYTES
        self._mm[start + _LENGTH.size : start + _LENGTH.size + len(data)] = data
        self._mm[start : start + _LENGTH.size] = _LENGTH.pack(len(data))

    def _write_counts(self) -> None:
        if self._mm is None:
            return
        data = json.dumps(self.channels).encode()
        if len(data) > _COUNTS_BYTES - _LENGTH.size:
            data = b'{"overflow": 1}'  # too many channels: readers treat the counts as unknown
        start = _HEADER.size + self.capacity * _SLOT_BYTES
        self._mm[start + _LENGTH.size : start + _LENGTH.size + len(data)] = data
        self._mm[start : start + _LENGTH.size] = _LENGTH.pack(len(data))


def read_record_file(path: str) -> tuple[list[dict[str, Any]], dict[str, int] | None]:
    """Read what a :class:`FlightRecorder` in another process wrote: its entries, oldest first,
    and its message counts per channel (None: unknown)."""
    for _ in range(3):
        try:
            with open(path, "rb") as f:
                raw = f.read()
            written, capacity = _HEADER.unpack_from(raw)
            entries = []
            for i in range(max(0, written - capacity), written):
                start = _HEADER.size + (i % capacity) * _SLOT_BYTES
                (n,) = _LENGTH.unpack_from(raw, start)
                entries.append(json.loads(raw[start + _LENGTH.size : start + _LENGTH.size + n]))
            start = _HEADER.size + capacity * _SLOT_BYTES
            counts: dict[str, int] | None = {}
            if len(raw) > start:
                (n,) = _LENGTH.unpack_from(raw, start)
                if n:
                    counts = json.loads(raw[start + _LENGTH.size : start + _LENGTH.size + n])
                    if counts is not None and "overflow" in counts:
                        counts = None
            return entries, counts
        except (OSError, ValueError, struct.error):
            time.sleep(0.01)  # a torn read while the rank writes: try again
    return [], None


def is_inside(entry: dict[str, Any]) -> bool:
    """Whether the rank is (or is about to be) blocked in the logged call: inside it, waiting
    on its work, or holding the work of a call that blocks (a ``send``, a collective without
    ``async_op=True``), which it waits on next."""
    state = entry.get("state")
    if state in ("entered", "waiting"):
        return True
    if state != "issued":
        return False
    return bool(entry.get("blocking")) if entry.get("p2p") else not entry.get("async")


def call_name(entry: dict[str, Any]) -> str:
    """How every report names a logged call (see [Note: one numbering]): ``all_reduce #3``,
    ``all_gather_into_tensor #2 on group 1(size 2)``, ``isend #1 to rank 1 (tag 3)``."""
    name = f"{entry['op']} #{entry.get('n', entry.get('seq', '?'))}"
    if entry.get("p2p"):
        peer = entry.get("peer")
        way = "to" if entry.get("family") == "send" else "from"
        name += f" {way} rank {peer}" if peer is not None else f" {way} any rank"
        if entry.get("tag"):
            name += f" (tag {entry['tag']})"
    if entry.get("group", "default") != "default":
        name += f" on group {entry['group']}"
    return name
