"""How a unit's state is read from an engine's own objects, and how units are named.

A probe answers, for one engine, what the recorder cannot see from the arguments of a wrapped
transition alone: which unit it is, whether it is unsharded, where its parameters are, and why
it was called. :class:`UnitNames` turns modules and units into FQNs.

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

import os
import sys
from types import FrameType
from typing import Any, ClassVar

import torch.distributed.fsdp
import torch.nn as nn

__all__ = ["Probe", "UnitNames", "clean_fqn", "probe_for"]

_WRAPPER_NAMES = {"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"}
_FSDP_DIR = os.path.dirname(os.path.abspath(torch.distributed.fsdp.__file__))

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


class Probe:
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


class _FSDP1Probe(Probe):
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


class _FSDP2Probe(Probe):
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


class _CoreProbe(Probe):
    exact = True

    def fallback_name(self, unit: Any) -> str:
        return str(getattr(unit, "name", "")) or super().fallback_name(unit)


_PROBES: dict[str, type[Probe]] = {
    "fsdp_core": _CoreProbe,
    "torch_fsdp1": _FSDP1Probe,
    "torch_fsdp2": _FSDP2Probe,
}


def probe_for(engine_name: str) -> Probe:
    """The probe of the engine named ``engine_name`` (the default :class:`Probe` if unknown)."""
    return _PROBES.get(engine_name, Probe)()


class UnitNames:
    """FQNs (wrapper prefixes such as ``_fsdp_wrapped_module`` dropped) of a model's modules."""

    def __init__(self) -> None:
        self._by_id: dict[int, str] = {}

    def __bool__(self) -> bool:
        return bool(self._by_id)

    def add_model(self, model: nn.Module) -> None:
        """Names every module of ``model`` not named already."""
        for name, module in model.named_modules():
            self._by_id.setdefault(id(module), clean_fqn(name))

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


def clean_fqn(name: str) -> str:
    """``name`` without the wrapper parts that engines insert."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_NAMES)
