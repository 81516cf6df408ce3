"""Record what an FSDP engine does on each rank, assert on it in one line, export a trace.

::

    with record_fsdp(model) as rec:
        model(x).sum().backward()
    rec.assert_count("all_gather", 6)
    rec.assert_prefetch_order(["1", "0"])            # backward prefetch, by unit FQN
    rec.export_chrome_trace(tmp_path / "trace.json")  # open in https://ui.perfetto.dev

Each rank records its own calls (thread ranks included: every record carries its rank, and a
recorder only keeps its own rank's). Records are frozen dataclasses: :class:`CollectiveRecord`,
:class:`UnshardRecord`, :class:`ReshardRecord`, :class:`PostBackwardRecord`,
:class:`ForwardRecord` and :class:`OffloadRecord`.

What is exact and what is inferred, per engine: see [Note: what is exact and what is inferred]
in :mod:`fsdp_testing.recording._probes`. What the recorder asks an engine (which unit a call is
about, whether it is unsharded, which events it publishes) is the engine's own probe
(``engine.probe()``), defined in the engine's module.

The package, by role: ``_records`` (the record types and the log of one rank's records),
``_probes`` (naming units by FQN), ``_capture`` (wrapping collectives and transitions,
subscribing to the engine's events),
``_assertions`` (the ``assert_*`` methods), ``_trace`` (Chrome/Perfetto export) and
``_recorder`` (:class:`FSDPRecorder` itself).
"""

from ._recorder import FSDPRecorder, record_comms, record_fsdp
from ._records import (
    CollectiveRecord,
    ForwardRecord,
    OffloadRecord,
    P2PRecord,
    PostBackwardRecord,
    Record,
    ReshardRecord,
    UnshardRecord,
    now_us,
)
from ._trace import chrome_trace

__all__ = [
    "CollectiveRecord",
    "FSDPRecorder",
    "ForwardRecord",
    "OffloadRecord",
    "P2PRecord",
    "PostBackwardRecord",
    "Record",
    "ReshardRecord",
    "UnshardRecord",
    "chrome_trace",
    "now_us",
    "record_comms",
    "record_fsdp",
]
