"""Switches for tools, benchmarks and debugging that change how the engine runs a model.

- :func:`suspend_hooks`: the doors' forward hooks pass everything through, for a tool that runs
  the model's forward its own way (graph mode's tracer gathers the parameters itself).
- :func:`set_order_check`: the in-payload order check on or off, to measure what it costs.
- :func:`set_cpu_overlap`: collectives overlapped with compute on the CPU, or not, likewise.

None is needed to train; each acts on every FSDP instance of a model, of either door.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from ._runtime import FSDPState, states_in
from .api import TrainingState

__all__ = ["set_cpu_overlap", "set_order_check", "suspend_hooks"]


@contextlib.contextmanager
def suspend_hooks(module: nn.Module) -> Iterator[None]:
    """Within the block the forward hooks of every FSDP instance in ``module``'s tree pass
    everything through: no unshard, reshard, input or output cast, and no backward hook is
    installed; the modules compute on the parameters they show (between steps: the local
    shards). Hooks anyone else registered on the same modules keep running, in their order.

    The composable door keeps its hooks registered (their handles are the door's) and switches
    them off, so they keep their place among the user's hooks; the wrapper's ``forward`` calls
    the wrapped module directly. Enter it between training steps; blocks nest.

    Args:
        module: a model sharded by either door, or a module containing some.

    Raises:
        RuntimeError: an instance is inside a forward or backward.
    """
    states = _idle_states(module, "suspend_hooks", "enter it")
    entered = [s for s in states if not s.hooks_suspended]  # an outer block keeps the others
    for state in entered:
        state.hooks_suspended = True
    try:
        yield
    finally:
        for state in entered:
            state.hooks_suspended = False


def set_order_check(module: nn.Module, *, enabled: bool) -> None:
    """Turn the order check of every FSDP instance in ``module``'s tree on (the default) or off.

    Each unit collective carries an order tag that every rank compares after it (see "Order
    checks" in docs/core.md): a divergence in any iteration raises instead of training on
    wrong numbers. Off, the collectives are a few elements shorter and unchecked after the
    first iteration (whose index check stays). For measurement: ``benchmarks/core_vs_fsdp2.py
    --order-check-cost`` steps a model with it off next to one with it on. Call it between
    steps, on every rank alike (the tags change the collectives' sizes).

    Args:
        module: a model sharded by either door, or a module containing some.
        enabled: ``True`` tags every unit collective, ``False`` none.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"set_order_check(enabled=...) takes a bool, got {enabled!r}.")
    for state in states_in(module):
        state.set_order_tags(enabled)


def set_cpu_overlap(module: nn.Module, *, enabled: bool) -> None:
    """Overlap the collectives of every FSDP instance in ``module``'s tree with compute on the
    CPU (the default) or not.

    On the CPU over gloo, prefetched all-gathers and reduce-scatters are issued asynchronously
    and waited on where their results are needed (see "Overlap on the CPU" in docs/core.md);
    the collectives and their order stay the same either way. Off, every collective waits
    where it is issued. For measurement: ``benchmarks/core_vs_fsdp2.py --overlap-cost`` steps
    a model with it off next to one with it on. Call it between steps.

    Args:
        module: a model sharded by either door, or a module containing some.
        enabled: ``True`` overlaps, ``False`` waits at every collective.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"set_cpu_overlap(enabled=...) takes a bool, got {enabled!r}.")
    for state in _idle_states(module, "set_cpu_overlap", "call it"):
        state.overlaps_on_cpu = enabled  # read at the root's lazy init
        if state.unit is not None and state.root is not None:
            state.unit.cpu_overlap = state.root.cpu_overlap if enabled else None


def _idle_states(module: nn.Module, api: str, fix: str) -> list[FSDPState]:
    """The FSDP states of ``module``'s tree; raises if one is inside a forward or backward."""
    states = states_in(module)
    busy = [s.fqn or "<root>" for s in states if s.training_state is not TrainingState.IDLE]
    if busy:
        raise RuntimeError(
            f"fsdp_core.debug.{api}: FSDP instances {busy} are inside a forward or backward; "
            f"{fix} between training steps."
        )
    return states
