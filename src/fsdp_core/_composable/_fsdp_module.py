"""``FSDPModule``: the methods a ``fully_shard``-ed module gains (its scheduling: unshard and
reshard, prefetch, gradient sync, backward finalization; the communication settings come from
its base in ``_comm_settings``), and torch FSDP2's helpers around them
(``register_fsdp_forward_method``, ``share_comm_ctx``)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from typing import Any

from torch import nn

from .._grad_dtype import give_back_grads, take_explicit_grads
from .._post_forward import PostForwardShards, post_forward_group
from .._root import finalize_backward, reset_iteration, set_manual_backward_finalization
from .._runtime import FSDPState
from .._unit import FSDPUnit
from ._comm_settings import FSDPCommSettings
from ._handles import GradientReductionHandle, UnshardHandle
from ._hooks import ForwardHooks

__all__ = [
    "API_KEY",
    "FSDPModule",
    "api_of",
    "register_fsdp_forward_method",
    "resolve_reshard_after_forward",
    "share_comm_ctx",
]


# The door that built a module's state ("fully_shard" or "replicate"), in its ``__dict__``.
API_KEY = "_fsdp_api"


def api_of(module: nn.Module) -> str:
    """``"fully_shard"`` or ``"replicate"``: the door that gave ``module`` its state."""
    return str(module.__dict__.get(API_KEY, "fully_shard"))


class FSDPModule(FSDPCommSettings):
    """Mixed into the class of every module ``fully_shard`` was applied to."""

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's unit now, ahead of its forward.

        Args:
            async_op: return an :class:`UnshardHandle` to ``wait()`` on instead of waiting
                (default ``False``).
        """
        state = self._get_fsdp_state()
        unit = state.unit
        if unit is not None and not unit.is_unsharded:
            if state.exec_order is not None:
                state.exec_order.validate(state, "unshard")
            if async_op:  # see [Note: overlap on the CPU] in _overlap
                unit.unshard("explicit", async_op=True)
            else:
                unit.unshard("explicit")
        handle = UnshardHandle(unit)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free this module's unsharded parameters; the module shows its shards again."""
        unit = self._get_fsdp_state().unit
        if unit is not None:
            unit.reshard("explicit")

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """Reduce gradients in backward (``True``, the default) or accumulate them unsharded
        and unreduced until a backward with it on (gradient accumulation without
        communication).

        Args:
            requires_gradient_sync: whether to reduce.
            recurse: also every ``FSDPModule`` below this one (default ``True``).
        """
        for state in self._states(recurse):
            state.sync_gradients = bool(requires_gradient_sync)

    def set_reshard_after_forward(
        self, reshard_after_forward: bool | int, recurse: bool = True
    ) -> None:
        """Change ``reshard_after_forward`` (see ``fully_shard``), between steps. Modules of
        ``replicate`` keep their parameters whole and are left as they are.

        Args:
            reshard_after_forward: ``True``, ``False`` or an int dividing the shard world size.
            recurse: also every ``FSDPModule`` below this one (default ``True``).
        """
        for state in self._states(recurse):
            if api_of(state.owner) == "replicate":
                continue  # nothing to free or gather: see [Note: replicate] in _replicate
            unit = state.unit
            world = unit.shard_world if unit is not None else 1
            value = resolve_reshard_after_forward(
                "set_reshard_after_forward", reshard_after_forward, world
            )
            state.config = dataclasses.replace(
                state.config,
                reshard_after_forward=value,
                reshard_root_after_forward=value is not False,
            )
            if unit is not None:
                unit.drop_post_forward()
                unit.post_forward = (
                    None
                    if isinstance(value, bool)
                    else PostForwardShards(post_forward_group(_shard_group(unit), value), world)
                )

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        """Free the unsharded parameters after backward (``True``, the default) or keep them
        (e.g. between micro-batches of gradient accumulation; they are stale once the
        optimizer steps, so set it back before the last micro-batch).

        Args:
            reshard_after_backward: whether to free them.
            recurse: also every ``FSDPModule`` below this one (default ``True``).
        """
        for state in self._states(recurse):
            state.reshard_after_backward = bool(reshard_after_backward)

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather ``modules``' units when this module's forward starts (explicit forward
        prefetch, from the first iteration on).

        Args:
            modules: ``FSDPModule``s, in the order to gather them.
        """
        self._get_fsdp_state().forward_prefetch_targets = _states_of(
            "set_modules_to_forward_prefetch", modules
        )

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather ``modules``' units when this module's backward starts (explicit backward
        prefetch, replacing the automatic one for this module).

        Args:
            modules: ``FSDPModule``s, in the order to gather them.
        """
        self._get_fsdp_state().backward_prefetch_targets = _states_of(
            "set_modules_to_backward_prefetch", modules
        )

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """With a 2-D mesh (HSDP): all-reduce the reduce-scattered gradients across replicas in
        backward (``True``, the default), or only reduce-scatter and sum the shards until a
        backward with it on (gradient accumulation across replicas without the all-reduce).

        Args:
            requires_all_reduce: whether to all-reduce.
            recurse: also every ``FSDPModule`` below this one (default ``True``).
        """
        for state in self._states(recurse):
            if state.unit is not None:
                state.unit.all_reduce_grads = bool(requires_all_reduce)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Whether backward needs this module's parameters (default ``True``); ``False`` skips
        the all-gather in backward where the gradients need no parameters (an embedding).
        Not recursive.

        Args:
            unshard_in_backward: whether to all-gather in backward.
        """
        self._get_fsdp_state().unshard_in_backward = bool(unshard_in_backward)

    def _set_unshard_async_op(self, async_op: bool) -> None:
        """Whether the pre-forward and pre-backward all-gathers of this module and every
        ``FSDPModule`` below it are issued with ``async_op=True`` (default ``False``), as
        FSDP2's private method of this name. Over gloo the all-gather then runs on the process
        group's threads until the unit waits for it, just before its compute; the numbers are
        the same. On CUDA the all-gather stays on the all-gather stream (in FSDP2 it moves to
        the current stream, which changes where its output is allocated, not what it holds);
        with ``set_cpu_overlap(model, enabled=False)`` and in thread mode it is synchronous.

        Args:
            async_op: whether to issue them asynchronously.
        """
        for state in self._states(recurse=True):
            state.unshard_async_op = bool(async_op)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward ends the step (default ``True``). With ``False``
        (micro-batches) the end of that backward does not wait for its gradient reductions on
        CUDA; a later backward does. Applies to the whole tree of the root.

        Args:
            is_last_backward: whether the next backward is the step's last.
        """
        state = self._get_fsdp_state()
        (state.root or state).is_last_backward = bool(is_last_backward)

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """Leave the end of each backward to the caller: backwards reduce what is ready and
        wait for nothing at their end; :meth:`finalize_backward`, called after the last
        backward of the step and before the gradients are read, reduces what is left
        (unused parameters, gradients accumulated with ``set_requires_gradient_sync(False)``),
        reshards and waits. Supersedes :meth:`set_is_last_backward`. Call on the root,
        before forward; the mode cannot change while a backward iteration is unfinalized.
        See [Note: manual backward finalization] in ``_root``.

        Args:
            enabled: whether the caller finalizes backward.
        """
        if not isinstance(enabled, bool):
            raise TypeError(f"set_manual_backward_finalization takes a bool, got {enabled!r}.")
        set_manual_backward_finalization(self._get_fsdp_state(), enabled)

    def finalize_backward(self, *, async_op: bool = False) -> GradientReductionHandle | None:
        """Finish the backward iteration under manual finalization (see
        :meth:`set_manual_backward_finalization`): reduce the gradients still unreduced,
        reshard, wait for the reductions. A no-op before the root's first forward. With
        several backwards before it, turn gradient sync off for them and back on before
        calling it. Call on the root, after backward, never between forward and backward.

        Args:
            async_op: return a :class:`GradientReductionHandle` without waiting (default
                ``False``: wait, return ``None``); call its ``wait()`` before reading the
                gradients or the next forward.
        """
        state = self._get_fsdp_state()
        if state.is_root is None:
            return GradientReductionHandle() if async_op else None
        if not async_op:
            finalize_backward(state, wait=True)
            return None
        finalize_backward(state, wait=False)
        handle = GradientReductionHandle(state)
        state.pending_reduction = handle
        return handle

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """Keep the unsharded parameters' storage across reshards (``True``), so their data
        pointers stay the same from one unshard to the next (e.g. for CUDA graph capture), at
        the cost of the memory; ``False`` (the default) frees it at each reshard.

        Args:
            keep: whether to keep the storage.
            recurse: also every ``FSDPModule`` below this one (default ``True``).
        """
        for state in self._states(recurse):
            if state.unit is not None:
                for p in state.unit.params:
                    p.keep_unsharded_storage = bool(keep)

    def set_reduce_scatter_unused_params(
        self, reduce_scatter_unused_params: bool, *, recurse: bool = True
    ) -> None:
        """Reduce zeros for the parameters that got no gradient in a backward (``True``), so
        ranks whose control flow uses different parameters (mixture of experts, multi-modal
        models) still run the same reductions; as DDP's ``find_unused_parameters``. Such a
        unit reduces at the end of backward on every rank (the same order on each), and every
        trainable parameter of it gets a ``.grad``. Default ``False``: a unit whose parameters
        got no gradient on this rank does not reduce.

        Args:
            reduce_scatter_unused_params: whether to reduce zeros for unused parameters.
            recurse: also every ``FSDPModule`` below this one (default ``True``).
        """
        for state in self._states(recurse):
            unit = state.unit
            if unit is not None:
                before, unit.reduce_unused_params = (
                    unit.reduce_unused_params,
                    bool(reduce_scatter_unused_params),
                )
                try:  # a grad_dtype=None parameter needs a reduce_dtype: see _grad_dtype
                    unit.check_unused_grad_dtypes()
                except ValueError:
                    unit.reduce_unused_params = before
                    raise

    def set_post_optim_event(self, event: Any) -> None:
        """Let the next forward's all-gathers wait on ``event`` (recorded after the optimizer
        step) instead of on the whole compute stream; used once. On the CPU, where nothing
        overlaps, it has no effect.

        Args:
            event: a ``torch.cuda.Event`` (or the device's event type).
        """
        state = self._get_fsdp_state()
        (state.root or state).post_optim_event = event

    def reset_iter_state(self) -> None:
        """Recover after an exception in forward or backward; call it on the root. Every unit
        is resharded and every state made idle; the failed step's gradients are dropped
        (also those kept by ``set_requires_gradient_sync(False)``); gradients already on the
        parameters stay.
        """
        state = self._get_fsdp_state()
        reset_iteration(state)
        for other in state.all_states or [state]:
            hooks = other.owner.__dict__.get("_fsdp_forward_hooks")
            if hooks is not None:
                hooks.reset()

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        # ``to_empty``/``to`` replace the sharded parameters: re-adopt them into the unit.
        unit = self._get_fsdp_state().unit
        taken = take_explicit_grads(unit.params) if unit is not None else {}
        result = super()._apply(*args, **kwargs)  # type: ignore[misc]
        if unit is not None:
            unit.reset_sharded_params()
            give_back_grads(taken)  # see [Note: per-parameter gradient dtypes]
        return result


def resolve_reshard_after_forward(api: str, value: object, shard_world: int) -> bool | int:
    """``value`` as the runtime takes it: None -> True, int 1 -> False, int W -> True."""
    if value is None:
        return True
    if isinstance(value, bool):
        return value
    if not isinstance(value, int):
        raise TypeError(
            f"{api}: reshard_after_forward takes a bool or an int (the group size to reshard "
            f"to), got {value!r}."
        )
    if value < 1 or shard_world % value != 0:
        divisors = [d for d in range(1, shard_world + 1) if shard_world % d == 0]
        raise ValueError(
            f"{api}: reshard_after_forward={value} must divide the shard world size "
            f"{shard_world}; pass one of {divisors}, or True/False."
        )
    if value == 1:
        return False
    return True if value == shard_world else value


def _shard_group(unit: FSDPUnit) -> Any:
    group = unit.groups.shard
    if group is None:
        raise AssertionError("an unsharded unit keeps nothing sharded after forward")
    return group


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>`` run the unit's forward hooks, as ``forward`` does.

    For methods other than ``forward`` that use the parameters (e.g. ``generate``). A no-op
    when ``module`` is not an ``FSDPModule``.

    Args:
        module: the module.
        method_name: the name of the method.
    """
    if not isinstance(module, FSDPModule):
        return
    if not callable(getattr(module, method_name, None)):
        raise ValueError(
            f"register_fsdp_forward_method: {type(module).__name__} has no method "
            f"{method_name!r}; pass the name of one of its methods."
        )
    original = getattr(module, method_name)
    hooks: ForwardHooks = module.__dict__["_fsdp_forward_hooks"]

    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = hooks.pre(module, args, kwargs)
        return hooks.post(module, args, original(*args, **kwargs))

    setattr(module, method_name, wrapped)


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """Let several roots (e.g. pipeline stages) use the first one's CUDA streams.

    Args:
        modules: root ``FSDPModule``s; call before their first forward. On the CPU there are
            no streams and this only records the sharing.
    """
    states = _states_of("share_comm_ctx", modules)
    for state in states[1:]:
        state.share_streams_with = states[0]


def _states_of(api: str, modules: Iterable[object]) -> list[FSDPState]:
    found = []
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise ValueError(
                f"{api} takes FSDPModules (modules fully_shard was applied to), got "
                f"{type(m).__name__}; apply fully_shard to it first."
            )
        found.append(m._get_fsdp_state())
    return found
