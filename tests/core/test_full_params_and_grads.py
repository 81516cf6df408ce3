"""summon_full_params, full state dicts, no_sync and clip_grad_norm_."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from fsdp_core import (
    FSDP,
    CPUOffload,
    FullStateDictConfig,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
    events,
)

from ._models import build, get_input, wrap_model
from ._parity import assert_same, full_params

STRATEGIES = [
    ShardingStrategy.FULL_SHARD,
    ShardingStrategy.SHARD_GRAD_OP,
    ShardingStrategy.NO_SHARD,
]


def _full_state(kind: str, rank: int) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in build(kind, rank).state_dict().items()}


@pytest.mark.distributed(world_size=2)
def test_summon_full_params_writeback_and_discard(rank, process_group):
    """Inside, the module sees full parameters (fp32 even under mixed precision); writes reach
    the shards with writeback=True and are discarded with writeback=False."""
    expected = dict(build("nested", rank).named_parameters())
    for offload, policy in [(False, None), (True, MixedPrecision(param_dtype=torch.bfloat16))]:
        model = wrap_model(
            "nested",
            build("nested", rank),
            process_group,
            cpu_offload=CPUOffload(offload_params=offload),
            mixed_precision=policy,
        )
        with model.summon_full_params(model):  # also callable on an instance
            for name, param in model.named_parameters():
                assert param.dtype == torch.float32 and torch.equal(param, expected[name]), name
            with torch.no_grad():
                for param in model.parameters():
                    param.add_(1.0)
        shifted = {n: p + 1.0 for n, p in expected.items()}
        assert_same(full_params(model), shifted, tolerance=None, what="writeback")
        with FSDP.summon_full_params(model, writeback=False), torch.no_grad():
            for param in model.parameters():
                param.zero_()
        assert_same(full_params(model), shifted, tolerance=None, what="discarded")
        # Sharded again afterwards (DTensor shards), and training still works.
        assert all(isinstance(p, DTensor) for p in model.parameters())
        assert [p.to_local().shape for p in model.parameters()] != [
            p.shape for p in expected.values()
        ]
        model(get_input("nested", rank, 0)).sum().backward()


def _local_shapes(model):
    """This rank's shapes of the parameters: a DTensor shard's local rows, else the shape."""
    return [p.to_local().shape if isinstance(p, DTensor) else p.shape for p in model.parameters()]


@pytest.mark.distributed(world_size=2)
def test_summon_full_params_options(rank, process_group):
    """recurse=False, rank0_only, offload_to_cpu, and rank0_only with writeback refused."""
    full_shapes = [p.shape for p in build("nested", rank).parameters()]
    model = wrap_model("nested", build("nested", rank), process_group)
    sharded_shapes = _local_shapes(model)
    with pytest.raises(ValueError, match=r"rank0_only=True, writeback=True\) is not supported"):
        with FSDP.summon_full_params(model, rank0_only=True):
            pass
    with FSDP.summon_full_params(model, rank0_only=True, writeback=False):
        shapes = _local_shapes(model)
        assert shapes == (full_shapes if rank == 0 else sharded_shapes)
    with FSDP.summon_full_params(model, recurse=False):
        shapes = _local_shapes(model)
    names = [n for n, _ in model.named_parameters()]
    for name, shape, full, sharded in zip(names, shapes, full_shapes, sharded_shapes, strict=True):
        # Only the outermost instance (the root) is summoned; the nested block stays sharded.
        assert shape == (sharded if name.startswith("block.") else full), name
    assert full_shapes != sharded_shapes
    with FSDP.summon_full_params(model, offload_to_cpu=True):
        assert all(p.device.type == "cpu" for p in model.parameters())
        assert [p.shape for p in model.parameters()] == full_shapes
    with pytest.raises(RuntimeError, match="between training steps"):
        with FSDP.summon_full_params(model), FSDP.summon_full_params(model):
            pass


@pytest.mark.distributed(world_size=2)
def test_summon_full_params_with_grads(rank, process_group):
    """with_grads exposes the full reduced gradients: DDP's averaged gradients."""
    ddp = DDP(build("frozen", rank), process_group=process_group)
    ddp(get_input("nested", rank, 0)).sum().backward()
    expected = {n: p.grad for n, p in ddp.module.named_parameters()}
    model = wrap_model("frozen", build("frozen", rank), process_group)
    model(get_input("nested", rank, 0)).sum().backward()
    with FSDP.summon_full_params(model, with_grads=True, writeback=False):
        for name, param in model.named_parameters():
            grad = expected[name]
            if grad is None:
                assert param.grad is None, name
            else:
                assert param.grad is not None and torch.equal(param.grad, grad), name
    assert all(p.grad is None or p.grad.shape == p.shape for p in model.parameters())


@pytest.mark.distributed(world_size=2)
def test_full_state_dict(rank, process_group):
    """Unwrapped keys, full values; rank0_only and offload_to_cpu; load restores the values."""
    expected = _full_state("transformer", rank)
    model = wrap_model("transformer", build("transformer", rank), process_group)
    state = model.state_dict()  # FULL_STATE_DICT is the default
    assert list(state) == list(expected)  # tied proj.weight included, as nn.Module does
    assert all(torch.equal(state[k], v) for k, v in expected.items())
    config = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
        state0 = model.state_dict()
    if rank == 0:
        assert list(state0) == list(expected) and all(
            v.device.type == "cpu" for v in state0.values()
        )
    else:
        assert state0 == {}
    with FSDP.summon_full_params(model), torch.no_grad():
        for param in model.parameters():
            param.zero_()
    assert all(not v.any() for k, v in model.state_dict().items() if "weight" in k or "bias" in k)
    missing_unexpected = model.load_state_dict(state)
    assert list(missing_unexpected.missing_keys) == list(missing_unexpected.unexpected_keys) == []
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in expected.items())
    with pytest.raises(RuntimeError, match=r"unexpected keys \['extra'\]"):
        model.load_state_dict({**state, "extra": torch.zeros(1)})
    for kind in (StateDictType.SHARDED_STATE_DICT, StateDictType.LOCAL_STATE_DICT):
        with pytest.raises(TypeError, match=r"takes a (Sharded|Local)StateDictConfig"):
            with FSDP.state_dict_type(model, kind, config):  # a FullStateDictConfig
                pass


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_sync_matches_ddp(rank, process_group, strategy):
    """Two micro-batches under no_sync and one outside, per step, equal DDP's no_sync; nothing
    is reduced inside the context."""
    ddp = DDP(build("nested", rank), process_group=process_group)
    model = wrap_model("nested", build("nested", rank), process_group, sharding_strategy=strategy)
    reductions = []

    def count(event: events.Event) -> None:
        if isinstance(event, events.Collective) and not event.op.startswith("all_gather"):
            reductions.append(event)

    for m in (ddp, model):
        optim = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
        for step in range(2):
            with m.no_sync():
                for micro in range(2):
                    with events.subscribe(count):
                        m(get_input("nested", rank, 10 * step + micro)).pow(2).mean().backward()
            assert not reductions
            m(get_input("nested", rank, 10 * step + 2)).pow(2).mean().backward()
            optim.step()
            optim.zero_grad()
    expected = {n: p.detach() for n, p in ddp.module.named_parameters()}
    assert_same(full_params(model), expected, tolerance=None, what=f"no_sync {strategy}")


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("strategy", [ShardingStrategy.FULL_SHARD, ShardingStrategy.NO_SHARD])
def test_clip_grad_norm_matches_unsharded(rank, process_group, strategy):
    """The total norm over all shards and the clipped gradients equal torch's clipping of the
    replicated model, for the 2-norm and the inf-norm."""
    for norm_type in (2.0, math.inf):
        ddp = DDP(build("nested", rank), process_group=process_group)
        model = wrap_model(
            "nested", build("nested", rank), process_group, sharding_strategy=strategy
        )
        for m in (ddp, model):
            m(get_input("nested", rank, 0)).pow(2).sum().backward()
        expected_norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.1, norm_type)
        norm = model.clip_grad_norm_(0.1, norm_type)
        assert norm > 0.1  # clipping is active
        expected = {n: p.grad for n, p in ddp.module.named_parameters()}
        with FSDP.summon_full_params(model, with_grads=True, writeback=False):
            grads = {n: p.grad for n, p in model.named_parameters()}
        if norm_type == math.inf:
            # A max is exact, so the clip coefficient and the clipped gradients are too.
            assert torch.equal(norm, expected_norm)
            assert_same(grads, expected, tolerance=None, what="inf-norm")
        else:
            # torch takes the norm of the per-tensor norms; the shards' parts are summed over
            # ranks instead: the same sum in another order, within a few fp32 ulps.
            torch.testing.assert_close(norm, expected_norm, rtol=1e-6, atol=0)
            assert_same(grads, expected, tolerance=(1e-6, 1e-8), what="2-norm")


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("kind", ["nested", "moe"])
@pytest.mark.parametrize("strategy", [ShardingStrategy.FULL_SHARD, ShardingStrategy.NO_SHARD])
def test_clip_grad_norm_below_max_norm_leaves_gradients_unchanged(
    rank, process_group, kind, strategy
):
    """A total norm below ``max_norm`` clips nothing: every gradient (sharded, replicated, and
    the one-rank-group experts of ``moe``) keeps its exact value, and the norm is still
    returned."""
    for norm_type in (2.0, math.inf):
        model = wrap_model(kind, build(kind, rank), process_group, sharding_strategy=strategy)
        model(get_input(kind, rank, 0)).pow(2).sum().backward()
        before = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        assert before  # every rank holds some gradient
        norm = model.clip_grad_norm_(1e6, norm_type)
        assert 0 < norm < 1e6
        for max_norm in (1e6, 2 * norm.item()):
            again = model.clip_grad_norm_(max_norm, norm_type)
            assert torch.equal(again, norm)
            for name, param in model.named_parameters():
                if name in before:
                    assert torch.equal(param.grad, before[name]), (name, norm_type, max_norm)


@pytest.mark.distributed(world_size=2)
def test_clip_grad_norm_and_no_sync_need_the_root(rank, process_group):
    model = wrap_model("nested", build("nested", rank), process_group)
    model(get_input("nested", rank, 0)).sum().backward()
    with pytest.raises(RuntimeError, match="inner FSDP instance is not supported"):
        model.block.clip_grad_norm_(1.0)
    with pytest.raises(RuntimeError, match="inner FSDP instance is not supported"):
        with model.block.no_sync():
            pass
    with pytest.raises(ValueError, match="norm_type must be > 0"):
        model.clip_grad_norm_(1.0, norm_type=0)
