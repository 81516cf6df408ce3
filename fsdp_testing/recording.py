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

[Note: what is exact and what is inferred]
Timing comes from wrapping, through :func:`fsdp_testing.patching.patched`, the engine's unit
transitions (``engine.patch_target``) and the ``torch.distributed`` collectives: ``ts_us`` and
``dur_us`` are host wall-clock times of the call (for ``async_op=True`` the launch only).

- ``fsdp_core`` publishes events (:mod:`fsdp_core.events`): unit names, unshard/reshard reasons,
  parameter devices, collective attribution and offload copies are the engine's own, exact.
- torch's FSDP1 and FSDP2 publish nothing. An unshard (reshard) is recorded when a call of the
  engine's transition moved the unit from sharded to unsharded (back); the state is read from
  the engine's objects before and after the call (FSDP1: whether the handle's unsharded flat
  parameter is allocated; FSDP2: the group's sharded state and pending all-gather), so *whether*
  it happened is exact. The *reason* is inferred from the engine function that called the
  transition (FSDP1 ``_pre_forward_unshard``/``_pre_backward_hook``/``_prefetch_handle``, FSDP2
  ``pre_forward``/``pre_backward``/``_prefetch_unshard``, ...; a caller not in that table gives
  ``"explicit"``) and such records have ``inferred=True``. Devices are those of the engine's
  buffers (unsharded: the compute device; sharded: the local shard's). A collective is
  attributed to the unit whose transition is running, or ``""``. Unit names are FQNs when the
  recorder is given the model (FSDP2 knows its FQNs anyway; FSDP1 otherwise gets
  ``ClassName@id``).
- FSDP1 binds its post-backward hook at a model's first forward, so its post-backward spans (and
  the unit of its reduce-scatters) are only seen when that forward ran inside a recorder or a
  patch of the post-backward target; its ``summon_full_params`` imports ``_unshard`` by name and
  is not seen at all.
- ``fsdp_core``'s first iteration also issues one small all-reduce per unit collective to check
  that ranks agree on the order; it is recorded like any other collective (``unit=""``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.distributed.fsdp
import torch.nn as nn

from .engines import FSDPEngine, PatchTarget, current_engine, engine_for, get_engine
from .patching import (
    _COLLECTIVE_FAMILIES,
    _collective_targets,
    _normalized,
    called_name,
    patched,
)

__all__ = [
    "CollectiveRecord",
    "FSDPRecorder",
    "ForwardRecord",
    "OffloadRecord",
    "PostBackwardRecord",
    "Record",
    "ReshardRecord",
    "UnshardRecord",
    "chrome_trace",
    "record_fsdp",
]

_WRAPPER_NAMES = {"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"}
_FSDP_DIR = os.path.dirname(os.path.abspath(torch.distributed.fsdp.__file__))


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
    input, all-reduce tensor); ``shapes``: the tensors in call order (output first)."""

    op: str
    shapes: tuple[tuple[int, ...], ...]
    dtype: str
    group_size: int
    bytes: int
    async_op: bool = False


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


def _clean(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_NAMES)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else -1


def _now_us() -> float:
    return time.perf_counter_ns() / 1000.0


def _resolve(engine: str | FSDPEngine | None, model: nn.Module | None) -> FSDPEngine:
    if isinstance(engine, str):
        return get_engine(engine)
    if engine is not None:
        return engine
    found = engine_for(model) if model is not None else None
    return found if found is not None else current_engine()


# -- engine probes: how to read a unit's state from torch's objects ----------------------------
# See [Note: what is exact and what is inferred].


def _fsdp_caller(depth: int = 40) -> FrameType | None:
    """The nearest frame that belongs to torch's FSDP packages."""
    frame: FrameType | None = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return None
        if frame.f_code.co_filename.startswith(_FSDP_DIR):
            return frame
        frame = frame.f_back
    return None


def _infer_reason(kind: str, table: dict[str, str], prefetch_local: str) -> str:
    frame = _fsdp_caller()
    if frame is None:
        return "explicit"
    name = frame.f_code.co_name
    if kind == "unshard" and prefetch_local and name in ("_prefetch_handle", "_prefetch_unshard"):
        mode = frame.f_locals.get(prefetch_local)
        mode_name = str(getattr(mode, "name", mode)).lower()
        return "forward_prefetch" if mode_name == "forward" else "backward_prefetch"
    return table.get(name, "explicit")


class _Probe:
    """Default: an engine we know nothing about; every call counts, reason "explicit"."""

    exact = False

    def unit(self, args: tuple[Any, ...]) -> Any:
        return args[0] if args else None

    def unsharded(self, unit: Any) -> bool | None:
        return None

    def devices(self, unit: Any, *, sharded: bool) -> tuple[str, ...]:
        return ()

    def offload(self, unit: Any) -> bool | None:
        return None

    def modules(self, unit: Any) -> tuple[nn.Module, ...]:
        return ()

    def fallback_name(self, unit: Any) -> str:
        return f"{type(unit).__name__}@{id(unit):x}"

    def reason(self, kind: str) -> str:
        return "explicit"


class _FSDP1Probe(_Probe):
    _UNSHARD: ClassVar[dict[str, str]] = {
        "_pre_forward_unshard": "forward",
        "_pre_backward_hook": "backward",
    }
    _RESHARD: ClassVar[dict[str, str]] = {
        "_post_forward_reshard": "forward",
        "_post_backward_reshard": "backward",
        "_catch_all_reshard": "backward",
    }

    def unit(self, args: tuple[Any, ...]) -> Any:
        return args[1] if len(args) > 1 else None  # (state, handle, ...)

    def unsharded(self, handle: Any) -> bool | None:
        if handle is None or not handle.uses_sharded_strategy:
            return False
        return not handle.needs_unshard()

    def devices(self, handle: Any, *, sharded: bool) -> tuple[str, ...]:
        flat = handle.flat_param
        tensor = flat._local_shard if sharded else flat
        return (str(tensor.device),) * int(getattr(flat, "_num_params", 1))

    def offload(self, handle: Any) -> bool | None:
        return bool(getattr(handle, "_offload_params", False))

    def modules(self, handle: Any) -> tuple[nn.Module, ...]:
        module = getattr(handle, "_fully_sharded_module", None)
        return (module,) if module is not None else ()

    def reason(self, kind: str) -> str:
        table = self._UNSHARD if kind == "unshard" else self._RESHARD
        return _infer_reason(kind, table, "prefetch_mode")


class _FSDP2Probe(_Probe):
    _UNSHARD: ClassVar[dict[str, str]] = {"pre_forward": "forward", "pre_backward": "backward"}
    _RESHARD: ClassVar[dict[str, str]] = {"post_forward": "forward", "post_backward": "backward"}

    def unsharded(self, group: Any) -> bool | None:
        return bool(group.is_unsharded or group._all_gather_result is not None)

    def devices(self, group: Any, *, sharded: bool) -> tuple[str, ...]:
        if not sharded:
            return (str(group.device),) * len(group.fsdp_params)
        return tuple(
            str(getattr(fp, "_sharded_param_data", fp.sharded_param).device)
            for fp in group.fsdp_params
        )

    def offload(self, group: Any) -> bool | None:
        return any(getattr(fp, "offload_to_cpu", False) for fp in group.fsdp_params)

    def modules(self, group: Any) -> tuple[nn.Module, ...]:
        return tuple(getattr(group, "modules", ()))

    def fallback_name(self, group: Any) -> str:
        return str(getattr(group, "_module_fqn", "") or super().fallback_name(group))

    def reason(self, kind: str) -> str:
        table = self._UNSHARD if kind == "unshard" else self._RESHARD
        return _infer_reason(kind, table, "pass_type")


class _CoreProbe(_Probe):
    exact = True

    def fallback_name(self, unit: Any) -> str:
        return str(getattr(unit, "name", "")) or super().fallback_name(unit)


_PROBES: dict[str, type[_Probe]] = {
    "fsdp_core": _CoreProbe,
    "torch_fsdp1": _FSDP1Probe,
    "torch_fsdp2": _FSDP2Probe,
}


# -- the recorder --------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class _Span:
    kind: str
    unit: Any
    start: float
    before: bool | None
    reason: str
    event: Any = None


class FSDPRecorder:
    """Records, for the calling rank, every collective and unit transition inside the block.

    Use :func:`record_fsdp`. Every rank of the default group must enter and leave the block
    together (barriers, as for the patch helpers), unless ``barrier=False``.

    Args:
        model: the root module; when given, units are named by FQN for every engine and the
            sharded modules' forwards are recorded (for :meth:`assert_graph_order`).
        engine: the engine or its name (default: the one that sharded ``model``, else the
            current engine).
        barrier: synchronize the ranks on entry and exit (default True).
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        *,
        engine: str | FSDPEngine | None = None,
        barrier: bool = True,
    ) -> None:
        self.model = model
        self.engine = _resolve(engine, model)
        self.rank = _rank()
        self.records: list[Record] = []
        self._step = 0
        self._barrier = barrier
        self._probe = _PROBES.get(self.engine.name, _Probe)()
        self._spans: list[_Span] = []
        self._pending: Any = None  # the last fsdp_core Collective event, until its call runs
        self._names: dict[int, str] = {}
        self._stack: contextlib.ExitStack | None = None
        self._lock = threading.Lock()

    # -- lifecycle --------------------------------------------------------------------------------

    def __enter__(self) -> FSDPRecorder:
        self.rank = _rank()
        stack = contextlib.ExitStack()
        try:
            if self.model is not None:
                self._init_names(self.model)
                self._init_forward_hooks(self.model, stack)
            nexts: dict[str, Callable[..., Any]] = {}
            for family in _COLLECTIVE_FAMILIES:
                present = _collective_targets(family)
                if present:
                    wrapper = _normalized(self._collective(family, nexts), family)
                    nexts[family] = stack.enter_context(patched(present, wrapper, barrier=False))
            nexts["all_reduce"] = stack.enter_context(
                patched(
                    PatchTarget(dist, "all_reduce"),
                    self._collective("all_reduce", nexts),
                    barrier=False,
                )
            )
            for kind in ("unshard", "reshard", "post_backward"):
                target = self.engine.patch_target(kind)
                nexts[kind] = stack.enter_context(
                    patched(target, self._transition(kind, nexts), barrier=False)
                )
            if self.engine.name == "fsdp_core":
                from fsdp_core import events

                stack.enter_context(events.subscribe(self._on_event))
            if self._barrier and dist.is_available() and dist.is_initialized():
                dist.barrier()
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        stack, self._stack = self._stack, None
        try:
            if self._barrier and exc is None and dist.is_available() and dist.is_initialized():
                dist.barrier()
        finally:
            if stack is not None:
                stack.close()

    def next_step(self) -> None:
        """Starts a new step: later records get ``step`` one higher."""
        self._step += 1

    # -- naming -----------------------------------------------------------------------------------

    def _init_names(self, model: nn.Module) -> None:
        for name, module in model.named_modules():
            self._names.setdefault(id(module), _clean(name))

    def _module_name(self, module: nn.Module) -> str:
        name = self._names.get(id(module))
        if name is None:
            raise ValueError(
                f"FSDPRecorder: {type(module).__name__} is not a submodule of the recorded "
                "model; pass the model to record_fsdp(model) and modules from it"
            )
        return name

    def _unit_name(self, unit: Any) -> str:
        for module in self._probe.modules(unit):
            name = self._names.get(id(module))
            if name is not None:
                return name
        return self._probe.fallback_name(unit)

    def _init_forward_hooks(self, model: nn.Module, stack: contextlib.ExitStack) -> None:
        for name, module in model.named_modules():
            if not self.engine.is_wrapped(module):
                continue
            fqn = _clean(name)

            def hook(module: nn.Module, args: Any, output: Any, fqn: str = fqn) -> None:
                self._add(ForwardRecord, unit=fqn, ts_us=_now_us())

            stack.callback(module.register_forward_hook(hook).remove)

    # -- recording --------------------------------------------------------------------------------

    def _add(self, cls: type[Record], **fields: Any) -> None:
        with self._lock:
            fields.setdefault("rank", self.rank)
            self.records.append(cls(seq=len(self.records), step=self._step, **fields))

    def _on_event(self, event: Any) -> None:
        if getattr(event, "rank", self.rank) != self.rank:
            return  # another thread rank's event
        kind = type(event).__name__
        if kind == "Collective":
            self._pending = event
        elif kind in ("Unshard", "Reshard"):
            span = next((s for s in reversed(self._spans) if s.kind == kind.lower()), None)
            if span is not None and span.event is None:
                span.event = event
            else:
                self._add_transition(kind.lower(), event, _now_us(), None)
        elif kind == "OffloadCopy":
            self._add(
                OffloadRecord,
                unit=event.unit,
                direction=event.direction,
                bytes=event.bytes,
                ts_us=_now_us(),
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
            start = _now_us()
            try:
                return nexts[op](*args, **kwargs)
            finally:
                self._add_collective(name, op, tensors, kwargs, start, _now_us())

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
            unit = self._unit_name(span.unit) if span is not None and not self._probe.exact else ""
        sized = tensors[1] if family == "reduce_scatter" else tensors[0]
        group = kwargs.get("group")
        self._add(
            CollectiveRecord,
            unit=unit,
            op=name,
            shapes=tuple(tuple(t.shape) for t in tensors),
            dtype=str(tensors[-1].dtype).removeprefix("torch."),
            group_size=dist.get_world_size(group) if dist.is_initialized() else 1,
            bytes=sized.numel() * sized.element_size(),
            async_op=bool(kwargs.get("async_op", False)),
            ts_us=start,
            dur_us=end - start,
        )

    def _transition(self, kind: str, nexts: dict[str, Callable[..., Any]]) -> Callable[..., Any]:
        probe = self._probe

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            unit = probe.unit(args)
            reason = "" if probe.exact or kind == "post_backward" else probe.reason(kind)
            before = None if probe.exact else probe.unsharded(unit)
            span = _Span(kind, unit, _now_us(), before, reason)
            self._spans.append(span)
            try:
                return nexts[kind](*args, **kwargs)
            finally:
                self._spans[:] = [s for s in self._spans if s is not span]
                self._finish(span, _now_us())

        return wrapper

    def _finish(self, span: _Span, end: float) -> None:
        if span.kind == "post_backward":
            self._add(
                PostBackwardRecord,
                unit=self._unit_name(span.unit),
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
            unit=self._unit_name(span.unit),
            reason=span.reason,
            devices=self._probe.devices(span.unit, sharded=sharded) if span.unit else (),
            offload=self._probe.offload(span.unit) if span.unit else None,
            inferred=True,
            ts_us=span.start,
            dur_us=end - span.start,
        )

    # -- queries ----------------------------------------------------------------------------------

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
        self, op: str | None = None, *, step: int | None = None, unit: str | None = None
    ) -> list[CollectiveRecord]:
        """Collective records; ``op`` is a torch name (``"all_gather_single"``) or a family
        that covers both spellings (``"all_gather"``, ``"reduce_scatter"``)."""
        names = _op_names(op)
        return [
            r
            for r in self.select(CollectiveRecord, step=step, unit=unit)
            if names is None or r.op in names
        ]

    def count(self, op: str, *, step: int | None = None, unit: str | None = None) -> int:
        """Number of calls of collective ``op`` (a name or a family, see :meth:`collectives`)."""
        return len(self.collectives(op, step=step, unit=unit))

    def unshards(
        self, reason: str | Iterable[str] | None = None, *, step: int | None = None
    ) -> list[UnshardRecord]:
        """Unshard records, optionally only those with ``reason`` (one or several)."""
        reasons = {reason} if isinstance(reason, str) else None if reason is None else set(reason)
        return [
            r
            for r in self.select(UnshardRecord, step=step)
            if not isinstance(r, ReshardRecord) and (reasons is None or r.reason in reasons)
        ]

    def reshards(
        self, reason: str | Iterable[str] | None = None, *, step: int | None = None
    ) -> list[ReshardRecord]:
        """Reshard records, optionally only those with ``reason``."""
        reasons = {reason} if isinstance(reason, str) else None if reason is None else set(reason)
        return [
            r
            for r in self.select(ReshardRecord, step=step)
            if reasons is None or r.reason in reasons
        ]

    def unshard_order(
        self, reason: str | Iterable[str] | None = None, *, step: int | None = None
    ) -> list[str]:
        """The units in the order they were unsharded (for ``reason``, in ``step``)."""
        return [r.unit for r in self.unshards(reason, step=step)]

    def graph_order(self, *, step: int | None = None) -> list[str]:
        """Sharded modules in the order their forward returned, first time each (needs
        ``model``); ``step`` defaults to the first step with a forward."""
        forwards = self.select(ForwardRecord)
        if step is None and forwards:
            step = forwards[0].step
        order: list[str] = []
        for record in forwards:
            if record.step == step and record.unit not in order:
                order.append(record.unit)
        return order

    # -- assertions -------------------------------------------------------------------------------

    def _fail(self, message: str) -> AssertionError:
        return AssertionError(f"[rank {self.rank}] {message}")

    def _names_of(self, expected: Sequence[str | nn.Module]) -> list[str]:
        return [e if isinstance(e, str) else self._module_name(e) for e in expected]

    def assert_count(
        self, op: str, expected: int, *, step: int | None = None, unit: str | None = None
    ) -> None:
        """Asserts that collective ``op`` ran ``expected`` times (see :meth:`count`)."""
        actual = self.count(op, step=step, unit=unit)
        if actual != expected:
            seen = Counter(r.op for r in self.collectives(step=step, unit=unit))
            where = _where(step, unit)
            raise self._fail(
                f"expected {expected} {op} collective(s){where}, recorded {actual}; all "
                f"collectives{where}: {dict(seen) or 'none'}"
            )

    def assert_unshard_order(
        self,
        expected: Sequence[str | nn.Module],
        *,
        reason: str | Iterable[str] | None = None,
        step: int | None = None,
    ) -> None:
        """Asserts the order in which units were unsharded (for ``reason``, in ``step``)."""
        want = self._names_of(expected)
        actual = self.unshard_order(reason, step=step)
        if actual != want:
            described = reason if isinstance(reason, str | None) else sorted(reason)
            raise self._fail(
                f"expected units unsharded (reason {described or 'any'}"
                f"{_where(step, None)}) in the order {want}, recorded {actual}; every unshard: "
                f"{_describe(self.unshards(step=step))}"
            )

    def assert_prefetch_order(
        self,
        expected: Sequence[str | nn.Module],
        *,
        direction: str = "backward",
        step: int | None = None,
    ) -> None:
        """Asserts which units were prefetched, in order.

        Args:
            expected: unit FQNs (or modules of the recorded model) in prefetch order.
            direction: ``"backward"`` (default) or ``"forward"`` prefetch.
            step: only this step (default: all recorded).
        """
        if direction not in ("forward", "backward"):
            raise ValueError(
                f"assert_prefetch_order: direction={direction!r}; use 'forward' or 'backward'"
            )
        self.assert_unshard_order(expected, reason=f"{direction}_prefetch", step=step)

    def assert_graph_order(self, model: nn.Module, expected_modules: Sequence[nn.Module]) -> None:
        """Asserts the forward (graph) order of the sharded modules of ``model``.

        Where the engine keeps it (``fsdp_core``: ``_fsdp_graph_order`` and
        ``_my_fsdp_idx_in_graph`` on every instance) that order is checked, on every instance;
        otherwise the order recorded by forward hooks (``record_fsdp(model)``). Modules may be
        the sharded instances or the modules they wrap.

        Args:
            model: the root module.
            expected_modules: the modules in the expected order.
        """
        if not self._names:
            self._init_names(model)
        want = self._names_of(expected_modules)
        instances = [m for m in model.modules() if self.engine.is_wrapped(m)]
        engine_order = getattr(instances[0], "_fsdp_graph_order", None) if instances else None
        if engine_order is not None:
            actual = [self._module_name(m) for m in engine_order]
            source = "the engine's _fsdp_graph_order"
            for instance in instances:
                index = getattr(instance, "_my_fsdp_idx_in_graph", None)
                mine = getattr(instance, "_fsdp_graph_order", None)
                if mine is not engine_order and mine != engine_order:
                    raise self._fail(
                        f"FSDP instance {self._module_name(instance)!r} has a different "
                        f"_fsdp_graph_order ({[self._module_name(m) for m in mine or []]}) "
                        f"than the root ({actual})"
                    )
                if index is None or not 0 <= index < len(engine_order):
                    raise self._fail(
                        f"FSDP instance {self._module_name(instance)!r} has "
                        f"_my_fsdp_idx_in_graph={index!r}, not an index into the graph order"
                    )
                if engine_order[index] is not instance:
                    raise self._fail(
                        f"FSDP instance {self._module_name(instance)!r} has "
                        f"_my_fsdp_idx_in_graph={index}, but position {index} of the graph order "
                        f"is {actual[index]!r}"
                    )
        else:
            actual = self.graph_order()
            source = "the recorded forwards"
            if not actual:
                raise self._fail(
                    f"engine {self.engine.name!r} keeps no graph order and no forward was "
                    "recorded; record the first forward with record_fsdp(model)"
                )
        if actual != want:
            raise self._fail(f"expected graph order {want}; according to {source} it is {actual}")

    def assert_resharded(
        self,
        *,
        after: str = "forward",
        units: Iterable[str] | None = None,
        step: int | None = None,
    ) -> None:
        """Asserts that every unit unsharded in a pass was resharded after that pass.

        Args:
            after: ``"forward"``: each unit unsharded for forward (or forward prefetch) has a
                later reshard with reason ``"forward"`` in the same step; the root (``""``) is
                exempt by default, as every engine keeps it for backward. ``"backward"``: each
                unit unsharded in a step has a later reshard with reason ``"backward"``.
            units: the units to check (default: every unit unsharded in that pass).
            step: only this step (default: every recorded step).
        """
        if after not in ("forward", "backward"):
            raise ValueError(f"assert_resharded: after={after!r}; use 'forward' or 'backward'")
        reasons = ("forward", "forward_prefetch") if after == "forward" else None
        wanted = set(units) if units is not None else None
        checked = 0
        problems = []
        for unshard in self.unshards(reasons, step=step):
            if wanted is None and after == "forward" and unshard.unit == "":
                continue
            if wanted is not None and unshard.unit not in wanted:
                continue
            checked += 1
            later = [
                r
                for r in self.reshards(after, step=unshard.step)
                if r.unit == unshard.unit and r.seq > unshard.seq
            ]
            if not later:
                problems.append(
                    f"unit {unshard.unit!r} unsharded for {unshard.reason} in step "
                    f"{unshard.step} was never resharded after {after}"
                )
        if checked == 0:
            raise self._fail(f"assert_resharded(after={after!r}): no matching unshard was recorded")
        if problems:
            reshards = _describe(self.reshards(step=step))
            raise self._fail("; ".join(dict.fromkeys(problems)) + f" (reshards: {reshards})")

    def assert_params_on(
        self,
        device: str | torch.device,
        *,
        when: str = "resharded",
        units: Iterable[str] | None = None,
        step: int | None = None,
    ) -> None:
        """Asserts where the parameters were at every recorded transition.

        Args:
            device: e.g. ``"cpu"``; a device without an index matches any index.
            when: ``"resharded"`` (the sharded parameters after each reshard, default) or
                ``"unsharded"`` (the full parameters after each unshard).
            units: only these units (default: all).
            step: only this step (default: all).
        """
        if when not in ("resharded", "unsharded"):
            raise ValueError(f"assert_params_on: when={when!r}; use 'resharded' or 'unsharded'")
        want = torch.device(device)
        records: list[UnshardRecord] = (
            list(self.reshards(step=step)) if when == "resharded" else self.unshards(step=step)
        )
        if units is not None:
            chosen = set(units)
            records = [r for r in records if r.unit in chosen]
        if not records:
            raise self._fail(f"assert_params_on: no unit was {when}{_where(step, None)}")
        wrong = [r for r in records if not all(_same_device(d, want) for d in r.devices)]
        if wrong:
            listed = ", ".join(
                f"{r.unit!r} ({r.reason}, step {r.step}): {list(r.devices)}" for r in wrong[:5]
            )
            raise self._fail(
                f"expected parameters on {want} when {when}, but {len(wrong)} of "
                f"{len(records)} transitions left them elsewhere: {listed}"
            )

    def assert_offloaded(
        self, *, units: Iterable[str] | None = None, step: int | None = None
    ) -> None:
        """Asserts CPU offload: after every reshard the sharded parameters are on the CPU, the
        engine reports offloading for the unit (torch engines), and (``fsdp_core`` with offload
        events) every unshard was preceded by a copy to the device since the unit's last
        reshard.

        Args:
            units: only these units (default: all).
            step: only this step (default: all).
        """
        self.assert_params_on("cpu", when="resharded", units=units, step=step)
        chosen = set(units) if units is not None else None
        transitions = [
            r for r in self.select(UnshardRecord, step=step) if chosen is None or r.unit in chosen
        ]
        not_offloaded = sorted({r.unit for r in transitions if r.offload is False})
        if not_offloaded:
            raise self._fail(
                f"units {not_offloaded} are not offloaded: the engine keeps their sharded "
                "parameters on the compute device (no CPU offload policy)"
            )
        if self.engine.name != "fsdp_core" or not _core_has_offload_events():
            return
        copied: set[str] = set()
        missing = []
        for record in self.select(Record, step=step):
            if isinstance(record, OffloadRecord) and record.direction == "to_device":
                copied.add(record.unit)
            elif isinstance(record, ReshardRecord):
                copied.discard(record.unit)
            elif isinstance(record, UnshardRecord) and (chosen is None or record.unit in chosen):
                if record.unit not in copied:
                    missing.append(f"{record.unit!r} ({record.reason}, step {record.step})")
        if missing:
            raise self._fail(
                f"unshards with no copy of the CPU shard to the device before them: {missing}"
            )

    # -- export -----------------------------------------------------------------------------------

    def export_chrome_trace(self, path: str | os.PathLike[str], *, all_ranks: bool = False) -> Path:
        """Writes a Chrome/Perfetto trace (JSON): one process per rank, one thread each for
        unit transitions, collectives and forwards; spans where a duration is known.

        Args:
            path: the file to write.
            all_ranks: gather every rank's records (a collective: every rank must call) and
                write them all from rank 0; other ranks write nothing (default False).

        Returns:
            the path.
        """
        target = Path(path)
        records = self.records
        if all_ranks and dist.is_available() and dist.is_initialized():
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, records)
            if dist.get_rank() != 0:
                return target
            records = [r for part in gathered for r in part]
        target.write_text(json.dumps(chrome_trace(records), indent=1))
        return target


def record_fsdp(
    model: nn.Module | None = None,
    *,
    engine: str | FSDPEngine | None = None,
    barrier: bool = True,
) -> FSDPRecorder:
    """Returns an :class:`FSDPRecorder` to use as a context manager (see its arguments)."""
    return FSDPRecorder(model, engine=engine, barrier=barrier)


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


def _op_names(op: str | None) -> set[str] | None:
    if op is None:
        return None
    if op in _COLLECTIVE_FAMILIES:
        return set(_COLLECTIVE_FAMILIES[op])
    return {op}


def _where(step: int | None, unit: str | None) -> str:
    parts = ([f"step {step}"] if step is not None else []) + (
        [f"unit {unit!r}"] if unit is not None else []
    )
    return f" in {', '.join(parts)}" if parts else ""


def _describe(records: Sequence[UnshardRecord]) -> str:
    return ", ".join(f"{r.unit!r}:{r.reason}" for r in records) or "none"


def _same_device(actual: str, want: torch.device) -> bool:
    have = torch.device(actual)
    return have.type == want.type and (want.index is None or have.index == want.index)


def _core_has_offload_events() -> bool:
    try:
        from fsdp_core import events
    except ImportError:
        return False
    return hasattr(events, "OffloadCopy")
