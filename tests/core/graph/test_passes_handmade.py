"""The graph-mode passes on small joint graphs built by hand (single process, no process group:
collectives run on a simulated world, see tests/core/graph/_graphs.py)."""

from __future__ import annotations

import itertools
import operator
from unittest import mock

import pytest
import torch
import torch.fx

from fsdp_core.graph import _meta, _motion, peak_memory
from fsdp_core.graph.passes import (
    bucket_all_gathers,
    bucket_reduce_scatters,
    prefetch,
    reshard_after_forward,
)

from ._graphs import ATEN, GROUP, _call, _input, count, example_inputs, linear_chain, run

UNIT_BYTES = 8 * 8 * 4  # one gathered 8 x 8 fp32 weight


def _same_outputs(a: torch.fx.GraphModule, b: torch.fx.GraphModule) -> None:
    inputs = example_inputs(a)
    expected, _ = run(a, inputs)
    got, _ = run(b, inputs)
    assert len(expected) == len(got)
    for want, have in zip(expected, got, strict=True):
        assert torch.equal(want, have)


def _gathers_by_unit(gm: torch.fx.GraphModule) -> dict[str, int]:
    found: dict[str, int] = {}
    for node in gm.graph.nodes:
        if _meta.is_all_gather(node):
            for unit in _meta.unit_names(node):
                found[unit] = found.get(unit, 0) + 1
    return found


def test_reshard_after_forward_gathers_every_unit_again_before_its_backward() -> None:
    gm = linear_chain(4)
    resharded = reshard_after_forward(gm, skip_units=())
    assert _gathers_by_unit(resharded) == {f"layers.{i}": 2 for i in range(4)}
    forward = _meta.forward_nodes(resharded.graph)
    added = [n for n in resharded.graph.nodes if n.meta.get(_meta.PASS) == "reshard_after_forward"]
    assert added and not (set(added) & forward)
    # No backward node reads a forward all-gather's result any more.
    for gather in (n for n in forward if _meta.is_all_gather(n)):
        region = {_meta.wait_of(gather)}
        region |= {u for w in region for u in w.users if u in forward}
        for node in region:
            assert all(user in forward for user in node.users), node.name
    _same_outputs(gm, resharded)
    assert count(gm, _meta.ALL_GATHER) == 4  # the input is left unchanged


def test_reshard_after_forward_lowers_the_peak_by_the_units_not_in_flight() -> None:
    units = 6
    gm = linear_chain(units)
    before, _ = peak_memory(gm)
    after, _ = peak_memory(reshard_after_forward(gm, skip_units=()))
    assert before - after >= (units - 2) * UNIT_BYTES


def test_reshard_after_forward_skips_the_root_by_default() -> None:
    gm = linear_chain(3)
    for node in gm.graph.nodes:
        if node.meta.get(_meta.UNIT) == "layers.0":
            node.meta[_meta.UNIT] = ""
    assert _gathers_by_unit(reshard_after_forward(gm)) == {"": 1, "layers.1": 2, "layers.2": 2}
    with pytest.raises(TypeError, match=r"skip_units.*\(''.*,\)"):
        reshard_after_forward(gm, skip_units="")


def test_bucketing_two_units_per_bucket_halves_the_collectives_rounded_up() -> None:
    gm = linear_chain(5)
    gathered = bucket_all_gathers(gm, bucket_bytes=2 * UNIT_BYTES)
    reduced = bucket_reduce_scatters(gm, bucket_bytes=2 * UNIT_BYTES)
    assert count(gathered, _meta.ALL_GATHER) == 3
    assert count(reduced, _meta.REDUCE_SCATTER) == 3
    _same_outputs(gm, gathered)
    _same_outputs(gm, reduced)
    _, issued = run(gathered, example_inputs(gm))
    assert [units for op, units in issued if op == "all_gather"] == [
        ("layers.0", "layers.1"),
        ("layers.2", "layers.3"),
        ("layers.4",),
    ]
    merged = next(n for n in gathered.graph.nodes if _meta.is_all_gather(n))
    assert merged.meta[_meta.PASS] == "bucket_all_gathers"
    assert merged.meta[_meta.UNIT] == "layers.0+layers.1"


def test_bucket_bytes_is_validated() -> None:
    with pytest.raises(ValueError, match=r"bucket_all_gathers\(bucket_bytes=...\).*got 0"):
        bucket_all_gathers(linear_chain(2), bucket_bytes=0)
    with pytest.raises(ValueError, match=r"prefetch\(depth=...\).*got -1"):
        prefetch(linear_chain(2), depth=-1)


def _dependent_gathers() -> torch.fx.GraphModule:
    """Unit b's shard is computed from unit a's gathered result: b cannot be issued with a."""
    graph = torch.fx.Graph()
    shard_a = _input(graph, "shard_a", (4, 8))
    shard_c = _input(graph, "shard_c", (4, 8))
    gather_a = _call(graph, _meta.ALL_GATHER, shard_a, 2, GROUP, unit="a")
    a = _call(graph, _meta.WAIT, gather_a, unit="a")
    rows = _call(graph, ATEN.slice.Tensor, a, 0, 0, 4)
    shard_b = _call(graph, ATEN.mul.Tensor, rows, 2.0)
    gather_b = _call(graph, _meta.ALL_GATHER, shard_b, 2, GROUP, unit="b")
    b = _call(graph, _meta.WAIT, gather_b, unit="b")
    gather_c = _call(graph, _meta.ALL_GATHER, shard_c, 2, GROUP, unit="c")
    c = _call(graph, _meta.WAIT, gather_c, unit="c")
    total = _call(graph, ATEN.add.Tensor, b, c)
    loss = _call(graph, ATEN.sum.default, total)
    graph.output((loss, a))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_bucketing_does_not_cross_a_data_dependency() -> None:
    gm = _dependent_gathers()
    bucketed = bucket_all_gathers(gm, bucket_bytes=1 << 20)
    units = [tuple(_meta.unit_names(n)) for n in bucketed.graph.nodes if _meta.is_all_gather(n)]
    # a's result feeds b's input, so a and b stay apart; b and c merge.
    assert units == [("a",), ("b", "c")]
    _same_outputs(gm, bucketed)


def test_a_copy_in_chain_is_found_without_walking_the_ancestors_it_shares() -> None:
    # x -> 200 relus -> shared, which feeds own (read only by the target) and other (an output).
    graph = torch.fx.Graph()
    node = graph.placeholder("x")
    for _ in range(200):
        node = graph.call_function(ATEN.relu.default, (node,))
    own = graph.call_function(ATEN.neg.default, (node,))
    other = graph.call_function(ATEN.neg.default, (node,))
    target = graph.call_function(ATEN.neg.default, (own,))
    graph.output((target, other))
    checked: list[torch.fx.Node] = []
    is_pure = _motion.is_pure

    def counting(n: torch.fx.Node) -> bool:
        checked.append(n)
        return is_pure(n)

    with mock.patch.object(_motion, "is_pure", counting):
        assert _motion.exclusive_inputs(target) == [own]
    # Only the chain is asked about: shared has a user outside it, so its 200 ancestors, which
    # could never join the chain, are not visited (a gradient's ancestors are most of a graph).
    assert checked == [own]


def test_prefetch_issues_the_next_gather_before_the_previous_unit_computes() -> None:
    gm = linear_chain(4)
    fetched = prefetch(gm, depth=1)
    nodes = list(fetched.graph.nodes)
    gathers = [n for n in nodes if _meta.is_all_gather(n)]
    for previous, gather in itertools.pairwise(gathers):
        wait_before = _meta.wait_of(previous)
        compute = next(u for u in wait_before.users)  # t(w) of the previous unit
        mm = next(iter(compute.users))
        assert nodes.index(wait_before) < nodes.index(gather) < nodes.index(mm)
        assert gather.meta["fsdp_prefetch"] == 1
    _same_outputs(gm, fetched)
    assert prefetch(gm, depth=0).code == gm.code


@pytest.mark.parametrize(
    "passes",
    [
        (reshard_after_forward, prefetch),
        (prefetch, reshard_after_forward),
        ("ag", "rs", reshard_after_forward, prefetch),
        (reshard_after_forward, "ag", prefetch, "rs"),
    ],
    ids=["reshard-prefetch", "prefetch-reshard", "buckets-first", "mixed"],
)
def test_passes_compose_in_any_order(passes: tuple) -> None:
    gm = linear_chain(4)
    result = gm
    for p in passes:
        if p == "ag":
            result = bucket_all_gathers(result, bucket_bytes=2 * UNIT_BYTES)
        elif p == "rs":
            result = bucket_reduce_scatters(result, bucket_bytes=2 * UNIT_BYTES)
        else:
            result = p(result, skip_units=()) if p is reshard_after_forward else p(result)
    _same_outputs(gm, result)
    result.graph.lint()


def test_peak_memory_follows_liveness_and_views() -> None:
    graph = torch.fx.Graph()
    x = _input(graph, "x", (4, 4))  # 64 bytes, alive throughout
    big = _call(graph, ATEN.mul.Tensor, x, 2.0)  # 64
    view = _call(graph, ATEN.t.default, big)  # a view: no bytes
    small = _call(graph, ATEN.sum.default, view)  # 4; big dies here
    wide = _call(graph, ATEN.cat.default, [x, x])  # 128
    out = _call(graph, ATEN.add.Tensor, wide, small)  # 128; wide dies here
    graph.output((out,))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    assert peak_memory(gm) == (64 + 4 + 128 + 128, out.name)


def test_peak_memory_needs_example_values() -> None:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output((graph.call_function(operator.neg, (x,)),))
    with pytest.raises(ValueError, match=r"peak_memory needs node.meta\['val'\].*neg"):
        peak_memory(torch.fx.GraphModule(torch.nn.Module(), graph))
