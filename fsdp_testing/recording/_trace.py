"""Chrome/Perfetto trace-event JSON from records: one process per rank, one track per kind of
record."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ._records import (
    CollectiveRecord,
    ForwardRecord,
    OffloadRecord,
    PostBackwardRecord,
    Record,
    ReshardRecord,
    UnshardRecord,
)

__all__ = ["chrome_trace", "write_chrome_trace"]

_TRACKS = {
    UnshardRecord: (1, "unit transitions"),
    ReshardRecord: (1, "unit transitions"),
    PostBackwardRecord: (1, "unit transitions"),
    CollectiveRecord: (2, "collectives"),
    OffloadRecord: (3, "offload copies"),
    ForwardRecord: (4, "forwards"),
}


def chrome_trace(records: Iterable[Record]) -> dict[str, Any]:
    """The Chrome trace-event JSON object (``{"traceEvents": [...]}``) for ``records``."""
    events: list[dict[str, Any]] = []
    ranks: set[int] = set()
    for record in records:
        tid, _ = _TRACKS.get(type(record), (5, "other"))
        ranks.add(record.rank)
        args = {
            f.name: getattr(record, f.name)
            for f in dataclasses.fields(record)
            if f.name not in ("ts_us", "dur_us", "rank")
        }
        name = _trace_name(record)
        event: dict[str, Any] = {
            "name": name,
            "cat": type(record).__name__.removesuffix("Record").lower(),
            "pid": record.rank,
            "tid": tid,
            "ts": record.ts_us,
            "args": args,
        }
        if record.dur_us is None:
            event.update(ph="i", s="t")
        else:
            event.update(ph="X", dur=max(record.dur_us, 0.001))
        events.append(event)
    for rank in sorted(ranks):
        events.append(_metadata("process_name", rank, 0, f"rank {rank}"))
        events.append(_metadata("process_sort_index", rank, 0, rank, key="sort_index"))
        for tid, label in set(_TRACKS.values()):
            events.append(_metadata("thread_name", rank, tid, label))
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _metadata(name: str, pid: int, tid: int, value: Any, key: str = "name") -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": {key: value}}


def _trace_name(record: Record) -> str:
    unit = record.unit or "<root>"
    if isinstance(record, CollectiveRecord):
        return f"{record.op} {unit}" if record.unit else record.op
    if isinstance(record, ReshardRecord):
        return f"reshard {unit} ({record.reason})"
    if isinstance(record, UnshardRecord):
        return f"unshard {unit} ({record.reason})"
    if isinstance(record, OffloadRecord):
        return f"offload {unit} {record.direction}"
    if isinstance(record, PostBackwardRecord):
        return f"post_backward {unit}"
    return f"forward {unit}"


def write_chrome_trace(
    records: list[Record], path: str | os.PathLike[str], *, all_ranks: bool = False
) -> Path:
    """Writes :func:`chrome_trace` of ``records`` to ``path`` (see
    :meth:`FSDPRecorder.export_chrome_trace`); with ``all_ranks``, a collective: every rank's
    records are gathered and rank 0 writes them all."""
    target = Path(path)
    if all_ranks and dist.is_available() and dist.is_initialized():
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, records)
        if dist.get_rank() != 0:
            return target
        records = [r for part in gathered for r in part]
    target.write_text(json.dumps(chrome_trace(records), indent=1))
    return target
