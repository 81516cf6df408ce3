"""Engine for this project's core, ``fsdp_core.FullyShardedDataParallel`` (the default).

``fsdp_core`` is imported on first use, not when this module is imported, so selecting another
engine never needs the core. A piece the core does not provide yet raises NotImplementedError
naming it and the engines to use instead.

The core publishes its own events (:mod:`fsdp_core.events`): the recorder subscribes to them
through this engine's probe instead of inferring anything.
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

from ._base import PatchTarget
from ._probe import Probe
from ._volume import CommVolume, UnitVolume, gathers_per_step, padded_bytes
from ._wrapper import WrapperEngine

__all__ = ["FSDPCoreEngine"]

_ENUM_AND_CONFIG_NAMES = {
    "sharding_strategy": "ShardingStrategy",
    "backward_prefetch": "BackwardPrefetch",
    "cpu_offload": "CPUOffload",
    "mixed_precision": "MixedPrecision",
}


class FSDPCoreEngine(WrapperEngine):
    """:class:`~fsdp_testing.engines.FSDPEngine` for ``fsdp_core``'s wrapper door.

    The unit class is ``fsdp_core._unit.FSDPUnit`` and its ``unshard``, ``reshard`` and
    ``post_backward`` methods are the patch targets.
    """

    name = "fsdp_core"

    def _load_api(self) -> SimpleNamespace:
        core = _import("fsdp_core")
        fsdp_cls = _attribute(core, "FullyShardedDataParallel")
        wrap_module = _import("fsdp_core.wrap")
        unit_module = _import("fsdp_core._unit")
        unit_class = _attribute(unit_module, "FSDPUnit")
        return SimpleNamespace(
            FSDP=fsdp_cls,
            wrap_module=wrap_module,
            StateDictType=getattr(core, "StateDictType", None),
            option_types={
                option: getattr(core, type_name)
                for option, type_name in _ENUM_AND_CONFIG_NAMES.items()
                if hasattr(core, type_name)
            },
            unit_class=unit_class,
            patch_targets={
                event: PatchTarget(unit_class, event)
                for event in ("unshard", "reshard", "post_backward")
            },
        )

    def manages(self, module: nn.Module) -> bool:
        # A process that never imported fsdp_core holds no module of it; asking would import it.
        return "fsdp_core" in sys.modules and super().manages(module)

    def probe(self) -> Probe:
        return _CoreProbe()

    def theoretical_volume(self, module: nn.Module, *, full_shard: bool) -> CommVolume | None:
        units = []
        for instance in self.api.FSDP.fsdp_modules(module):
            unit = instance._unit
            if unit is None:
                continue
            units.append(_unit_volume(instance, unit, full_shard))
        if not units:
            return None
        return CommVolume("fsdp_core: per-parameter dim-0 padding", tuple(units))


def _unit_volume(instance: Any, unit: Any, full_shard: bool) -> UnitVolume:
    # See [Note: unit groups] in fsdp_core/_groups.py: sharded over ``world`` ranks, each shard
    # replicated across ``replicas`` (NO_SHARD: world 1, hybrid: both above 1).
    world = unit.shard_world
    replicas = unit.groups.replicate_size
    sharded = world > 1
    trainable = [p for p in unit.params if p.requires_grad]
    # Gathered in the compute dtype and reduced in the reduce dtype (mixed precision).
    precision = getattr(unit, "precision", None)
    gather_dtype = getattr(precision, "param_dtype", None) or unit.dtype
    reduce_dtype = getattr(precision, "reduce_dtype", None) or unit.dtype

    def size(param: Any, itemsize: int) -> int:
        shape = tuple(param.full_shape)
        return padded_bytes(shape, world, itemsize) if sharded else math.prod(shape) * itemsize

    reduce_kind = None
    if trainable and sharded:
        reduce_kind = "reduce_scatter"
    elif trainable and replicas > 1:
        reduce_kind = "all_reduce"
    # The order tag (elements): per rank of a gather; per rank per row of a reduction.
    tagged = getattr(unit, "order_tags", None) is not None
    gather_tag = 2 * world if tagged else 0
    first_group = world if sharded else replicas
    reduce_tag = 2 * first_group * world if tagged and reduce_kind else 0
    gathered = sum(size(p, gather_dtype.itemsize) for p in unit.params)
    replica_reduce = 0
    if trainable and sharded and replicas > 1:  # hybrid: the shard, across the replicas
        shard_bytes = sum(size(p, reduce_dtype.itemsize) for p in trainable) // world
        replica_reduce = shard_bytes + (2 * replicas * reduce_dtype.itemsize if tagged else 0)
    return UnitVolume(
        name=instance._fsdp_state.fqn or "<root>",
        gather_bytes=gathered + gather_tag * gather_dtype.itemsize if sharded else 0,
        reduce_bytes=sum(size(p, reduce_dtype.itemsize) for p in trainable)
        + reduce_tag * reduce_dtype.itemsize,
        gathers=gathers_per_step(
            sharded=sharded,
            is_root=bool(instance._fsdp_state.is_root),
            trainable=bool(trainable),
            reshard_after_forward=full_shard,
        ),
        reduce_kind=reduce_kind,
        replica_reduce_bytes=replica_reduce,
    )


class _CoreProbe(Probe):
    """The core names its units and publishes every transition, collective and offload copy."""

    exact = True

    @property
    def reports_offload_copies(self) -> bool:
        return hasattr(_events(), "OffloadCopy")

    def subscribe(self, callback: Callable[[Any], None]) -> contextlib.AbstractContextManager[Any]:
        return _events().subscribe(callback)

    def fallback_name(self, unit: Any) -> str:
        return str(getattr(unit, "name", "")) or super().fallback_name(unit)


def _events() -> Any:
    return _import("fsdp_core.events")


def _import(module_name: str) -> object:
    try:
        return importlib.import_module(module_name)
    except ImportError as error:
        raise NotImplementedError(
            f"engine 'fsdp_core': cannot import {module_name} ({error}); reinstall the "
            "fsdp-testing distribution (it ships fsdp_core), or select another engine: "
            "use_engine('torch_fsdp1') or --fsdp-engine torch_fsdp1"
        ) from error


def _attribute(owner: object, name: str) -> type:
    found = getattr(owner, name, None)
    if found is None:
        raise NotImplementedError(
            f"engine 'fsdp_core': this fsdp_core has no {getattr(owner, '__name__', owner)}."
            f"{name}; select another engine: use_engine('torch_fsdp1') or --fsdp-engine "
            "torch_fsdp1"
        )
    return found
