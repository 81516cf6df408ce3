"""Engine for this project's composable door, ``fsdp_core.fully_shard``.

It shards like the ``torch_fsdp2`` engine (the same FSDP1-option mapping, ``fully_shard`` on
each submodule the policy selects, bottom-up, then on the root), so the unit structure of every
reference model is the one torch's FSDP2 gets; its parameters are ``DTensor``s, so full
parameters and state dicts go through the same ``DTensor`` paths. Everything else is the core's:
the unit class ``fsdp_core._unit.FSDPUnit`` and its patch targets, the core's events for the
recorder, the core's theoretical volume (order tags included).

Beyond FSDP2's mapping, ``NO_SHARD`` is not supported (``replicate`` is the door for it) and
``forward_prefetch=True`` raises as with FSDP2: use ``set_modules_to_forward_prefetch``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterable
from typing import Any

import torch.distributed as dist
import torch.nn as nn

from ._base import (
    UNIT_EVENTS,
    PatchTarget,
    broadcast_module_states,
    default_process_group,
    has_accelerator,
    modules_selected_by_policy,
)
from ._probe import Probe
from ._volume import CommVolume, UnitVolume
from .fsdp_core import _CoreProbe
from .fsdp_core import _unit_volume as _core_unit_volume
from .torch_fsdp2 import _ACCEPTED, TorchFSDP2Engine

__all__ = ["FSDPCoreFullyShardEngine"]


def _core() -> Any:
    return importlib.import_module("fsdp_core")


class FSDPCoreFullyShardEngine(TorchFSDP2Engine):
    """:class:`~fsdp_testing.engines.FSDPEngine` for ``fsdp_core.fully_shard``."""

    name = "fsdp_core_fully_shard"
    api = "fsdp_core.fully_shard"

    def wrap(
        self, module: nn.Module, process_group: dist.ProcessGroup | None = None, **fsdp_kwargs: Any
    ) -> nn.Module:
        core = _core()
        unknown = sorted(set(fsdp_kwargs) - _ACCEPTED)
        if unknown:
            raise TypeError(
                f"engine {self.name!r}: unknown FSDP options {', '.join(unknown)}; accepted: "
                f"{', '.join(sorted(_ACCEPTED))}"
            )
        shard_kwargs = self._core_kwargs(fsdp_kwargs)
        device = self._device(module, fsdp_kwargs.get("device_id"))
        if fsdp_kwargs.get("device_id") is not None:
            module.to(device)
        group = process_group if process_group is not None else default_process_group()
        shard_kwargs["mesh"] = self._mesh_of(group, device.type, fsdp_kwargs)
        if fsdp_kwargs.get("sync_module_states"):
            broadcast_module_states(module, group, skip=self.is_wrapped)
        policy = fsdp_kwargs.get("auto_wrap_policy")
        if policy is not None:
            for submodule in modules_selected_by_policy(module, policy):
                if not self.is_wrapped(submodule):
                    core.fully_shard(submodule, **shard_kwargs)
        core.fully_shard(module, **shard_kwargs)
        return module

    def _core_kwargs(self, fsdp_kwargs: dict[str, Any]) -> dict[str, Any]:
        core = _core()
        torch_kwargs = self._fully_shard_kwargs(fsdp_kwargs)  # torch's policies, validated
        result: dict[str, Any] = {}
        if "reshard_after_forward" in torch_kwargs:
            result["reshard_after_forward"] = torch_kwargs["reshard_after_forward"]
        if "offload_policy" in torch_kwargs:
            result["offload_policy"] = core.CPUOffloadPolicy(pin_memory=has_accelerator())
        mixed = torch_kwargs.get("mp_policy")
        if mixed is not None:
            result["mp_policy"] = core.MixedPrecisionPolicy(
                param_dtype=mixed.param_dtype, reduce_dtype=mixed.reduce_dtype
            )
        if "ignored_params" in torch_kwargs:
            result["ignored_params"] = torch_kwargs["ignored_params"]
        return result

    def is_wrapped(self, module: nn.Module) -> bool:
        if "fsdp_core" not in sys.modules:
            return False
        return isinstance(module, _core().FSDPModule)

    def manages(self, module: nn.Module) -> bool:
        return any(self.is_wrapped(m) for m in module.modules())

    def module_wrap_policy(self, module_classes: Iterable[type[nn.Module]]) -> Any:
        return _core().wrap.ModuleWrapPolicy(set(module_classes))

    def always_wrap_policy(self) -> Any:
        return _core().wrap.always_wrap_policy

    # -- patching --------------------------------------------------------------------------------

    @property
    def unit_class(self) -> type:
        return importlib.import_module("fsdp_core._unit").FSDPUnit

    def patch_target(self, event: str) -> PatchTarget:
        if event not in UNIT_EVENTS:
            raise ValueError(
                f"{self.name}.patch_target: unknown event {event!r}; expected one of "
                f"{', '.join(UNIT_EVENTS)}"
            )
        return PatchTarget(self.unit_class, event)

    # -- recording and theory --------------------------------------------------------------------

    def probe(self) -> Probe:
        return _CoreProbe()

    def theoretical_volume(self, module: nn.Module, *, full_shard: bool) -> CommVolume | None:
        """The core's volume per unit; ``reshard_after_forward`` is read from each unit (an
        int counts like ``True``: the backward all-gather moves the same bytes, inside a
        smaller group). See [Note: theoretical volume]."""
        units: list[UnitVolume] = []
        for state in _core()._runtime.states_in(module):
            unit = state.unit
            if unit is None or unit.groups.world == 1:
                continue
            rsf = state.config.reshard_after_forward
            reshards = rsf is not False and (
                not state.is_root or state.config.reshard_root_after_forward
            )
            volume = _core_unit_volume(_Instance(state), unit, reshards)
            if state.is_root and reshards and volume.gathers == 1 and volume.reduce_kind:
                volume = UnitVolume(**{**volume.__dict__, "gathers": 2})
            units.append(volume)
        if not units:
            return None
        return CommVolume("fsdp_core.fully_shard: per-parameter dim-0 padding", tuple(units))


class _Instance:
    """What ``fsdp_core``'s unit volume reads of a wrapper instance, for a composable state."""

    def __init__(self, state: Any) -> None:
        self._fsdp_state = state
