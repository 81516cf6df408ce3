"""Engine for this project's composable door, ``fsdp_core.fully_shard``.

It shards like every composable engine (``engines/_composable.py``: the FSDP1-option mapping,
``fully_shard`` on each submodule the policy selects, bottom-up, then on the root), so the unit
structure of every reference model is the one torch's FSDP2 gets; its parameters are
``DTensor``s, so full parameters and state dicts go through the same ``DTensor`` paths.
Everything else is the core's (``engines/_core.py``): the unit class ``FSDPUnit`` and its patch
targets, the core's events for the recorder, and the theoretical volume computed from the
core's public unit views (order tags included).

Beyond that mapping, ``NO_SHARD`` is not supported (``replicate`` is the door for it) and
``forward_prefetch=True`` raises as with FSDP2: use ``set_modules_to_forward_prefetch``.
"""

from __future__ import annotations

import dataclasses

import torch.nn as nn

from ._core import CoreComposableEngine, core_unit_volume
from ._volume import CommVolume, UnitVolume

__all__ = ["FSDPCoreFullyShardEngine"]


class FSDPCoreFullyShardEngine(CoreComposableEngine):
    """:class:`~fsdp_testing.engines.FSDPEngine` for ``fsdp_core.fully_shard``."""

    name = "fsdp_core_fully_shard"

    def theoretical_volume(self, module: nn.Module, *, full_shard: bool) -> CommVolume | None:
        """The core's volume per unit over more than one rank; ``reshard_after_forward`` is
        read from each unit's view (an int counts like ``True``: the backward all-gather moves
        the same bytes, inside a smaller group). See [Note: theoretical volume]."""
        from fsdp_core import unit_views

        units: list[UnitVolume] = []
        for view in unit_views(module):
            if view.door == "FullyShardedDataParallel" or view.world == 1:
                continue
            reshards = view.reshard_after_forward is not False
            volume = core_unit_volume(view, reshard_after_forward=reshards)
            if view.is_root and reshards and volume.gathers == 1 and volume.reduce_kind:
                volume = dataclasses.replace(volume, gathers=2)
            units.append(volume)
        if not units:
            return None
        return CommVolume("fsdp_core.fully_shard: per-parameter dim-0 padding", tuple(units))
