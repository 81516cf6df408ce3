"""Execution order: what ran in the first iteration, what to prefetch, and order validation.

[Note: graph order]
In the first forward every FSDP instance is appended to the *graph order* when its forward
finishes (post-order): for ``root -> lin1, lin2, lin3, lin4 -> nested_lin`` that is
``[lin1, lin2, lin3, nested_lin, lin4, root]``. Backward reaches the units' outputs in the reverse
of that order, so backward prefetch takes ``graph_order[i - 1]`` for the unit at index ``i``.
Forward prefetch follows the order in which forwards *start* (pre-order), recorded alongside.
Prefetching starts in the second iteration, once the order is known.

[Note: order validation]
If ranks ran units in different orders, their all-gathers would pair up across different units
and hang or silently mix tensors. In every iteration each unit collective carries an order tag
in its own payload, compared after it completes, at no extra collective: see [Note: order
check] in ``_order_check``. That cannot help when the units differ in size: the collective
itself fails first (gloo aborts one rank's process with ``gloo::EnforceNotMet`` and hands the
other a corrupted buffer; NCCL may hang). With ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (the level at
which torch's FSDP1 checks its execution order the same way) the first iteration also checks
*before* every collective a unit issues (its all-gather or gradient reduction): the ranks of
the unit's group all-reduce (MAX) the pair ``(code, -code)`` with ``code = 2 * unit_index +
op``; if the minimum and maximum differ, every rank raises the same error naming the units
involved, before the collective. It costs one 16-byte all-reduce per unit collective of the
first iteration, which is why it is opt-in: by default fsdp_core issues exactly the collectives
torch's FSDP issues (tests that count them, torch's own included, see the same numbers). Rank-
dependent control flow usually shows in the first iteration, so a run that aborts inside a
collective is worth repeating under DETAIL. Later iterations also compare the local forward
order against the recorded one and warn once on a deviation (dynamic control flow is legal as
long as all ranks take the same path).
"""

from __future__ import annotations

import warnings
from typing import Generic, Literal, Protocol, TypeVar

import torch.distributed as dist
from torch import nn

from . import _collectives
from ._order_check import OrderChecker
from ._unit import FSDPUnit

__all__ = ["ExecOrder", "OrderedState"]


class OrderedState(Protocol):
    """What the execution order needs of an FSDP instance's state (``_runtime.FSDPState``)."""

    @property
    def fqn(self) -> str: ...

    @property
    def owner(self) -> nn.Module: ...

    @property
    def unit(self) -> FSDPUnit | None: ...


FSDPState = TypeVar("FSDPState", bound=OrderedState)

_OPS = ("unshard", "reduce")


class ExecOrder(Generic[FSDPState]):
    """Forward order of the FSDP instances under one root, shared by all of them.

    Args:
        states: every FSDP state under the root, in ``modules()`` order; the position is the
            unit index ranks compare in [Note: order validation].
    """

    def __init__(self, states: list[FSDPState]) -> None:
        self.states = states
        self._index = {id(s): i for i, s in enumerate(states)}
        self.recording = True  # the first forward has not finished
        # The first iteration has not finished and the debug level asks for the check: see
        # [Note: order validation].
        self.validating = dist.get_debug_level() == dist.DebugLevel.DETAIL
        self.pre_forward_order: list[FSDPState] = []
        self.post_forward_order: list[FSDPState] = []
        # The owners (wrapper modules) in post-forward order; the same list on every instance.
        self.graph_order: list[nn.Module] = []
        self._graph_index: dict[int, int] = {}  # id(state) -> its position in graph order
        self._forward_pos = 0
        self._started: set[int] = set()  # ids of the states whose forward started in this one
        self._warned = False
        # Codes and comparison of the in-payload order tags. See [Note: order check].
        self.checker = OrderChecker([s.fqn for s in states])

    # ------------------------------------------------------------------ recording
    def record_pre_forward(self, state: FSDPState) -> None:
        if self.recording:
            if state not in self.pre_forward_order:
                self.pre_forward_order.append(state)
            return
        pos = self._forward_pos
        self._forward_pos += 1
        self._started.add(id(state))
        expected = self.pre_forward_order[pos] if pos < len(self.pre_forward_order) else None
        if expected is not state and not self._warned:
            self._warned = True
            warnings.warn(
                f"[rank {dist.get_rank()}] FSDP forward order changed after the first iteration: "
                f"forward #{pos} ran {state.fqn!r}, the first iteration ran "
                f"{expected.fqn if expected else None!r} there. Prefetching follows the first "
                "iteration's order; all ranks must still run the same units in the same order.",
                stacklevel=2,
            )

    def record_post_forward(self, state: FSDPState) -> None:
        if self.recording and state not in self.post_forward_order:
            self.post_forward_order.append(state)

    def start_forward(self) -> None:
        """Called when the root's forward starts: a new iteration."""
        self._forward_pos = 0
        self._started.clear()
        self.checker.begin_iteration()

    def may_gather_ahead(self, state: FSDPState) -> bool:
        """Whether ``state``'s forward all-gather may be issued ahead of its pre-forward (see
        [Note: overlap on the CPU] in ``_overlap``): the order is known, not being validated
        (whose checks are collectives of their own), and its forward has not run in this one."""
        return not (self.recording or self.validating) and id(state) not in self._started

    def finish_forward(self) -> None:
        """Called when the root's forward ends; fixes the graph order after the first one."""
        if not self.recording:
            return
        self.recording = False
        self.graph_order.extend(s.owner for s in self.post_forward_order)
        self._graph_index = {id(s): i for i, s in enumerate(self.post_forward_order)}

    def graph_index(self, state: FSDPState) -> int | None:
        """``state``'s position in the graph order, once the first forward has finished."""
        return self._graph_index.get(id(state))

    def index(self, state: FSDPState) -> int:
        """``state``'s position under the root: the unit index ranks compare."""
        return self._index[id(state)]

    def finish_iteration(self) -> None:
        """Called when the root's backward (or a forward without grad) ends.

        Compares the order tags deferred on CUDA (see [Note: order check]).
        """
        if not self.recording:
            self.validating = False
        self.checker.flush()

    # ------------------------------------------------------------------ prefetch targets
    def next_to_forward(self, state: FSDPState) -> FSDPState | None:
        """The state whose forward starts after ``state``'s, if the order is known."""
        if self.recording or state not in self.pre_forward_order:
            return None
        i = self.pre_forward_order.index(state) + 1
        return self.pre_forward_order[i] if i < len(self.pre_forward_order) else None

    def next_to_backward(self, state: FSDPState) -> FSDPState | None:
        """The state whose backward comes after ``state``'s. See [Note: graph order]."""
        index = self._graph_index.get(id(state))
        if self.recording or index is None or index == 0:
            return None
        return self.post_forward_order[index - 1]

    # ------------------------------------------------------------------ validation
    def validate(self, state: FSDPState, op: Literal["unshard", "reduce"]) -> None:
        """Raise if the ranks of ``state``'s group are not at the same unit collective.

        See [Note: order validation].
        """
        unit = state.unit
        if not self.validating or unit is None:
            return
        code = 2 * self._index[id(state)] + _OPS.index(op)
        low = high = code
        # Hybrid: the shard group, then the replicate group; both always run, so that no rank
        # waits in a check its group's other ranks skipped.
        for group in unit.groups.collective_groups():
            group_low, group_high = _collectives.check_same_index(code, group, unit.device)
            low, high = min(low, group_low), max(high, group_high)
        if low == high:
            return
        others = sorted({low, high} - {code})
        described = ", ".join(self._describe(c) for c in others)
        raise RuntimeError(
            f"[rank {dist.get_rank()}] FSDP ranks ran units in different orders: this rank is "
            f"about to {self._describe(code)}, another rank is about to {described}. All ranks "
            "must run the same FSDP instances in the same order in forward and backward; look "
            "for control flow that depends on the rank or on rank-local data."
        )

    def _describe(self, code: int) -> str:
        index, op = divmod(code, 2)
        name = self.states[index].fqn if 0 <= index < len(self.states) else f"unit #{index}"
        verb = "all-gather" if _OPS[op] == "unshard" else "reduce gradients of"
        return f"{verb} {name!r}"
