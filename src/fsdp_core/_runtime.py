"""Per-instance runtime: forward and backward hooks, prefetching (what only a root does, its
lazy init and the end of a backward iteration, is in ``_root``).

An :class:`FSDPState` drives one :class:`~fsdp_core._unit.FSDPUnit` (or none, when the module
owns no parameters) through a training step. The front door calls :meth:`FSDPState.pre_forward`
and :meth:`FSDPState.post_forward` around the module's forward (the wrapper from its
``forward``, the composable door from the forward pre-hook and hook it registers on the
module, see ``_composable/_hooks.ForwardHooks``); ``fsdp_core.debug.suspend_hooks``
switches both off. Everything in backward is driven by autograd hooks the state registers itself:

- pre-backward: a hook on each forward output that requires grad unshards the unit when the
  gradient reaches it (and prefetches under ``BACKWARD_PRE``);
- post-backward: a post-accumulate-grad hook on each unsharded parameter that requires grad
  (registered at the first forward in which it does); once every parameter the unit waits for
  has its gradient, the unit reduces (and prefetches under ``BACKWARD_POST``);
- a final callback, queued by the root on the first pre-backward, reduces what is left (units
  with unused parameters), reshards every unit, and checks that all of them are idle.

With ``set_manual_backward_finalization(True)`` the final callback leaves the rest to the
caller's ``finalize_backward()``: see [Note: manual backward finalization] in ``_root``, which
also holds the root's lazy init and the end of each backward iteration.

Inside ``no_sync`` (``sync_gradients`` is ``False`` on every state) units reshard after their
backward as usual but keep their unsharded gradients, which autograd keeps accumulating into;
the first backward outside reduces the sum.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.utils import _pytree as pytree

from . import events
from ._config import RuntimeConfig
from ._exec_order import ExecOrder
from ._overlap import CpuOverlap
from ._param import ShardedParam
from ._precision import BufferSlot, cast_floating_tensors
from ._root import end_backward_iteration, init_root
from ._streams import CudaStreams
from ._unit import FSDPUnit
from .api import BackwardPrefetch, TrainingState, default_state_dict_settings

__all__ = [
    "WRAPPED_MODULE_NAME",
    "FSDPState",
    "RuntimeConfig",
    "clean_fqn",
    "state_of",
    "states_in",
]

# The attribute under which the wrapper door keeps the wrapped module; never part of a name.
WRAPPED_MODULE_NAME = "_fsdp_wrapped_module"

# limit_all_gathers: no prefetch while this many non-root units are gathered (not replicated).
_MAX_UNSHARDED = 2


_BACKWARD_STATES = (TrainingState.IDLE, TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD)


def state_of(module: nn.Module) -> FSDPState | None:
    """The FSDP state attached to ``module`` (a wrapper, or a ``fully_shard``-ed module)."""
    state = module.__dict__.get("_fsdp_state")
    return state if isinstance(state, FSDPState) else None


def states_in(module: nn.Module, *, root_only: bool = False) -> list[FSDPState]:
    """The FSDP states in ``module``'s tree (``module`` included), in ``modules()`` order.

    Args:
        module: the tree to search.
        root_only: only states not nested below another state of the tree.
    """
    found: list[FSDPState] = []
    seen: set[int] = set()

    def visit(m: nn.Module, inside: bool) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        state = state_of(m)
        if state is not None and not (root_only and inside) and state not in found:
            found.append(state)  # a state of several modules (fully_shard([a, b])) once
        for child in m.children():
            visit(child, inside or state is not None)

    visit(module, False)
    return found


class FSDPState:
    """Runtime state of one FSDP instance.

    Args:
        owner: the object users see as the FSDP instance (the wrapper module); this is what
            ``_fsdp_graph_order`` lists.
        unit: the unit of parameters this instance owns, or ``None``.
        config: the instance's options.
        buffers: the floating-point buffers this instance owns (default: none). See
            [Note: mixed precision].
    """

    def __init__(
        self,
        owner: nn.Module,
        unit: FSDPUnit | None,
        config: RuntimeConfig,
        buffers: list[BufferSlot] | None = None,
    ) -> None:
        self.owner = owner
        self.unit = unit
        self.config = config
        self.buffers = buffers or []
        self.training_state = TrainingState.IDLE
        self.sync_gradients = True  # False inside no_sync()
        self.reshard_after_backward = True  # False: keep the unsharded parameters
        # Explicit prefetch targets (the composable door's set_modules_to_*_prefetch); they
        # replace the graph-order prefetch of that pass and apply from the first iteration.
        self.forward_prefetch_targets: list[FSDPState] | None = None
        self.backward_prefetch_targets: list[FSDPState] | None = None
        self.state_dict_settings = default_state_dict_settings()  # see _state_dict/settings.py
        self.in_state_dict = False  # an enclosing instance is building a full state dict
        self.streams: CudaStreams | None = None  # root only, on CUDA
        self.cpu_overlap = CpuOverlap()  # the root's is used, on the CPU
        self.overlaps_on_cpu = True  # see ``fsdp_core.debug.set_cpu_overlap``
        self.fqn = ""
        self.is_root: bool | None = None  # decided at the first forward
        self.root: FSDPState | None = None
        self.exec_order: ExecOrder[FSDPState] | None = None
        self.all_states: list[FSDPState] = []  # root only: the cached traversal
        # Another root whose CUDA streams this root uses (``share_comm_ctx``), if any.
        self.share_streams_with: FSDPState | None = None
        self._ran_pre_backward = False
        # Whether the last forward's outputs carry a pre-backward hook (some output requires
        # grad); a unit without one never runs backward, so backward prefetch skips it.
        self._expects_backward = False
        self.final_callback_queued = False  # root only
        self._hooked_params: set[ShardedParam] = set()  # with a post-accumulate-grad hook
        self.tag_collectives = True  # order tags; off: ``fsdp_core.debug.set_order_check``
        self.unshard_in_backward = True  # False: backward needs no parameters (embeddings)
        self.unshard_async_op = False  # FSDP2's ``_set_unshard_async_op``
        self.force_sum_reduction_for_comms = False  # ``set_force_sum_reduction_for_comms``
        # Root only (FSDP2's iteration controls): whether the coming backward ends the step,
        # and a CUDA event the next forward's all-gathers wait on instead of the stream.
        self.is_last_backward = True
        self.post_optim_event: torch.cuda.Event | None = None
        # Root only: see [Note: manual backward finalization]. The mode asked for, the mode of
        # the backward iteration under way (None: none started), whether a backward ended
        # unfinalized, and the handle of an asynchronous finalization not waited on yet.
        self.manual_backward_finalization = False
        self.manual_finalization_active: bool | None = None
        self.backward_unfinalized = False
        self.pending_reduction: object | None = None
        self.hooks_suspended = False  # True: see ``fsdp_core.debug.suspend_hooks``
        self._register_post_backward_hooks()

    @property
    def _rank(self) -> int:
        return dist.get_rank()

    def assert_state(self, *expected: TrainingState) -> None:
        if self.training_state not in expected:
            raise AssertionError(
                f"[rank {self._rank}] FSDP instance {self.fqn!r} is in {self.training_state}, "
                f"expected one of {[s.name for s in expected]}"
            )

    # ------------------------------------------------------------------ root lazy init
    def _lazy_init(self) -> None:
        """Make this state the root of every FSDP state under its owner (done once); see
        ``_root.init_root``."""
        named: list[tuple[str, FSDPState]] = []
        for name, module in self.owner.named_modules():
            state = state_of(module)
            if state is not None and all(state is not other for _, other in named):
                named.append((clean_fqn(name), state))
        init_root(self, named)

    def set_order_tags(self, enabled: bool) -> None:
        """Tag this unit's collectives (the default) or not; see ``fsdp_core.debug``."""
        self.tag_collectives = enabled
        unit, order = self.unit, self.exec_order
        if unit is not None and order is not None:  # else lazy init reads ``tag_collectives``
            unit.order_tags = order.checker.for_unit(order.index(self)) if enabled else None

    # ------------------------------------------------------------------ forward
    def pre_forward(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self.is_root is None:
            self._lazy_init()
        root = self.root
        if root is not None and root.pending_reduction is not None:
            raise RuntimeError(
                "The previous gradient reduction must be waited on before forward: call wait() "
                "on the GradientReductionHandle that finalize_backward(async_op=True) returned."
            )
        if self.training_state is TrainingState.PRE_BACKWARD:
            # Activation checkpointing recomputes this forward inside backward: the state
            # stays, the parameters must be there (as in FSDP2).
            self._unshard("backward")
            if self.unit is not None:
                self.unit.wait_for_unshard()
            return self.cast_forward_inputs(args, kwargs)
        order = self._order()
        if self.is_root:
            order.start_forward()
            if self.streams is not None:
                self.streams.begin_iteration(self.post_optim_event)
            self.post_optim_event = None
        self.assert_state(TrainingState.IDLE)
        self.training_state = TrainingState.FORWARD
        self._ran_pre_backward = self._expects_backward = False
        if self.unit is not None:
            # See [Note: requires_grad changes after wrapping] in _param.
            self.unit.update_grad_params()
            self.unit.sync_unsharded_grad_dtypes()  # see [Note: per-parameter gradient dtypes]
            self._register_post_backward_hooks()
        if self.is_root or self._root().training_state is TrainingState.FORWARD:
            # Not a standalone call between the root's forward and backward (a module of a
            # group called alone, e.g. an output head per chunk): that is not in the order.
            order.record_pre_forward(self)
        self._unshard("forward")
        unit = self.unit
        if unit is not None and unit.streams is None:  # see [Note: overlap on the CPU]
            unit.wait_for_unshard()  # the CPU copies out before a prefetch gathers more
        if self.forward_prefetch_targets is not None:
            for target in self.forward_prefetch_targets:
                self._prefetch(target, "forward_prefetch", explicit=True)
        elif self.config.forward_prefetch or (unit is not None and unit.cpu_overlap is not None):
            ahead = not self.config.forward_prefetch  # see [Note: overlap on the CPU]
            self._prefetch(order.next_to_forward(self), "forward_prefetch", ahead=ahead)
        if unit is not None:
            unit.wait_for_unshard()
        return self.cast_forward_inputs(args, kwargs)

    def cast_forward_inputs(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``args`` and ``kwargs`` with floating-point tensors in this instance's input dtype."""
        input_dtype = self._forward_input_dtype()
        if input_dtype is None:
            return args, kwargs
        return cast_floating_tensors((args, kwargs), input_dtype)

    def cast_output(self, output: Any) -> Any:
        """``output`` with floating-point tensors in the policy's output dtype, if it has one."""
        if self.config.output_dtype is None:
            return output
        return cast_floating_tensors(output, self.config.output_dtype)

    def _forward_input_dtype(self) -> torch.dtype | None:
        """The dtype this instance casts its floating-point forward inputs to, if any."""
        config = self.config
        dtype = config.root_input_dtype if self.is_root else None
        dtype = dtype or config.input_dtype
        if dtype is None or (
            self.unit is not None
            and not self.unit.precision.casts_params
            and not config.cast_inputs_always
        ):
            return None  # a no-op policy: see [Note: mixed precision]
        return dtype

    def post_forward(self, output: Any) -> Any:
        if self.training_state is TrainingState.PRE_BACKWARD:
            return self.cast_output(output)  # an activation checkpointing recompute
        order = self._order()
        order.record_post_forward(self)
        grad_enabled = torch.is_grad_enabled()
        if self.unit is not None and self._reshards_after_forward(grad_enabled):
            # An int keeps a copy sharded over a smaller group when backward will need it.
            self.unit.reshard("forward")
            if not grad_enabled:
                self.unit.drop_post_forward()
        output = self.cast_output(output)
        if grad_enabled:
            self.hook_outputs(output)
        self.training_state = TrainingState.IDLE
        if self.is_root:
            self.cpu_overlap.drop_ahead()
            order.finish_forward()
            if not grad_enabled:
                order.finish_iteration()
        return output

    def _reshards_after_forward(self, grad_enabled: bool) -> bool:
        if not grad_enabled:
            return True  # no backward will need them
        if self.is_root and not self.config.reshard_root_after_forward:
            return False  # the first parameters backward needs
        return self.config.reshard_after_forward is not False

    # ------------------------------------------------------------------ backward
    def hook_outputs(self, output: Any) -> None:
        """Unshard this unit for backward when a gradient reaches a tensor of ``output``."""
        for leaf in pytree.tree_leaves(output):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaf.register_hook(self._pre_backward_hook)
                self._expects_backward = True

    def _pre_backward_hook(self, grad: torch.Tensor) -> None:
        if self._ran_pre_backward:
            return
        self._ran_pre_backward = True
        root = self._root()
        root._queue_final_callback()
        self.assert_state(TrainingState.IDLE)
        self.training_state = TrainingState.PRE_BACKWARD
        if self.unshard_in_backward:
            self._unshard("backward")
        unit = self.unit
        if unit is not None and unit.streams is None:  # as in ``pre_forward``
            unit.wait_for_unshard()
        if unit is not None:  # see [Note: per-parameter gradient dtypes] in _grad_dtype
            unit.defer_grad_upcast(reduces=self.sync_gradients)
        if self.backward_prefetch_targets is not None:
            for target in self.backward_prefetch_targets:
                self._prefetch(target, "backward_prefetch", explicit=True)
        elif self.config.backward_prefetch is BackwardPrefetch.BACKWARD_PRE:
            self._prefetch(self._order().next_to_backward(self), "backward_prefetch")
        if unit is not None:
            unit.wait_for_unshard()

    def _register_post_backward_hooks(self) -> None:
        """Hook every trainable unsharded parameter that has no hook yet: lazily, at each
        forward, as only a tensor that requires grad takes one (a frozen one keeps its hook)."""
        if self.unit is None:
            return
        for param in self.unit.grad_params:
            if param not in self._hooked_params:
                param.unsharded.register_post_accumulate_grad_hook(
                    self._make_grad_ready_hook(param)
                )
                self._hooked_params.add(param)

    def _make_grad_ready_hook(self, param: ShardedParam) -> Any:
        # Weak: autograd keeps the hook where gc cannot see it; a strong one kept the model.
        state, weak_param = weakref.ref(self), weakref.ref(param)

        def hook(_: torch.Tensor) -> None:
            this, p = state(), weak_param()
            if this is not None and p is not None and this.unit is not None:
                # With ``reduce_unused_params`` the unit reduces in the final callback on every
                # rank alike; see ``FSDPModule.set_reduce_scatter_unused_params``.
                if this.unit.mark_grad_ready(p) and not this.unit.reduce_unused_params:
                    this.post_backward()

        return hook

    def post_backward(self, *, prefetch: bool = True) -> None:
        if self.unit is None:
            return
        self.assert_state(TrainingState.PRE_BACKWARD, TrainingState.IDLE)
        self.training_state = TrainingState.POST_BACKWARD
        if self.sync_gradients:
            self._order().validate(self, "reduce")
        self.unit.post_backward(reduce=self.sync_gradients, reshard=self.reshard_after_backward)
        if prefetch and self.config.backward_prefetch is BackwardPrefetch.BACKWARD_POST:
            self._prefetch(self._order().next_to_backward(self), "backward_prefetch")

    def _queue_final_callback(self) -> None:
        if self.final_callback_queued:
            return
        self.final_callback_queued = True
        if self.manual_finalization_active is None:
            self.manual_finalization_active = self.manual_backward_finalization
        Variable._execution_engine.queue_callback(self._final_callback)

    def _final_callback(self) -> None:
        """Root only: finish the backward of every unit, then check that all are idle (with
        manual finalization, leave what is left to ``finalize_backward``: see [Note: manual
        backward finalization])."""
        self.final_callback_queued = False
        manual = bool(self.manual_finalization_active)
        # Same order on every rank: the cached traversal, reversed.
        for state in reversed(self.all_states):
            state.assert_state(*_BACKWARD_STATES)
            if not manual and state.has_reduction_left():
                # Some parameter got no gradient in this backward (unused on this path).
                state.post_backward(prefetch=False)
            state.end_backward()
            state.make_idle()
        self._order().finish_iteration()
        if manual:
            self.backward_unfinalized = True
            return
        end_backward_iteration(self)

    def has_reduction_left(self) -> bool:
        """Whether this unit still has gradients to reduce in this backward."""
        unit = self.unit
        return (
            unit is not None
            and self.sync_gradients
            and (unit.has_pending_grads() or unit.reduce_unused_params)
        )

    def end_backward(self) -> None:
        """This unit's backward is over: reshard it if still unsharded (unless
        ``reshard_after_backward`` is off) and forget the backward's bookkeeping."""
        unit = self.unit
        if unit is None:
            return
        # Only units still unsharded (no gradients, or prefetched unused) reshard: a
        # reshard is a free, which patches and delays count (FSDP1 skips them too).
        if self.reshard_after_backward and unit.is_unsharded:
            unit.reshard("backward")
        else:
            unit.drop_post_forward()
        unit.reset_backward()

    def make_idle(self) -> None:
        """Idle, with no backward under way (after a backward, or a reset)."""
        self.training_state = TrainingState.IDLE
        self._ran_pre_backward = self._expects_backward = False

    # ------------------------------------------------------------------ helpers
    def _unshard(self, reason: events.UnshardReason) -> None:
        unit = self.unit
        if unit is None or unit.is_unsharded:
            return
        self._order().validate(self, "unshard")
        unit.unshard(reason, async_op=self.unshard_async_op)

    def _prefetch(
        self,
        target: FSDPState | None,
        reason: events.UnshardReason,
        *,
        explicit: bool = False,
        ahead: bool = False,
    ) -> None:
        """Unshard ``target`` early (``ahead``: only issue its forward all-gather, see [Note:
        overlap on the CPU]); see ``limit_all_gathers`` in the wrapper's docstring. An
        ``explicit`` target (set by the user) is not limited by ``limit_all_gathers``."""
        if target is None or target.unit is None or target.unit.is_unsharded:
            return
        if reason == "backward_prefetch" and (
            target.training_state is not TrainingState.IDLE
            or not target._expects_backward
            or not target.unshard_in_backward
        ):
            # Its backward already started (e.g. a root that owns both the first and the last
            # layer reduces only at the end), or will not run (no output of its forward requires
            # grad, e.g. frozen layers before any trainable one): gathering it would be wasted.
            return
        if self.config.limit_all_gathers and not explicit:
            root = self._root()
            # A replicated unit (shard world 1) holds its full parameters without gathering
            # them: nothing to limit, so it does not count.
            units = [s.unit for s in root.all_states if s is not root and s.unit is not None]
            if sum(u.shard_world > 1 and u.is_unsharded for u in units) >= _MAX_UNSHARDED:
                return
        if not ahead:
            target._unshard(reason)  # waited on in the target's pre-hook
        elif target.unit.cpu_overlap is not None and self._order().may_gather_ahead(target):
            if self._root().training_state is TrainingState.FORWARD:  # not a standalone call
                target.unit.cpu_overlap.gather_ahead(target.unit)

    def _order(self) -> ExecOrder[FSDPState]:
        if self.exec_order is None:
            raise AssertionError(f"[rank {self._rank}] FSDP state used before lazy init")
        return self.exec_order

    def _root(self) -> FSDPState:
        if self.root is None:
            raise AssertionError(f"[rank {self._rank}] FSDP state used before lazy init")
        return self.root


def clean_fqn(name: str) -> str:
    """``name`` without the wrapper's ``_fsdp_wrapped_module`` components."""
    return ".".join(part for part in name.split(".") if part != WRAPPED_MODULE_NAME)
