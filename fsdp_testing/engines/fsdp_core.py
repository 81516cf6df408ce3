"""Engine for this project's core, ``fsdp_core.FullyShardedDataParallel`` (the default).

``fsdp_core`` is imported on first use, not when this module is imported, so selecting another
engine never needs the core. A piece the core does not provide yet raises NotImplementedError
naming it and the engines to use instead.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

from ._base import PatchTarget
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


def _import(module_name: str) -> object:
    try:
        return importlib.import_module(module_name)
    except ImportError as error:
        raise NotImplementedError(
            f"engine 'fsdp_core': cannot import {module_name} ({error}); the core may not be "
            "built yet. Select another engine: use_engine('torch_fsdp1') or "
            "--fsdp-engine torch_fsdp1"
        ) from error


def _attribute(owner: object, name: str) -> type:
    found = getattr(owner, name, None)
    if found is None:
        raise NotImplementedError(
            f"engine 'fsdp_core': {getattr(owner, '__name__', owner)}.{name} does not exist yet; "
            "select another engine: use_engine('torch_fsdp1') or --fsdp-engine torch_fsdp1"
        )
    return found
