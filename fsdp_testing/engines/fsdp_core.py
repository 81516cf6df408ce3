"""Engine for this project's core, ``fsdp_core.FullyShardedDataParallel`` (the default).

The wrapper API (construction, ``summon_full_params``, ``state_dict_type``, wrap policies) is
the one torch's FSDP1 has too (``engines/_wrapper.py``); the rest is the core's
(``engines/_core.py``): the unit class ``FSDPUnit`` and its patch targets, the recorder probe
subscribed to the core's own events (:mod:`fsdp_core.events`: nothing is inferred), and the
theoretical volume computed from the core's public unit views. ``fsdp_core`` is imported on
first use, so selecting another engine never needs the core.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch.nn as nn

from ._core import CoreProbe, core_patch_targets, core_unit_class, core_unit_volume, imported
from ._probe import Probe
from ._volume import CommVolume
from ._wrapper import WrapperEngine

__all__ = ["FSDPCoreEngine"]


class FSDPCoreEngine(WrapperEngine):
    """:class:`~fsdp_testing.engines.FSDPEngine` for ``fsdp_core``'s wrapper door.

    The unit class is ``fsdp_core._unit.FSDPUnit`` and its ``unshard``, ``reshard`` and
    ``post_backward`` methods are the patch targets.
    """

    name = "fsdp_core"

    def _load_api(self) -> SimpleNamespace:
        import fsdp_core
        import fsdp_core.wrap as wrap_module

        return SimpleNamespace(
            FSDP=fsdp_core.FullyShardedDataParallel,
            wrap_module=wrap_module,
            StateDictType=fsdp_core.StateDictType,
            option_types={
                "sharding_strategy": fsdp_core.ShardingStrategy,
                "backward_prefetch": fsdp_core.BackwardPrefetch,
                "cpu_offload": fsdp_core.CPUOffload,
                "mixed_precision": fsdp_core.MixedPrecision,
            },
            unit_class=core_unit_class(),
            patch_targets=core_patch_targets(),
        )

    def manages(self, module: nn.Module) -> bool:
        return imported() and super().manages(module)

    def probe(self) -> Probe:
        return CoreProbe()

    def theoretical_volume(self, module: nn.Module, *, full_shard: bool) -> CommVolume | None:
        from fsdp_core import unit_views

        units = [
            core_unit_volume(view, reshard_after_forward=full_shard)
            for view in unit_views(module)
            if view.door == "FullyShardedDataParallel"
        ]
        if not units:
            return None
        return CommVolume("fsdp_core: per-parameter dim-0 padding", tuple(units))
