"""The wrapper door: ``FullyShardedDataParallel`` with torch's FSDP1 names."""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from . import _init
from . import wrap as _wrap
from ._param import DTensorLayout, ParamSpec
from ._precision import UnitPrecision
from ._runtime import (
    WRAPPED_MODULE_NAME,
    FSDPState,
    RuntimeConfig,
    clean_fqn,
    state_of,
    states_in,
)
from ._state_dict import optim as _optim_state
from ._state_dict import settings as _state_dict_types
from ._unit import FSDPUnit
from ._wrapper.args import (
    HYBRID_STRATEGIES,
    consumed_by_nested,
    resolve_wrapper_groups,
    validate_hybrid_agreement,
    validate_wrapper_args,
)
from ._wrapper.clip_grad import clip_grad_norm
from ._wrapper.full_params import apply_with_full_params
from ._wrapper.full_params import summon_full_params as _summon_full_params
from .api import (
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    ShardingStrategy,
    TrainingState,
)

__all__ = ["FSDP", "FullyShardedDataParallel"]

_API = "FullyShardedDataParallel"


class FullyShardedDataParallel(nn.Module):
    """Shard ``module``'s parameters over ``process_group``, one unit per wrapped module.

    Each wrapped module owns the parameters not owned by a nested wrapped module. Between passes
    the module (and ``parameters()``, so the optimizer) sees each rank's dim-0 shard of every
    parameter, a ``DTensor``; forward and backward all-gather the full parameters once per
    unit and reduce gradients once per unit. ``named_parameters()`` gives the original names.

    Args:
        module: the module to wrap.
        process_group: the group to shard over (default ``None``: the default group); for
            the hybrid strategies a pair ``(shard_group, replicate_group)`` whose groups tile
            the world as a grid (default ``None``: shard within a node, replicate across
            nodes; see ``docs/core.md``).
        sharding_strategy: ``FULL_SHARD`` (default), ``SHARD_GRAD_OP``, ``NO_SHARD``,
            ``HYBRID_SHARD`` (``FULL_SHARD`` inside the shard group, gradients then
            all-reduced across the replicate group) or ``_HYBRID_SHARD_ZERO2`` (the same with
            ``SHARD_GRAD_OP``). Hybrid instances of one model must use the same groups.
        cpu_offload: ``CPUOffload(offload_params=True)`` keeps the sharded parameters and their
            gradients on the CPU and copies them to the compute device only to gather (default
            ``None``: no offload). The module must not be moved off the CPU afterwards.
        auto_wrap_policy: a policy from :mod:`fsdp_core.wrap` choosing submodules to wrap as
            their own units (default ``None``: only ``module``).
        backward_prefetch: ``BACKWARD_PRE`` (default), ``BACKWARD_POST`` or ``None``; which
            unit is gathered ahead in backward follows the reverse of the first iteration's
            graph order.
        mixed_precision: a ``MixedPrecision`` policy for parameters, gradient reduction and
            buffers (default ``None``: full precision). See [Note: mixed precision].
        ignored_modules: modules (with their submodules) whose parameters and buffers FSDP
            does not manage: not sharded, not gathered, gradients not reduced (default
            ``None``).
        param_init_fn: ``fn(module)`` materializing modules on the meta device before
            sharding, called on every module of the subtree this instance owns (default
            ``None``: ``to_empty`` on ``device_id`` or the CPU, then ``reset_parameters()``).
        ignored_states: parameters, or modules, FSDP does not manage (default ``None``);
            exclusive with ``ignored_modules``.
        device_id: device to move the module to before sharding, which is also the compute
            device (default ``None``: the parameters' device). ``"meta"`` keeps a module
            built on the meta device there (no materialization): sharding and steps then
            allocate nothing, for planning.
        sync_module_states: broadcast parameters and buffers from rank 0 of the group before
            sharding (default ``False``).
        forward_prefetch: gather the next unit in forward order when a unit's forward starts
            (default ``False``); from the second iteration on.
        limit_all_gathers: bound the memory held by prefetching (default ``True``). On the CPU
            (gloo) collectives run synchronously, so there is never more than one all-gather in
            flight; what this bounds instead is how many units may be unsharded at once through
            prefetching: a prefetch is skipped while two or more non-root units are already
            unsharded, and that unit is gathered when it is needed instead.
        use_orig_params: accepted for compatibility; fsdp_core always exposes the original
            parameters (as shards), which is torch's ``use_orig_params=True`` behaviour.
        device_mesh: instead of ``process_group``: a 1-D mesh, or for the hybrid strategies a
            2-D mesh whose dim 0 replicates and dim 1 shards (default ``None``).
    """

    def __init__(
        self,
        module: nn.Module,
        process_group: dist.ProcessGroup | None = None,
        *,
        sharding_strategy: ShardingStrategy | None = None,
        cpu_offload: CPUOffload | None = None,
        auto_wrap_policy: _wrap.WrapPolicy | None = None,
        backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
        mixed_precision: MixedPrecision | None = None,
        ignored_modules: Iterable[nn.Module] | None = None,
        device_id: int | torch.device | None = None,
        sync_module_states: bool = False,
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,
        use_orig_params: bool = False,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        ignored_states: Iterable[nn.Parameter] | Iterable[nn.Module] | None = None,
        device_mesh: Any = None,
    ) -> None:
        super().__init__()
        strategy = sharding_strategy or ShardingStrategy.FULL_SHARD
        validate_wrapper_args(module, strategy, cpu_offload, backward_prefetch, mixed_precision)
        if isinstance(module, FullyShardedDataParallel):
            raise ValueError(
                "FullyShardedDataParallel(module) got a module that is already wrapped; pass "
                "the inner module (fsdp.module) or use the existing wrapper."
            )
        if not dist.is_initialized():
            raise RuntimeError(
                "FullyShardedDataParallel needs torch.distributed to be initialized; call "
                "dist.init_process_group(...) before wrapping."
            )
        groups = resolve_wrapper_groups(strategy, process_group, device_mesh)
        group = groups.shard if groups.shard is not None else groups.replicate
        assert group is not None  # for mypy: every strategy has one of the two
        ignored, ignored_params = _init.resolve_ignored(
            "FullyShardedDataParallel", ignored_modules, ignored_states, _is_unit
        )
        self.process_group = group  # the shard group (NO_SHARD: the group it replicates over)
        self._inter_node_pg = groups.replicate if strategy in HYBRID_STRATEGIES else None
        self._unit_groups = groups
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.sharding_strategy = strategy
        self.backward_prefetch = backward_prefetch
        self.forward_prefetch = forward_prefetch
        self.limit_all_gathers = limit_all_gathers
        self.cpu_offload = cpu_offload or CPUOffload()
        self.mixed_precision = mixed_precision
        self.use_orig_params = use_orig_params

        if auto_wrap_policy is not None:
            child_kwargs: dict[str, Any] = {
                "sharding_strategy": strategy,
                "cpu_offload": cpu_offload,
                "backward_prefetch": backward_prefetch,
                "mixed_precision": mixed_precision,
                # torch passes its children the ignored parameters; given as modules, the
                # modules go down so that their buffers stay ignored too.
                "ignored_modules": None if ignored_states is not None else ignored,
                "ignored_states": list(ignored_params) if ignored_states is not None else None,
                "param_init_fn": param_init_fn,
                "device_id": device_id,
                "sync_module_states": sync_module_states,
                "forward_prefetch": forward_prefetch,
                "limit_all_gathers": limit_all_gathers,
                "use_orig_params": use_orig_params,
                "device_mesh": device_mesh,
            }
            _wrap.auto_wrap(
                module,
                auto_wrap_policy,
                lambda m, **kw: type(self)(m, process_group, **{**child_kwargs, **kw}),
                ignored,
                ignored_params,
            )
        device = _init.device_from_id(_API, device_id) if device_id is not None else None
        _init.materialize_meta_module(
            _API,
            module,
            param_init_fn,
            ignored_modules=ignored,
            ignored_params=ignored_params,
            is_unit=_is_unit,
            device=device or torch.device("cpu"),
        )
        if device is not None:
            _init.move_owned_to_device(
                module,
                device,
                ignored_modules=ignored,
                ignored_params=ignored_params,
                is_unit=_is_unit,
            )
        self.__dict__["_fsdp_state"] = self._init_state(
            module, ignored, ignored_params, sync_module_states
        )
        validate_hybrid_agreement(
            [
                (clean_fqn(name) or "<root>", m.sharding_strategy, m._unit_groups)
                for name, m in self.named_modules()
                if isinstance(m, FullyShardedDataParallel)
            ]
        )

    def _init_state(
        self,
        module: nn.Module,
        ignored: set[nn.Module],
        ignored_params: set[nn.Parameter],
        sync_module_states: bool,
    ) -> FSDPState:
        """Collect what this instance owns (see [Note: ownership]) and build its runtime."""
        specs = _init.collect_params(
            module, ignored_modules=ignored, ignored_params=ignored_params, is_unit=_is_unit
        )
        nested = consumed_by_nested(module, specs, _is_unit)
        specs = [ParamSpec(clean_fqn(s.fqn), s.param, s.slots) for s in specs]
        _init.validate_no_scalars("FullyShardedDataParallel", specs)
        if specs:
            _init.validate_uniform("FullyShardedDataParallel", specs, frozen_may_differ=False)
        if sync_module_states:
            _init.sync_module_states(module, specs, ignored, self._unit_groups)
        strategy = self.sharding_strategy
        policy = self.mixed_precision
        unit = None
        if specs:
            unit = FSDPUnit(
                module,
                specs,
                self._unit_groups,
                precision=UnitPrecision.resolve(policy, specs[0].param.dtype),
                offload_params=self.cpu_offload.offload_params,
                layout=DTensorLayout.of_groups(self._unit_groups, specs[0].param.device.type),
            )
        # The original parameters this instance and its nested instances took over, by id.
        self._consumed_params = nested | {id(s.param): weakref.ref(s.param) for s in specs}
        setattr(self, WRAPPED_MODULE_NAME, module)
        full_shard = strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)
        param_dtype = policy.param_dtype if policy is not None else None
        config = RuntimeConfig(
            # FSDP1's root keeps its parameters for backward: they are the first it needs.
            reshard_after_forward=full_shard,
            reshard_root_after_forward=False,
            backward_prefetch=self.backward_prefetch,
            forward_prefetch=self.forward_prefetch,
            limit_all_gathers=self.limit_all_gathers,
            buffer_dtype=policy.buffer_dtype if policy is not None else None,
            input_dtype=param_dtype if policy is not None and policy.cast_forward_inputs else None,
            root_input_dtype=(
                param_dtype if policy is not None and policy.cast_root_forward_inputs else None
            ),
        )
        buffers = _init.collect_buffers(module, ignored_modules=ignored, is_unit=_is_unit)
        return FSDPState(self, unit, config, buffers)

    # ------------------------------------------------------------------ forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        state = self._fsdp_state
        if state.hooks_suspended:  # see fsdp_core.debug.suspend_hooks
            return self.module(*args, **kwargs)
        args, kwargs = state.pre_forward(args, kwargs)
        output = self.module(*args, **kwargs)
        return state.post_forward(output)

    # ------------------------------------------------------------------ access
    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        wrapped = self._modules[WRAPPED_MODULE_NAME]
        assert wrapped is not None
        return wrapped

    @property
    def _fsdp_state(self) -> FSDPState:
        return self.__dict__["_fsdp_state"]

    @property
    def _unit(self) -> FSDPUnit | None:
        """The unit of parameters this instance owns (``None`` if it owns none)."""
        return self._fsdp_state.unit

    @property
    def training_state(self) -> TrainingState:
        return self._fsdp_state.training_state

    @property
    def _fsdp_graph_order(self) -> list[nn.Module] | None:
        """FSDP instances in forward (graph) order, recorded in the first iteration."""
        order = self._fsdp_state.exec_order
        return order.graph_order if order is not None and not order.recording else None

    @property
    def _my_fsdp_idx_in_graph(self) -> int | None:
        order = self._fsdp_state.exec_order
        return order.graph_index(self._fsdp_state) if order is not None else None

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == WRAPPED_MODULE_NAME:
                raise
            return getattr(self.module, name)

    def __getitem__(self, key: int) -> Any:
        return self.module.__getitem__(key)  # type: ignore[operator]

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """Like ``nn.Module.named_parameters`` with the original (unwrapped) names."""
        for name, param in super().named_parameters(prefix, recurse, remove_duplicate):
            yield clean_fqn(name), param

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Like ``nn.Module.named_buffers`` with the original (unwrapped) names."""
        for name, buffer in super().named_buffers(prefix, recurse, remove_duplicate):
            yield clean_fqn(name), buffer

    # ------------------------------------------------------------------ full parameters
    @staticmethod
    def summon_full_params(
        module: nn.Module,
        recurse: bool = True,
        writeback: bool = True,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
        with_grads: bool = False,
    ) -> contextlib.AbstractContextManager[None]:
        """Context manager in which ``module``'s FSDP instances expose full parameters.

        Every rank must enter it (the parameters are all-gathered), between training steps.
        The full parameters are in the parameters' original dtype even under mixed precision.
        Also callable on an instance: ``with model.summon_full_params(model): ...``.

        Args:
            module: an FSDP instance or a module containing some.
            recurse: also the nested instances (default ``True``); ``False``: only the
                outermost instances of ``module``'s tree.
            writeback: on exit, copy each rank's rows of the (possibly modified) full
                parameters into its shards (default ``True``); ``False`` discards changes.
            rank0_only: only global rank 0 sees full parameters, other ranks keep their
                shards (default ``False``); requires ``writeback=False``.
            offload_to_cpu: the full parameters (and gradients) are CPU copies (default
                ``False``).
            with_grads: ``.grad`` of each full parameter is the full reduced gradient, or
                ``None`` if no rank has one (default ``False``); changes to it are discarded.
        """
        return _summon_full_params(
            module,
            recurse=recurse,
            writeback=writeback,
            rank0_only=rank0_only,
            offload_to_cpu=offload_to_cpu,
            with_grads=with_grads,
        )

    def apply(self, fn: Callable[[nn.Module], None]) -> FullyShardedDataParallel:
        """``nn.Module.apply`` on full parameters: gathers this instance's, runs ``fn`` on every
        submodule and itself (nested instances gather their own), writes the changes back.

        Every rank must call it, between training steps and outside ``summon_full_params``.
        """
        return apply_with_full_params(self, fn)

    # ------------------------------------------------------------------ state dicts
    # See [Note: sharded state dict] and [Note: optimizer state dict] for what these do.
    state_dict_type = staticmethod(_state_dict_types.state_dict_type)
    set_state_dict_type = staticmethod(_state_dict_types.set_state_dict_type)
    get_state_dict_type = staticmethod(_state_dict_types.get_state_dict_type)
    optim_state_dict = staticmethod(_optim_state.optim_state_dict)
    optim_state_dict_to_load = staticmethod(_optim_state.optim_state_dict_to_load)
    _fqn_modifiers = _state_dict_types.fqn_modifiers  # for DCP's state dict functions

    def state_dict(  # type: ignore[override]
        self,
        *,
        destination: dict[str, Any] | None = None,
        prefix: str = "",
        keep_vars: bool = False,
    ) -> dict[str, Any]:
        """The state dict in the layout ``state_dict_type`` sets: by default the full state
        dict (unsharded tensors under the unwrapped module's names), or ``DTensor`` shards
        (``SHARDED_STATE_DICT``) or flat local shards (``LOCAL_STATE_DICT``).

        Every rank must call it. See ``FullStateDictConfig`` for ``rank0_only`` and
        ``offload_to_cpu``. Buffers are in their original dtype under mixed
        precision. Values are always detached (``keep_vars`` is accepted for compatibility).
        """
        if self._fsdp_state.in_state_dict:  # an enclosing instance is building it
            return nn.Module.state_dict(
                self,
                destination=destination,  # type: ignore[arg-type]
                prefix=prefix,
                keep_vars=keep_vars,
            )
        result = _state_dict_types.save_state_dict(self, prefix)
        if destination is None:
            return result
        destination.update(result)
        return destination

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> _IncompatibleKeys:
        """Load a state dict in the layout ``state_dict_type`` sets (by default a full state
        dict, which every rank passes whole).

        Args:
            state_dict: keys of the unwrapped module, values as ``state_dict()`` gives them.
            strict: missing or unexpected keys raise (default ``True``).
            assign: not supported: the values are always copied into the shards.
        """
        if assign:
            raise ValueError(
                "FullyShardedDataParallel.load_state_dict(assign=True) is not supported: the "
                "full tensors are copied into the local shards. Pass assign=False."
            )
        return _state_dict_types.load_state_dict(self, state_dict, strict=strict)

    # ------------------------------------------------------------------ gradients
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Context manager in which backwards accumulate unsharded gradients, unreduced.

        The first backward after the context reduces everything accumulated, so the result
        equals DDP's ``no_sync``. Call it on the root instance; accumulating unsharded
        gradients costs the memory of the full gradients of every unit.
        """
        if self._fsdp_state.is_root is False:
            raise RuntimeError(
                "no_sync() on an inner FSDP instance is not supported: call it on the root "
                "(outermost) FSDP instance."
            )
        states = states_in(self)
        busy = [s.fqn for s in states if s.training_state is not TrainingState.IDLE]
        if busy:
            raise RuntimeError(f"no_sync() must be entered between training steps; busy: {busy}")
        previous = [s.sync_gradients for s in states]
        for state in states:
            state.sync_gradients = False
        try:
            yield
        finally:
            for state, sync in zip(states, previous, strict=True):
                state.sync_gradients = sync

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of every parameter to a total norm of at most ``max_norm``.

        The norm is over the whole (unsharded) model: local shard norms are combined with one
        all-reduce, so every rank must call it. Equals ``torch.nn.utils.clip_grad_norm_`` on
        the unsharded model up to rounding (see [Note: sharded gradient norm]).

        Args:
            max_norm: the largest allowed total norm.
            norm_type: the p of the p-norm (default ``2.0``); ``math.inf`` for the max norm.

        Returns:
            The total norm before clipping (fp32 scalar tensor).
        """
        state = self._fsdp_state
        if state.is_root is False:
            raise RuntimeError(
                "clip_grad_norm_() on an inner FSDP instance is not supported: call it on the "
                "root (outermost) FSDP instance."
            )
        norm = float(norm_type)
        if not (norm == math.inf or norm > 0):
            raise ValueError(
                f"clip_grad_norm_: norm_type must be > 0 or math.inf, got {norm_type}."
            )
        states = states_in(self)
        busy = [s.fqn for s in states if s.training_state is not TrainingState.IDLE]
        if busy:
            raise RuntimeError(f"clip_grad_norm_() must run between training steps; busy: {busy}")
        return clip_grad_norm(self.parameters(), states, max_norm, norm)

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list[FullyShardedDataParallel]:
        """The FSDP instances in ``module``'s tree, in ``modules()`` order.

        Args:
            module: the tree to search (it may itself be an FSDP instance).
            root_only: only instances not nested inside another instance (default ``False``).
        """
        found: list[FullyShardedDataParallel] = []

        def visit(m: nn.Module, inside: bool) -> None:
            is_fsdp = isinstance(m, FullyShardedDataParallel)
            if is_fsdp and not (root_only and inside):
                found.append(m)  # type: ignore[arg-type]
            for child in m.children():
                visit(child, inside or is_fsdp)

        visit(module, False)
        return found


FSDP = FullyShardedDataParallel


def _is_unit(module: nn.Module) -> bool:
    return state_of(module) is not None
