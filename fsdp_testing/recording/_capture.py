"""How records are captured: wrappers around the ``torch.distributed`` collectives and the
engine's unit transitions (through :func:`fsdp_testing.patching.patched`), forward hooks on the
sharded modules, and the events of an engine that publishes them (``fsdp_core``), through the
engine's probe.

See [Note: what is exact and what is inferred] in :mod:`._probes`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ..engines import FSDPEngine, clean_param_name
from ..patching import called_name, collective_targets, normalized_collective, patched
from ._probes import UnitNames
from ._records import (
    CollectiveRecord,
    ForwardRecord,
    OffloadRecord,
    PostBackwardRecord,
    ReshardRecord,
    UnshardRecord,
    now_us,
)

__all__ = ["Capture"]

#: Collective families recorded with their (output, input) calls normalized; ``all_reduce`` is
#: recorded as called.
_NORMALIZED_FAMILIES = ("all_gather", "reduce_scatter")


@dataclasses.dataclass(eq=False)
class _Span:
    """A unit transition (or post-backward) running on this rank."""

    kind: str
    unit: Any
    start: float
    before: bool | None  # whether the unit was unsharded on entry (None: the probe cannot tell)
    reason: str
    event: Any = None  # fsdp_core: the Unshard/Reshard event published inside the call


class Capture:
    """Turns, while installed, the calling rank's collectives, unit transitions, sharded
    forwards and (``fsdp_core``) events into records.

    Args:
        add: appends a record (``add(cls, **fields)``).
        rank: the recording rank; events of other (thread) ranks are ignored.
        engine: the engine whose transitions are wrapped.
        names: the FQNs of the recorded model's modules.
    """

    def __init__(
        self,
        add: Callable[..., None],
        *,
        rank: int,
        engine: FSDPEngine,
        names: UnitNames,
    ) -> None:
        self._add = add
        self._rank = rank
        self._engine = engine
        self._names = names
        self._probe = engine.probe()
        self._spans: list[_Span] = []
        self._pending: Any = None  # the last fsdp_core Collective event, until its call runs

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
        for family in _NORMALIZED_FAMILIES:
            present = collective_targets(family)
            if present:
                wrapper = normalized_collective(self._collective(family, nexts), family)
                nexts[family] = stack.enter_context(patched(present, wrapper, barrier=False))
        nexts["all_reduce"] = stack.enter_context(
            patched(
                collective_targets("all_reduce"),
                self._collective("all_reduce", nexts),
                barrier=False,
            )
        )
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

    def _collective(self, op: str, nexts: dict[str, Callable[..., Any]]) -> Callable[..., Any]:
        def record(*args: Any, **kwargs: Any) -> Any:
            name = called_name(op) if op != "all_reduce" else op
            tensors = [a for a in args[:2] if isinstance(a, torch.Tensor)]
            if op == "all_reduce":
                main = args[0] if args else kwargs.get("tensor")
                tensors = [main] if isinstance(main, torch.Tensor) else []
            start = now_us()
            try:
                return nexts[op](*args, **kwargs)
            finally:
                self._add_collective(name, op, tensors, kwargs, start, now_us())

        return record

    def _add_collective(
        self,
        name: str,
        family: str,
        tensors: list[torch.Tensor],
        kwargs: dict[str, Any],
        start: float,
        end: float,
    ) -> None:
        if not tensors:
            return
        pending, self._pending = self._pending, None
        if pending is not None and pending.op == name:
            unit = pending.unit
        else:
            span = self._spans[-1] if self._spans else None
            unit = (
                self._names.unit(span.unit, self._probe)
                if span is not None and not self._probe.exact
                else ""
            )
        sized = tensors[1] if family == "reduce_scatter" else tensors[0]
        group = kwargs.get("group")
        initialized = dist.is_initialized()
        self._add(
            CollectiveRecord,
            unit=unit,
            op=name,
            shapes=tuple(tuple(t.shape) for t in tensors),
            dtype=str(tensors[-1].dtype).removeprefix("torch."),
            group_size=dist.get_world_size(group) if initialized else 1,
            group_ranks=_group_ranks(group) if initialized else (),
            bytes=sized.numel() * sized.element_size(),
            async_op=bool(kwargs.get("async_op", False)),
            ts_us=start,
            dur_us=end - start,
        )

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


def _group_ranks(group: Any) -> tuple[int, ...]:
    """Global ranks of ``group`` (``None``: the default group), or ``()`` if unknown."""
    try:
        return tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
    except (KeyError, ValueError, RuntimeError, TypeError):  # e.g. a group of another world
        return ()
