"""``reshard_after_forward``: free each unit's gathered parameters after forward and gather them
again before backward, as an explicit rewrite of the joint graph.

[Note: reshard after forward in a joint graph]
With a forward graph and a backward graph split by a partitioner, "reshard after forward" is a
choice the partitioner makes: an all-gather marked for recomputation is not saved for backward
but issued again there. A joint forward+loss+backward graph has no partitioner: backward reads
the forward's gathered tensor (and views of it, like the transposed weight a linear layer saves)
directly, so those stay alive from the unit's forward to its backward and every unit is full at
the end of forward. This pass makes the recomputation explicit: for each unit it copies the
all-gather, its copy-in, its wait and the parameter-only nodes backward reads (views and copies
of the gathered parameters, nothing that reads an activation) to just before the unit's first
backward use, and points the backward uses at the copies. The forward's gathered tensor then dies
after its last forward use.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
import torch.fx

from .. import _meta, _motion

__all__ = ["reshard_after_forward"]

PASS_NAME = "reshard_after_forward"


def _parameter_region(wait: torch.fx.Node, forward: set[torch.fx.Node]) -> list[torch.fx.Node]:
    """``wait`` and the forward nodes computed from it alone (views, copy-outs), in order."""
    region = {wait}
    order = _meta.positions(wait.graph)
    for node in list(wait.graph.nodes)[order[wait] + 1 :]:
        if (
            node in forward
            and _motion.is_pure(node)
            and node.all_input_nodes
            and all(arg in region for arg in node.all_input_nodes)
        ):
            region.add(node)
    return _meta.ordered(region, order)


def _needed(used: set[torch.fx.Node], region: list[torch.fx.Node]) -> list[torch.fx.Node]:
    """The region's nodes that the used ones are computed from (themselves included)."""
    inside = set(region)
    needed: set[torch.fx.Node] = set()
    stack = list(used)
    while stack:
        node = stack.pop()
        if node in needed or node not in inside:
            continue
        needed.add(node)
        stack.extend(node.all_input_nodes)
    return [node for node in region if node in needed]


def _reshard_unit(
    graph: torch.fx.Graph, gather: torch.fx.Node, forward: set[torch.fx.Node]
) -> bool:
    wait = _meta.wait_of(gather)
    region = _parameter_region(wait, forward)
    order = _meta.positions(graph)
    uses: list[tuple[torch.fx.Node, torch.fx.Node]] = [
        (user, node)
        for node in region
        for user in node.users
        if user.op != "output" and user not in forward
    ]
    if not uses:
        return False
    first_use = min((user for user, _ in uses), key=order.__getitem__)
    copy_in = _motion.exclusive_inputs(gather)
    to_copy = [*copy_in, gather, *_needed({node for _, node in uses}, region)]
    copies: dict[torch.fx.Node, torch.fx.Node] = {}
    unit = _meta.unit_of(gather)
    with graph.inserting_before(first_use):
        for node in to_copy:
            clone = graph.node_copy(node, lambda arg: copies.get(arg, arg))
            clone.meta = dict(node.meta)
            clone.meta[_meta.PASS] = PASS_NAME
            if unit is not None and node in (gather, wait, *copy_in):
                clone.meta[_meta.UNIT] = unit
            copies[node] = clone
    for user, node in uses:
        user.replace_input_with(node, copies[node])
    return True


def reshard_after_forward(
    gm: torch.fx.GraphModule, *, skip_units: Collection[str] = ("",)
) -> torch.fx.GraphModule:
    """Free each unit's gathered parameters after their last forward use and all-gather them
    again before their first backward use. See [Note: reshard after forward in a joint graph].

    Before (one unit, three nodes; the gathered ``w`` lives from forward into backward)::

        w = wait(all_gather(shard))       # forward
        y = mm(x, t(w))                   # forward
        dx = mm(dy, w)                    # backward reads the forward's w

    After (``w`` dies after ``y``; backward gathers its own copy)::

        w = wait(all_gather(shard))       # forward
        y = mm(x, t(w))                   # forward
        w2 = wait(all_gather(shard))      # backward, meta["fsdp_pass"] = "reshard_after_forward"
        dx = mm(dy, w2)

    Args:
        gm: a joint train-step graph (see [Note: graph-mode node conventions]); left unchanged.
        skip_units: units kept gathered from forward to backward, by FQN. Default ``("",)``:
            the root, whose parameters backward needs first, as FSDP2 keeps it.

    Returns:
        A new GraphModule in which every other unit whose gathered parameters backward reads
        has a second all-gather.
    """
    if isinstance(skip_units, str):
        raise TypeError(
            f"reshard_after_forward(skip_units=...) takes a collection of unit FQNs, got the "
            f"string {skip_units!r}; pass ({skip_units!r},)"
        )
    result = _motion.copy_module(gm)
    graph = result.graph
    forward = _meta.forward_nodes(graph)
    gathers = [
        node
        for node in graph.nodes
        if _meta.is_all_gather(node)
        and node in forward
        and not (set(_meta.unit_names(node)) & set(skip_units))
    ]
    for gather in gathers:
        _reshard_unit(graph, gather, forward)
    graph.lint()
    result.recompile()
    return result
