"""How records are captured: every call that reaches a process group, collective or point to
point, as the harness observes it (``fsdp_testing/_rank/comm_observer.py``: no
``torch.distributed`` function is replaced), wrappers around the engine's unit transitions
(through :func:`fsdp_testing.patching.patched`), forward hooks on the sharded modules, and the
events of an engine that publishes them (``fsdp_core``), through the engine's probe.

See [Note: what is exact and what is inferred] in :mod:`._probes`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import torch.nn as nn

from .._rank import comm_observer
from ..engines import FSDPEngine, clean_param_name
from ..patching import patched
from ._phases import MeshDims, PhaseTracker
from ._probes import UnitNames
from ._records import (
    CollectiveRecord,
    ForwardRecord,
    OffloadRecord,
    P2PRecord,
    PostBackwardRecord,
    ReshardRecord,
    UnshardRecord,
    now_us,
)

__all__ = ["Capture"]


@dataclasses.dataclass(eq=False)
class _Span:
    """A unit transition (or post-backward) running on this rank."""

    kind: str
    unit: Any
    start: float
    before: bool | None  # whether the unit was unsharded on entry (None: the probe cannot tell)
    reason: str
    event: Any = None  # fsdp_core: the Unshard/Reshard event published inside the call


class Capture(comm_observer.Listener):
    """Turns, while installed, the calling rank's collectives, unit transitions, sharded
    forwards and (``fsdp_core``) events into records.

    Args:
        add: appends a record (``add(cls, **fields)``), returns its index.
        amend: fills in fields of the record at an index (``amend(index, **fields)``).
        rank: the recording rank; events of other (thread) ranks are ignored.
        engine: the engine whose transitions are wrapped.
        names: the FQNs of the recorded model's modules.
    """

    def __init__(
        self,
        add: Callable[..., int],
        amend: Callable[..., None],
        *,
        rank: int,
        engine: FSDPEngine,
        names: UnitNames,
    ) -> None:
        self._add = add
        self._amend = amend
        self._rank = rank
        self._engine = engine
        self._names = names
        self._probe = engine.probe()
        self._spans: list[_Span] = []
        self._pending: Any = None  # the last fsdp_core Collective event, until its call runs
        self._starts: dict[int, tuple[float, str]] = {}  # id(call) -> when it started, phase
        self.phases = PhaseTracker()
        self.mesh = MeshDims(None)
        self.muted = False
        """While True, calls are not recorded (the recorder's own barriers)."""
        self._issued: dict[int, int] = {}  # id(call) -> index of its record, until it completes

    def install(self, stack: contextlib.ExitStack, model: nn.Module | None) -> None:
        """Installs every wrapper, hook and subscription on ``stack`` (closing it removes them).

        Args:
            stack: owns what is installed.
            model: the root module, to name units and record forwards; None records neither.
        """
        if model is not None:
            self._names.add_model(model)
            self._init_forward_hooks(model, stack)
        nexts: dict[str, Callable[..., Any]] = {}
        if not comm_observer.installed():  # outside the harness's ranks (torch's own harness)
            comm_observer.install(None)
            stack.callback(comm_observer.uninstall)
        else:
            comm_observer.install(None)  # a process group class the test defined since
        comm_observer.add_listener(self)
        stack.callback(comm_observer.remove_listener, self)
        self.phases.install(stack)
        for kind in ("unshard", "reshard", "post_backward"):
            target = self._engine.patch_target(kind)
            nexts[kind] = stack.enter_context(
                patched(target, self._transition(kind, nexts), barrier=False)
            )
        stack.enter_context(self._probe.subscribe(self._on_event))

    def _init_forward_hooks(self, model: nn.Module, stack: contextlib.ExitStack) -> None:
        for name, module in model.named_modules():
            if not self._engine.is_wrapped(module):
                continue
            fqn = clean_param_name(name)

            def hook(module: nn.Module, args: Any, output: Any, fqn: str = fqn) -> None:
                self._add(ForwardRecord, unit=fqn, ts_us=now_us())

            stack.callback(module.register_forward_hook(hook).remove)

    def _on_event(self, event: Any) -> None:
        if getattr(event, "rank", self._rank) != self._rank:
            return  # another thread rank's event
        kind = type(event).__name__
        if kind == "Collective":
            self._pending = event
        elif kind in ("Unshard", "Reshard"):
            span = next((s for s in reversed(self._spans) if s.kind == kind.lower()), None)
            if span is not None and span.event is None:
                span.event = event
            else:
                self._add_transition(kind.lower(), event, now_us(), None)
        elif kind == "OffloadCopy":
            self._add(
                OffloadRecord,
                unit=event.unit,
                direction=event.direction,
                bytes=event.bytes,
                ts_us=now_us(),
            )

    def _add_transition(self, kind: str, event: Any, start: float, end: float | None) -> None:
        self._add(
            UnshardRecord if kind == "unshard" else ReshardRecord,
            unit=event.unit,
            reason=event.reason,
            devices=tuple(event.devices),
            ts_us=start,
            dur_us=None if end is None else end - start,
        )

    # --- calls that reach a process group (comm_observer.Listener) ----------------------------

    def started(self, call: comm_observer.CommCall) -> None:
        if call.rank == self._rank and not self.muted:
            self._starts[id(call)] = (now_us(), self.phases.phase())

    def ended(self, call: comm_observer.CommCall, state: str) -> None:
        started = self._starts.get(id(call))
        if started is None:
            return  # another rank's call, or one started before the block
        start, phase = started
        end = now_us()
        index = self._issued.pop(id(call), None)
        if index is not None:  # an async call issued earlier completed now
            if call.p2p and state == "completed":
                self._amend(index, completed_us=end)
            del self._starts[id(call)]
            return
        if state == "issued" and call.blocking:
            return  # the rank waits on it next: recorded once it completed
        if state == "issued":
            self._issued[id(call)] = self._record(call, start, end, phase, completed=False)
        else:
            del self._starts[id(call)]
            self._record(call, start, end, phase, completed=state == "completed")

    def _record(
        self, call: comm_observer.CommCall, start: float, end: float, phase: str, completed: bool
    ) -> int:
        mesh_dims = self.mesh.of(call.group_ranks)
        if call.p2p:
            tensor = call.outputs[0] if call.outputs else None
            return self._add(
                P2PRecord,
                unit="",
                op=call.op,
                kind=call.family,
                peer=call.peer,
                tag=call.tag,
                shape=tuple(tensor.shape) if tensor is not None else (),
                dtype=call.dtype or "",
                bytes=call.nbytes,
                blocking=call.blocking,
                group_ranks=call.group_ranks,
                batch=call.batch,
                completed_us=end if completed else None,
                phase=phase,
                mesh_dims=mesh_dims,
                ts_us=start,
                dur_us=end - start,
            )
        return self._add(
            CollectiveRecord,
            unit=self._unit_of(call.op),
            op=call.op,
            shapes=tuple(tuple(s) for s in call.shapes),
            dtype=call.dtype or "",
            group_size=len(call.group_ranks),
            group_ranks=call.group_ranks,
            bytes=call.nbytes,
            async_op=not call.blocking,
            reduce_op=call.reduce_op,
            root=call.root,
            phase=phase,
            mesh_dims=mesh_dims,
            ts_us=start,
            dur_us=end - start,
        )

    def _unit_of(self, name: str) -> str:
        """The unit a collective is for: from the engine's event just before it (fsdp_core),
        else the transition running around it."""
        pending, self._pending = self._pending, None
        if pending is not None and pending.op == name:
            return str(pending.unit)
        span = self._spans[-1] if self._spans else None
        if span is not None and not self._probe.exact:
            return str(self._names.unit(span.unit, self._probe))
        return ""

    def _transition(self, kind: str, nexts: dict[str, Callable[..., Any]]) -> Callable[..., Any]:
        probe = self._probe

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            unit = probe.unit(args)
            reason = "" if probe.exact or kind == "post_backward" else probe.reason(kind, args)
            before = None if probe.exact else probe.unsharded(unit)
            span = _Span(kind, unit, now_us(), before, reason)
            self._spans.append(span)
            try:
                return nexts[kind](*args, **kwargs)
            finally:
                self._spans[:] = [s for s in self._spans if s is not span]
                self._finish(span, now_us())

        return wrapper

    def _finish(self, span: _Span, end: float) -> None:
        if span.kind == "post_backward":
            self._add(
                PostBackwardRecord,
                unit=self._names.unit(span.unit, self._probe),
                ts_us=span.start,
                dur_us=end - span.start,
            )
            return
        if self._probe.exact:
            if span.event is not None:
                self._add_transition(span.kind, span.event, span.start, end)
            return
        after = self._probe.unsharded(span.unit)
        if span.before is not None and after is not None:
            moved = (not span.before and after) if span.kind == "unshard" else span.before
            if not moved or (span.kind == "reshard" and after):
                return
        sharded = span.kind == "reshard"
        self._add(
            UnshardRecord if span.kind == "unshard" else ReshardRecord,
            unit=self._names.unit(span.unit, self._probe),
            reason=span.reason,
            devices=self._probe.devices(span.unit, sharded=sharded) if span.unit else (),
            offload=self._probe.offload(span.unit) if span.unit else None,
            inferred=True,
            ts_us=span.start,
            dur_us=end - span.start,
        )
