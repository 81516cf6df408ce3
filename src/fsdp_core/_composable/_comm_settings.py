"""The base of ``FSDPModule``: how a module reaches its FSDP state, and the methods that
choose how its unit communicates (custom and process-group-allocated collectives, symmetric
memory, a reduce-scatter group of its own, the gradient divide factor, the all-reduce hook,
how many reductions may be in flight)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .. import _collectives
from .._collectives import (
    AllGatherComm,
    GroupAllocatedAllGather,
    GroupAllocatedReduceScatter,
    ReduceScatterComm,
)
from .._reduce import AllReduceHook
from .._runtime import FSDPState, state_of, states_in

__all__ = ["FSDPCommSettings"]


class FSDPCommSettings:
    """Mixed into ``FSDPModule`` (never used alone): its state access and communication
    settings."""

    def _get_fsdp_state(self) -> FSDPState:
        state = state_of(self)  # type: ignore[arg-type]
        if state is None:
            raise AssertionError("FSDPModule without an FSDP state")
        return state

    def _states(self, recurse: bool) -> list[FSDPState]:
        return states_in(self) if recurse else [self._get_fsdp_state()]  # type: ignore[arg-type]

    def set_all_reduce_hook(
        self, hook: Callable[[torch.Tensor], None], *, stream: Any = None
    ) -> None:
        """Run ``hook(reduced)`` on this module's reduced gradient shard (1D, ``reduce_dtype``)
        after the reduce-scatter, or after the all-reduce with a 2-D mesh, before it is added
        to the ``.grad``s; it may change it in place (e.g. all-reduce it over replicas of its
        own). Not recursive.

        Args:
            hook: ``hook(reduced) -> None``.
            stream: a stream of the compute device to run it on (default ``None``: where the
                reduction ran); not with a 2-D mesh, whose all-reduce stream runs it.
        """
        unit = self._get_fsdp_state().unit
        if unit is None:
            return
        if stream is not None and unit.groups.replicate_size > 1:
            raise ValueError("stream cannot be set when using native HSDP")
        unit.all_reduce_hook = AllReduceHook(hook, stream)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Reduce this module's gradients to their sum divided by ``factor`` instead of their
        average over the data-parallel ranks (a factor of 1: the plain sum). Not recursive.

        Args:
            factor: a positive number.
        """
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
            raise ValueError(
                f"set_gradient_divide_factor takes a positive number, got {factor!r}; e.g. "
                "the data-parallel world size for an average."
            )
        unit = self._get_fsdp_state().unit
        if unit is not None:
            unit.gradient_divide_factor = float(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Accepted for FSDP2's API: fsdp_core's collectives only ever sum (the division by
        the world size or ``set_gradient_divide_factor`` happens before, on the input), so
        there is no other reduction to switch off. Not recursive.

        Args:
            enable: whether only sum-type reductions may be used.
        """
        if not isinstance(enable, bool):
            raise TypeError(f"set_force_sum_reduction_for_comms takes a bool, got {enable!r}.")
        self._get_fsdp_state().force_sum_reduction_for_comms = enable

    def set_reduce_scatter_max_input_buffers(
        self, max_input_buffers: int, *, recurse: bool = True
    ) -> None:
        """How many gradient reduction inputs may be in flight at once on CUDA (default 1):
        beyond that the compute stream waits for the oldest reduction before going on. The
        units of one root share one pipeline, which takes the largest value set on them at
        lazy init (the first forward). Scheduling only: the numbers do not change. On the CPU
        reductions complete before backward goes on, so nothing is held.

        Args:
            max_input_buffers: a positive int.
            recurse: also every ``FSDPModule`` below this one (default ``True``).
        """
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(
                "set_reduce_scatter_max_input_buffers: max_input_buffers must be an int, got "
                f"{type(max_input_buffers).__name__}"
            )
        if max_input_buffers < 1:
            raise ValueError(
                "set_reduce_scatter_max_input_buffers: max_input_buffers must be a positive "
                f"int, got {max_input_buffers}"
            )
        for state in self._states(recurse):
            if state.unit is not None:
                state.unit.reduce_scatter_max_input_buffers = max_input_buffers

    def set_custom_all_gather(self, comm: AllGatherComm) -> None:
        """All-gather this module's parameters with ``comm`` (torch's ``AllGather``
        interface: ``allocate`` makes the output buffer, calling it runs the collective); see
        [Note: custom collectives] in ``_collectives``. Not recursive.

        Args:
            comm: the all-gather.
        """
        comm = _checked_comm("set_custom_all_gather", comm)
        unit = self._get_fsdp_state().unit
        if unit is not None:
            unit.all_gather_comm = comm

    def set_custom_reduce_scatter(self, comm: ReduceScatterComm) -> None:
        """Reduce-scatter this module's gradients with ``comm`` (torch's ``ReduceScatter``
        interface), as :meth:`set_custom_all_gather`. Not recursive.

        Args:
            comm: the reduce-scatter.
        """
        comm = _checked_comm("set_custom_reduce_scatter", comm)
        unit = self._get_fsdp_state().unit
        if unit is not None:
            unit.reduce_scatter_comm = comm

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Allocate this module's all-gather and reduce-scatter buffers from the process
        group's own allocator where its backend has one (NCCL memory registration), else as
        usual; see [Note: custom collectives] in ``_collectives``. Raises ``AssertionError``
        after :meth:`set_custom_all_gather` or :meth:`set_custom_reduce_scatter`, which choose
        their own buffers (a custom comm set afterwards replaces this). Not recursive.

        Args:
            enable: whether to allocate from the process group.
        """
        unit = self._get_fsdp_state().unit
        if unit is None:
            return
        defaults = (None, GroupAllocatedAllGather, GroupAllocatedReduceScatter)
        for name, comm in (
            ("all-gather", unit.all_gather_comm),
            ("reduce-scatter", unit.reduce_scatter_comm),
        ):
            if comm is not None and type(comm) not in defaults:
                raise AssertionError(
                    "set_allocate_memory_from_process_group_for_comm: this module's "
                    f"{name} is custom ({type(comm).__name__}), which allocates its own "
                    "buffers; set one or the other."
                )
        group = unit.groups.shard
        unit.all_gather_comm = GroupAllocatedAllGather(group) if enable else None
        unit.reduce_scatter_comm = GroupAllocatedReduceScatter(group) if enable else None

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated alias of :meth:`set_gradient_divide_factor` (as in torch), which it
        calls after a ``DeprecationWarning`` (torch's category).

        Args:
            factor: a positive number.
        """
        warnings.warn(
            "set_reduce_scatter_divide_factor is deprecated: use set_gradient_divide_factor "
            "instead.",
            DeprecationWarning,
            stacklevel=2,
        )
        self.set_gradient_divide_factor(factor)

    def set_separate_reduce_scatter_group(
        self, enable: bool = True, *, recurse: bool = True
    ) -> None:
        """Run the gradient reduce-scatter on a process group of its own over the same ranks
        (``True``), so that it can progress alongside the all-gathers of backward instead of
        queuing behind them on one communicator; ``False`` goes back to the shard group. One
        group is made per set of shard ranks (``dist.new_group(ranks,
        use_local_synchronization=True)``), so every rank of those groups must call this
        alike. Same numbers either way.

        Args:
            enable: whether to use a group of its own (default ``True``).
            recurse: also every ``FSDPModule`` below this one (default ``True``).
        """
        made: dict[tuple[int, ...], Any] = {}
        for state in self._states(recurse):
            unit = state.unit
            if unit is None or unit.groups.shard is None or unit.shard_world == 1:
                continue
            if not enable:
                unit.reduce_scatter_group = None
                continue
            ranks = tuple(dist.get_process_group_ranks(unit.groups.shard))
            if ranks not in made:
                made[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
            unit.reduce_scatter_group = made[ranks]

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Allocate this module's all-gather buffers (and, with
        :meth:`set_force_sum_reduction_for_comms`, reduce-scatter buffers) from symmetric
        memory (``torch.distributed._symmetric_memory``), for NCCL's symmetric-memory
        collectives. Needs CUDA parameters, an NCCL process group and a torch with symmetric
        memory; elsewhere it raises ``RuntimeError`` naming what is missing. Not with
        :meth:`set_custom_all_gather`/:meth:`set_custom_reduce_scatter`. Not recursive.

        Args:
            backend: the symmetric memory backend; only ``"NCCL"`` (the default).
        """
        if backend != "NCCL":
            raise ValueError(
                f"set_symm_mem_for_comm: backend={backend!r} is not supported; only 'NCCL' is."
            )
        state = self._get_fsdp_state()
        unit = state.unit
        if unit is None:
            return
        for name, comm in (
            ("all gather", unit.all_gather_comm),
            ("reduce scatter", unit.reduce_scatter_comm),
        ):
            if comm is not None and not _collectives.is_default_comm(comm):
                raise AssertionError(
                    f"cannot call set_symm_mem() when {name} comm is custom: {type(comm).__name__}"
                )
        symm = _collectives.symm_mem_comms(unit.groups.shard, unit.device)
        unit.all_gather_comm = symm.all_gather
        if state.force_sum_reduction_for_comms:
            unit.reduce_scatter_comm = symm.reduce_scatter


def _checked_comm(api: str, comm: Any) -> Any:
    if not callable(comm) or not callable(getattr(comm, "allocate", None)):
        raise TypeError(
            f"{api}: expected an object with allocate(size, *, dtype, device) and __call__ "
            f"(torch's AllGather/ReduceScatter interface), got {type(comm).__name__}."
        )
    return comm
