"""Engine for torch's FSDP2, ``torch.distributed.fsdp.fully_shard``.

FSDP2 shards a module in place (its class gains ``FSDPModule``) and its parameters become
``DTensor``s. Wrapping, the FSDP1-style option mapping, full parameters and state dicts are
those of every composable engine (``engines/_composable.py``, which lists the mapping); this
module says where FSDP2 lives, and adds its recorder probe and its theoretical volume.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any, ClassVar

import torch.nn as nn

from ._base import OPTIONAL_PATCH_EVENTS, UNIT_EVENTS, PatchTarget
from ._composable import ComposableEngine
from ._probe import Probe, infer_reason_from_torch_caller
from ._volume import CommVolume, UnitVolume, gathers_per_step

__all__ = ["TorchFSDP2Engine"]


def _root_keeps_parameters_by_default() -> bool:
    """Whether ``fully_shard``'s default ``reshard_after_forward=None`` exists, meaning True for
    every module but the root (torch 2.7 and later); older torch defaults to True everywhere."""
    import inspect

    from torch.distributed.fsdp import fully_shard

    default = inspect.signature(fully_shard).parameters["reshard_after_forward"].default
    return default is None


class TorchFSDP2Engine(ComposableEngine):
    """:class:`~fsdp_testing.engines.FSDPEngine` for torch's ``fully_shard``.

    The unit class is ``FSDPParamGroup``; its ``unshard``, ``reshard`` and ``post_backward``
    methods are the patch targets, and the ``backward`` of ``RegisterPostBackwardFunction`` the
    optional ``register_post_backward_hook_backward`` one.
    """

    name = "torch_fsdp2"
    api = "torch.distributed.fsdp.fully_shard"

    def _load_impl(self) -> SimpleNamespace:
        import torch.distributed.fsdp.wrap as wrap_module
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            FSDPModule,
            MixedPrecisionPolicy,
            fully_shard,
        )
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import (
            FSDPParamGroup,
            RegisterPostBackwardFunction,
        )

        targets = {event: PatchTarget(FSDPParamGroup, event) for event in UNIT_EVENTS}
        # See OPTIONAL_PATCH_EVENTS: the autograd function whose backward runs post_backward.
        (optional,) = OPTIONAL_PATCH_EVENTS
        targets[optional] = PatchTarget(RegisterPostBackwardFunction, "backward")
        return SimpleNamespace(
            fully_shard=fully_shard,
            FSDPModule=FSDPModule,
            MixedPrecisionPolicy=MixedPrecisionPolicy,
            CPUOffloadPolicy=CPUOffloadPolicy,
            wrap_module=wrap_module,
            unit_class=FSDPParamGroup,
            patch_targets=targets,
            root_keeps_parameters_by_default=_root_keeps_parameters_by_default(),
        )

    # -- recording and theory --------------------------------------------------------------------

    def probe(self) -> Probe:
        return _FSDP2Probe()

    def theoretical_volume(self, module: nn.Module, *, full_shard: bool) -> CommVolume | None:
        from torch.distributed.fsdp import FSDPModule

        units = []
        for submodule in module.modules():
            if not isinstance(submodule, FSDPModule):
                continue
            state = submodule._get_fsdp_state()
            group = state._fsdp_param_group
            if group is None:
                continue
            world = group.mesh_info.shard_mesh_size  # type: ignore[attr-defined]
            replicas = getattr(group.mesh_info, "replicate_mesh_size", 1)  # HSDP
            if world == 1:
                continue  # nothing to gather or reduce over a group of one rank
            units.append(
                _unit_volume(submodule, group, world, bool(state._is_root), full_shard, replicas)
            )
        if not units:
            return None
        return CommVolume("torch FSDP2: per-parameter dim-0 padding", tuple(units))


def _unit_volume(
    module: nn.Module, group: Any, world: int, is_root: bool, full_shard: bool, replicas: int = 1
) -> UnitVolume:
    """One ``FSDPParamGroup``: every parameter padded in dim 0, gathered in ``param_dtype`` and
    reduced in ``reduce_dtype``; under HSDP (``replicas`` > 1) the reduced shard is then
    all-reduced across the replicate group."""
    gather = reduce = 0
    trainable = False
    for fp in group.fsdp_params:
        numel = math.prod(fp.padded_sharded_param_size) * world
        gather += numel * (fp.param_dtype or fp.orig_dtype).itemsize
        if fp.sharded_param.requires_grad:
            trainable = True
            reduce += numel * (fp.reduce_dtype or fp.param_dtype or fp.orig_dtype).itemsize
    return UnitVolume(
        name=type(module).__name__,
        gather_bytes=gather,
        reduce_bytes=reduce,
        gathers=gathers_per_step(
            sharded=True, is_root=is_root, trainable=trainable, reshard_after_forward=full_shard
        ),
        reduce_kind="reduce_scatter" if trainable else None,
        replica_reduce_bytes=reduce // world if trainable and replicas > 1 else 0,
    )


class _FSDP2Probe(Probe):
    """A unit is an ``FSDPParamGroup``; FSDP2 functions that call its transitions tell the
    reason."""

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

    def reason(self, kind: str, args: tuple[Any, ...]) -> str:
        table = self._UNSHARD if kind == "unshard" else self._RESHARD
        return infer_reason_from_torch_caller(kind, table, "pass_type")
