"""The arithmetic of local mode's collectives: the same additions, in the same order, as gloo.

[Note: gloo's summation order]
Floating-point addition is not associative, so "the numbers equal a real run's" needs the order
in which a real CPU run (gloo) adds the ranks' contributions, element by element. gloo's
all-reduce is a ring (measured against torch 2.13's gloo at world sizes 2 to 8 and checked
bitwise by ``tests/scale/test_local_exact.py``):

- The flat buffer of ``n`` elements of ``b`` bytes is cut into ``world * k`` segments of
  ``ceil(n / (world * k))`` elements, ``k = max(2, ceil(n * b / (1 MiB * world)))`` segments
  per rank (segments hold at most about 1 MiB), the last ones shorter or empty.
- Rank ``c`` owns the ``k`` consecutive segments from ``c * k``: its elements are summed along
  the ring ending at ``c``: ``x[c-1] + x[c-2] + ... + x[c+1]``, then ``+ x[c]`` (ranks modulo
  the world), each addition rounded to the dtype (bf16/fp16 sums round after every step).
- The owner's sum is then copied to every rank, so all ranks hold the same bits.

``reduce_scatter_tensor`` on gloo is an all-reduce of the whole input followed by each rank
keeping its chunk (``ProcessGroupGloo::reduce_scatter_tensor_coalesced``), so it sums in the
same order over the same segments of the *whole* input; the list form ``reduce_scatter``
all-reduces each rank's piece on its own; ``allreduce_coalesced`` all-reduces the
concatenation. Copies (all-gather, broadcast, scatter, gather, all-to-all) are exact in any
order. MIN and MAX do not depend on the order; PRODUCT follows the ring like SUM.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["all_reduce", "ring_order", "segments"]

SEGMENT_BYTES = 1 << 20
"""The largest segment gloo's ring moves at once (see [Note: gloo's summation order])."""


def ring_order(owner: int, world: int) -> list[int]:
    """The ranks whose contributions are added, first to last, for elements ``owner`` holds."""
    return [(owner - 1 - k) % world for k in range(world - 1)] + [owner]


def segments(numel: int, element_size: int, world: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of the elements each rank of ``world`` sums, by rank (may be empty)."""
    per_rank = max(2, math.ceil(numel * element_size / (SEGMENT_BYTES * world)))
    seg = math.ceil(numel / (world * per_rank)) if numel else 0
    span = per_rank * seg
    return [(min(numel, c * span), min(numel, (c + 1) * span)) for c in range(world)]


def _combine(acc: torch.Tensor, other: torch.Tensor, op: dist.ReduceOp.RedOpType) -> None:
    if op == dist.ReduceOp.SUM or op == dist.ReduceOp.AVG:
        acc.add_(other)
    elif op == dist.ReduceOp.PRODUCT:
        acc.mul_(other)
    elif op == dist.ReduceOp.MAX:
        torch.maximum(acc, other, out=acc)
    elif op == dist.ReduceOp.MIN:
        torch.minimum(acc, other, out=acc)
    elif op == dist.ReduceOp.BAND:
        acc.bitwise_and_(other)
    elif op == dist.ReduceOp.BOR:
        acc.bitwise_or_(other)
    elif op == dist.ReduceOp.BXOR:
        acc.bitwise_xor_(other)
    else:
        raise NotImplementedError(
            f"mode='local' does not implement reduce op {op}; use SUM, AVG, PRODUCT, MIN, MAX, "
            "BAND, BOR or BXOR"
        )


@torch.no_grad()
def all_reduce(inputs: Sequence[torch.Tensor], op: dist.ReduceOp.RedOpType) -> torch.Tensor:
    """The reduction of ``inputs`` (one flat tensor per rank of the group, in group order), with
    gloo's grouping of the operations. See [Note: gloo's summation order].

    ``AVG`` (which gloo lacks) is the sum divided by the group size once, at the end.
    """
    world = len(inputs)
    first = inputs[0]
    if world == 1:
        out = first.clone()
    else:
        out = torch.empty_like(first)
        for owner, (start, stop) in enumerate(segments(first.numel(), first.element_size(), world)):
            if start >= stop:
                continue
            order = ring_order(owner, world)
            acc = inputs[order[0]][start:stop].clone()
            for rank in order[1:]:
                _combine(acc, inputs[rank][start:stop], op)
            out[start:stop] = acc
    if op == dist.ReduceOp.AVG:
        out.div_(world)
    return out
