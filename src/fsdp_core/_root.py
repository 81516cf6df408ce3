"""What only a root :class:`~fsdp_core._runtime.FSDPState` does: its lazy init (the first
forward makes it the root of every state below it and sets up what they share) and the end of
each backward iteration (wait for the reductions in flight, check that every unit is idle;
manual finalization; recovery after an exception).

[Note: manual backward finalization]
With ``set_manual_backward_finalization(True)`` on the root (FSDP2's mode for pipeline
schedules that treat gradient reduction as an action of its own), the final callback of each
backward reduces nothing that is left and waits for nothing: units whose gradients are still
unreduced (unused parameters, or gradients accumulated with ``set_requires_gradient_sync(False)``)
stay so, and the caller's ``finalize_backward()`` later reduces them (in the same order on
every rank: ``all_states`` reversed), reshards what is still unsharded, waits for the
reductions in flight and checks that every unit is idle. ``finalize_backward(async_op=True)``
leaves that wait to the ``GradientReductionHandle`` it returns; until it is waited on, a
forward or another finalization raises. The mode is read when a backward starts and holds
until the iteration is finalized (or ``reset_iter_state``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ._exec_order import ExecOrder
from ._offload import validate_offloaded_devices
from ._replaced import adopt_at_lazy_init, refuse_unowned_shared
from ._staging import StagingBuffers
from ._streams import CudaStreams, uses_streams
from .api import TrainingState

if TYPE_CHECKING:
    from ._runtime import FSDPState

__all__ = [
    "end_backward_iteration",
    "finalize_backward",
    "init_root",
    "reset_iteration",
    "set_manual_backward_finalization",
]


# ---------------------------------------------------------------------- lazy init
def init_root(root: FSDPState, named_states: list[tuple[str, FSDPState]]) -> None:
    """Make ``root`` the root of ``named_states`` (every state under its owner, ``root``
    included, each once with its name without wrapper components, in ``modules()`` order):
    their order check, adopted parameters, buffer casts, and the CUDA streams or CPU staging
    buffers they share. Done once, at the root's first forward."""
    for name, state in named_states:
        if state is not root and state.manual_backward_finalization:
            raise RuntimeError(
                f"set_manual_backward_finalization must be called on the root FSDP module, "
                f"not on {name!r}: call it on the module the first forward runs through."
            )
    root.is_root = True
    root.root = root
    for name, state in named_states:
        if state is not root and state.is_root:
            raise AssertionError(
                f"[rank {dist.get_rank()}] FSDP instance {name!r} already ran as a root before "
                "its parent's first forward"
            )
        state.is_root = state is root
        state.root = root
        state.fqn = name
        if state is root and not root.config.reshard_root_after_forward and root.unit:
            root.unit.post_forward = None  # the root keeps its parameters after forward
        if state.unit is not None:
            state.unit.name = name
    states = [state for _, state in named_states]
    root.all_states = states
    order: ExecOrder[FSDPState] = ExecOrder(states)
    for index, state in enumerate(states):
        state.exec_order = order
        if state.unit is not None and state.tag_collectives:
            # See [Note: order check].
            state.unit.order_tags = order.checker.for_unit(index)
    # See [Note: replaced parameters] in _replaced (the offload check sees adopted ones).
    adopt_at_lazy_init(
        [(s.fqn, s.unit, s.config.api) for s in states if s.unit is not None],
        check=lambda: validate_offloaded_devices([s.unit for s in states if s.unit]),
    )
    refuse_unowned_shared(root.owner)
    for state in states:
        buffer_dtype = state.config.buffer_dtype
        if buffer_dtype is not None:
            for slot in state.buffers:
                slot.cast(buffer_dtype)
    _init_shared_resources(root, states)


def _init_shared_resources(root: FSDPState, states: list[FSDPState]) -> None:
    """One set of CUDA streams per root, or on the CPU one overlap and one set of staging
    buffers, shared by its units."""
    units = [s.unit for s in states if s.unit is not None]
    pending = max((u.reduce_scatter_max_input_buffers for u in units), default=1)
    cuda = [u.device for u in units if uses_streams(u.device)]
    if cuda:
        # See [Note: streams and events].
        shared = root.share_streams_with
        shared_streams = shared.streams if shared is not None else None
        root.streams = shared_streams or CudaStreams(cuda[0])
        root.streams.max_pending_reduces = max(root.streams.max_pending_reduces, pending)
        for unit in units:
            unit.streams = root.streams
    else:  # see [Note: overlap on the CPU] in _overlap, [Note: staging buffers on the CPU]
        root.cpu_overlap.max_pending_reduces = pending
        staging = StagingBuffers()
        for state in states:
            if state.unit is not None:
                state.unit.staging = staging
                state.unit.cpu_overlap = root.cpu_overlap if state.overlaps_on_cpu else None


# ---------------------------------------------------------------------- end of an iteration
def end_backward_iteration(root: FSDPState) -> None:
    """Wait for the reductions in flight and check that every unit is idle."""
    root.cpu_overlap.flush()  # the reductions still in flight
    if root.streams is not None and (root.is_last_backward or root.manual_finalization_active):
        offload = any(s.unit is not None and s.unit.offload_params for s in root.all_states)
        root.streams.end_backward(offload=offload)
    root.manual_finalization_active = None
    root.backward_unfinalized = False
    _check_idle(root)


def _check_idle(root: FSDPState) -> None:
    """Every unit must be resharded with its gradients reduced once a step ends."""
    for state in root.all_states:
        state.assert_state(TrainingState.IDLE)
        unit = state.unit
        pending = unit is not None and state.sync_gradients and unit.has_pending_grads()
        unsharded = unit is not None and unit.is_unsharded and state.reshard_after_backward
        if unit is not None and (unsharded or pending):
            raise AssertionError(
                f"[rank {dist.get_rank()}] FSDP unit {state.fqn!r} is not idle after the step "
                f"(unsharded={unit.is_unsharded}, unreduced gradients="
                f"{unit.has_pending_grads()})"
            )


def set_manual_backward_finalization(state: FSDPState, enabled: bool) -> None:
    """See ``FSDPModule.set_manual_backward_finalization``; ``state`` must be a root, or not
    known yet (before lazy init, which checks it)."""
    if state.is_root is False:
        raise RuntimeError(
            f"set_manual_backward_finalization must be called on the root FSDP module, not "
            f"on {state.fqn!r}."
        )
    if enabled != state.manual_backward_finalization and torch._C._current_graph_task_id() != -1:
        raise RuntimeError(
            "set_manual_backward_finalization cannot change mode during backward; call it "
            "before forward."
        )
    active = state.manual_finalization_active
    if active is not None and enabled != active:
        raise RuntimeError(
            "set_manual_backward_finalization cannot change mode after backward starts: "
            "finalize the backward iteration (finalize_backward()) or reset_iter_state() "
            "first."
        )
    state.manual_backward_finalization = enabled


def finalize_backward(root: FSDPState, *, wait: bool) -> None:
    """Reduce what is left, reshard, and (``wait``) end the backward iteration. See [Note:
    manual backward finalization]."""
    _validate_finalize_backward(root)
    for state in reversed(root.all_states):
        if state.has_reduction_left():
            state.post_backward(prefetch=False)
        state.end_backward()
        state.training_state = TrainingState.IDLE
    if wait:
        end_backward_iteration(root)


def _validate_finalize_backward(root: FSDPState) -> None:
    if root.pending_reduction is not None:
        raise RuntimeError(
            "The previous gradient reduction must be waited on before finalizing backward "
            "again: call wait() on the GradientReductionHandle."
        )
    if not root.is_root:
        raise RuntimeError(
            f"finalize_backward must be called on the root FSDP module, not on {root.fqn!r}."
        )
    manual = root.manual_finalization_active
    if manual is None:
        manual = root.manual_backward_finalization
    if not manual:
        raise RuntimeError(
            "FSDP finalize_backward requires manual backward finalization. Call "
            "set_manual_backward_finalization(True) before forward."
        )
    if root.final_callback_queued:
        raise RuntimeError(
            "FSDP finalize_backward must be called after backward completes, not inside it."
        )
    for state in root.all_states:
        unit = state.unit
        if unit is not None and unit.has_partial_reduction():
            raise RuntimeError(
                "FSDP manual backward finalization does not support partial gradient "
                f"reductions for unit {state.fqn or '<root>'!r} (set_requires_all_reduce("
                "False)). Call set_requires_all_reduce(True) before the last backward, or "
                "use automatic backward finalization for this configuration."
            )


def reset_iteration(root: FSDPState) -> None:
    """After an exception in forward or backward, reshard every unit and make every state
    idle. The failed step's gradients, also those kept by ``no_sync``, are dropped; those
    reduced already stay (reductions in flight on the CPU finish)."""
    if root.is_root is False:
        raise RuntimeError(
            f"reset_iter_state must be called on the root FSDP module, not {root.fqn!r}."
        )
    root.cpu_overlap.flush()  # as if each reduction had waited where it was issued
    root.manual_finalization_active = None
    root.backward_unfinalized = False
    root.pending_reduction = None  # its handle's wait() now raises
    for state in root.all_states or [root]:
        unit = state.unit
        if unit is not None:
            unit.reshard("explicit")
            unit.drop_unreduced_grads()
            unit.reset_backward()
        state.make_idle()
    root.final_callback_queued = False
