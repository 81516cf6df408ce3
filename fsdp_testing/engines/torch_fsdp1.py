"""Engine for torch's FSDP1 wrapper, ``torch.distributed.fsdp.FullyShardedDataParallel``.

[Note: FSDP1 on a machine without an accelerator]
FSDP1 (torch 2.13) refuses to build when no accelerator exists unless ``device_id`` is the CPU
("FSDP needs a non-CPU accelerator device"), refuses ``sync_module_states=True`` for CPU modules,
and fails on ``CPUOffload(offload_params=True)`` ("Cannot access accelerator device"). With no
accelerator this engine therefore passes ``device_id=torch.device("cpu")`` unless one is given,
performs ``sync_module_states`` itself (a broadcast from the group's rank 0 before wrapping,
skipping already wrapped subtrees, whose local tensors are shards), and rejects parameter
offloading with a NotImplementedError in torch's own words ("Cannot access accelerator device
when none is available"), so a torch-style test class skips it as needing an accelerator, as it
skips every body that needs one. The same holds on a machine with an accelerator for a rank
whose process group moves CPU tensors only (gloo, threads, local or fake ranks: its ``device``
is the CPU). On an accelerator's backend, arguments pass through unchanged.
"""

from __future__ import annotations

import importlib
import math
from types import SimpleNamespace
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.nn as nn

from ._base import (
    PatchTarget,
    broadcast_module_states,
    computes_on_cpu,
    has_accelerator,
    translate_kwargs,
)
from ._probe import Probe, infer_reason_from_torch_caller
from ._volume import CommVolume, UnitVolume, gathers_per_step
from ._wrapper import WrapperEngine

__all__ = ["TorchFSDP1Engine"]


class TorchFSDP1Engine(WrapperEngine):
    """:class:`~fsdp_testing.engines.FSDPEngine` for torch's ``FullyShardedDataParallel``.

    Unit transitions are FSDP1's free functions in ``torch.distributed.fsdp._runtime_utils``
    (``_unshard``, ``_reshard``, ``_post_backward_hook``); the unit class is ``FlatParamHandle``.
    """

    name = "torch_fsdp1"

    def _load_api(self) -> SimpleNamespace:
        import torch.distributed.fsdp as fsdp
        import torch.distributed.fsdp._runtime_utils as runtime
        import torch.distributed.fsdp.wrap as wrap_module
        from torch.distributed.fsdp._flat_param import FlatParamHandle

        return SimpleNamespace(
            FSDP=fsdp.FullyShardedDataParallel,
            wrap_module=wrap_module,
            StateDictType=fsdp.StateDictType,
            option_types={
                "sharding_strategy": fsdp.ShardingStrategy,
                "backward_prefetch": fsdp.BackwardPrefetch,
                "cpu_offload": fsdp.CPUOffload,
                "mixed_precision": fsdp.MixedPrecision,
            },
            unit_class=FlatParamHandle,
            patch_targets={
                "unshard": PatchTarget(runtime, "_unshard"),
                "reshard": PatchTarget(runtime, "_reshard"),
                "post_backward": PatchTarget(runtime, "_post_backward_hook"),
            },
        )

    def wrap(
        self, module: nn.Module, process_group: dist.ProcessGroup | None = None, **fsdp_kwargs: Any
    ) -> nn.Module:
        _attach_functional_collectives()
        return super().wrap(module, process_group, **fsdp_kwargs)

    def _prepare_kwargs(
        self,
        module: nn.Module,
        process_group: dist.ProcessGroup | None,
        fsdp_kwargs: dict[str, Any],
    ) -> dict[str, Any]:
        if not computes_on_cpu(process_group):
            return fsdp_kwargs
        # See [Note: FSDP1 on a machine without an accelerator]
        kwargs = dict(fsdp_kwargs)
        if kwargs.get("device_id") is None:
            kwargs["device_id"] = torch.device("cpu")
        offload = kwargs.get("cpu_offload")
        if offload is not None and getattr(offload, "offload_params", False):
            # torch's own words for this case, which the torch-compatible classes turn into a
            # skip naming the need (see fsdp_testing/_compat/accelerator_errors.py).
            why = (
                "this rank's process group computes on the CPU; run it on the accelerator's "
                "backend (nccl)"
                if has_accelerator()
                else "Cannot access accelerator device when none is available"
            )
            raise NotImplementedError(
                "engine 'torch_fsdp1': torch's FSDP1 offloads parameters "
                f"(cpu_offload=CPUOffload(offload_params=True)) through an accelerator: {why}. "
                "Use engine 'torch_fsdp2' or 'fsdp_core', or drop cpu_offload"
            )
        if kwargs.pop("sync_module_states", False):
            broadcast_module_states(
                module, process_group, skip=lambda m: isinstance(m, self.api.FSDP)
            )
        return kwargs

    def probe(self) -> Probe:
        return _FSDP1Probe()

    def theoretical_volume(self, module: nn.Module, *, full_shard: bool) -> CommVolume | None:
        units = [
            _unit_volume(instance, instance._handle, full_shard)
            for instance in self.api.FSDP.fsdp_modules(module)
            if getattr(instance, "_handle", None) is not None
        ]
        if not units:
            return None
        return CommVolume("torch FSDP1: one flat parameter per unit, padded", tuple(units))

    def full_precision_classes(self, mixed_precision: Any) -> tuple[type[nn.Module], ...]:
        # FSDP1 wraps these separately with mixed precision off (MixedPrecision's
        # ``_module_classes_to_ignore``, batch norms by default), whatever policy was given.
        if mixed_precision is None:
            return ()
        policy = translate_kwargs({"mixed_precision": mixed_precision}, self.api.option_types)
        return tuple(getattr(policy["mixed_precision"], "_module_classes_to_ignore", ()))


def _unit_volume(instance: Any, handle: Any, full_shard: bool) -> UnitVolume:
    """One flat parameter: gathered in the compute dtype, reduced in the reduce dtype."""
    flat = handle.flat_param
    world = instance.world_size
    sharded = handle.uses_sharded_strategy
    gather_size = (getattr(handle, "_fwd_bwd_param_dtype", None) or flat.dtype).itemsize
    reduce_size = (getattr(handle, "_reduce_dtype", None) or flat.dtype).itemsize
    numel = sum(flat._numels_with_padding)
    padded = math.ceil(numel / world) * world if sharded else numel
    trainable = flat.requires_grad
    reduce_kind = None
    if trainable and world > 1:
        reduce_kind = "reduce_scatter" if sharded else "all_reduce"
    # Hybrid strategies: ``world`` is the shard group's; the reduced shard is then all-reduced
    # across the replicate group (``_inter_node_pg``).
    inter_node = getattr(instance, "_inter_node_pg", None)
    replicas = dist.get_world_size(inter_node) if inter_node is not None else 1
    return UnitVolume(
        name=type(instance.module).__name__,
        gather_bytes=padded * gather_size if sharded else 0,
        reduce_bytes=padded * reduce_size if trainable else 0,
        gathers=gathers_per_step(
            sharded=sharded,
            is_root=bool(instance._is_root),
            trainable=trainable,
            reshard_after_forward=full_shard,
        ),
        reduce_kind=reduce_kind,
        replica_reduce_bytes=padded // world * reduce_size if trainable and replicas > 1 else 0,
    )


class _FSDP1Probe(Probe):
    """A unit is a ``FlatParamHandle``; transitions are ``(state, handle, ...)`` free functions,
    called by FSDP1 functions that tell the reason."""

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

    def reason(self, kind: str, args: tuple[Any, ...]) -> str:
        table = self._UNSHARD if kind == "unshard" else self._RESHARD
        return infer_reason_from_torch_caller(kind, table, "prefetch_mode")


def _attach_functional_collectives() -> None:
    # FSDP1's FlatParamHandle reads ``torch.distributed._functional_collectives`` as an
    # attribute without importing it (torch 2.13), so it fails with an AttributeError in a
    # process where nothing imported it, or where the submodule is in sys.modules but the
    # attribute on torch.distributed was removed (a warm rank restoring module attributes).
    module = importlib.import_module("torch.distributed._functional_collectives")
    if getattr(dist, "_functional_collectives", None) is not module:
        dist._functional_collectives = module
