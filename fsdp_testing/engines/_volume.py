"""The theoretical communication of one training step, which each engine computes for the
models it sharded (``engine.theoretical_volume``) and ``fsdp-testing check`` compares with the
collectives it counts.

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
- bytes are counted in the dtype the engine gathers in (``param_dtype`` under mixed precision)
  and reduces in (``reduce_dtype``).
- hybrid sharding (``HYBRID_SHARD``, ``_HYBRID_SHARD_ZERO2``, a 2-D mesh) over a shard group of
  ``S`` ranks and a replicate group of ``R``: the all-gather and the reduce-scatter are those of
  a unit sharded over ``S`` (padding to a multiple of ``S``), inside the shard group; each
  unit with trainable parameters then all-reduces its reduced shard, ``1 / S`` of the padded
  gradient bytes, across the replicate group (``replica_reduce_bytes``). So the families map
  to groups: all-gather and reduce-scatter to the shard group, all-reduce to the replicate
  group.

Padding is the layout's: ``fsdp_core`` and FSDP2 pad every parameter in dim 0 to a multiple of
the world size; FSDP1 pads one flat parameter per unit. ``fsdp_core`` also sends an order tag
with every unit collective: two elements per rank after each rank's all-gather block and after
each row of a reduction (``[Note: order check]`` in ``fsdp_core/_order_check.py``).
"""

from __future__ import annotations

import dataclasses
import math

__all__ = ["CommVolume", "UnitVolume", "gathers_per_step", "padded_bytes"]


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
    replica_reduce_bytes: int = 0
    """Hybrid sharding: bytes of the all-reduce of the reduced shard across the replicate
    group after the reduce-scatter (0: none)."""


@dataclasses.dataclass(frozen=True)
class CommVolume:
    """The theoretical collectives of one training step, per unit; :meth:`totals` sums them.

    Args:
        layout: how the engine lays parameters out (shown with the figures).
        units: every unit's share.
    """

    layout: str
    units: tuple[UnitVolume, ...]

    def totals(self) -> dict[str, tuple[int, int]]:
        """``family -> (number of calls, bytes)`` per step (``all_gather``,
        ``reduce_scatter``, ``all_reduce``)."""
        out: dict[str, tuple[int, int]] = {}
        for unit in self.units:
            if unit.gathers:
                count, size = out.get("all_gather", (0, 0))
                out["all_gather"] = (count + unit.gathers, size + unit.gathers * unit.gather_bytes)
            if unit.reduce_kind is not None:
                count, size = out.get(unit.reduce_kind, (0, 0))
                out[unit.reduce_kind] = (count + 1, size + unit.reduce_bytes)
            if unit.replica_reduce_bytes:
                count, size = out.get("all_reduce", (0, 0))
                out["all_reduce"] = (count + 1, size + unit.replica_reduce_bytes)
        return out


def gathers_per_step(
    *, sharded: bool, is_root: bool, trainable: bool, reshard_after_forward: bool
) -> int:
    """All-gathers of one unit per step. See [Note: theoretical volume].

    Args:
        sharded: the unit's parameters are sharded (not ``NO_SHARD``).
        is_root: the unit is the root (it keeps its parameters for backward).
        trainable: some of its parameters require gradients.
        reshard_after_forward: ``FULL_SHARD`` (gathered again in backward).
    """
    if not sharded:
        return 0
    if reshard_after_forward and not is_root and trainable:
        return 2
    return 1


def padded_bytes(shape: tuple[int, ...], world: int, itemsize: int) -> int:
    """Bytes of a tensor of ``shape`` padded in dim 0 to a multiple of ``world``."""
    rows = shape[0] if shape else 1
    rest = math.prod(shape[1:]) if len(shape) > 1 else 1
    return math.ceil(rows / world) * world * rest * itemsize
