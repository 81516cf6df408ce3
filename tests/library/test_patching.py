"""The patch helpers: every engine, both collective spellings, thread ranks, nesting, and the
checks built on them catching a broken engine."""

from __future__ import annotations

import functools
import warnings
from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_testing.engines import get_engine, use_engine
from fsdp_testing.patching import (
    current_full_precision_param_dtype,
    patch_all_gather,
    patch_all_reduce,
    patch_post_backward,
    patch_reduce_scatter,
    patch_register_post_backward_hook_backward,
    patch_reshard,
    patch_unshard,
    reduce_scatter_with_assert,
)

from .._spellings import ALL_GATHER, REDUCE_SCATTER, all_gather_single, reduce_scatter_single

ENGINES = ["fsdp_core", "torch_fsdp1", "torch_fsdp2"]


def _mlp_stack(engine_name: str, group: dist.ProcessGroup, **fsdp_kwargs: Any) -> nn.Module:
    """Three linears, each its own unit; the root owns no parameters, so all three engines
    fully shard the same three units."""
    engine = get_engine(engine_name)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    policy = engine.module_wrap_policy({nn.Linear})
    return engine.wrap(model, group, auto_wrap_policy=policy, **fsdp_kwargs)


def _step(model: nn.Module, rank: int) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    model(x).sum().backward()


def _counting(counts: Counter[str], key: str, original: Any) -> Any:
    def counted(*args: Any, **kwargs: Any) -> Any:
        counts[key] += 1
        return original(*args, **kwargs)

    return counted


@pytest.mark.parametrize("mode_engine", ENGINES)
@pytest.mark.distributed(world_size=2)
def test_collective_counts_agree_across_engines_process_ranks(mode_engine, rank, process_group):
    _assert_full_shard_counts(mode_engine, rank, process_group)


@pytest.mark.parametrize("mode_engine", ENGINES)
@pytest.mark.distributed(world_size=2, mode="thread")
def test_collective_counts_agree_across_engines_thread_ranks(mode_engine, rank, process_group):
    _assert_full_shard_counts(mode_engine, rank, process_group)


def _assert_full_shard_counts(engine_name: str, rank: int, group: dist.ProcessGroup) -> None:
    # FULL_SHARD, three non-root units: per step each unit all-gathers in forward and again in
    # backward, and reduce-scatters once. Step 0 of fsdp_core adds order-check all-reduces, so
    # count step 1. FSDP1 all-gathers with the list form on CPU; patch_all_gather sees it.
    model = _mlp_stack(engine_name, group)
    _step(model, rank)
    counts: Counter[str] = Counter()
    with (
        patch_all_gather(_counting(counts, "all_gather", getattr(dist, ALL_GATHER))),
        patch_reduce_scatter(_counting(counts, "reduce_scatter", getattr(dist, REDUCE_SCATTER))),
        patch_all_reduce(_counting(counts, "all_reduce", dist.all_reduce)),
    ):
        _step(model, rank)
    assert counts == {"all_gather": 6, "reduce_scatter": 3}, (engine_name, dict(counts))


@pytest.mark.distributed(world_size=2, mode="thread")
def test_one_signature_for_both_spellings_and_any_argument_style(rank, world_size, process_group):
    calls: list[tuple[Any, ...]] = []
    orig_gather, orig_scatter = getattr(dist, ALL_GATHER), getattr(dist, REDUCE_SCATTER)

    def new_all_gather(output: torch.Tensor, input: torch.Tensor, **kwargs: Any) -> Any:
        calls.append(("ag", tuple(output.shape), tuple(input.shape), sorted(kwargs)))
        return orig_gather(output, input, **kwargs)

    def new_reduce_scatter(output: torch.Tensor, input: torch.Tensor, **kwargs: Any) -> Any:
        calls.append(("rs", tuple(output.shape), tuple(input.shape), sorted(kwargs)))
        return orig_scatter(output, input, **kwargs)

    out, shard = torch.empty(2 * world_size), torch.full((2,), float(rank))
    with patch_all_gather(new_all_gather), patch_reduce_scatter(new_reduce_scatter):
        all_gather_single(out, shard, process_group)  # group positional
        with warnings.catch_warnings():  # the old spelling is deprecated
            warnings.simplefilter("ignore", FutureWarning)
            dist.all_gather_into_tensor(output_tensor=out, input_tensor=shard)
        dist.all_gather(list(out.chunk(world_size)), shard)  # FSDP1's CPU form
        reduce_scatter_single(output=shard, input=out, op=dist.ReduceOp.SUM)  # FSDP2 style
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            dist.reduce_scatter_tensor(shard, out)
        unrelated = [torch.empty(3) for _ in range(world_size)]
        dist.all_gather(unrelated, torch.ones(3))  # not one buffer: bypasses the patch
    assert calls == [
        ("ag", (4,), (2,), ["group"]),
        ("ag", (4,), (2,), []),
        ("ag", (4,), (2,), []),
        ("rs", (2,), (4,), ["op"]),
        ("rs", (2,), (4,), []),
    ]
    assert out.tolist() == [0.0, 0.0, 1.0, 1.0] and unrelated[1].tolist() == [1.0] * 3
    assert getattr(dist, ALL_GATHER) is orig_gather
    assert getattr(dist, REDUCE_SCATTER) is orig_scatter


@pytest.mark.distributed(world_size=4, mode="thread")
def test_thread_ranks_each_run_their_own_replacement(rank, world_size):
    original = dist.all_reduce
    mine: list[int] = []

    def new_all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        mine.append(dist.get_rank())
        return original(tensor, *args, **kwargs)

    with patch_all_reduce(new_all_reduce):
        t = torch.ones(1)
        dist.all_reduce(t)
        dist.all_reduce(t)
    # torch's helpers send every rank's calls to the closure of the last rank that entered.
    assert mine == [rank, rank] and t.item() == world_size**2
    assert dist.all_reduce is original


@pytest.mark.distributed(world_size=2, mode="thread")
def test_nested_patches_chain_without_recursion(rank):
    order: list[str] = []
    captured = dist.all_reduce  # captured before any patch: the true original

    def outer(tensor: torch.Tensor, **kwargs: Any) -> Any:
        order.append("outer")
        return captured(tensor, **kwargs)

    def inner(tensor: torch.Tensor, **kwargs: Any) -> Any:
        order.append("inner")
        tensor.add_(1)
        return dist.all_reduce(tensor, **kwargs)  # the patched name: runs the next one down

    with patch_all_reduce(outer), patch_all_reduce(inner) as call_next:
        t = torch.zeros(1)
        dist.all_reduce(t)
        assert order == ["inner", "outer"] and t.item() == 2.0
        order.clear()
        call_next(t)  # the yielded callable skips ``inner``
        assert order == ["outer"]
    assert dist.all_reduce is captured


@pytest.mark.parametrize("engine_name", ENGINES)
@pytest.mark.distributed(world_size=2, mode="thread")
def test_unit_patches_reach_every_engine(engine_name, rank, process_group):
    counts: Counter[str] = Counter()
    engine = get_engine(engine_name)
    originals = {e: engine.patch_target(e).get() for e in ("unshard", "reshard", "post_backward")}
    with use_engine(engine_name):  # the default engine= is the current one
        with (
            patch_unshard(_counting(counts, "unshard", originals["unshard"])),
            patch_reshard(_counting(counts, "reshard", originals["reshard"])),
            patch_post_backward(_counting(counts, "post_backward", originals["post_backward"])),
        ):
            model = _mlp_stack(engine_name, process_group)  # FSDP1 binds its hook in forward
            _step(model, rank)
    assert counts["unshard"] >= 6 and counts["reshard"] >= 6, dict(counts)
    assert counts["post_backward"] >= 3, dict(counts)
    for event, original in originals.items():
        assert engine.patch_target(event).get() is original


@pytest.mark.distributed(world_size=2, mode="thread")
def test_register_post_backward_hook_backward_is_fsdp2_only(rank, process_group):
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import (
        RegisterPostBackwardFunction,
    )

    original = RegisterPostBackwardFunction.backward
    calls: list[int] = []

    def new_backward(ctx: Any, *grads: torch.Tensor) -> Any:
        calls.append(rank)
        return original(ctx, *grads)

    model = _mlp_stack("torch_fsdp2", process_group)
    with patch_register_post_backward_hook_backward(new_backward, engine="torch_fsdp2"):
        _step(model, rank)
    # The first linear's input needs no gradient, so FSDP2 registers no function for it.
    assert len(calls) == 2 and RegisterPostBackwardFunction.backward is original
    with pytest.raises(NotImplementedError, match=r"engine 'fsdp_core'.*patch_post_backward"):
        patch_register_post_backward_hook_backward(new_backward, engine="fsdp_core")


@pytest.mark.parametrize("engine_name", ENGINES)
@pytest.mark.distributed(world_size=2, mode="thread")
def test_reduce_scatter_with_assert_sees_the_output(engine_name, rank, process_group):
    model = _mlp_stack(engine_name, process_group)
    seen: list[torch.dtype | None] = []

    def assert_fp32(output: torch.Tensor) -> None:
        seen.append(current_full_precision_param_dtype())
        assert output.dtype == torch.float32

    new = functools.partial(
        reduce_scatter_with_assert, None, getattr(dist, REDUCE_SCATTER), assert_fp32
    )
    with patch_reduce_scatter(new, full_precision_param_dtype=torch.float32):
        _step(model, rank)
    assert seen == [torch.float32] * 3
    assert current_full_precision_param_dtype() is None


@pytest.mark.distributed(world_size=2, mode="thread")
def test_reduce_scatter_with_assert_fails_for_a_wrong_dtype(rank, process_group):
    model = _mlp_stack("fsdp_core", process_group)

    def assert_bf16(output: torch.Tensor) -> None:
        if output.dtype != torch.bfloat16:
            raise AssertionError(f"reduce-scatter in {output.dtype}, expected torch.bfloat16")

    new = functools.partial(
        reduce_scatter_with_assert, None, getattr(dist, REDUCE_SCATTER), assert_bf16
    )
    with (
        pytest.raises(AssertionError, match=r"reduce-scatter in torch\.float32, expected"),
        patch_reduce_scatter(new),
    ):
        _step(model, rank)


def test_reduce_scatter_with_assert_names_missing_output():
    with pytest.raises(AssertionError, match="no output tensor among the arguments"):
        reduce_scatter_with_assert(None, lambda *a: None, lambda t: None, input=torch.ones(1))


@pytest.mark.distributed(world_size=2, mode="thread")
def test_average_check_catches_an_engine_that_sums_gradients(rank, world_size, process_group):
    """Every rank feeds the same input, so the averaged gradient equals each rank's own; a
    reduce-scatter whose result is ``world_size`` times that did not average."""
    original = getattr(dist, REDUCE_SCATTER)

    def expect_average(expected: torch.Tensor) -> Any:
        def check(output: torch.Tensor, input: torch.Tensor, **kwargs: Any) -> Any:
            work = original(output, input, **kwargs)
            shard = expected.reshape(-1).chunk(world_size)[rank]
            if not torch.allclose(output[: shard.numel()], shard):
                ratio = (output[: shard.numel()] / shard).mean().item()
                raise AssertionError(
                    f"[rank {rank}] reduce-scatter gave {ratio:g}x the average gradient: "
                    "gradients were summed, not averaged"
                )
            return work

        return check

    def sums_instead_of_averaging(output: torch.Tensor, input: torch.Tensor, **kwargs: Any) -> Any:
        # The deliberate bug: undo the engine's pre-division by the group size.
        return reduce_scatter_single(output, input * world_size, **kwargs)

    def run(broken: bool) -> None:
        torch.manual_seed(0)
        lin = get_engine("fsdp_core").wrap(nn.Linear(4, 4, bias=False), process_group)
        x = torch.ones(2, 4)
        expected = torch.full((4, 4), 2.0)  # d(sum(x @ W.T))/dW, the same on every rank
        with patch_reduce_scatter(expect_average(expected)):
            if not broken:
                lin(x).sum().backward()
                return
            with patch_reduce_scatter(sums_instead_of_averaging):
                lin(x).sum().backward()

    run(broken=False)
    with pytest.raises(AssertionError, match=r"gave 2x the average gradient: .*summed"):
        run(broken=True)


def test_public_surface_for_recorders_and_delays():
    import fsdp_testing.collectives as collectives
    import fsdp_testing.patching as patching

    for name in ("COLLECTIVE_FAMILIES", "collective_targets", "normalized_collective",
                 "current_rank", "resolve_engine"):  # fmt: skip
        assert name in patching.__all__, name
        assert name.isupper() or getattr(patching, name).__doc__, name
    # The one table: patching re-exports fsdp_testing.collectives'.
    assert patching.COLLECTIVE_FAMILIES is collectives.COLLECTIVE_FAMILIES
    with pytest.raises(TypeError):
        patching.COLLECTIVE_FAMILIES["all_reduce"] = ("all_reduce",)  # type: ignore[index]
    targets = patching.collective_targets("all_gather")
    assert targets and all(t.owner is dist for t in targets)
    # Every spelling that moves tensors; not all_gather_object (objects).
    assert [t.attribute for t in targets] == [
        name
        for name in (
            "all_gather_single",
            "all_gather_into_tensor",
            "_all_gather_base",
            "all_gather",
        )
        if hasattr(dist, name)  # all_gather_single is new in torch 2.13
    ]
    assert [t.attribute for t in patching.collective_targets("all_reduce")] == ["all_reduce"]
    with pytest.raises(ValueError, match="unknown family 'allreduce'; one of all_gather"):
        patching.collective_targets("allreduce")
    with pytest.raises(ValueError, match="family 'all_reduce' has no \\(output, input\\)"):
        patching.normalized_collective(lambda *a, **k: None, "all_reduce")
    assert patching.current_rank() == -1  # outside a process group
    assert patching.resolve_engine("torch_fsdp2") is get_engine("torch_fsdp2")
    with use_engine("torch_fsdp1"):
        assert patching.resolve_engine(None) is get_engine("torch_fsdp1")


def test_normalized_collective_sees_one_convention():
    seen: list[tuple[Any, ...]] = []
    from fsdp_testing.patching import normalized_collective

    call = normalized_collective(
        lambda out, inp, **rest: seen.append((out, inp, sorted(rest))), "reduce_scatter"
    )
    out, inp = torch.zeros(2), torch.ones(4)
    call(output=out, input=inp, group=None)
    call(out, inp, None)  # positional op
    assert [(o is out, i is inp, r) for o, i, r in seen] == [
        (True, True, ["group"]),
        (True, True, ["op"]),
    ]


def test_toolkit_modules_use_only_the_public_patching_names():
    import ast
    import pathlib

    import fsdp_testing

    root = pathlib.Path(fsdp_testing.__file__).parent
    private = []
    for path in root.rglob("*.py"):
        if path.parent.name == "patching":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("patching"):
                private += [f"{path.name}: {a.name}" for a in node.names if a.name.startswith("_")]
    assert private == []


@pytest.mark.distributed(world_size=2, mode="thread")
def test_current_rank_is_per_thread_rank(rank):
    from fsdp_testing.patching import current_rank

    assert current_rank() == rank


@pytest.mark.distributed(world_size=2)
def test_a_replacement_runs_synchronously_when_the_caller_asks_for_async_op(rank, process_group):
    """An asynchronous call (fsdp_core's overlap on the CPU) reaches the replacement with
    async_op=False and returns a complete collective (None), so the replacement sees the
    finished output after calling the next implementation down; without a patch the same call
    returns a Work."""
    seen: list[dict[str, Any]] = []

    def doubled(output: torch.Tensor, input: torch.Tensor, **kwargs: Any) -> Any:
        seen.append(dict(kwargs))
        work = call_next(output, input, **kwargs)
        output.mul_(2)  # after a synchronous call: the gathered values
        return work

    out = torch.empty(2)
    shard = torch.tensor([float(rank + 1)])
    with patch_all_gather(doubled) as call_next:
        result = dist.all_gather_into_tensor(out, shard, group=process_group, async_op=True)
    assert result is None
    assert seen == [{"group": process_group, "async_op": False}]
    assert out.tolist() == [2.0, 4.0]
    work = dist.all_gather_into_tensor(out, shard, group=process_group, async_op=True)
    work.wait()
    assert out.tolist() == [1.0, 2.0]
