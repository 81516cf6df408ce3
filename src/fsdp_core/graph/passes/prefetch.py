"""``prefetch``: issue each all-gather earlier so it overlaps the previous unit's compute.

[Note: prefetch in a joint graph]
A traced step waits for each all-gather right after issuing it. This pass moves all-gather
``k`` (with its copy-in) to just after the *wait* of all-gather ``k - depth`` in graph order:
with ``depth=1``, unit ``k`` is in flight while unit ``k - 1`` computes; its own wait stays
where it was, just before the first read. Waits never move, so moves do not cascade, and at
most ``depth + 1`` units' gathered parameters are live in the window. Forward all-gathers and
the backward ones ``reshard_after_forward`` adds are one sequence, so the first backward gather
is issued during the last forward unit's compute, as FSDP2 issues the first backward all-gather
before it is needed. An all-gather whose copy-in reads something computed later than that point
moves only as far as it can.
"""

from __future__ import annotations

import torch
import torch.fx

from .. import _meta, _motion

__all__ = ["prefetch"]

PASS_NAME = "prefetch"


def prefetch(gm: torch.fx.GraphModule, *, depth: int = 1) -> torch.fx.GraphModule:
    """Issue each all-gather right after the wait of the all-gather ``depth`` before it.
    See [Note: prefetch in a joint graph].

    Before (unit ``b`` is gathered only when unit ``a`` is done)::

        a = wait(ag_a := all_gather(shard_a))
        ya = mm(x, t(a))
        b = wait(ag_b := all_gather(shard_b))

    After (``b`` is in flight while ``a`` computes)::

        a = wait(ag_a := all_gather(shard_a))
        ag_b = all_gather(shard_b)
        ya = mm(x, t(a))
        b = wait(ag_b)

    Args:
        gm: a joint train-step graph (see [Note: graph-mode node conventions]); left unchanged.
        depth: how many units ahead to gather; default 1. ``0`` returns an unchanged copy.

    Returns:
        A new GraphModule; moved all-gathers get ``meta["fsdp_prefetch"] = depth``.
    """
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
        raise ValueError(
            f"prefetch(depth=...) must be a non-negative int (all-gathers to issue ahead), got "
            f"{depth!r}"
        )
    result = _motion.copy_module(gm)
    graph = result.graph
    gathers = [node for node in graph.nodes if _meta.is_all_gather(node)]
    for index in range(depth, len(gathers)):
        gather, target = gathers[index], _meta.wait_of(gathers[index - depth])
        order = _meta.positions(graph)
        chain = _motion.exclusive_inputs(gather)
        earliest = max(order[target], _motion.frontier(gather, chain, order))
        if earliest + 1 >= min(order[node] for node in [*chain, gather]):
            continue
        anchor = list(graph.nodes)[earliest + 1]
        _motion.move_before([*chain, gather], anchor)
        gather.meta["fsdp_prefetch"] = depth
    graph.lint()
    result.recompile()
    return result
