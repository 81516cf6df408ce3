"""Overlap on the CPU: a unit's collectives run on gloo's threads while the rank computes.

[Note: overlap on the CPU]
On CUDA the all-gathers and reduce-scatters run on side streams (see [Note: streams and events]
in ``_streams``). On the CPU, gloo runs every collective on the process group's own threads; a
synchronous call only makes the rank wait for them. Where the engine does not need a result at
once it issues the collective with ``async_op=True`` and waits where the result is used:

- A prefetched all-gather (backward prefetch, ``forward_prefetch``, the composable door's
  explicit prefetch targets and ``unshard(async_op=True)``) is issued where it always was and
  waited on in ``FSDPUnit.wait_for_unshard``, just before the module's compute: there its
  order tags are checked and its parameters copied out. The unsharded storage is allocated at
  that copy-out, not at the issue, so while the all-gather runs only its output buffer exists,
  as without overlap. A prefetch that nothing used is waited on when it is resharded.
- The reduce-scatter of a unit sharded over its whole world (no replicate group, no custom
  reduce-scatter) is issued in its post-backward; the rest of the reduction (wait, tag check,
  the all-reduce hook, the add into each ``.grad``) runs when the next unit's reduction starts,
  before that unit's reduce buffer is made (at most ``max_pending_reduces`` in flight, one unless
  ``set_reduce_scatter_max_input_buffers`` says more, as FSDP2 holds one on CUDA), or at the end
  of backward, in issue order. A unit with a replicate group reduces synchronously: its
  all-reduce would otherwise move after the next unit's collectives. After a failed step
  ``reset_iter_state`` finishes the reductions in flight, so the gradients left are those left
  without overlap. The engine keeps no reference to the input of a reduction in flight: the
  process group holds what it still reads (gloo's reduce-scatter copies its input when it is
  issued, so the engine's copy goes back to the root's staging buffers there: see [Note:
  staging buffers on the CPU] in ``_staging``). The unsharded gradients are let go once they
  are copied into the input, before the collective is issued, so that they never coexist with
  gloo's copy. So that the overlap costs no memory, a backward prefetch asked for while a
  reduction is in flight takes its all-gather's place there instead: the unit is unsharded as
  asked (its ``unshard`` runs, and is seen, where it always was), but the all-gather is issued
  when the next reduction makes room, just before the one in flight is waited on, or at the
  unit's own ``wait_for_unshard`` or reshard if that comes first. On the benchmark model the
  peak tensor memory was 3.5% over FSDP2's with the prefetch issued at its unshard, 0.7% with
  it deferred, and is about 1% under FSDP2's with the gradients and the input let go early
  (docs/benchmarks.md; ``tests/core/test_reduce_memory.py``). gloo's ``Work.is_completed()``
  stays False until ``wait()`` on torch 2.13, so "finish what is already complete" cannot be
  asked.
- On the CPU a unit copies its own parameters out before it prefetches the next unit, so the
  prefetch's buffer does not coexist with both copies of its own parameters.
- Without a forward prefetch (the default of both doors) a unit's pre-forward still issues the
  forward all-gather of the unit that follows it in the recorded forward order (from the
  second step, inside the root's forward, under ``limit_all_gathers``), once its own
  parameters are copied out: ``CpuOverlap.gather_ahead``. That unit is not unsharded early:
  its ``unshard`` runs, and is seen, in its own pre-forward, which takes the all-gather over and
  waits for it. The all-gathers are issued in the order they were (forward issues no other
  collective of the engine's), each before the compute of the unit ahead of it; one all-gather
  output lives through that compute, as a prefetch's does (and as FSDP2's next all-gather on
  CUDA, issued while the current unit computes). An all-gather issued ahead for a unit that
  does not run (the forward took another path) is finished at the end of the root's forward,
  so the unit's next forward gathers its shard anew. Not while the order is validated
  (``TORCH_DISTRIBUTED_DEBUG=DETAIL``, whose checks are collectives of their own). On the
  benchmark model this removed most of the forward's wait for all-gathers (docs/benchmarks.md).

Every collective keeps its place in the order of a rank's collectives (what the recorder and
the collective patches see, what the order check compares): a deferred backward prefetch is
still issued before the reduce-scatter of the unit whose backward asked for it; only where the
rank waits, and when between two collectives it computes, changes. Only gloo overlaps: thread
mode's backends complete a collective inside the call and the fake backend moves nothing.
``fsdp_core.debug.set_cpu_overlap`` turns it off, to measure it (``benchmarks/core_vs_fsdp2.py
--overlap-cost``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from . import _collectives, _order_check
from ._order_check import UnitTags
from ._reduce import ReduceScatter

__all__ = ["CpuOverlap", "PendingGather", "overlaps"]


def overlaps(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group``'s collectives run on threads of their own (gloo), so that issuing them
    with ``async_op=True`` lets the rank compute meanwhile."""
    return group is not None and dist.get_backend(group) == "gloo"


@dataclass
class PendingGather:
    """A unit's all-gather and the order-tag check that follows it."""

    work: Any  # ``dist.Work``, or None once complete
    gathered: torch.Tensor  # 1D, ``world`` blocks of ``block`` elements
    tags: UnitTags | None
    code: int
    group: dist.ProcessGroup
    world: int
    numel: int  # data elements per block, before the tag

    def finish(self) -> None:
        """Wait for the all-gather; then compare the tags it carried."""
        _collectives.wait(self.work)
        self.work = None
        if self.tags is not None:
            received = _order_check.gathered_tags(self.gathered, self.world, self.numel)
            self.tags.check(self.code, received, self.group)


class CpuOverlap:
    """One root's reduce-scatters in flight on the CPU (shared by its units, as ``CudaStreams``
    is on CUDA), each with what runs once it is complete."""

    def __init__(self) -> None:
        self.max_pending_reduces = 1
        self._reduces: deque[tuple[ReduceScatter, Callable[[torch.Tensor], None]]] = deque()
        self._gathers: list[Callable[[], None]] = []  # deferred backward prefetches, in order
        self._ahead: list[Any] = []  # units whose forward all-gather was issued ahead

    @property
    def reducing(self) -> bool:
        """Whether a reduction is in flight."""
        return bool(self._reduces)

    def defer_gather(self, issue: Callable[[], None]) -> None:
        """Call ``issue`` (a backward prefetch's all-gather) when room is next made, before the
        reduction in flight is waited on; ``issue`` must do nothing once called already."""
        self._gathers.append(issue)

    def make_room(self) -> None:
        """Issue the deferred all-gathers, then finish the oldest reductions until one more may
        be issued."""
        gathers, self._gathers = self._gathers, []
        for issue in gathers:
            issue()
        while len(self._reduces) >= self.max_pending_reduces:
            self._finish_oldest()

    def defer(self, scatter: ReduceScatter, then: Callable[[torch.Tensor], None]) -> None:
        """Once ``scatter`` completes, pass ``then`` the reduced shard (1D, ``scatter.numel``).
        The reduce input is not kept: the process group holds what it still reads."""
        self._reduces.append((scatter, then))

    def gather_ahead(self, unit: Any) -> None:
        """Issue ``unit``'s (an ``FSDPUnit``'s) forward all-gather ahead of its pre-forward."""
        if unit.gather_ahead():
            self._ahead.append(unit)

    def drop_ahead(self) -> None:
        """Finish the all-gathers issued ahead that no unshard took over (the end of forward:
        their units did not run, so the parameters may change before they do)."""
        ahead, self._ahead = self._ahead, []
        for unit in ahead:
            unit.drop_gather_ahead()

    def flush(self) -> None:
        """Finish every reduction in flight, oldest first (the end of backward, or after a
        failed step), and any all-gather issued ahead. A deferred all-gather is left to its
        unit's wait or reshard."""
        self.drop_ahead()
        self._gathers.clear()
        while self._reduces:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        scatter, then = self._reduces.popleft()
        then(scatter.finish()[: scatter.numel])
