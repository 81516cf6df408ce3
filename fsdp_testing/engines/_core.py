"""What the ``fsdp_core`` engines share: the recorder probe, the theoretical volume of one unit
and the composable door's API.

The engines read the core through its public seams only: ``fsdp_core.unit_views`` (a frozen view
of every unit: groups, parameters, padding, dtypes, root, order check) for the theory, and
``fsdp_core.events`` for the recorder. The one private name they use is the patch target, the
unit class ``fsdp_core._unit.FSDPUnit`` whose ``unshard``, ``reshard`` and ``post_backward``
patches reach every call (as torch's harness patches FSDP2's ``FSDPParamGroup``). ``fsdp_core``
is imported on first use, so selecting another engine never needs the core.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import sys
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch.nn as nn

from ._base import UNIT_EVENTS, PatchTarget
from ._composable import ComposableEngine
from ._probe import Probe
from ._volume import UnitVolume, gathers_per_step, padded_bytes

__all__ = [
    "CoreComposableEngine",
    "CoreProbe",
    "core_patch_targets",
    "core_unit_class",
    "core_unit_volume",
    "imported",
]


def imported() -> bool:
    """Whether this process imported ``fsdp_core``: if not, it holds no module of it (and
    asking would import it)."""
    return "fsdp_core" in sys.modules


def core_unit_class() -> type:
    """The core's unit class, whose transitions are the patch targets."""
    return importlib.import_module("fsdp_core._unit").FSDPUnit


def core_patch_targets() -> dict[str, PatchTarget]:
    unit_class = core_unit_class()
    return {event: PatchTarget(unit_class, event) for event in UNIT_EVENTS}


class CoreProbe(Probe):
    """The core names its units and publishes every transition, collective and offload copy."""

    exact = True

    @property
    def reports_offload_copies(self) -> bool:
        return True

    def subscribe(self, callback: Callable[[Any], None]) -> contextlib.AbstractContextManager[Any]:
        from fsdp_core import events

        return events.subscribe(callback)

    def fallback_name(self, unit: Any) -> str:
        return str(unit.name) or super().fallback_name(unit)


def core_unit_volume(view: Any, *, reshard_after_forward: bool) -> UnitVolume:
    """One unit's theoretical volume from its ``fsdp_core.UnitView``. See [Note: theoretical
    volume] in ``_volume.py``.

    Args:
        view: the unit's view.
        reshard_after_forward: whether it is gathered again in backward (``FULL_SHARD``).
    """
    # Sharded over ``world`` ranks, each shard replicated across ``replicas`` (NO_SHARD: world
    # 1, hybrid: both above 1).
    world, replicas = view.shard_size, view.replicate_size
    sharded = world > 1
    trainable = [p for p in view.params if p.requires_grad]
    # Gathered in the compute dtype and reduced in the reduce dtype (mixed precision); the
    # order tags travel in the unit's buffers, in the dtypes of its first parameter.
    first = view.params[0]
    gather_size = view.gather_dtype(first).itemsize
    reduce_size = view.grad_reduce_dtype(first).itemsize

    def size(param: Any, itemsize: int) -> int:
        if sharded:
            return padded_bytes(param.shape, world, itemsize)
        return math.prod(param.shape) * itemsize

    reduce_kind = None
    if trainable and sharded:
        reduce_kind = "reduce_scatter"
    elif trainable and replicas > 1:
        reduce_kind = "all_reduce"
    # The order tag (elements): per rank of a gather; per rank per row of a reduction.
    tagged = view.order_check
    gather_tag = 2 * world if tagged else 0
    first_group = world if sharded else replicas
    reduce_tag = 2 * first_group * world if tagged and reduce_kind else 0
    gathered = sum(size(p, view.gather_dtype(p).itemsize) for p in view.params)
    reduced = sum(size(p, view.grad_reduce_dtype(p).itemsize) for p in trainable)
    replica_reduce = 0
    if trainable and sharded and replicas > 1:  # hybrid: the shard, across the replicas
        replica_reduce = reduced // world + (2 * replicas * reduce_size if tagged else 0)
    return UnitVolume(
        name=view.fqn or "<root>",
        gather_bytes=gathered + gather_tag * gather_size if sharded else 0,
        reduce_bytes=reduced + reduce_tag * reduce_size,
        gathers=gathers_per_step(
            sharded=sharded,
            is_root=bool(view.is_root),
            trainable=bool(trainable),
            reshard_after_forward=reshard_after_forward,
        ),
        reduce_kind=reduce_kind,
        replica_reduce_bytes=replica_reduce,
    )


class CoreComposableEngine(ComposableEngine):
    """The composable door, ``fsdp_core.fully_shard``, behind :class:`ComposableEngine`; the
    ``fsdp_core_fully_shard`` and ``fsdp_core_graph`` engines build on it."""

    api = "fsdp_core.fully_shard"

    def _load_impl(self) -> SimpleNamespace:
        import fsdp_core
        import fsdp_core.wrap as wrap_module

        return SimpleNamespace(
            fully_shard=fsdp_core.fully_shard,
            FSDPModule=fsdp_core.FSDPModule,
            MixedPrecisionPolicy=fsdp_core.MixedPrecisionPolicy,
            CPUOffloadPolicy=fsdp_core.CPUOffloadPolicy,
            wrap_module=wrap_module,
            unit_class=core_unit_class(),
            patch_targets=core_patch_targets(),
            # fully_shard's default keeps the root's parameters from forward to backward.
            root_keeps_parameters_by_default=True,
        )

    def is_wrapped(self, module: nn.Module) -> bool:
        return imported() and super().is_wrapped(module)

    def probe(self) -> Probe:
        return CoreProbe()
