"""``bucket_all_gathers`` / ``bucket_reduce_scatters``: merge neighbouring collectives into one.

[Note: bucketing without crossing a dependency]
Collectives of one kind are taken in graph order and grouped greedily into buckets of the same
process group, dtype (and reduce op) up to ``bucket_bytes`` of unsharded data. A bucket becomes
one collective: a copy-in that concatenates the members' inputs, the collective, its wait, and a
copy-out that gives every member's reader a tensor of the member's shape. The merged collective
is issued at the first member's place, or later if a member's input is computed later (its
copy-in, the pure nodes feeding only it, moves with it; compute never moves); its wait sits
where the first member's wait was, or just after the issue. A member joins a bucket only if that
issue point still comes before every read of every member's result: a collective whose input is
computed from another's result (or after another's result is read) starts a new bucket.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from .. import _meta, _motion

__all__ = ["bucket_all_gathers", "bucket_reduce_scatters"]

_ATEN = torch.ops.aten


def _unsharded_bytes(collective: torch.fx.Node) -> int:
    value = collective.args[0]
    size, _ = _meta.group_of(collective)
    if not isinstance(value, torch.fx.Node):
        raise AssertionError(f"collective {collective.name} has no input node")
    nbytes = _meta.nbytes_of(value.meta.get("val"))
    return nbytes * size if _meta.is_all_gather(collective) else nbytes


def _key(collective: torch.fx.Node) -> tuple[object, ...]:
    value = collective.args[0]
    dtype = value.meta["val"].dtype if isinstance(value, torch.fx.Node) else None
    op = collective.args[1] if _meta.is_reduce_scatter(collective) else None
    return (_meta.group_of(collective), dtype, op)


class _Plan:
    """A bucket being grown: its members and where the merged collective would go."""

    def __init__(self, first: torch.fx.Node, order: dict[torch.fx.Node, int]) -> None:
        self.members: list[torch.fx.Node] = []
        self.issue = order[first]
        self.first_read = len(order)
        self.nbytes = 0

    def admits(self, collective: torch.fx.Node, order: dict[torch.fx.Node, int]) -> bool:
        chain = _motion.exclusive_inputs(collective)
        issue = max(self.issue, _motion.frontier(collective, chain, order))
        wait = _meta.wait_of(collective)
        reads = [order[user] for user in wait.users]
        first_read = min([self.first_read, *reads])
        if issue >= first_read or self._reads_a_member(collective, order):
            return False
        self.issue, self.first_read = issue, first_read
        self.members.append(collective)
        self.nbytes += _unsharded_bytes(collective)
        return True

    def _reads_a_member(self, collective: torch.fx.Node, order: dict[torch.fx.Node, int]) -> bool:
        """Whether ``collective``'s input is computed from a member's result."""
        if not self.members:
            return False
        waits = {_meta.wait_of(member) for member in self.members}
        lowest = min(order[wait] for wait in waits)
        seen: set[torch.fx.Node] = set()
        stack = list(collective.all_input_nodes)
        while stack:
            node = stack.pop()
            if node in waits:
                return True
            if node in seen or order[node] < lowest:
                continue
            seen.add(node)
            stack.extend(node.all_input_nodes)
        return False


def _buckets(graph: torch.fx.Graph, kind: str, bucket_bytes: int) -> list[list[torch.fx.Node]]:
    is_kind = _meta.is_all_gather if kind == "all_gather" else _meta.is_reduce_scatter
    collectives = [node for node in graph.nodes if is_kind(node)]
    order = _meta.positions(graph)
    buckets: list[list[torch.fx.Node]] = []
    plan: _Plan | None = None
    for collective in collectives:
        if (
            plan is not None
            and _key(plan.members[0]) == _key(collective)
            and plan.nbytes + _unsharded_bytes(collective) <= bucket_bytes
            and plan.admits(collective, order)
        ):
            continue
        plan = _Plan(collective, order)
        plan.admits(collective, order)
        buckets.append(plan.members)
    return buckets


def _emit(
    graph: torch.fx.Graph,
    pass_name: str,
    target: object,
    *args: object,
    **kwargs: object,
) -> torch.fx.Node:
    node = graph.call_function(target, args, kwargs)  # type: ignore[arg-type]
    return _meta.stamp(node, unit=None, pass_name=pass_name)


def _merge(graph: torch.fx.Graph, members: list[torch.fx.Node], pass_name: str) -> None:
    order = _meta.positions(graph)
    gather = _meta.is_all_gather(members[0])
    size, _ = _meta.group_of(members[0])
    chains = [_motion.exclusive_inputs(member) for member in members]
    issue_at = max(
        [order[members[0]]]
        + [_motion.frontier(m, c, order) + 1 for m, c in zip(members, chains, strict=True)]
    )
    moving = {node for chain in chains for node in chain}
    anchor = next(n for n in list(graph.nodes)[issue_at:] if n not in moving)
    for chain in chains:
        _motion.move_before([n for n in chain if order[n] >= issue_at], anchor)
    waits = [_meta.wait_of(member) for member in members]
    inputs = [member.args[0] for member in members]
    units = [u for member in members for u in _meta.unit_names(member)]
    with graph.inserting_before(anchor):
        if gather:
            flats = [_emit(graph, pass_name, _ATEN.reshape.default, x, [-1]) for x in inputs]
        else:
            flats = [_emit(graph, pass_name, _ATEN.reshape.default, x, [size, -1]) for x in inputs]
        cat = _emit(graph, pass_name, _ATEN.cat.default, flats, 0 if gather else 1)
        if not gather:
            cat = _emit(graph, pass_name, _ATEN.reshape.default, cat, [-1])
        merged = _emit(graph, pass_name, members[0].target, cat, *members[0].args[1:])
    order = _meta.positions(graph)
    wait_anchor = min(waits, key=order.__getitem__)
    if order[wait_anchor] < order[merged]:
        wait_anchor = anchor
    with graph.inserting_before(wait_anchor):
        wait = _emit(graph, pass_name, _meta.WAIT, merged)
        if gather:
            grid = _emit(graph, pass_name, _ATEN.view.default, wait, [size, -1])
            widths = [flat.meta["val"].numel() for flat in flats]
            pieces = _emit(graph, pass_name, _ATEN.split_with_sizes.default, grid, widths, 1)
        else:
            widths = [flat.meta["val"].shape[1] for flat in flats]
            pieces = _emit(graph, pass_name, _ATEN.split_with_sizes.default, wait, widths)
        for index, (member, old_wait) in enumerate(zip(members, waits, strict=True)):
            piece = _emit(graph, pass_name, operator.getitem, pieces, index)
            shape = list(old_wait.meta["val"].shape)
            if gather:
                piece = _emit(
                    graph,
                    pass_name,
                    _ATEN.clone.default,
                    piece,
                    memory_format=torch.contiguous_format,
                )
            out = _emit(graph, pass_name, _ATEN.view.default, piece, shape)
            out.meta[_meta.UNIT] = _meta.unit_of(member) or ""
            old_wait.replace_all_uses_with(out)
    for member, old_wait in zip(members, waits, strict=True):
        graph.erase_node(old_wait)
        graph.erase_node(member)
    for node in (merged, wait):
        node.meta[_meta.UNIT] = "+".join(units)
        node.meta[_meta.UNITS] = units


def _bucket(
    gm: torch.fx.GraphModule, *, kind: str, bucket_bytes: int, pass_name: str
) -> torch.fx.GraphModule:
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise ValueError(
            f"{pass_name}(bucket_bytes=...) must be a positive int (bytes of unsharded data per "
            f"bucket), got {bucket_bytes!r}"
        )
    result = _motion.copy_module(gm)
    for members in _buckets(result.graph, kind, bucket_bytes):
        if len(members) > 1:
            _merge(result.graph, members, pass_name)
    result.graph.lint()
    result.recompile()
    return result


def bucket_all_gathers(gm: torch.fx.GraphModule, *, bucket_bytes: int) -> torch.fx.GraphModule:
    """Merge neighbouring all-gathers of one group and dtype into one all-gather per bucket.
    See [Note: bucketing without crossing a dependency].

    Before (two units, each gathered and read in turn)::

        a = wait(all_gather(shard_a))
        ya = mm(x, t(a))
        b = wait(all_gather(shard_b))

    After (one collective at ``a``'s place; ``b``'s copy-in moved up with it)::

        ab = wait(all_gather(cat([shard_a.reshape(-1), shard_b.reshape(-1)])))
        a, b = <split ab per rank and per member, copied out to each member's shape>
        ya = mm(x, t(a))

    Args:
        gm: a joint train-step graph (see [Note: graph-mode node conventions]); left unchanged.
        bucket_bytes: the most unsharded bytes (all-gather outputs) one bucket holds; a single
            all-gather larger than this stays alone.

    Returns:
        A new GraphModule; merged nodes carry ``meta["fsdp_pass"] = "bucket_all_gathers"`` and
        ``meta["fsdp_units"]``.
    """
    return _bucket(gm, kind="all_gather", bucket_bytes=bucket_bytes, pass_name="bucket_all_gathers")


def bucket_reduce_scatters(gm: torch.fx.GraphModule, *, bucket_bytes: int) -> torch.fx.GraphModule:
    """Merge neighbouring reduce-scatters of one group, dtype and reduce op into one per bucket.
    See [Note: bucketing without crossing a dependency].

    Before (two units' gradients reduced as each is ready)::

        ga = wait(reduce_scatter(grad_a, "avg"))
        grad_b = mm(dy, x)
        gb = wait(reduce_scatter(grad_b, "avg"))

    After (one collective once ``grad_b`` exists; each rank's rows of both inputs side by side)::

        grad_b = mm(dy, x)
        gab = wait(reduce_scatter(cat([grad_a.reshape(g, -1), grad_b.reshape(g, -1)], 1), "avg"))
        ga, gb = <split gab per member, viewed to each member's shape>

    Args:
        gm: a joint train-step graph (see [Note: graph-mode node conventions]); left unchanged.
        bucket_bytes: the most unsharded bytes (reduce-scatter inputs) one bucket holds; a
            single reduce-scatter larger than this stays alone.

    Returns:
        A new GraphModule; merged nodes carry ``meta["fsdp_pass"] = "bucket_reduce_scatters"``
        and ``meta["fsdp_units"]``.
    """
    return _bucket(
        gm, kind="reduce_scatter", bucket_bytes=bucket_bytes, pass_name="bucket_reduce_scatters"
    )
