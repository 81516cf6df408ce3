"""The collective log: a cheap per-rank record of collectives, readable while the rank is blocked
(``divergence.py`` turns the records of all ranks into "where do they diverge").

[Note: collective log]
A rank stuck in a gloo or threaded-PG collective cannot run Python code (its main thread waits
in C++ or on a condition), so the record must be readable from outside: in process mode each
update is written to a small memory-mapped file that the parent reads at a timeout; in thread
mode the parent reads the recorder object directly. Sequence numbers count per process group,
so "rank 1 never entered all_gather #12" compares like with like.

The file is a ring of fixed-size slots, one per entry, after a header that counts the entries
written since the test began: an update rewrites its own slot only. (Rewriting the whole record
as one JSON text cost about 0.3 ms a collective once it held 32 entries: more than a gloo
collective itself, on every collective of every test.)
"""

from __future__ import annotations

import functools
import json
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from fsdp_testing.collectives import COLLECTIVE_NAMES

__all__ = [
    "RECORDED_OPS",
    "FlightRecorder",
    "current_recorder",
    "install",
    "read_record_file",
    "uninstall",
]

RECORDED_OPS = COLLECTIVE_NAMES
"""Every spelling of every collective in the one table (``fsdp_testing.collectives``)."""
_SLOT_BYTES = 2048
_HEADER = struct.Struct("<II")  # entries written since the last reset, slots in the ring
_LENGTH = struct.Struct("<I")  # a slot: the length of its JSON text, then the text


class FlightRecorder:
    """The last ``capacity`` collectives of one rank, oldest first.

    Each entry: ``seq`` (per group), ``op``, ``group``, ``shapes``, ``dtype``, ``state``
    (``entered``, ``completed``, ``issued`` for async ops, ``raised``).
    """

    def __init__(self, capacity: int = 32, path: str | None = None) -> None:
        self.capacity = capacity
        self.entries: list[dict[str, Any]] = []
        self._seq: dict[str, int] = {}
        self.faults: Any = None
        """The rank's :class:`fsdp_testing.faults.FaultPlan` while faults are injected."""
        self._written = 0
        """Entries written since the last reset; entry ``i`` lives in slot ``i % capacity``."""
        self._mm: mmap.mmap | None = None
        if path is not None:
            size = _HEADER.size + capacity * _SLOT_BYTES
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.ftruncate(fd, size)
                self._mm = mmap.mmap(fd, size)
            finally:
                os.close(fd)

    def reset(self) -> None:
        """Forget the entries and sequence numbers (a new test starts)."""
        self.entries.clear()
        self._seq.clear()
        self.faults = None
        self._written = 0
        if self._mm is not None:
            self._mm[: _HEADER.size] = _HEADER.pack(0, self.capacity)

    def enter(self, op: str, group: str, shapes: list[list[int]], dtype: str | None) -> dict:
        seq = self._seq.get(group, 0) + 1
        self._seq[group] = seq
        entry = {
            "seq": seq,
            "op": op,
            "group": group,
            "shapes": shapes,
            "dtype": dtype,
            "state": "entered",
            "t": time.time(),
        }
        self._append(entry)
        return entry

    def note_fault(self, entry: dict[str, Any]) -> None:
        """Record an injected fault (an entry with a ``"fault"`` key, outside the sequence)."""
        self._append(entry)

    def finish(self, entry: dict, state: str) -> None:
        entry["state"] = state
        first = self._written - len(self.entries)  # the number of ``entries[0]``
        for i in range(len(self.entries) - 1, -1, -1):  # nearly always the newest
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


def read_record_file(path: str) -> list[dict[str, Any]]:
    """Read a record written by a :class:`FlightRecorder` in another process, oldest first."""
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
            return entries
        except (OSError, ValueError, struct.error):
            time.sleep(0.01)  # a torn read while the rank writes: try again
    return []


# --- wrapping torch.distributed ------------------------------------------------------------

_installed: dict[str, Callable[..., Any]] = {}
_lookup: Callable[[], FlightRecorder | None] = lambda: None  # noqa: E731
_install_lock = threading.Lock()


def _describe_args(args: tuple, kwargs: dict) -> tuple[str, list[list[int]], str | None]:
    import torch
    import torch.distributed as dist

    group = kwargs.get("group")
    shapes: list[list[int]] = []
    dtype: str | None = None

    def visit(value: Any) -> None:
        nonlocal group, dtype
        if isinstance(value, torch.Tensor):
            shapes.append(list(value.shape))
            dtype = dtype or str(value.dtype).replace("torch.", "")
        elif isinstance(value, (list, tuple)) and len(value) <= 64:
            for v in value:
                visit(v)
        elif group is None and isinstance(value, dist.ProcessGroup):
            group = value

    for a in args:
        visit(a)
    for k, v in kwargs.items():
        if k != "group":
            visit(v)
    if group is None or group is dist.GroupMember.WORLD:
        name = "default"
    else:
        name = f"{getattr(group, 'group_name', '') or hex(id(group))}(size {group.size()})"
    return name, shapes, dtype


def _wrap(op: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def recorded(*args: Any, **kwargs: Any) -> Any:
        rec = _lookup()
        if rec is None:
            return fn(*args, **kwargs)
        if rec.faults is not None:
            rec.faults.before(op, rec.note_fault)
        group, shapes, dtype = _describe_args(args, kwargs)
        entry = rec.enter(op, group, shapes, dtype)
        try:
            out = fn(*args, **kwargs)
        except BaseException:
            rec.finish(entry, "raised")
            raise
        rec.finish(entry, "issued" if kwargs.get("async_op") else "completed")
        return out

    recorded.__wrapped_collective__ = fn  # type: ignore[attr-defined]
    return recorded


def current_recorder() -> FlightRecorder | None:
    """The calling rank's recorder, or None outside a distributed test."""
    return _lookup()


def install(lookup: Callable[[], FlightRecorder | None]) -> None:
    """Wrap the collectives of ``torch.distributed`` so each call is recorded on the recorder
    that ``lookup()`` returns for the calling rank (None: not recorded)."""
    global _lookup
    import torch.distributed as dist

    with _install_lock:
        _lookup = lookup
        for op in RECORDED_OPS:
            fn = getattr(dist, op, None)
            if fn is None or op in _installed:
                continue
            _installed[op] = fn
            setattr(dist, op, _wrap(op, fn))


def uninstall() -> None:
    """Restore the collectives that :func:`install` wrapped."""
    global _lookup
    import torch.distributed as dist

    with _install_lock:
        for op, fn in _installed.items():
            setattr(dist, op, fn)
        _installed.clear()
        _lookup = lambda: None  # noqa: E731
