"""Naming units by FQN, and what the recorder's records mean for each engine.

What the recorder cannot see from the arguments of a wrapped transition it asks the engine's
probe (``engine.probe()``, :class:`fsdp_testing.engines.Probe`; each engine module defines its
own). :class:`UnitNames` turns modules and units into FQNs.

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
- Under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, ``fsdp_core``'s first iteration also issues one
  small all-reduce per unit collective to check that ranks agree on the order; it is recorded
  like any other collective (``unit=""``).
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from ..engines import Probe, clean_param_name

__all__ = ["UnitNames"]


class UnitNames:
    """FQNs (wrapper prefixes such as ``_fsdp_wrapped_module`` dropped) of a model's modules."""

    def __init__(self) -> None:
        self._by_id: dict[int, str] = {}

    def __bool__(self) -> bool:
        return bool(self._by_id)

    def add_model(self, model: nn.Module) -> None:
        """Names every module of ``model`` not named already."""
        for name, module in model.named_modules():
            self._by_id.setdefault(id(module), clean_param_name(name))

    def module(self, module: nn.Module) -> str:
        """The FQN of ``module``; raises ValueError if it is not in a model added."""
        name = self._by_id.get(id(module))
        if name is None:
            raise ValueError(
                f"FSDPRecorder: {type(module).__name__} is not a submodule of the recorded "
                "model; pass the model to record_fsdp(model) and modules from it"
            )
        return name

    def unit(self, unit: Any, probe: Probe) -> str:
        """The FQN of the first named module of ``unit``, else the probe's fallback name."""
        for module in probe.modules(unit):
            name = self._by_id.get(id(module))
            if name is not None:
                return name
        return probe.fallback_name(unit)
