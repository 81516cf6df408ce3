"""The in-payload order check: ranks that diverge in any iteration fail in that iteration.

See [Note: order check] in ``fsdp_core._order_check``.
"""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_core import FSDP, CPUOffload, MixedPrecision, ShardingStrategy, events, unit_views
from fsdp_core._order_check import (
    GATHER_TAG_NUMEL,
    TagOp,
    codes_from_digits,
    decode,
    encode,
    reduce_tag_numel,
    write_gather_tag,
    write_reduce_tag,
)
from fsdp_core.debug import set_cpu_overlap, set_order_check
from fsdp_core.wrap import ModuleWrapPolicy
from fsdp_testing.collectives import family_of

SWAP_AT = 3  # the iteration in which one rank swaps two units
ITERATIONS = 5

# ---------------------------------------------------------------------- the code, one process


def test_every_code_survives_every_dtype():
    """All 2**16 codes round-trip through their digits in fp32, fp16 and bf16 (integers below
    256 are exact in bf16), and the fields decode back."""
    codes = torch.arange(1 << 16)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        digits = torch.stack([codes // 256, codes % 256], dim=1).to(dtype)
        assert codes_from_digits(digits.reshape(-1).tolist()) == codes.tolist(), dtype
    for unit in (0, 1, 255, 256, 4095):
        for op in TagOp:
            for iteration in (1, 2, 3, 4, 7):
                assert decode(encode(unit, op, iteration)) == (unit, op, iteration % 4)
    assert encode(4096 + 5, TagOp.REDUCE, 1) == encode(5, TagOp.REDUCE, 1)  # modulo 4096


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("world", [2, 3, 8])
def test_reduction_tags_survive_the_sum(dtype, world):
    """A reduction sums every rank's input: each rank's digits sit in its own pair, so the sum
    of the tag columns (in the reduce dtype, any order) gives every rank's code exactly, next
    to pre-divided gradients of any value."""
    numel = 5
    codes = [encode(200 + 37 * r, TagOp.REDUCE, 3) for r in range(world)]
    codes[-1] = encode(4095, TagOp.FORWARD_GATHER, 2)  # a mismatching rank, every digit high
    inputs = []
    for r in range(world):
        rows = torch.zeros(world, numel + reduce_tag_numel(world), dtype=dtype)
        rows[:, :numel] = torch.randn(world, numel).to(dtype) / world
        write_reduce_tag(rows, codes[r], r, world)
        inputs.append(rows)
    for order in (range(world), reversed(range(world))):
        total = torch.zeros_like(inputs[0])
        for r in order:
            total += inputs[r]
        for row in total:  # what each rank receives from a reduce-scatter
            assert codes_from_digits(row[numel:].tolist()) == codes, (dtype, world)


def test_gather_tag_and_unreadable_digits():
    send = torch.zeros(3 + GATHER_TAG_NUMEL, dtype=torch.bfloat16)
    write_gather_tag(send, encode(300, TagOp.BACKWARD_GATHER, 2))
    assert codes_from_digits(send[3:].tolist()) == [encode(300, TagOp.BACKWARD_GATHER, 2)]
    assert codes_from_digits([0.5, 1.0, 256.0, 0.0, 1.0, 2.0]) == [None, None, 258]


# ---------------------------------------------------------------------- diverging ranks


class _TwoUnits(nn.Module):
    """``a`` then ``b`` (same sizes); ``swap`` runs ``b`` first. Only ``head`` is the root's."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
        self.swap = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second = (self.b, self.a) if self.swap else (self.a, self.b)
        return self.head(torch.relu(second(torch.relu(first(x)))))


def _wrap_two_units(group: dist.ProcessGroup, **kwargs: object) -> FSDP:
    model = _TwoUnits()
    model.a = FSDP(model.a, group, **kwargs)
    model.b = FSDP(model.b, group, **kwargs)
    return FSDP(model, group, **kwargs)


def _train_until_error(
    model: nn.Module, step: object, swap_rank: int, rank: int
) -> tuple[int, str]:
    """Run ``step`` for ``ITERATIONS`` iterations, swapping on ``swap_rank`` at ``SWAP_AT``;
    return the iteration that raised and the message (0 and "" if none did)."""
    inner = model.module
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    for iteration in range(1, ITERATIONS + 1):
        inner.swap = iteration == SWAP_AT and rank == swap_rank
        try:
            step(model, iteration)  # type: ignore[operator]
        except RuntimeError as error:
            return iteration, str(error)
        optim.step()
        optim.zero_grad()
    return 0, ""


def _forward_backward(model: nn.Module, iteration: int) -> None:
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(iteration + 10 * dist.get_rank()))
    model(x).sum().backward()


def _messages_on_every_rank(message: str, group: dist.ProcessGroup) -> list[str]:
    """Every rank's message without its ``[rank N]`` prefix (one collective: the ranks raised
    at the same point, so they are still in step)."""
    gathered: list[str] = [""] * dist.get_world_size(group)
    dist.all_gather_object(gathered, re.sub(r"^\[rank \d+\] ", "", message), group=group)
    return gathered


POLICIES = {
    "fp32": None,
    "bf16": MixedPrecision(param_dtype=torch.bfloat16),  # gathers and reduces in bf16
    "fp16/fp32": MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32),
}


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.distributed(world_size=2)
def test_swapped_units_in_iteration_three_fail_there_on_both_ranks(
    rank, process_group, policy, offload
):
    """Rank 1 runs ``b`` before ``a`` in iteration 3 only: the units have the same size, so
    without a check their all-gathers would pair up and exchange each other's shards. Both
    ranks raise in iteration 3, at the first swapped all-gather, with the same message naming
    both units, the op and the iteration; iterations 1 and 2 train normally. (Without the CPU
    overlap, whose forward all-gathers issued ahead follow the recorded order: see the next
    test. On CUDA, and in thread mode, every all-gather is issued at its unit's unshard.)"""
    model = _wrap_two_units(
        process_group,
        mixed_precision=POLICIES[policy],
        cpu_offload=CPUOffload(offload_params=offload),
    )
    set_cpu_overlap(model, enabled=False)
    raised_at, message = _train_until_error(model, _forward_backward, swap_rank=1, rank=rank)
    assert raised_at == SWAP_AT, (raised_at, message)
    assert message.startswith(f"[rank {rank}] FSDP ranks ran units in different orders in "
                              f"iteration {SWAP_AT}: ")  # fmt: skip
    assert "rank 0 all-gathered 'a' for forward" in message, message
    assert "rank 1 all-gathered 'b' for forward" in message, message
    messages = _messages_on_every_rank(message, process_group)
    assert messages[0] == messages[1]


@pytest.mark.distributed(world_size=2)
def test_swapped_units_gather_their_own_shards_ahead_and_fail_at_the_reduction(rank, process_group):
    """With the CPU overlap (the default over gloo) the root's pre-forward issues ``a``'s
    all-gather ahead, in the recorded order, on both ranks; rank 1's ``b`` then gathers its own,
    which pairs with the one rank 0's ``a`` issues ahead for ``b``: each unit gets its own
    shards and the forward is right. The swap pairs different units at the first reduction of
    that iteration's backward, where both ranks raise with the same message."""
    model = _wrap_two_units(process_group)
    raised_at, message = _train_until_error(model, _forward_backward, swap_rank=1, rank=rank)
    assert raised_at == SWAP_AT, (raised_at, message)
    assert message.startswith(f"[rank {rank}] FSDP ranks ran units in different orders in "
                              f"iteration {SWAP_AT}: ")  # fmt: skip
    assert "rank 0 reduced the gradients of 'b'; rank 1 reduced the gradients of 'a'" in message
    messages = _messages_on_every_rank(message, process_group)
    assert messages[0] == messages[1]


def _two_backwards(model: nn.Module, iteration: int) -> None:
    """Forward both branches, then one backward per branch, ``b``'s first when swapped."""
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(iteration + 10 * dist.get_rank()))
    out_a, out_b = model(x)
    first, second = (out_b, out_a) if model.module.swap else (out_a, out_b)
    first.sum().backward()
    second.sum().backward()


class _TwoBranches(_TwoUnits):
    """``a`` and ``b`` side by side (same forward order on every rank); the root owns nothing."""

    def __init__(self) -> None:
        super().__init__()
        del self.head

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        return self.a(x), self.b(x)


@pytest.mark.parametrize(
    "strategy,op", [(ShardingStrategy.SHARD_GRAD_OP, "reduce_scatter"), (ShardingStrategy.NO_SHARD, "all_reduce")]
)  # fmt: skip
@pytest.mark.distributed(world_size=2)
def test_swapped_reductions_fail_in_that_iteration(rank, process_group, strategy, op):
    """The forwards agree but rank 1 runs ``b``'s backward before ``a``'s in iteration 3, so the
    gradient reductions (no all-gather in backward: SHARD_GRAD_OP keeps the parameters, NO_SHARD
    never gathers) would sum ``a``'s gradients with ``b``'s. Both ranks raise in iteration 3,
    at the reduction, naming both units."""
    model = FSDP(
        _TwoBranches(),
        process_group,
        sharding_strategy=strategy,
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
    )
    seen: list[events.Event] = []
    with events.subscribe(seen.append):
        raised_at, message = _train_until_error(model, _two_backwards, swap_rank=1, rank=rank)
    assert raised_at == SWAP_AT, (raised_at, message)
    assert f"in iteration {SWAP_AT}: " in message
    assert "rank 0 reduced the gradients of 'a'" in message, message
    assert "rank 1 reduced the gradients of 'b'" in message, message
    collectives = [e for e in seen if isinstance(e, events.Collective)]
    assert collectives[-1].op.startswith(op)  # the reduction is where it failed
    messages = _messages_on_every_rank(message, process_group)
    assert messages[0] == messages[1]


@pytest.mark.distributed(world_size=4)
def test_divergence_inside_a_subgroup_names_global_ranks(rank, process_group):
    """Groups [0, 2] and [1, 3] shard separately; rank 3 swaps in iteration 3. Ranks 1 and 3
    (group ranks 0 and 1) raise, naming global ranks; ranks 0 and 2 train on."""
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    group = groups[rank % 2]
    model = _wrap_two_units(group)
    raised_at, message = _train_until_error(model, _forward_backward, swap_rank=3, rank=rank)
    if rank % 2 == 0:
        assert (raised_at, message) == (0, "")
        return
    assert raised_at == SWAP_AT, message
    # Two swapped units gather their own shards ahead in forward (see the test above).
    assert "rank 1 reduced the gradients of 'b'; rank 3 reduced the gradients of 'a'" in message


@pytest.mark.distributed(world_size=2)
def test_set_order_check_off_sends_the_data_only(rank, process_group):
    """The measurement switch: with the tags off, each collective moves the data alone (the
    bytes of the check's cost), and a swap after the first iteration goes unnoticed; on again,
    the tags are back. The units' views say which."""
    data_bytes = {"": (2 * 4 + 2) * 4, "a": (4 * 4 + 4) * 4, "b": (4 * 4 + 4) * 4}

    def gathered_bytes(model: nn.Module) -> dict[str, int]:
        seen: list[events.Event] = []
        with events.subscribe(seen.append):
            _forward_backward(model, 0)
        return {
            e.unit: e.bytes for e in seen if isinstance(e, events.Collective) and "gather" in e.op
        }

    model = _wrap_two_units(process_group)
    assert {v.order_check for v in unit_views(model)} == {True}
    set_order_check(model, enabled=False)  # before lazy init
    assert {v.order_check for v in unit_views(model)} == {False}
    assert gathered_bytes(model) == data_bytes
    set_order_check(model, enabled=True)  # after it
    assert gathered_bytes(model) == {u: b + 2 * 2 * 4 for u, b in data_bytes.items()}
    with pytest.raises(TypeError, match=r"set_order_check\(enabled=...\) takes a bool, got 0"):
        set_order_check(model, enabled=0)  # type: ignore[arg-type]
    set_order_check(model, enabled=False)
    model.module.swap = rank == 1
    _forward_backward(model, 1)  # same sizes: nothing notices; this is what the tags catch


@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="the CUDA stream path needs two GPUs for NCCL"
)
@pytest.mark.distributed(world_size=2, backend="nccl")
def test_cuda_swap_fails_at_the_end_of_that_iteration(rank, process_group, device):
    """On CUDA the tags are compared when the iteration ends (no host synchronization per
    collective): a swap in iteration 3's forward raises from iteration 3's backward, on both
    ranks, with the same message."""
    model = _wrap_two_units(process_group, device_id=device)
    phases: list[str] = []

    def step(model: nn.Module, iteration: int) -> None:
        gen = torch.Generator().manual_seed(iteration + 10 * rank)
        x = torch.randn(3, 4, generator=gen).to(device)
        phases.append("forward")
        loss = model(x).sum()
        phases.append("backward")
        loss.backward()

    raised_at, message = _train_until_error(model, step, swap_rank=1, rank=rank)
    assert (raised_at, phases[-1]) == (SWAP_AT, "backward"), message
    assert "rank 0 all-gathered 'a' for forward" in message, message
    assert "rank 1 all-gathered 'b' for forward" in message, message
    messages = _messages_on_every_rank(message, process_group)
    assert messages[0] == messages[1]


# ---------------------------------------------------------------------- units of different sizes


class _Uneven(nn.Module):
    """``small`` and ``big`` (three times the parameters) in a rank-chosen order."""

    def __init__(self) -> None:
        super().__init__()
        self.small = nn.Linear(4, 4)
        self.big = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
        self.swap = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second = (self.big, self.small) if self.swap else (self.small, self.big)
        return second(first(x))


def _uneven(group: dist.ProcessGroup) -> nn.Module:
    from fsdp_core import fully_shard

    model = _Uneven()
    mesh = DeviceMesh.from_group(group, "cpu")
    fully_shard(model.small, mesh=mesh)
    fully_shard(model.big, mesh=mesh)
    return fully_shard(model, mesh=mesh)


@pytest.mark.distributed(world_size=2)
def test_units_of_different_sizes_swapped_in_iteration_one_fail_before_the_collective(
    rank, process_group
):
    """[Note: order validation]: rank 1 runs the bigger unit first in the first iteration. The
    all-gathers differ in size, so the payload tags are never read: gloo aborts the process of
    one rank (SIGABRT, gloo::EnforceNotMet) and hands the other a corrupted buffer. Under
    TORCH_DISTRIBUTED_DEBUG=DETAIL the ranks compare the unit before the collective and both
    raise the same error naming both units (a run without that check fails this test with
    rank 1 killed by SIGABRT)."""
    previous = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        model = _uneven(process_group)
        model.swap = rank == 1
        with pytest.raises(RuntimeError, match="FSDP ranks ran units in different orders") as info:
            model(torch.randn(2, 4)).sum().backward()
    finally:
        dist.set_debug_level(previous)
    message = str(info.value)
    assert message.startswith(f"[rank {rank}] FSDP ranks ran units in different orders: ")
    mine, other = ("small", "big") if rank == 0 else ("big", "small")
    assert (
        f"this rank is about to all-gather {mine!r}, another rank is about to all-gather {other!r}"
        in message
    )
    assert dist.get_debug_level() == previous


@pytest.mark.distributed(world_size=2)
def test_no_extra_collective_in_the_first_iteration_by_default(rank, process_group):
    """Without DETAIL the first iteration issues the unit collectives only, as torch's FSDP
    does (its tests count them): one reduce-scatter per unit and no all-reduce."""
    model = _uneven(process_group)
    seen: list = []
    with events.subscribe(seen.append):
        model(torch.randn(2, 4)).sum().backward()
    ops = [e.op for e in seen if isinstance(e, events.Collective)]
    assert not [op for op in ops if "all_reduce" in op], ops
    assert sum("reduce_scatter" in op for op in ops) == 2, ops  # small and big; the root has none


@pytest.mark.parametrize("door", ["FullyShardedDataParallel", "fully_shard"])
@pytest.mark.distributed(world_size=64, mode="fake")
def test_a_fake_world_trains_on_fake_tensors_without_comparing_tags(rank, world_size, door):
    """Over torch's fake backend collectives move nothing, so other ranks' tags are never
    there to compare: steps on fake tensors (no data to read) and on real ones (outputs left
    as they were) run, with every collective still issued and tagged."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import DeviceMesh

    from fsdp_core import fully_shard

    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")  # made from real tensors
    for fake in (True, False):
        with FakeTensorMode() if fake else contextlib.nullcontext():
            model: nn.Module = nn.Sequential(nn.Linear(8, 30), nn.ReLU(), nn.Linear(30, 5))
            if door == "fully_shard":
                fully_shard(model[0], mesh=mesh)
                fully_shard(model, mesh=mesh)
            else:
                model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
            seen: list[events.Event] = []
            with events.subscribe(seen.append):
                for _ in range(2):
                    model(torch.randn(4, 8)).sum().backward()
        # By family: the spelling called is the newest this torch has (all_gather_single in
        # 2.13, all_gather_into_tensor before).
        calls = [family_of(e.op) for e in seen if isinstance(e, events.Collective)]
        # Per step, two reductions and the all-gathers: fully_shard's root keeps its
        # parameters for backward, so 1 + 2 (FULL_SHARD); the wrapper's root owns none, so its
        # two Linear units 2 + 2.
        gathers = 3 if door == "fully_shard" else 4
        per_step = ["all_gather"] * gathers + ["reduce_scatter"] * 2
        assert sorted(calls) == sorted(per_step * 2), (fake, calls)
        assert all(view.order_check for view in unit_views(model))
