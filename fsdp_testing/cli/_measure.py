"""Measurements taken on a rank: collectives on the wire, resident memory, and the theoretical
communication volume of a sharded model.

[Note: theoretical volume]
For every unit (one all-gather and one gradient reduction per pass) the theory is computed from
the unit's parameters and the world size, not from what the engine sends:

- all-gather bytes per step = sum over units of the padded unsharded bytes x gathers per step,
  where a sharded unit is gathered once in forward and, under ``FULL_SHARD``, once more in
  backward. Two exceptions follow from the algorithm, not from the engine: the root keeps its
  parameters from forward to backward (they are the first that backward needs), and a unit
  whose parameters are all frozen is upstream of every trainable one in our reference models,
  so no gradient flows through it and backward never needs it.
- reduce-scatter bytes per step = sum over units with trainable parameters of their padded
  unsharded bytes (one reduce-scatter each); a replicated unit (``NO_SHARD``) all-reduces the
  unpadded bytes instead, and a unit over a group of one rank sends nothing.

Padding is the layout's: ``fsdp_core`` and FSDP2 pad every parameter in dim 0 to a multiple of
the world size; FSDP1 pads one flat parameter per unit. ``fsdp_core`` also sends an order tag
with every unit collective: two elements per rank after each rank's all-gather block and after
each row of a reduction (``[Note: order check]`` in ``fsdp_core/_order_check.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import resource
import time
from collections.abc import Iterator
from typing import Any

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

# Collective name -> (kind, index of the argument whose size is the volume, "list" if a list).
_WATCHED: dict[str, tuple[str, int, bool]] = {
    "all_gather_single": ("all_gather", 0, False),
    "all_gather_into_tensor": ("all_gather", 0, False),
    "_all_gather_base": ("all_gather", 0, False),
    "all_gather": ("all_gather", 0, True),
    "reduce_scatter_single": ("reduce_scatter", 1, False),
    "reduce_scatter_tensor": ("reduce_scatter", 1, False),
    "_reduce_scatter_base": ("reduce_scatter", 1, False),
    "reduce_scatter": ("reduce_scatter", 1, True),
    "all_reduce": ("all_reduce", 0, False),
    "broadcast": ("broadcast", 0, False),
    "all_to_all_single": ("all_to_all", 1, False),
}


@dataclasses.dataclass(frozen=True)
class CollectiveCall:
    """One collective issued through ``torch.distributed`` while a :class:`CollectiveLog`
    watched."""

    op: str
    """The function called, e.g. ``"all_gather_single"``."""
    kind: str
    """``all_gather``, ``reduce_scatter``, ``all_reduce``, ``broadcast`` or ``all_to_all``."""
    bytes: int
    """Size of the unsharded side: all-gather output, reduce-scatter input, all-reduce tensor."""
    group_size: int
    start_ns: int
    end_ns: int


def _nbytes(value: Any, is_list: bool) -> int:
    if is_list:
        return sum(t.numel() * t.element_size() for t in value)
    return int(value.numel() * value.element_size())


class CollectiveLog:
    """Records every outermost collective called through the ``torch.distributed`` module.

    Engines look collectives up on the module at call time (fsdp_core, torch's FSDP1 and FSDP2
    all do), so wrapping the module attributes sees every call, including ones an engine does not
    report through its own events. Nested calls (a deprecated name forwarding to the new one)
    count once.
    """

    def __init__(self) -> None:
        self.calls: list[CollectiveCall] = []
        self._depth = 0

    @contextlib.contextmanager
    def watching(self) -> Iterator[CollectiveLog]:
        """Wrap the collectives for the duration of the ``with`` block."""
        import torch.distributed as dist

        originals = {name: getattr(dist, name) for name in _WATCHED if hasattr(dist, name)}
        for name, original in originals.items():
            setattr(dist, name, self._wrap(name, original))
        try:
            yield self
        finally:
            for name, original in originals.items():
                setattr(dist, name, original)

    def _wrap(self, name: str, original: Any) -> Any:
        import torch.distributed as dist

        kind, index, is_list = _WATCHED[name]
        signature = inspect.signature(original)
        sized = list(signature.parameters)[index]

        def watched(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return original(*args, **kwargs)
            self._depth += 1
            start = time.perf_counter_ns()
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1
                end = time.perf_counter_ns()
                bound = signature.bind(*args, **kwargs).arguments
                group = bound.get("group")
                world = dist.get_world_size(group) if group is not None else dist.get_world_size()
                size = _nbytes(bound[sized], is_list)
                self.calls.append(CollectiveCall(name, kind, size, world, start, end))

        watched.__wrapped__ = original  # type: ignore[attr-defined]
        return watched

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


@dataclasses.dataclass(frozen=True)
class UnitVolume:
    """One unit's share of the theoretical volume. See [Note: theoretical volume]."""

    name: str
    gather_bytes: int
    """Padded unsharded bytes of all its parameters (0 when replicated)."""
    reduce_bytes: int
    """Bytes of its trainable parameters' gradients as reduced (padded when sharded)."""
    gathers: int
    """All-gathers per step."""
    reduce_kind: str | None
    """``reduce_scatter``, ``all_reduce`` or None (nothing to reduce, or a group of one)."""


@dataclasses.dataclass(frozen=True)
class CommVolume:
    """The theoretical collectives of one training step: ``kind -> (count, bytes)``."""

    layout: str
    units: tuple[UnitVolume, ...]

    def totals(self) -> dict[str, tuple[int, int]]:
        out: dict[str, tuple[int, int]] = {}
        for unit in self.units:
            if unit.gathers:
                count, size = out.get("all_gather", (0, 0))
                out["all_gather"] = (count + unit.gathers, size + unit.gathers * unit.gather_bytes)
            if unit.reduce_kind is not None:
                count, size = out.get(unit.reduce_kind, (0, 0))
                out[unit.reduce_kind] = (count + 1, size + unit.reduce_bytes)
        return out


def _gathers(sharded: bool, is_root: bool, trainable: bool, reshard_after_forward: bool) -> int:
    if not sharded:
        return 0
    if reshard_after_forward and not is_root and trainable:
        return 2
    return 1


def _padded_bytes(shape: tuple[int, ...], world: int, itemsize: int) -> int:
    rows = shape[0] if shape else 1
    rest = math.prod(shape[1:]) if len(shape) > 1 else 1
    return math.ceil(rows / world) * world * rest * itemsize


def _core_volume(model: Any, full_shard: bool) -> CommVolume | None:
    try:
        from fsdp_core import FullyShardedDataParallel as CoreFSDP
    except ImportError:
        return None
    instances = CoreFSDP.fsdp_modules(model)
    if not instances:
        return None
    units = []
    for instance in instances:
        unit = instance._unit
        if unit is None:
            continue
        world = unit.group_size
        sharded = not unit.replicate
        trainable = [p for p in unit.params if p.requires_grad]
        # Gathered in the compute dtype and reduced in the reduce dtype (mixed precision).
        precision = getattr(unit, "precision", None)
        gather_size = getattr(precision, "param_dtype", None) or unit.dtype
        reduce_size = getattr(precision, "reduce_dtype", None) or unit.dtype

        def size(p: Any, itemsize: int, world: int = world, sharded: bool = sharded) -> int:
            shape = tuple(p.full_shape)
            if sharded:
                return _padded_bytes(shape, world, itemsize)
            return math.prod(shape) * itemsize

        reduce_kind = None
        if trainable and world > 1:
            reduce_kind = "reduce_scatter" if sharded else "all_reduce"
        # The order tag (elements): per rank of a gather; per rank per row of a reduction.
        tagged = getattr(unit, "order_tags", None) is not None
        gather_tag = 2 * world if tagged else 0
        reduce_tag = 2 * world * (world if sharded else 1) if tagged and reduce_kind else 0
        units.append(
            UnitVolume(
                name=instance._fsdp_state.fqn or "<root>",
                gather_bytes=(
                    sum(size(p, gather_size.itemsize) for p in unit.params)
                    + gather_tag * gather_size.itemsize
                    if sharded
                    else 0
                ),
                reduce_bytes=sum(size(p, reduce_size.itemsize) for p in trainable)
                + reduce_tag * reduce_size.itemsize,
                gathers=_gathers(
                    sharded, bool(instance._fsdp_state.is_root), bool(trainable), full_shard
                ),
                reduce_kind=reduce_kind,
            )
        )
    return CommVolume("fsdp_core: per-parameter dim-0 padding", tuple(units))


def _fsdp1_volume(model: Any, full_shard: bool) -> CommVolume | None:
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    instances = TorchFSDP.fsdp_modules(model)
    if not instances:
        return None
    units = []
    for instance in instances:
        handle = getattr(instance, "_handle", None)
        if handle is None:
            continue
        flat = handle.flat_param
        world = instance.world_size
        sharded = handle.uses_sharded_strategy
        # Gathered in the compute dtype, reduced in the reduce dtype (mixed precision).
        gather_size = (getattr(handle, "_fwd_bwd_param_dtype", None) or flat.dtype).itemsize
        reduce_size = (getattr(handle, "_reduce_dtype", None) or flat.dtype).itemsize
        numel = sum(flat._numels_with_padding)
        padded = math.ceil(numel / world) * world if sharded else numel
        trainable = flat.requires_grad
        reduce_kind = None
        if trainable and world > 1:
            reduce_kind = "reduce_scatter" if sharded else "all_reduce"
        units.append(
            UnitVolume(
                name=type(instance.module).__name__,
                gather_bytes=padded * gather_size if sharded else 0,
                reduce_bytes=padded * reduce_size if trainable else 0,
                gathers=_gathers(sharded, bool(instance._is_root), trainable, full_shard),
                reduce_kind=reduce_kind,
            )
        )
    return CommVolume("torch FSDP1: one flat parameter per unit, padded", tuple(units))


def _fsdp2_volume(model: Any, full_shard: bool) -> CommVolume | None:
    from torch.distributed.fsdp import FSDPModule

    units = []
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        group = state._fsdp_param_group
        if group is None:
            continue
        world = group.mesh_info.shard_mesh_size  # type: ignore[attr-defined]
        if world == 1:
            continue  # nothing to gather or reduce over a group of one rank
        gather = reduce = 0
        trainable = False
        for fp in group.fsdp_params:
            numel = math.prod(fp.padded_sharded_param_size) * world
            gather += numel * (fp.param_dtype or fp.orig_dtype).itemsize
            if fp.sharded_param.requires_grad:
                trainable = True
                reduce += numel * (fp.reduce_dtype or fp.param_dtype or fp.orig_dtype).itemsize
        units.append(
            UnitVolume(
                name=type(module).__name__,
                gather_bytes=gather,
                reduce_bytes=reduce,
                gathers=_gathers(True, bool(state._is_root), trainable, full_shard),
                reduce_kind="reduce_scatter" if trainable and world > 1 else None,
            )
        )
    if not units:
        return None
    return CommVolume("torch FSDP2: per-parameter dim-0 padding", tuple(units))


def theoretical_volume(model: Any, *, full_shard: bool) -> CommVolume | None:
    """The theoretical collectives per step of ``model`` as sharded by any of the three engines,
    or None when the layout is not one of theirs. See [Note: theoretical volume].

    Args:
        model: the sharded model.
        full_shard: units reshard after forward (``FULL_SHARD``; FSDP2's
            ``reshard_after_forward=True``).
    """
    for compute in (_core_volume, _fsdp1_volume, _fsdp2_volume):
        try:
            found = compute(model, full_shard)
        except (AttributeError, ImportError):
            found = None
        if found is not None:
            return found
    return None
