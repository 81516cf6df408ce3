"""Communication of fsdp_core: collective counts and volume, prefetch order, graph order."""

from __future__ import annotations

import contextlib
import functools
import math
from collections import Counter
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp_core import FSDP, BackwardPrefetch, ShardingStrategy, events
from fsdp_core.wrap import ModuleWrapPolicy, always_wrap_policy, size_based_auto_wrap_policy

from ._models import FourLinear, build, get_input, wrap_model


class Chain(nn.Module):
    """root(head) over three wrapped layers: graph order [l0, l1, l2, root]."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(*(nn.Linear(6, 6) for _ in range(3)))
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(x))


def _chain(group: dist.ProcessGroup, **kwargs: object) -> nn.Module:
    model = Chain()
    for i, layer in enumerate(model.layers):
        model.layers[i] = FSDP(layer, group, **kwargs)
    return FSDP(model, group, **kwargs)


def _step(model: nn.Module, rank: int) -> None:
    model(torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))).sum().backward()


@contextlib.contextmanager
def _recording() -> Iterator[list[events.Event]]:
    seen: list[events.Event] = []
    with events.subscribe(seen.append):
        yield seen


@contextlib.contextmanager
def _counting_collectives() -> Iterator[Counter[str]]:
    """Count calls of the torch.distributed collectives by monkeypatching the module."""
    counts: Counter[str] = Counter()
    names = ["all_gather_single", "all_gather_into_tensor", "reduce_scatter_single"]
    names += ["reduce_scatter_tensor", "all_reduce"]
    originals = {n: getattr(dist, n) for n in names if hasattr(dist, n)}

    def counted(name: str, *args: object, **kwargs: object) -> object:
        counts[name] += 1
        return originals[name](*args, **kwargs)

    for name in originals:
        setattr(dist, name, functools.partial(counted, name))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


@pytest.mark.distributed(world_size=[2, 4])
def test_full_shard_collectives_per_step(rank, world_size, process_group):
    """FULL_SHARD: a non-root unit all-gathers twice and reduce-scatters once per step.

    The root keeps its parameters from forward to backward, so it gathers once. The bytes
    gathered equal the padded unsharded size of each unit times its number of gathers, and the
    bytes reduced its padded size once, each plus the order tag (see [Note: order check]): two
    elements per rank after each rank's block, two per rank after each row of the reduction.
    """
    gather_op = (
        "all_gather_single" if hasattr(dist, "all_gather_single") else ("all_gather_into_tensor")
    )
    reduce_op = (
        "reduce_scatter_single"
        if hasattr(dist, "reduce_scatter_single")
        else ("reduce_scatter_tensor")
    )
    # Theoretical volume from the unwrapped model: unit "block" and the root (the rest).
    unit_bytes: Counter[str] = Counter()
    for name, p in build("nested", rank).named_parameters():
        rows = math.ceil(p.shape[0] / world_size) * world_size
        unit_bytes["block" if name.startswith("block.") else ""] += rows * p[0].numel() * 4
    gather_tag = world_size * 2 * 4
    reduce_tag = world_size * (2 * world_size) * 4
    for backward_prefetch in [None, BackwardPrefetch.BACKWARD_PRE, BackwardPrefetch.BACKWARD_POST]:
        for forward_prefetch in [False, True]:
            model = wrap_model(
                "nested",
                build("nested", rank),
                process_group,
                backward_prefetch=backward_prefetch,
                forward_prefetch=forward_prefetch,
            )
            for step in range(3):
                with _recording() as seen, _counting_collectives() as counts:
                    model(get_input("nested", rank, step)).sum().backward()
                per_unit = Counter((e.unit, e.op) for e in seen if isinstance(e, events.Collective))
                assert per_unit == {
                    ("block", gather_op): 2,
                    ("block", reduce_op): 1,
                    ("", gather_op): 1,
                    ("", reduce_op): 1,
                }, (backward_prefetch, forward_prefetch, step)
                assert counts[gather_op] == 3 and counts[reduce_op] == 2
                assert counts["all_reduce"] == 0  # the order check's are DETAIL-only
                gathered, reduced = Counter(), Counter()
                for e in seen:
                    if isinstance(e, events.Collective) and e.op == gather_op:
                        gathered[e.unit] += e.bytes
                        assert e.group_size == world_size and e.dtype == "float32"
                    elif isinstance(e, events.Collective) and e.op == reduce_op:
                        reduced[e.unit] += e.bytes
                assert gathered == {
                    "block": 2 * (unit_bytes["block"] + gather_tag),
                    "": unit_bytes[""] + gather_tag,
                }
                assert reduced == {u: unit_bytes[u] + reduce_tag for u in ("block", "")}
    # Under TORCH_DISTRIBUTED_DEBUG=DETAIL the first step adds one order check (an all-reduce)
    # per unit collective, and the later steps none.
    previous = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        model = wrap_model("nested", build("nested", rank), process_group)
        for step in range(2):
            with _counting_collectives() as counts:
                model(get_input("nested", rank, step)).sum().backward()
            assert counts["all_reduce"] == (5 if step == 0 else 0), step
    finally:
        dist.set_debug_level(previous)


def _backward_trace(seen: list[events.Event]) -> list[str]:
    """Unshards (after the forward) and reduce-scatters, as readable strings."""
    forward_done = max(
        i for i, e in enumerate(seen) if isinstance(e, events.Reshard) and e.reason == "forward"
    )
    trace = []
    for e in seen[forward_done + 1 :]:
        if isinstance(e, events.Unshard):
            trace.append(f"AG {e.unit} ({e.reason})")
        elif isinstance(e, events.Collective) and e.op.startswith("reduce_scatter"):
            trace.append(f"RS {e.unit}")
    return trace


@pytest.mark.distributed(world_size=2)
def test_backward_prefetch_order(rank, process_group):
    """PRE gathers the next unit before this unit's gradients; POST after they are reduced."""
    root, l0, l1, l2 = "", "layers.0", "layers.1", "layers.2"
    expected = {
        None: [
            f"RS {root}",
            f"AG {l2} (backward)",
            f"RS {l2}",
            f"AG {l1} (backward)",
            f"RS {l1}",
            f"AG {l0} (backward)",
            f"RS {l0}",
        ],
        BackwardPrefetch.BACKWARD_PRE: [
            f"AG {l2} (backward_prefetch)",
            f"RS {root}",
            f"AG {l1} (backward_prefetch)",
            f"RS {l2}",
            f"AG {l0} (backward_prefetch)",
            f"RS {l1}",
            f"RS {l0}",
        ],
        BackwardPrefetch.BACKWARD_POST: [
            f"RS {root}",
            f"AG {l2} (backward_prefetch)",
            f"RS {l2}",
            f"AG {l1} (backward_prefetch)",
            f"RS {l1}",
            f"AG {l0} (backward_prefetch)",
            f"RS {l0}",
        ],
    }
    for prefetch, trace in expected.items():
        model = _chain(process_group, backward_prefetch=prefetch)
        _step(model, rank)  # the first iteration records the order; no prefetch yet
        with _recording() as seen:
            _step(model, rank)
        assert _backward_trace(seen) == trace, prefetch


@pytest.mark.distributed(world_size=2)
def test_forward_prefetch_order(rank, process_group):
    """forward_prefetch gathers the next unit in forward order when a unit's forward starts."""
    model = _chain(process_group, forward_prefetch=True, backward_prefetch=None)
    _step(model, rank)
    with _recording() as seen:
        model(torch.randn(4, 6))
    unshards = [(e.unit, e.reason) for e in seen if isinstance(e, events.Unshard)]
    assert unshards == [
        ("", "forward"),
        ("layers.0", "forward_prefetch"),
        ("layers.1", "forward_prefetch"),
        ("layers.2", "forward_prefetch"),
    ]
    # Without forward_prefetch every unit is gathered by its own forward.
    model = _chain(process_group, forward_prefetch=False)
    _step(model, rank)
    with _recording() as seen:
        model(torch.randn(4, 6))
    assert {e.reason for e in seen if isinstance(e, events.Unshard)} == {"forward"}


class _Outer(nn.Module):
    """Uses its own layer before its nested unit, so it stays unsharded through the child's."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(6, 6)
        self.child = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.child(self.pre(x))


class _Deep(nn.Module):
    """Graph order [side, outer.child, outer, root]; backward runs root, outer, child, side."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.side = nn.Linear(6, 6)
        self.outer = _Outer()
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.outer(self.side(x)))


def _peak_unsharded(rank: int, group: dist.ProcessGroup, *, limit: bool) -> int:
    """Most non-root units unsharded at once during a steady-state BACKWARD_PRE step."""
    kwargs = {"backward_prefetch": BackwardPrefetch.BACKWARD_PRE, "limit_all_gathers": limit}
    model = _Deep()
    model.outer.child = FSDP(model.outer.child, group, **kwargs)
    model.outer = FSDP(model.outer, group, **kwargs)
    model.side = FSDP(model.side, group, **kwargs)
    fsdp = FSDP(model, group, **kwargs)
    _step(fsdp, rank)
    with _recording() as seen:
        _step(fsdp, rank)
    live: set[str] = set()
    peak = 0
    for e in seen:
        if isinstance(e, events.Unshard) and e.unit:
            live.add(e.unit)
        elif isinstance(e, events.Reshard):
            live.discard(e.unit)
        peak = max(peak, len(live))
    return peak


@pytest.mark.distributed(world_size=2)
def test_limit_all_gathers_bounds_prefetched_units(rank, process_group):
    """With limit_all_gathers a prefetch waits while two non-root units are unsharded.

    In backward, ``outer`` stays unsharded until its first layer's gradient, i.e. through
    ``outer.child``'s backward; prefetching ``side`` then would make three.
    """
    assert _peak_unsharded(rank, process_group, limit=True) == 2
    assert _peak_unsharded(rank, process_group, limit=False) == 3


@pytest.mark.distributed(world_size=2)
def test_graph_order_matches_seed_000(rank, process_group):
    """Instances are appended to the graph order when their forward finishes (post-order)."""
    model = FSDP(
        FourLinear(),
        process_group,
        auto_wrap_policy=functools.partial(size_based_auto_wrap_policy, min_num_params=0),
        backward_prefetch=BackwardPrefetch.BACKWARD_POST,
    )
    inner = model.module
    expected = [inner.lin1, inner.lin2, inner.lin3, inner.lin4.module[0], inner.lin4, model]
    assert all(isinstance(m, FSDP) for m in expected)
    assert model._fsdp_graph_order is None  # not known before the first forward
    optim = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    for _ in range(3):
        model(torch.ones(1)).sum().backward()
        optim.step()
    for i, module in enumerate(expected):
        assert module._my_fsdp_idx_in_graph == i
        assert module._fsdp_graph_order == expected
        assert module._fsdp_graph_order is model._fsdp_graph_order  # one shared list


class _RankOrdered(nn.Module):
    """Runs ``a`` then ``b`` on rank 0 and ``b`` then ``a`` elsewhere."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second = (self.a, self.b) if self.rank == 0 else (self.b, self.a)
        return second(first(x))


@pytest.mark.distributed(world_size=2)
def test_mismatched_order_across_ranks_raises(rank, process_group):
    """Ranks running units in different orders fail with a clear error instead of hanging."""
    model = FSDP(_RankOrdered(rank), process_group, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    with pytest.raises(RuntimeError, match="ranks ran units in different orders") as info:
        model(torch.randn(2, 4))
    message = str(info.value)
    assert f"[rank {rank}]" in message
    assert "'a'" in message and "'b'" in message


@pytest.mark.distributed(world_size=2)
def test_no_shard_all_reduces_once_per_unit(rank, process_group):
    """NO_SHARD gathers nothing and all-reduces each unit's gradients in one collective."""
    model = _chain(process_group, sharding_strategy=ShardingStrategy.NO_SHARD)
    _step(model, rank)
    with _recording() as seen, _counting_collectives() as counts:
        _step(model, rank)
    ops = Counter((e.unit, e.op) for e in seen if isinstance(e, events.Collective))
    units = ["", "layers.0", "layers.1", "layers.2"]
    assert ops == {(u, "all_reduce"): 1 for u in units}
    assert counts["all_reduce"] == 4 and sum(counts.values()) == 4


@pytest.mark.distributed(world_size=2)
def test_always_wrap_policy_units(rank, process_group):
    """always_wrap_policy makes every parameter-owning submodule a unit; the root has none."""
    model = FSDP(build("always_wrap", rank), process_group, auto_wrap_policy=always_wrap_policy)
    assert model._unit is None
    model(get_input("nested", rank, 0)).sum().backward()  # names are FQNs once the root is known
    units = {m._unit.name for m in FSDP.fsdp_modules(model) if m._unit is not None}
    assert units == {"inp", "block.0", "block.2", "out"}
