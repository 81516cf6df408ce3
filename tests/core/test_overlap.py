"""Overlap on the CPU (see [Note: overlap on the CPU] in ``fsdp_core/_overlap.py``): prefetched
all-gathers and reduce-scatters over gloo are issued asynchronously and waited on where their
results are needed; the collectives, their order and the numbers stay what they are without."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp_core import FSDP, BackwardPrefetch, events, fully_shard
from fsdp_core.debug import set_cpu_overlap
from fsdp_testing.recording import record_fsdp

from .._spellings import ALL_GATHER

# Every spelling fsdp_core may call (it picks the newest the installed torch has).
_GATHERS = ("all_gather_single", "all_gather_into_tensor")
_SCATTERS = ("reduce_scatter_single", "reduce_scatter_tensor")


class Chain(nn.Module):
    """A root head over three layers: forward order root, l0, l1, l2; backward the reverse."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(*(nn.Linear(10, 10) for _ in range(3)))
        self.head = nn.Linear(10, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.layers(x)))


def _wrapper(group: dist.ProcessGroup) -> nn.Module:
    model = Chain()
    kwargs = dict(forward_prefetch=True, backward_prefetch=BackwardPrefetch.BACKWARD_PRE)
    for i, layer in enumerate(model.layers):
        model.layers[i] = FSDP(layer, group, **kwargs)
    return FSDP(model, group, **kwargs)


def _composable(group: dist.ProcessGroup) -> nn.Module:
    model = Chain()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model, reshard_after_forward=False)
    modules = [model, *model.layers]
    for module, following in itertools.pairwise(modules):
        module.set_modules_to_forward_prefetch([following])
    return model


_DOORS = {"wrapper": _wrapper, "fully_shard": _composable}
_TRANSITIONS = ("Unshard", "Reshard")


def _describe(event: events.Event) -> tuple[object, ...] | None:
    if isinstance(event, events.Collective):
        return (event.op, event.unit, event.bytes)
    if isinstance(event, (events.Unshard, events.Reshard)):
        return (type(event).__name__, event.unit, event.reason)
    return None


def _train(model: nn.Module, rank: int, steps: int = 3) -> list[tuple[object, ...]]:
    """``steps`` SGD steps on rank-dependent inputs; every collective and transition seen."""
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[events.Event] = []
    handle = events.subscribe(seen.append)
    try:
        for step in range(steps):
            x = torch.randn(4, 10, generator=torch.Generator().manual_seed(10 * rank + step))
            model(x).pow(2).sum().backward()
            optim.step()
            optim.zero_grad()
    finally:
        handle.remove()
    return [d for d in map(_describe, seen) if d is not None]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


@pytest.mark.distributed(world_size=[2, 3])
@pytest.mark.parametrize("door", sorted(_DOORS))
def test_overlap_keeps_the_collectives_their_order_and_the_numbers(rank, process_group, door):
    """The same model trained with overlap and without: the same collectives (op, unit, bytes)
    in the same order, the same unshards/reshards (unit, reason) in the same order, and
    bit-identical parameters. (A backward prefetch's all-gather may be issued after its unshard
    while a reduction is in flight, so the two orders are compared each on its own.) At world
    size 3 the shards are padded."""
    assert dist.get_backend(process_group) == "gloo"
    overlapped, waited = _DOORS[door](process_group), _DOORS[door](process_group)
    set_cpu_overlap(waited, enabled=False)
    seen, plain = _train(overlapped, rank), _train(waited, rank)

    def transitions(events: list[tuple[object, ...]]) -> list[tuple[object, ...]]:
        return [e for e in events if e[0] in _TRANSITIONS]

    def collectives(events: list[tuple[object, ...]]) -> list[tuple[object, ...]]:
        return [e for e in events if e[0] not in _TRANSITIONS]

    assert collectives(seen) == collectives(plain)
    assert transitions(seen) == transitions(plain)
    assert [d[2] for d in seen if d[0] == "Unshard"].count("backward_prefetch") >= 3
    for a, b in zip(overlapped.parameters(), waited.parameters(), strict=True):
        assert torch.equal(_local(a), _local(b))


@contextlib.contextmanager
def _timeline(modules: dict[str, nn.Module]) -> Iterator[list[str]]:
    """A log of collective issues and waits and of the given modules' compute, in order.

    An asynchronous all-gather or reduce-scatter logs ``"issue AG <unit>"`` and, when its work
    is waited on, ``"wait AG <unit>"``; a synchronous one ``"sync AG <unit>"``. A module of
    ``modules`` logs ``"compute <name>"`` when its forward starts.
    """
    log: list[str] = []
    unit = [""]  # the unit of the collective about to be called: its event comes first

    def on_event(event: events.Event) -> None:
        if isinstance(event, events.Collective):
            unit[0] = event.unit

    class Work:
        def __init__(self, work: dist.Work, label: str) -> None:
            self._work, self._label = work, label

        def wait(self, *args: object) -> bool:
            log.append(f"wait {self._label}")
            return self._work.wait(*args)

        def is_completed(self) -> bool:
            return self._work.is_completed()

    def logged(kind: str, original):
        def call(*args: object, **kwargs: object) -> object:
            label = f"{kind} {unit[0] or '<root>'}"
            if not kwargs.get("async_op"):
                log.append(f"sync {label}")
                return original(*args, **kwargs)
            log.append(f"issue {label}")
            return Work(original(*args, **kwargs), label)

        return call

    originals = {name: getattr(dist, name) for name in _GATHERS + _SCATTERS if hasattr(dist, name)}
    hooks = [
        module.register_forward_pre_hook(lambda *_, name=name: log.append(f"compute {name}"))
        for name, module in modules.items()
    ]
    handle = events.subscribe(on_event)
    for name, original in originals.items():
        setattr(dist, name, logged("AG" if name in _GATHERS else "RS", original))
    try:
        yield log
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
        handle.remove()
        for hook in hooks:
            hook.remove()


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("door", sorted(_DOORS))
def test_prefetches_and_reductions_are_waited_on_where_they_are_needed(rank, process_group, door):
    """Forward: the next layer's all-gather is issued before this layer computes (once this
    layer's own parameters are copied out) and waited on just before the next layer computes.
    Backward: each prefetched all-gather is issued when the reduction of the unit that asked
    for it starts, just before the reduce-scatter in flight is waited on, and is waited on when
    its unit's backward starts; each reduce-scatter is waited on when the next unit's reduction
    starts (one in flight at most) or at the end of backward.
    Without overlap every collective waits where it is issued."""
    model = _DOORS[door](process_group)
    inner = model.module if isinstance(model, FSDP) else model
    layers = {
        f"layers.{i}": layer.module if isinstance(layer, FSDP) else layer
        for i, layer in enumerate(inner.layers)
    }
    x = torch.randn(4, 10, generator=torch.Generator().manual_seed(rank))
    model(x).sum().backward()  # the first step records the order it prefetches in
    for overlap in (True, False):
        set_cpu_overlap(model, enabled=overlap)
        with _timeline(layers) as log:
            model(x).sum().backward()
            log.append("backward returned")
        if not overlap:
            assert all(e.startswith(("sync", "compute", "backward")) for e in log), log
            continue
        assert log == [
            "sync AG <root>",
            "issue AG layers.0",  # the root's pre-forward prefetches l0
            "wait AG layers.0",  # l0's pre-forward waits for its own parameters, then ...
            "issue AG layers.1",  # ... prefetches l1 ...
            "compute layers.0",  # ... whose all-gather runs while l0 computes
            "wait AG layers.1",
            "issue AG layers.2",
            "compute layers.1",
            "wait AG layers.2",
            "compute layers.2",
            # Backward: the root kept its parameters; it prefetches l2 and reduces.
            "issue AG layers.2",
            "issue RS <root>",
            "wait AG layers.2",  # l2's pre-backward waits for its own parameters and asks
            # for l1, whose all-gather waits while the root's reduction is in flight: l2
            # computes; its reduction starts by issuing l1's all-gather, then ...
            "issue AG layers.1",
            "wait RS <root>",  # ... finishes the root's
            "issue RS layers.2",
            "wait AG layers.1",
            "issue AG layers.0",
            "wait RS layers.2",
            "issue RS layers.1",
            "wait AG layers.0",
            "wait RS layers.1",
            "issue RS layers.0",
            "wait RS layers.0",  # the end of backward finishes the last one
            "backward returned",
        ], log


def _default(door: str, group: dist.ProcessGroup, model: nn.Module | None = None) -> nn.Module:
    """``model`` (default ``Chain``) with each layer a unit, the defaults otherwise: no forward
    prefetch."""
    model = model or Chain()
    for i, layer in enumerate(model.layers):
        model.layers[i] = FSDP(layer, group) if door == "wrapper" else fully_shard(layer)
    return FSDP(model, group) if door == "wrapper" else fully_shard(model)


@pytest.mark.distributed(world_size=[2, 3])
@pytest.mark.parametrize("door", sorted(_DOORS))
def test_without_forward_prefetch_the_next_all_gather_is_issued_ahead(rank, process_group, door):
    """Without forward prefetch a unit's pre-forward still issues the next unit's forward
    all-gather (from the second step, in the recorded order) before the unit computes: the
    next unit is not unsharded early (its unshard, and what recorders see of it, stays in its
    own pre-forward, which waits for the all-gather). Without overlap each waits where issued."""
    model = _default(door, process_group)
    inner = model.module if isinstance(model, FSDP) else model
    layers = {f"layers.{i}": getattr(m, "module", m) for i, m in enumerate(inner.layers)}
    x = torch.randn(4, 10, generator=torch.Generator().manual_seed(rank))
    model(x).sum().backward()  # the first step records the forward order
    for overlap in (True, False):
        set_cpu_overlap(model, enabled=overlap)
        seen: list[events.Event] = []
        handle = events.subscribe(seen.append)
        with _timeline(layers) as log:
            model(x).sum().backward()
        handle.remove()
        forward = log[: log.index("compute layers.2") + 1]
        if not overlap:
            assert all(e.startswith(("sync", "compute")) for e in forward), forward
            continue
        assert forward == [
            "sync AG <root>",
            "issue AG layers.0",  # the root's pre-forward issues l0's all-gather, then ...
            "wait AG layers.0",  # ... l0's pre-forward unshards l0, waits for it, then ...
            "issue AG layers.1",  # ... issues l1's, which runs while l0 computes
            "compute layers.0",
            "wait AG layers.1",
            "issue AG layers.2",
            "compute layers.1",
            "wait AG layers.2",
            "compute layers.2",
        ], forward
        reasons = [e.reason for e in seen if isinstance(e, events.Unshard)]
        assert "forward_prefetch" not in reasons, reasons


class Skipping(Chain):
    """``Chain`` whose forward skips its last layer when ``skip`` is set."""

    skip = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if not (self.skip and i == 2):
                x = layer(x)
        return self.head(torch.relu(x))


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("door", sorted(_DOORS))
def test_an_all_gather_issued_ahead_for_a_unit_that_does_not_run_is_finished(
    rank, process_group, door
):
    """A forward that skips the unit the recorded order says comes next: its all-gather,
    issued ahead, is finished at the end of the forward and never used, so the unit's next
    forward (after an optimizer step changed its shard) gathers the new values. Parameters
    stay bit-identical to training without overlap."""
    models = [_default(door, process_group, Skipping()) for _ in range(2)]
    set_cpu_overlap(models[1], enabled=False)
    for model in models:
        inner = model.module if isinstance(model, FSDP) else model
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        for step, skip in enumerate((False, True, False, False)):
            inner.skip = skip
            x = torch.randn(4, 10, generator=torch.Generator().manual_seed(10 * rank + step))
            model(x).pow(2).sum().backward()
            optim.step()
            optim.zero_grad()
            assert all(s.unit is None or s.unit._gathered is None for s in _states(model))
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(_local(a), _local(b))


def _states(model: nn.Module) -> list[object]:
    from fsdp_core._runtime import states_in

    return states_in(model)


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("door", sorted(_DOORS))
def test_a_backward_prefetch_waits_for_the_reduction_in_flight(rank, process_group, door):
    """A backward prefetch asked for while a reduce-scatter is in flight is unsharded where it
    always was, but its all-gather is issued after the asking unit's backward has computed and
    resharded, just before that unit's reduction: the prefetch's buffer never lives through a
    unit's backward next to the reduce input in flight (the overlap costs no memory). Without
    overlap it is issued at the unshard."""
    for overlap in (True, False):
        model = _DOORS[door](process_group)
        set_cpu_overlap(model, enabled=overlap)
        _train(model, rank, steps=1)  # records the backward order the prefetches follow
        seen = _train(model, rank, steps=1)
        backward = seen[seen.index(("Unshard", "layers.2", "backward_prefetch")) :]
        gather = next(i for i, e in enumerate(backward) if e[:2] == (ALL_GATHER, "layers.1"))
        asked = backward.index(("Unshard", "layers.1", "backward_prefetch"))
        resharded = backward.index(("Reshard", "layers.2", "backward"))
        scatter = next(
            i
            for i, e in enumerate(backward)
            if "reduce_scatter" in str(e[0]) and e[1] == "layers.2"
        )
        if overlap:
            assert asked < resharded < gather < scatter, backward
        else:
            assert gather < asked < resharded < scatter, backward


@pytest.mark.distributed(world_size=2)
def test_unshard_async_op_leaves_the_all_gather_to_the_handle(rank, process_group):
    """``unshard(async_op=True)`` returns with the all-gather in flight; ``wait()`` waits for it
    and shows the full parameters."""
    model = _composable(process_group)
    model(torch.randn(4, 10)).sum().backward()  # the root's lazy init
    layer = model.layers[1]
    with _timeline({}) as log:
        handle = layer.unshard(async_op=True)
        log.append("returned")
        handle.wait()
    assert log == ["issue AG layers.1", "returned", "wait AG layers.1"]
    assert torch.equal(layer.weight, Chain().layers[1].weight)
    layer.reshard()


class FailingChain(Chain):
    """Chain whose backward raises once the gradient reaches layer 0's output, if armed."""

    armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i == 0 and self.armed:
                x.register_hook(self._fail)
        return self.head(torch.relu(x))

    @staticmethod
    def _fail(_: torch.Tensor) -> None:
        raise RuntimeError("boom in backward")


@pytest.mark.distributed(world_size=2)
def test_a_failed_backward_leaves_the_gradients_it_leaves_without_overlap(rank, process_group):
    """An exception in the middle of backward (at layer 0, with layer 1's reduce-scatter in
    flight): after reset_iter_state every gradient is what it is without overlap (layer 1's
    reduction finished, layer 0's never started), and so is the next step's."""
    models = []
    for overlap in (True, False):
        model = FailingChain()
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model, reshard_after_forward=False)
        set_cpu_overlap(model, enabled=overlap)
        models.append(model)
    x = torch.randn(4, 10, generator=torch.Generator().manual_seed(rank))
    for model in models:
        model.armed = True
        with pytest.raises(RuntimeError, match="boom in backward"):
            model(x).sum().backward()
        model.reset_iter_state()
        model.armed = False
    overlapped, waited = models
    assert waited.layers[1].weight.grad is not None and waited.layers[0].weight.grad is None
    for _ in range(2):
        for a, b in zip(overlapped.parameters(), waited.parameters(), strict=True):
            assert (a.grad is None) == (b.grad is None)
            if a.grad is not None:
                assert torch.equal(a.grad.to_local(), b.grad.to_local())
        for model in models:
            model(x).sum().backward()


@pytest.mark.distributed(world_size=2, mode="thread")
def test_no_overlap_where_collectives_complete_in_the_call(rank, process_group):
    """Thread mode's backend completes each collective inside the call: nothing is issued
    asynchronously there."""
    model = _wrapper(process_group)
    x = torch.randn(4, 10, generator=torch.Generator().manual_seed(rank))
    with record_fsdp(model) as rec:
        model(x).sum().backward()
    issued = rec.collectives("all_gather") + rec.collectives("reduce_scatter")
    assert len(issued) == 4 + 3 + 4  # a forward gather per unit, backward's, a reduction each
    assert not any(r.async_op for r in issued)


@pytest.mark.distributed(world_size=2)
def test_set_cpu_overlap_refuses_a_non_bool_and_a_call_inside_a_step(rank, process_group):
    model = _wrapper(process_group)
    with pytest.raises(TypeError, match=r"set_cpu_overlap\(enabled=...\) takes a bool, got 1"):
        set_cpu_overlap(model, enabled=1)  # type: ignore[arg-type]
    errors: list[str] = []

    def inside(*_: object) -> None:
        try:
            set_cpu_overlap(model, enabled=False)
        except RuntimeError as error:
            errors.append(str(error))

    model.module.head.register_forward_pre_hook(inside)
    model(torch.randn(4, 10)).sum().backward()
    assert len(errors) == 1 and "fsdp_core.debug.set_cpu_overlap: FSDP instances" in errors[0]
    assert "call it between training steps" in errors[0]


@pytest.mark.distributed(world_size=2)
def test_set_unshard_async_op_issues_every_unshard_asynchronously_with_the_same_numbers(
    rank, process_group
):
    """FSDP2's private ``_set_unshard_async_op(True)`` on the root reaches every module below
    it: their pre-forward and pre-backward all-gathers are issued with ``async_op=True`` (the
    root's own first all-gather is synchronous without it), and training gives the same
    parameters bit for bit."""
    results = {}
    for flag in (False, True):
        model = Chain()
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        if flag:
            model._set_unshard_async_op(True)
        calls: list[bool] = []
        name = next(n for n in _GATHERS if hasattr(dist, n))
        gather = getattr(dist, name)

        def recording(*args, _gather=gather, _calls=calls, **kwargs):
            _calls.append(bool(kwargs.get("async_op", False)))
            return _gather(*args, **kwargs)

        with mock.patch.object(dist, name, recording):
            _train(model, rank, steps=2)
        results[flag] = [_local(p).detach().clone() for p in model.parameters()]
        assert calls, "no all-gather was recorded"
        assert all(calls) if flag else not all(calls), (flag, calls)
    for without, with_flag in zip(results[False], results[True], strict=True):
        assert torch.equal(without, with_flag)
