"""Staging buffers on the CPU (see [Note: staging buffers on the CPU] in
``fsdp_core/_staging.py``): a root hands its units' all-gather outputs and reduce inputs out
again from step to step, on what the reuse rests (gloo's reduce-scatter copies its input when
it is issued), and the numbers stay those of fresh buffers."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp_core import FSDP, _collectives, fully_shard
from fsdp_core._runtime import states_in
from fsdp_core._staging import GRAIN_BYTES, KEEP, StagingBuffers
from fsdp_core.debug import set_cpu_overlap

CPU = torch.device("cpu")


def _idle_bytes(staging: StagingBuffers) -> int:
    return sum(b.numel() * b.element_size() for b in staging.idle())


def test_a_given_buffer_is_taken_again_at_its_rounded_size() -> None:
    staging = StagingBuffers()
    first = staging.take(1000, torch.float32, CPU)
    assert first.numel() == 1000
    address = first.data_ptr()
    staging.give(first)
    assert _idle_bytes(staging) == GRAIN_BYTES  # 1000 floats round up to one grain
    again = staging.take(1010, torch.float32, CPU)  # a few more elements: the same grain
    assert again.data_ptr() == address and _idle_bytes(staging) == 0
    other = staging.take(1000, torch.float64, CPU)  # another dtype: another buffer
    assert other.data_ptr() != address


def test_a_view_of_a_lent_buffer_brings_it_back() -> None:
    """A reduce input is the lent tensor reshaped: giving it back returns the whole buffer;
    a view that does not start at the buffer's start is left alone."""
    staging = StagingBuffers()
    lent = staging.take(1000, torch.float32, CPU)
    staging.give(lent[1:])
    assert _idle_bytes(staging) == 0
    staging.give(lent.view(10, 100))
    assert _idle_bytes(staging) == GRAIN_BYTES
    assert staging.take(1000, torch.float32, CPU).data_ptr() == lent.data_ptr()


def test_only_lent_buffers_come_back_and_at_most_keep_per_size() -> None:
    staging = StagingBuffers()
    staging.give(torch.empty(10))  # not lent: left alone
    assert _idle_bytes(staging) == 0
    lent = [staging.take(10, torch.float32, CPU) for _ in range(KEEP + 1)]
    for tensor in lent:
        staging.give(tensor)
    staging.give(lent[0])  # twice: the second is ignored
    assert _idle_bytes(staging) == KEEP * GRAIN_BYTES


def test_meta_and_fake_tensors_are_made_fresh_and_never_kept() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    staging = StagingBuffers()
    meta = staging.take(10, torch.float32, torch.device("meta"))
    assert meta.device.type == "meta" and meta.numel() == 10
    staging.give(meta)
    with FakeTensorMode():
        fake = staging.take(10, torch.float32, CPU)
        staging.give(fake)
    assert fake.numel() == 10 and staging.idle() == []


def test_a_buffer_never_given_back_is_freed() -> None:
    staging = StagingBuffers()
    tensor = staging.take(10, torch.float32, CPU)
    ref = weakref.ref(tensor._base)
    del tensor
    gc.collect()
    assert ref() is None


@pytest.mark.distributed(world_size=2)
def test_gloos_reduce_scatter_copies_its_input_when_issued(rank, process_group) -> None:
    """What giving a reduce input back at the issue rests on: overwriting the input right after
    issuing the reduce-scatter does not change its result."""
    if dist.get_backend(process_group) != "gloo":
        pytest.skip("the staging buffers are used on the CPU, over gloo")
    numel = 1 << 20  # long enough that the collective is still running when it is overwritten
    full = torch.arange(2 * numel, dtype=torch.float32) + rank
    out = torch.empty(numel)
    scatter = getattr(dist, _collectives._REDUCE_SCATTER)
    work = scatter(out, full, op=dist.ReduceOp.SUM, group=process_group, async_op=True)
    full.fill_(-1e9)
    work.wait()
    expected = 2 * torch.arange(rank * numel, (rank + 1) * numel, dtype=torch.float32) + 1
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def _sharded(door: str, group: dist.ProcessGroup) -> nn.Module:
    """Four layers of one size, so their all-gather outputs and reduce inputs share buffers."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(4)))
    for i, layer in enumerate(model):
        if door == "wrapper":
            model[i] = FSDP(layer, group)
        else:
            fully_shard(layer)
    return FSDP(model, group) if door == "wrapper" else fully_shard(model)


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no_overlap"])
@pytest.mark.parametrize("door", ["wrapper", "fully_shard"])
def test_steps_after_the_first_reuse_the_buffers_and_train_alike(
    rank, process_group, door, overlap
) -> None:
    model, fresh = _sharded(door, process_group), _sharded(door, process_group)
    for m in (model, fresh):
        set_cpu_overlap(m, enabled=overlap)
    optims = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, fresh)]
    gather = getattr(dist, _collectives._ALL_GATHER)
    outputs: list[int] = []  # data pointers of the all-gather outputs, this step

    def gathering(output, shard, *args, **kwargs):
        outputs.append(output.data_ptr())
        return gather(output, shard, *args, **kwargs)

    used: list[set[int]] = []
    for step in range(3):
        x = torch.randn(4, 64, generator=torch.Generator().manual_seed(10 * rank + step))
        outputs.clear()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(dist, _collectives._ALL_GATHER, gathering)
            model(x).pow(2).sum().backward()
        used.append(set(outputs))
        fresh(x).pow(2).sum().backward()
        for state in states_in(fresh):  # from its second step, fresh buffers every time
            if state.unit is not None:
                state.unit.staging = None
        for optim in optims:
            optim.step()
            optim.zero_grad()
    # From the second step every all-gather writes a buffer an earlier one wrote (the units
    # are of one size, so their all-gather outputs and reduce inputs share buffers).
    assert used[2] <= used[1] | used[0], (used, rank)
    assert len(used[2]) <= KEEP
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("door", ["wrapper", "fully_shard"])
def test_a_model_and_its_staging_buffers_are_freed_once_let_go(rank, process_group, door) -> None:
    """The post-accumulate-grad hooks hold their state weakly: autograd keeps them where gc
    cannot see them, and a strong reference kept the whole model (and its idle staging
    buffers) alive after the user let go of it."""
    model = _sharded(door, process_group)
    for step in range(2):
        model(torch.randn(4, 64, generator=torch.Generator().manual_seed(step))).sum().backward()
    staging = next(s.unit.staging for s in states_in(model) if s.unit is not None)
    assert staging is not None and staging.idle()
    refs = [weakref.ref(model), weakref.ref(staging.idle()[0])]
    del model, staging
    gc.collect()
    assert [ref() is None for ref in refs] == [True, True]
