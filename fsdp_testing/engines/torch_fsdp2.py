"""Engine for torch's FSDP2, ``torch.distributed.fsdp.fully_shard``.

FSDP2 shards a module in place (its class gains ``FSDPModule``) and its parameters become
``DTensor``s. FSDP1-style options are mapped where the meaning carries over:

============================  =====================================================
FSDP1 option                  ``fully_shard``
============================  =====================================================
process_group                 ``mesh=DeviceMesh.from_group(process_group, ...)``
device_mesh                   ``mesh=device_mesh`` (instead of ``process_group``)
sharding_strategy             FULL_SHARD: ``reshard_after_forward`` left to FSDP2
                              (True, except the root, which keeps its parameters
                              for backward as FSDP1's root does);
                              SHARD_GRAD_OP: ``reshard_after_forward=False``;
                              HYBRID_SHARD, _HYBRID_SHARD_ZERO2: the same on a 2-D
                              ``device_mesh`` (replicate, shard): HSDP
cpu_offload                   ``offload_policy=CPUOffloadPolicy(pin_memory=...)``
mixed_precision               ``mp_policy=MixedPrecisionPolicy(param_dtype, reduce_dtype)``
auto_wrap_policy              ``fully_shard`` on each selected submodule, bottom-up
ignored_modules               ``ignored_params`` = their parameters
device_id                     the module is moved there and the mesh uses its type
sync_module_states            a broadcast from the group's rank 0 before sharding
backward_prefetch             None or BACKWARD_PRE (FSDP2 always prefetches one unit)
use_orig_params, limit_all_   accepted: FSDP2 always keeps the original parameters and
gathers                       bounds its all-gathers itself
============================  =====================================================

Anything else (NO_SHARD, a hybrid strategy without a 2-D ``device_mesh``, ``buffer_dtype``,
``keep_low_precision_grads``, ``forward_prefetch=True``, BACKWARD_POST) raises
NotImplementedError naming this engine.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.nn as nn

from ._base import (
    OPTIONAL_PATCH_EVENTS,
    UNIT_EVENTS,
    BaseEngine,
    PatchTarget,
    broadcast_module_states,
    clean_param_name,
    default_process_group,
    has_accelerator,
    modules_selected_by_policy,
)
from ._probe import Probe, infer_reason_from_torch_caller
from ._volume import CommVolume, UnitVolume, gathers_per_step

__all__ = ["TorchFSDP2Engine"]

_ACCEPTED = {
    "auto_wrap_policy",
    "sharding_strategy",
    "cpu_offload",
    "mixed_precision",
    "ignored_modules",
    "device_id",
    "sync_module_states",
    "backward_prefetch",
    "forward_prefetch",
    "use_orig_params",
    "limit_all_gathers",
    "device_mesh",
}

#: Hybrid strategy -> the single-group strategy it runs in each shard group.
_HYBRID = {"HYBRID_SHARD": "FULL_SHARD", "_HYBRID_SHARD_ZERO2": "SHARD_GRAD_OP"}


def _unsupported(
    engine: type[TorchFSDP2Engine], option: str, value: object, why: str = ""
) -> NotImplementedError:
    return NotImplementedError(
        f"engine {engine.name!r} ({engine.api}) does not support "
        f"{option}={value!r}{': ' + why if why else ''}; run this configuration with engine "
        "'torch_fsdp1' or 'fsdp_core'"
    )


def _root_keeps_parameters_by_default() -> bool:
    """Whether ``fully_shard``'s default ``reshard_after_forward=None`` exists, meaning True for
    every module but the root (torch 2.7 and later); older torch defaults to True everywhere."""
    import inspect

    from torch.distributed.fsdp import fully_shard

    default = inspect.signature(fully_shard).parameters["reshard_after_forward"].default
    return default is None


class TorchFSDP2Engine(BaseEngine):
    """:class:`~fsdp_testing.engines.FSDPEngine` for torch's ``fully_shard``.

    The unit class is ``FSDPParamGroup``; its ``unshard``, ``reshard`` and ``post_backward``
    methods are the patch targets.
    """

    name = "torch_fsdp2"
    #: The API the engine drives, named in its "does not support" errors.
    api = "torch.distributed.fsdp.fully_shard"

    # -- wrapping -------------------------------------------------------------------------------

    def wrap(
        self, module: nn.Module, process_group: dist.ProcessGroup | None = None, **fsdp_kwargs: Any
    ) -> nn.Module:
        from torch.distributed.fsdp import fully_shard

        unknown = sorted(set(fsdp_kwargs) - _ACCEPTED)
        if unknown:
            raise TypeError(
                f"engine 'torch_fsdp2': unknown FSDP options {', '.join(unknown)}; accepted: "
                f"{', '.join(sorted(_ACCEPTED))}"
            )
        shard_kwargs = self._fully_shard_kwargs(fsdp_kwargs)  # validates before any effect
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
                    fully_shard(submodule, **shard_kwargs)
        fully_shard(module, **shard_kwargs)
        return module

    @staticmethod
    def _device(module: nn.Module, device_id: Any) -> torch.device:
        if device_id is not None:
            if isinstance(device_id, int):
                return torch.device("cuda", device_id)
            return torch.device(device_id)
        for tensor in module.parameters():
            return tensor.device
        return torch.device("cuda" if has_accelerator() else "cpu")

    def _mesh_of(
        self, group: dist.ProcessGroup, device_type: str, fsdp_kwargs: dict[str, Any]
    ) -> Any:
        """``device_mesh`` when given (2-D exactly for the hybrid strategies), else a 1-D mesh
        over ``group``."""
        mesh = fsdp_kwargs.get("device_mesh")
        name = getattr(fsdp_kwargs.get("sharding_strategy"), "name", "")
        hybrid = name in _HYBRID
        if mesh is None and not hybrid:
            return self._mesh(group, device_type)
        if hybrid and getattr(mesh, "ndim", None) != 2:
            raise _unsupported(
                type(self), "sharding_strategy", fsdp_kwargs["sharding_strategy"],
                f"HSDP needs a 2-D device_mesh (replicate, shard), got {mesh!r}",
            )  # fmt: skip
        if not hybrid and getattr(mesh, "ndim", None) != 1:
            raise ValueError(
                f"engine {self.name!r}: sharding_strategy={name or None} takes a 1-D "
                f"device_mesh, got {mesh!r}; pass HYBRID_SHARD for a 2-D mesh"
            )
        return mesh

    @staticmethod
    def _mesh(group: dist.ProcessGroup, device_type: str) -> Any:
        from torch.distributed.device_mesh import DeviceMesh

        return DeviceMesh.from_group(group, device_type)

    @classmethod
    def _fully_shard_kwargs(cls, fsdp_kwargs: dict[str, Any]) -> dict[str, Any]:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

        result: dict[str, Any] = {}
        strategy = fsdp_kwargs.get("sharding_strategy")
        if strategy is not None:
            name = _HYBRID.get(getattr(strategy, "name", ""), getattr(strategy, "name", ""))
            if name not in ("FULL_SHARD", "SHARD_GRAD_OP"):
                raise _unsupported(
                    cls, "sharding_strategy", strategy, "only FULL_SHARD/SHARD_GRAD_OP (and hybrid)"
                )
            if name == "SHARD_GRAD_OP":
                result["reshard_after_forward"] = False
            elif not _root_keeps_parameters_by_default():
                result["reshard_after_forward"] = True
        offload = fsdp_kwargs.get("cpu_offload")
        if offload is not None and getattr(offload, "offload_params", False):
            result["offload_policy"] = CPUOffloadPolicy(pin_memory=has_accelerator())
        mixed = fsdp_kwargs.get("mixed_precision")
        if mixed is not None:
            if getattr(mixed, "buffer_dtype", None) is not None:
                raise _unsupported(cls, "mixed_precision.buffer_dtype", mixed.buffer_dtype)
            if getattr(mixed, "keep_low_precision_grads", False):
                raise _unsupported(cls, "mixed_precision.keep_low_precision_grads", True)
            result["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=mixed.param_dtype, reduce_dtype=mixed.reduce_dtype
            )
        prefetch = fsdp_kwargs.get("backward_prefetch")
        if prefetch is not None and getattr(prefetch, "name", "") != "BACKWARD_PRE":
            raise _unsupported(
                cls, "backward_prefetch", prefetch, "FSDP2 prefetches like BACKWARD_PRE"
            )
        if fsdp_kwargs.get("forward_prefetch"):
            raise _unsupported(cls, "forward_prefetch", True, "use set_modules_to_forward_prefetch")
        ignored = fsdp_kwargs.get("ignored_modules")
        if ignored:
            result["ignored_params"] = {p for m in ignored for p in m.parameters()}
        return result

    def is_wrapped(self, module: nn.Module) -> bool:
        from torch.distributed.fsdp import FSDPModule

        return isinstance(module, FSDPModule)

    def manages(self, module: nn.Module) -> bool:
        return any(self.is_wrapped(m) for m in module.modules())

    def module_wrap_policy(self, module_classes: Iterable[type[nn.Module]]) -> Any:
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return ModuleWrapPolicy(set(module_classes))

    def always_wrap_policy(self) -> Any:
        from torch.distributed.fsdp.wrap import always_wrap_policy

        return always_wrap_policy

    def enable_wrap(
        self, process_group: dist.ProcessGroup | None = None, **fsdp_kwargs: Any
    ) -> contextlib.AbstractContextManager[None]:
        raise NotImplementedError(
            "engine 'torch_fsdp2': fully_shard has no enable_wrap()/wrap() context; apply "
            "fully_shard bottom-up or pass auto_wrap_policy to the engine's wrap()"
        )

    def wrap_if_enabled(self, module: nn.Module) -> nn.Module:
        # No enable_wrap context can be active for this engine, and torch's wrap() outside one
        # returns the module unchanged.
        return module

    # -- full parameters and state dicts ---------------------------------------------------------

    @contextlib.contextmanager
    def full_params(
        self, module: nn.Module, *, recurse: bool = True, writeback: bool = True
    ) -> Iterator[None]:
        from torch.distributed.tensor import DTensor, distribute_tensor

        # Swap each DTensor parameter for a plain full one, and on exit copy the full values
        # back into the local shards (each rank slices its own chunk; no communication).
        swapped: list[tuple[nn.Module, str, DTensor, nn.Parameter]] = []
        owners = module.modules() if recurse else iter([module])
        for owner in owners:
            for name, param in list(owner._parameters.items()):
                if isinstance(param, DTensor):
                    full = nn.Parameter(param.full_tensor().detach(), param.requires_grad)
                    owner._parameters[name] = full
                    swapped.append((owner, name, param, full))
        try:
            yield
        finally:
            for owner, name, sharded, full in swapped:
                owner._parameters[name] = sharded  # type: ignore[assignment]
                if writeback:
                    local = distribute_tensor(
                        full.detach(), sharded.device_mesh, sharded.placements, src_data_rank=None
                    )
                    with torch.no_grad():
                        sharded.to_local().copy_(local.to_local())

    def named_full_params(self, module: nn.Module) -> list[tuple[str, torch.Tensor]]:
        from torch.distributed.tensor import DTensor

        return [
            (
                clean_param_name(name),
                (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone(),
            )
            for name, p in module.named_parameters()
        ]

    def full_state_dict(self, module: nn.Module) -> dict[str, Any]:
        from torch.distributed.tensor import DTensor

        return {
            key: (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()
            if isinstance(value, torch.Tensor)
            else value
            for key, value in module.state_dict().items()
        }

    def load_full_state_dict(self, module: nn.Module, state_dict: dict[str, Any]) -> None:
        from torch.distributed.tensor import DTensor, distribute_tensor

        current = module.state_dict()
        converted = {}
        for key, value in state_dict.items():
            target = current.get(key)
            if isinstance(target, DTensor) and not isinstance(value, DTensor):
                value = distribute_tensor(
                    value.to(target.device),
                    target.device_mesh,
                    target.placements,
                    src_data_rank=None,
                )
            converted[key] = value
        module.load_state_dict(converted)

    # -- patching --------------------------------------------------------------------------------

    @property
    def unit_class(self) -> type:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        return FSDPParamGroup

    def patch_target(self, event: str) -> PatchTarget:
        if event == "register_post_backward_hook_backward":
            # See OPTIONAL_PATCH_EVENTS: the autograd function whose backward runs post_backward.
            from torch.distributed.fsdp._fully_shard._fsdp_param_group import (
                RegisterPostBackwardFunction,
            )

            return PatchTarget(RegisterPostBackwardFunction, "backward")
        if event not in UNIT_EVENTS:
            raise ValueError(
                f"torch_fsdp2.patch_target: unknown event {event!r}; "
                f"expected one of {', '.join(UNIT_EVENTS + OPTIONAL_PATCH_EVENTS)}"
            )
        return PatchTarget(self.unit_class, event)

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
