"""The handles ``FSDPModule`` returns for work it leaves in flight: ``UnshardHandle``
(``unshard(async_op=True)``) and ``GradientReductionHandle``
(``finalize_backward(async_op=True)``)."""

from __future__ import annotations

from .._root import end_backward_iteration
from .._runtime import FSDPState
from .._unit import FSDPUnit

__all__ = ["GradientReductionHandle", "UnshardHandle"]


class UnshardHandle:
    """What ``FSDPModule.unshard(async_op=True)`` returns: ``wait()`` makes the unsharded
    parameters usable on the current stream (on the CPU over gloo: waits for the all-gather;
    see [Note: overlap on the CPU] in ``_overlap``)."""

    def __init__(self, unit: FSDPUnit | None = None) -> None:
        self._unit = unit

    def wait(self) -> None:
        """Wait for the all-gather and copy the parameters out (once)."""
        if self._unit is not None:
            self._unit.wait_for_unshard()
            self._unit = None


class GradientReductionHandle:
    """What ``FSDPModule.finalize_backward(async_op=True)`` returns: ``wait()`` waits for the
    gradient reductions finalization issued and ends the backward iteration (once). See
    [Note: manual backward finalization] in ``_root``."""

    def __init__(self, state: FSDPState | None = None) -> None:
        self._state = state

    def wait(self) -> None:
        """Wait for the gradient reductions; afterwards the gradients may be read.

        Raises:
            RuntimeError: ``reset_iter_state()`` invalidated this handle.
        """
        state = self._state
        if state is None:
            return
        if state.pending_reduction is not self:
            raise RuntimeError(
                "This gradient reduction handle was invalidated by reset_iter_state(); its "
                "gradients were dropped."
            )
        state.pending_reduction = None
        self._state = None
        end_backward_iteration(state)
