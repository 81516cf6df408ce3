"""Shared implementation for engines with a composable ``fully_shard`` API.

torch's FSDP2 ``fully_shard`` and ``fsdp_core.fully_shard`` share one surface (``fully_shard``
applied bottom-up on a ``DeviceMesh``, ``MixedPrecisionPolicy``, ``CPUOffloadPolicy``, an
``FSDPModule`` class, ``DTensor`` parameters), so one class implements
:class:`~fsdp_testing.engines.FSDPEngine` for both; subclasses say where the API lives
(:meth:`ComposableEngine._load_impl`) and add their probe and theory. FSDP1-style options are
mapped where the meaning carries over:

============================  =====================================================
FSDP1 option                  ``fully_shard``
============================  =====================================================
process_group                 ``mesh=DeviceMesh.from_group(process_group, ...)``
device_mesh                   ``mesh=device_mesh`` (instead of ``process_group``)
sharding_strategy             FULL_SHARD: ``reshard_after_forward`` left to the
                              implementation (True, except the root, which keeps its
                              parameters for backward as FSDP1's root does);
                              SHARD_GRAD_OP: ``reshard_after_forward=False``;
                              HYBRID_SHARD, _HYBRID_SHARD_ZERO2: the same on a 2-D
                              ``device_mesh`` (replicate, shard): HSDP
cpu_offload                   ``offload_policy=CPUOffloadPolicy(pin_memory=...)``
mixed_precision               ``mp_policy=MixedPrecisionPolicy(param_dtype, reduce_dtype)``,
                              ``reduce_dtype=None`` as ``param_dtype`` (FSDP1's meaning)
auto_wrap_policy              ``fully_shard`` on each selected submodule, bottom-up
ignored_modules               ``ignored_params`` = their parameters
device_id                     the module is moved there and the mesh uses its type
sync_module_states            a broadcast from the group's rank 0 before sharding
backward_prefetch             None or BACKWARD_PRE (``fully_shard`` always prefetches
                              one unit)
use_orig_params, limit_all_   accepted: ``fully_shard`` always keeps the original
gathers                       parameters and bounds its all-gathers itself
============================  =====================================================

Anything else (NO_SHARD, a hybrid strategy without a 2-D ``device_mesh``, ``buffer_dtype``,
``keep_low_precision_grads``, ``forward_prefetch=True``, BACKWARD_POST) raises
NotImplementedError naming the engine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ._base import (
    BaseEngine,
    PatchTarget,
    broadcast_module_states,
    clean_param_name,
    default_process_group,
    has_accelerator,
    modules_selected_by_policy,
)

__all__ = ["ACCEPTED_OPTIONS", "ComposableEngine"]

#: The FSDP1-style options a composable engine's ``wrap`` accepts.
ACCEPTED_OPTIONS = frozenset(
    {
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
)

#: Hybrid strategy -> the single-group strategy it runs in each shard group.
_HYBRID = {"HYBRID_SHARD": "FULL_SHARD", "_HYBRID_SHARD_ZERO2": "SHARD_GRAD_OP"}


class ComposableEngine(BaseEngine):
    """An engine whose units are modules a ``fully_shard`` function was applied to.

    Subclasses set ``name`` and ``api`` (the function the engine drives, named in its errors)
    and implement :meth:`_load_impl`, returning a namespace with ``fully_shard``,
    ``FSDPModule``, ``MixedPrecisionPolicy``, ``CPUOffloadPolicy``, ``wrap_module`` (with
    ``ModuleWrapPolicy`` and ``always_wrap_policy``), ``unit_class``, ``patch_targets`` (event
    to :class:`PatchTarget`) and ``root_keeps_parameters_by_default`` (whether ``fully_shard``
    left at its default keeps the root's parameters from forward to backward).
    """

    name: str = ""
    #: The API the engine drives, named in its "does not support" errors.
    api: str = ""
    _impl_cache: SimpleNamespace | None = None

    def _load_impl(self) -> SimpleNamespace:
        raise NotImplementedError

    @property
    def impl(self) -> SimpleNamespace:
        """The lazily imported API namespace described in the class docstring."""
        if self._impl_cache is None:
            self._impl_cache = self._load_impl()
        return self._impl_cache

    def _unsupported(self, option: str, value: object, why: str = "") -> NotImplementedError:
        return NotImplementedError(
            f"engine {self.name!r} ({self.api}) does not support "
            f"{option}={value!r}{': ' + why if why else ''}; run this configuration with engine "
            "'torch_fsdp1' or 'fsdp_core'"
        )

    # -- wrapping -------------------------------------------------------------------------------

    def wrap(
        self, module: nn.Module, process_group: dist.ProcessGroup | None = None, **fsdp_kwargs: Any
    ) -> nn.Module:
        unknown = sorted(set(fsdp_kwargs) - ACCEPTED_OPTIONS)
        if unknown:
            raise TypeError(
                f"engine {self.name!r}: unknown FSDP options {', '.join(unknown)}; accepted: "
                f"{', '.join(sorted(ACCEPTED_OPTIONS))}"
            )
        shard_kwargs = self._fully_shard_kwargs(fsdp_kwargs)  # validates before any effect
        device = self._device(module, fsdp_kwargs.get("device_id"))
        if fsdp_kwargs.get("device_id") is not None:
            module.to(device)
        group = process_group if process_group is not None else default_process_group()
        shard_kwargs["mesh"] = self._mesh_of(group, device.type, fsdp_kwargs)
        if fsdp_kwargs.get("sync_module_states"):
            broadcast_module_states(module, group, skip=self.is_wrapped)
        fully_shard = self.impl.fully_shard
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
            from torch.distributed.device_mesh import DeviceMesh

            return DeviceMesh.from_group(group, device_type)
        if hybrid and getattr(mesh, "ndim", None) != 2:
            raise self._unsupported(
                "sharding_strategy", fsdp_kwargs["sharding_strategy"],
                f"HSDP needs a 2-D device_mesh (replicate, shard), got {mesh!r}",
            )  # fmt: skip
        if not hybrid and getattr(mesh, "ndim", None) != 1:
            raise ValueError(
                f"engine {self.name!r}: sharding_strategy={name or None} takes a 1-D "
                f"device_mesh, got {mesh!r}; pass HYBRID_SHARD for a 2-D mesh"
            )
        return mesh

    def _fully_shard_kwargs(self, fsdp_kwargs: dict[str, Any]) -> dict[str, Any]:
        """The ``fully_shard`` keyword arguments (mesh aside) for FSDP1-style options, with
        this engine's policy classes; raises for an option without a counterpart."""
        result: dict[str, Any] = {}
        strategy = fsdp_kwargs.get("sharding_strategy")
        if strategy is not None:
            name = _HYBRID.get(getattr(strategy, "name", ""), getattr(strategy, "name", ""))
            if name not in ("FULL_SHARD", "SHARD_GRAD_OP"):
                raise self._unsupported(
                    "sharding_strategy", strategy, "only FULL_SHARD/SHARD_GRAD_OP (and hybrid)"
                )
            if name == "SHARD_GRAD_OP":
                result["reshard_after_forward"] = False
            elif not self.impl.root_keeps_parameters_by_default:
                result["reshard_after_forward"] = True
        offload = fsdp_kwargs.get("cpu_offload")
        if offload is not None and getattr(offload, "offload_params", False):
            result["offload_policy"] = self.impl.CPUOffloadPolicy(pin_memory=has_accelerator())
        mixed = fsdp_kwargs.get("mixed_precision")
        if mixed is not None:
            if getattr(mixed, "buffer_dtype", None) is not None:
                raise self._unsupported("mixed_precision.buffer_dtype", mixed.buffer_dtype)
            if getattr(mixed, "keep_low_precision_grads", False):
                raise self._unsupported("mixed_precision.keep_low_precision_grads", True)
            # FSDP1's reduce_dtype=None means param_dtype; FSDP2's means the gradient's own
            # dtype from torch 2.15 (float32 for float32 parameters), so it is passed as such.
            result["mp_policy"] = self.impl.MixedPrecisionPolicy(
                param_dtype=mixed.param_dtype, reduce_dtype=mixed.reduce_dtype or mixed.param_dtype
            )
        prefetch = fsdp_kwargs.get("backward_prefetch")
        if prefetch is not None and getattr(prefetch, "name", "") != "BACKWARD_PRE":
            raise self._unsupported(
                "backward_prefetch", prefetch, "FSDP2 prefetches like BACKWARD_PRE"
            )
        if fsdp_kwargs.get("forward_prefetch"):
            raise self._unsupported("forward_prefetch", True, "use set_modules_to_forward_prefetch")
        ignored = fsdp_kwargs.get("ignored_modules")
        if ignored:
            result["ignored_params"] = {p for m in ignored for p in m.parameters()}
        return result

    def is_wrapped(self, module: nn.Module) -> bool:
        return isinstance(module, self.impl.FSDPModule)

    def manages(self, module: nn.Module) -> bool:
        return any(self.is_wrapped(m) for m in module.modules())

    def module_wrap_policy(self, module_classes: Iterable[type[nn.Module]]) -> Any:
        return self.impl.wrap_module.ModuleWrapPolicy(set(module_classes))

    def always_wrap_policy(self) -> Any:
        return self.impl.wrap_module.always_wrap_policy

    def enable_wrap(
        self, process_group: dist.ProcessGroup | None = None, **fsdp_kwargs: Any
    ) -> contextlib.AbstractContextManager[None]:
        raise NotImplementedError(
            f"engine {self.name!r}: fully_shard has no enable_wrap()/wrap() context; apply "
            "fully_shard bottom-up or pass auto_wrap_policy to the engine's wrap()"
        )

    def wrap_if_enabled(self, module: nn.Module) -> nn.Module:
        # No enable_wrap context can be active for this engine, and wrap() outside one returns
        # the module unchanged.
        return module

    # -- full parameters and state dicts: DTensor parameters -------------------------------------

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
        return self.impl.unit_class

    def patch_target(self, event: str) -> PatchTarget:
        targets: dict[str, PatchTarget] = self.impl.patch_targets
        if event not in targets:
            raise ValueError(
                f"{self.name}.patch_target: unknown event {event!r}; "
                f"expected one of {', '.join(targets)}"
            )
        return targets[event]
