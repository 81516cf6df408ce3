"""Hybrid sharding (HSDP) at world size 4 as a 2 x 2 grid: shard groups {0, 1} and {2, 3},
replicate groups {0, 2} and {1, 3}. Both wrapper strategies (``HYBRID_SHARD``,
``_HYBRID_SHARD_ZERO2``) with groups from a 2-D ``device_mesh`` and from a
``process_group=(shard, replicate)`` pair, and ``fully_shard`` on a 2-D mesh, train like DDP over
the world; the bytes of each collective family go over the right group and equal the theory.

Tolerances: DDP sums four gradients in the order of gloo's all-reduce; HSDP sums two inside the
shard group, then two across replicas, so fp32 results agree to rounding only
(``FP32_TOLERANCE``), as for every strategy at world size 4 in ``test_parity.py``.
"""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from fsdp_core import FSDP, DataParallelMeshDims, ShardingStrategy, fully_shard
from fsdp_core._runtime import states_in
from fsdp_core.wrap import ModuleWrapPolicy, always_wrap_policy, enable_wrap, wrap
from fsdp_testing.engines import get_engine
from fsdp_testing.recording import record_fsdp

from ._models import MixtureOfExperts, NestedModel, _own_rank_group, build
from ._parity import FP32_TOLERANCE, assert_same, assert_same_losses, full_params, reference, train
from ._spmd import on_spmd_mesh

KINDS = ["nested", "always_wrap", "frozen", "transformer", "moe"]
HYBRID = [ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2]
SHARD_GROUPS = ((0, 1), (2, 3))
REPLICATE_GROUPS = ((0, 2), (1, 3))
TOL = FP32_TOLERANCE


def _mesh() -> DeviceMesh:
    return DeviceMesh("cpu", torch.arange(4).view(2, 2), mesh_dim_names=("replicate", "shard"))


def _pair(mesh: DeviceMesh) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    return mesh.get_group("shard"), mesh.get_group("replicate")


def _wrap(kind: str, model: nn.Module, groups: dict, strategy: ShardingStrategy) -> nn.Module:
    """Wrap ``model`` as ``tests/core/_models.wrap_model`` does, with hybrid ``groups``
    (``process_group=`` or ``device_mesh=``); MoE experts stay on a group of one (FULL_SHARD,
    mixed with the hybrid instances: only hybrid instances must agree on groups)."""
    kw = {"sharding_strategy": strategy, **groups}
    if kind == "always_wrap":
        return FSDP(model, auto_wrap_policy=always_wrap_policy, **kw)
    if kind == "transformer":
        return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({nn.TransformerEncoderLayer}), **kw)
    if kind == "moe":
        assert isinstance(model, MixtureOfExperts)
        model.expert = FSDP(model.expert, _own_rank_group(dist.group.WORLD))
        return FSDP(model, **kw)
    with enable_wrap(wrapper_cls=FSDP, **kw):
        assert isinstance(model, NestedModel)
        model.block = wrap(model.block)
        return wrap(model)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.distributed(world_size=4)
def test_wrapper_hybrid_parity_with_ddp(kind, rank, process_group):
    """Both hybrid strategies, groups from a 2-D mesh and from a pair, train like DDP; every
    unit is sharded over its shard group and replicated across the other."""
    ref_losses, ref_params = reference(kind, build(kind, rank), rank, process_group)
    mesh = _mesh()
    for strategy, source in itertools.product(HYBRID, ("device_mesh", "process_group")):
        groups = (
            {"device_mesh": mesh} if source == "device_mesh" else {"process_group": _pair(mesh)}
        )
        what = f"{kind} {strategy.name} {source}"
        model = _wrap(kind, build(kind, rank), groups, strategy)
        for state in states_in(model):
            if state.unit is not None and state.unit.groups.is_hybrid:
                shard, replicate = state.unit.groups.ranks()
                assert shard == SHARD_GROUPS[rank // 2] and replicate == REPLICATE_GROUPS[rank % 2]
        losses = train(model, kind, rank)
        assert_same_losses(losses, ref_losses, tolerance=TOL, what=what)
        assert_same(full_params(model), ref_params, tolerance=TOL, what=what)


def _shard_hybrid(kind: str, model: nn.Module, mesh: DeviceMesh, **kw) -> nn.Module:
    if kind == "always_wrap":
        for module in list(model.modules())[::-1]:
            if module is not model:
                fully_shard(module, mesh=mesh, **kw)
    elif kind == "transformer":
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, **kw)
    elif kind == "moe":
        assert isinstance(model, MixtureOfExperts)
        own = DeviceMesh.from_group(_own_rank_group(dist.group.WORLD), "cpu")
        fully_shard(model.expert, mesh=own)
    else:
        fully_shard(model.block, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def _train_composable(model: nn.Module, kind: str, rank: int):
    from .test_fully_shard import train as train_fully_shard

    return train_fully_shard(model, kind, rank)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.distributed(world_size=4)
def test_fully_shard_2d_mesh_parity_with_ddp(kind, rank, process_group):
    """``fully_shard(mesh=2-D)``: DTensors with (Replicate(), Shard(0)) placements, and the
    same training as DDP, for True, False and 2 as ``reshard_after_forward``."""
    ref_losses, ref_params = reference(kind, build(kind, rank), rank, process_group)
    mesh = _mesh()
    for rsf in (True, False, 2):
        what = f"{kind} fully_shard 2-D mesh reshard_after_forward={rsf}"
        model = _shard_hybrid(kind, build(kind, rank), mesh, reshard_after_forward=rsf)
        for name, param in model.named_parameters():
            if kind == "moe" and name.startswith("expert."):
                continue
            assert isinstance(param, DTensor), name
            assert param.placements == (Replicate(), Shard(0)), (name, param.placements)
        losses, params = _train_composable(model, kind, rank)
        assert_same_losses(losses, ref_losses, tolerance=TOL, what=what)
        assert_same(params, ref_params, tolerance=TOL, what=what)


@pytest.mark.distributed(world_size=4)
def test_dp_mesh_dims_on_a_bigger_mesh(rank, process_group):
    """``DataParallelMeshDims(shard=..., replicate=...)`` picks the HSDP dimensions out of the
    full SPMD mesh the parameters live on; the result trains like DDP and its parameters stay
    on that mesh, sharded on the shard dimension."""
    ref_losses, ref_params = reference("nested", build("nested", rank), rank, process_group)
    mesh = DeviceMesh("cpu", torch.arange(4).view(2, 1, 2), mesh_dim_names=("dp", "tp", "fs"))
    dims = DataParallelMeshDims(shard="fs", replicate="dp")
    model = on_spmd_mesh(build("nested", rank), mesh)
    fully_shard(model.block, mesh=mesh, dp_mesh_dims=dims)
    fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
    unit = states_in(model)[0].unit
    assert unit is not None
    assert unit.groups.ranks() == (SHARD_GROUPS[rank // 2], REPLICATE_GROUPS[rank % 2])
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor) and param.device_mesh is mesh, name
        assert param.placements == (Replicate(), Replicate(), Shard(0)), name
    losses, params = _train_composable(model, "nested", rank)
    assert_same_losses(losses, ref_losses, tolerance=TOL, what="dp_mesh_dims")
    assert_same(params, ref_params, tolerance=TOL, what="dp_mesh_dims")


def _stack() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))


def _step(model: nn.Module, rank: int) -> None:
    model(torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))).sum().backward()


def _padded(shape: tuple[int, ...], world: int) -> int:
    return math.ceil(shape[0] / world) * world * math.prod(shape[1:])


@pytest.mark.parametrize("strategy", HYBRID)
@pytest.mark.distributed(world_size=4)
def test_bytes_per_group_equal_the_theory(strategy, rank, process_group):
    """Per step, all-gathers and reduce-scatters go over this rank's shard group and the
    all-reduces over its replicate group, with the bytes of [Note: theoretical volume],
    computed here by hand and by the engine."""
    model = FSDP(
        _stack(),
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
        sharding_strategy=strategy,
        device_mesh=_mesh(),
    )
    _step(model, rank)  # first iteration: lazy init and order validation
    with record_fsdp(model) as rec:
        _step(model, rank)
    shard, replicate = SHARD_GROUPS[rank // 2], REPLICATE_GROUPS[rank % 2]
    # Hand count (fp32, 4 bytes): units are the three Linears (weight, bias) and an empty root.
    layers = [(6, 8), (5, 6), (3, 5)]
    units = [[(o, i), (o,)] for o, i in layers]
    gathers = 2 if strategy is ShardingStrategy.HYBRID_SHARD else 1
    # Tags: 2 per shard rank per all-gather, 2 per shard rank per row (2 rows) of a
    # reduce-scatter, 2 per replica after an all-reduce's shard.
    gather = sum(gathers * (sum(_padded(p, 2) for p in u) + 2 * 2) * 4 for u in units)
    scatter = sum((sum(_padded(p, 2) for p in u) + 2 * 2 * 2) * 4 for u in units)
    replica = sum((sum(_padded(p, 2) for p in u) // 2 + 2 * 2) * 4 for u in units)
    assert rec.bytes_by_group("all_gather") == {shard: gather}
    assert rec.bytes_by_group("reduce_scatter") == {shard: scatter}
    assert rec.bytes_by_group("all_reduce") == {replicate: replica}
    theory = get_engine("fsdp_core").theoretical_volume(
        model, full_shard=strategy is ShardingStrategy.HYBRID_SHARD
    )
    assert theory is not None
    assert theory.totals() == {
        "all_gather": (3 * gathers, gather),
        "reduce_scatter": (3, scatter),
        "all_reduce": (3, replica),
    }


@pytest.mark.distributed(world_size=4)
def test_mixing_hybrid_strategies_in_one_model(rank, process_group):
    """HYBRID_SHARD and _HYBRID_SHARD_ZERO2 instances in one model (same groups) train like
    DDP; the ZERO2 unit keeps its parameters after forward, the other frees them."""
    ref_losses, ref_params = reference("nested", build("nested", rank), rank, process_group)
    mesh = _mesh()
    model = build("nested", rank)
    model.block = FSDP(model.block, device_mesh=mesh, sharding_strategy=HYBRID[1])
    model.out = FSDP(model.out, device_mesh=mesh, sharding_strategy=HYBRID[0])
    model = FSDP(model, device_mesh=mesh, sharding_strategy=HYBRID[0])
    with record_fsdp(model) as rec:
        losses = train(model, "nested", rank)
    assert_same_losses(losses, ref_losses, tolerance=TOL, what="mixed hybrid")
    assert_same(full_params(model), ref_params, tolerance=TOL, what="mixed hybrid")
    after_forward = {r.unit for r in rec.reshards("forward")}
    assert "out" in after_forward and "block" not in after_forward, after_forward


@pytest.mark.distributed(world_size=4)
def test_hybrid_instances_must_agree_on_groups(rank, process_group):
    """A hybrid instance on other groups than its hybrid parent raises, naming both; a
    FULL_SHARD instance on any group mixes with hybrid ones."""
    mesh = _mesh()
    swapped = DeviceMesh("cpu", torch.arange(4).view(2, 2).t(), mesh_dim_names=("r", "s"))
    model = build("nested", rank)
    model.block = FSDP(model.block, device_mesh=swapped, sharding_strategy=HYBRID[0])
    with pytest.raises(ValueError, match="must use the same process groups") as info:
        FSDP(model, device_mesh=mesh, sharding_strategy=HYBRID[1])
    assert "'block'" in str(info.value) and "<root>" in str(info.value)
    model = build("nested", rank)
    model.block = FSDP(model.block, process_group, sharding_strategy=ShardingStrategy.FULL_SHARD)
    FSDP(model, device_mesh=mesh, sharding_strategy=HYBRID[0])  # no error


@pytest.mark.distributed(world_size=4)
def test_sync_module_states_across_both_dimensions(rank, process_group):
    """Every rank starts from different values; after ``sync_module_states`` all hold global
    rank 0's, sharded by shard rank, for groups from a mesh and from a pair."""
    mesh = _mesh()
    for groups in ({"device_mesh": mesh}, {"process_group": _pair(mesh)}):
        torch.manual_seed(100)
        expected = nn.Linear(8, 6)  # global rank 0's model
        torch.manual_seed(100 + rank)  # a different model on every rank
        model = FSDP(
            nn.Linear(8, 6), sharding_strategy=HYBRID[0], sync_module_states=True, **groups
        )
        gathered = full_params(model)
        assert torch.equal(gathered["weight"], expected.weight.detach()), groups
        assert torch.equal(gathered["bias"], expected.bias.detach()), groups
        # Other ranks built other values: the check above is not vacuous.
        torch.manual_seed(100 + rank)
        assert rank == 0 or not torch.equal(nn.Linear(8, 6).weight, expected.weight)


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.distributed(world_size=4)
def test_clip_grad_norm_equals_ddp(norm_type, rank, process_group):
    """The total norm counts each replica's shard once: it equals the norm DDP's averaged
    gradients have, and the clipped gradients equal DDP's."""
    plain = build("nested", rank)
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(plain), process_group=process_group)
    model = FSDP(
        plain,
        auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}),
        sharding_strategy=HYBRID[0],
        device_mesh=_mesh(),
    )
    batch = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    ddp(batch).pow(2).mean().backward()
    model(batch).pow(2).mean().backward()
    expected = torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1e-3, norm_type)
    total = model.clip_grad_norm_(1e-3, norm_type)
    # Rounding only: the sums of squares are added in another order (per shard, then over 2).
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-7)
    assert expected > 1e-3  # the gradients were clipped
    with FSDP.summon_full_params(model, with_grads=True):
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    for name, param in ddp.module.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-4, atol=1e-9)


class _TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l0, self.l1 = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, swap: bool = False) -> torch.Tensor:
        return self.l0(self.l1(x)) if swap else self.l1(self.l0(x))


@pytest.mark.distributed(world_size=4)
def test_order_check_catches_divergence_across_replicas(rank, process_group):
    """Ranks 2 and 3 run the two (same-sized) units in the other order in iteration 2. They
    agree with each other, and all-gathers never leave a shard group, so only the all-reduce
    across replicas can tell: every rank raises there, naming both units."""
    model, mesh = _TwoLayers(), _mesh()  # one mesh: the units share their groups
    model.l0 = FSDP(model.l0, device_mesh=mesh, sharding_strategy=HYBRID[1])
    model.l1 = FSDP(model.l1, device_mesh=mesh, sharding_strategy=HYBRID[1])
    model = FSDP(model, device_mesh=mesh, sharding_strategy=HYBRID[1])
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))
    model(x).sum().backward()  # iteration 1: lazy init and the index check
    with pytest.raises(RuntimeError, match="different orders in iteration 2") as info:
        model(x, swap=rank >= 2).sum().backward()
    assert "reduced the gradients of 'l0'" in str(info.value), str(info.value)
    assert "reduced the gradients of 'l1'" in str(info.value), str(info.value)


@pytest.mark.distributed(world_size=4)
def test_bad_hybrid_input_raises_naming_the_fix(rank, process_group):
    """A 3-D mesh, groups that do not tile the world, a pair for a non-hybrid strategy, and an
    int reshard_after_forward that does not divide the shard group size."""
    cube = DeviceMesh("cpu", torch.arange(4).view(1, 2, 2), mesh_dim_names=("a", "b", "c"))
    with pytest.raises(ValueError, match=r"2-D mesh.*3-D mesh.*mesh\['replicate', 'shard'\]"):
        FSDP(nn.Linear(4, 4), device_mesh=cube, sharding_strategy=HYBRID[0])
    with pytest.raises(ValueError, match=r"1-D \(FSDP\) or 2-D \(HSDP.*3-D mesh"):
        fully_shard(nn.Linear(4, 4), mesh=cube)
    # Unequal shard groups: {0, 1, 2} and {3}; replicate groups {0, 3}, {1}, {2}.
    shards = [dist.new_group(r) for r in ([0, 1, 2], [3])]
    replicas = [dist.new_group(r) for r in ([0, 3], [1], [2])]
    pair = (shards[0] if rank < 3 else shards[1], replicas[{0: 0, 3: 0, 1: 1, 2: 2}[rank]])
    with pytest.raises(ValueError, match=r"must tile the world.*different sizes.*device_mesh="):
        FSDP(nn.Linear(4, 4), process_group=pair, sharding_strategy=HYBRID[0])
    # Overlapping shard groups: rank 0 and 1 pass {0, 1}, rank 2 passes {1, 2}, rank 3 {2, 3}.
    groups = {tuple(r): dist.new_group(list(r)) for r in ((0, 1), (1, 2), (2, 3))}
    replicate = {r: dist.new_group(list(r)) for r in ((0, 2), (1, 3))}
    mine = {0: (0, 1), 1: (0, 1), 2: (1, 2), 3: (2, 3)}[rank]
    pair = (groups[mine], replicate[REPLICATE_GROUPS[rank % 2]])
    with pytest.raises(ValueError, match=r"must tile the world.*overlap"):
        FSDP(nn.Linear(4, 4), process_group=pair, sharding_strategy=HYBRID[1])
    with pytest.raises(ValueError, match="only the hybrid strategies take"):
        FSDP(nn.Linear(4, 4), process_group=_pair(_mesh()))
    with pytest.raises(ValueError, match="not both"):
        FSDP(nn.Linear(4, 4), process_group, device_mesh=_mesh(), sharding_strategy=HYBRID[0])
    with pytest.raises(ValueError, match=r"must divide the shard world size 2; pass one of"):
        fully_shard(nn.Linear(4, 4), mesh=_mesh(), reshard_after_forward=4)
    with pytest.raises(ValueError, match="must be DTensors on the full SPMD mesh"):
        fully_shard(
            nn.Linear(4, 4), mesh=_mesh(), dp_mesh_dims=DataParallelMeshDims(replicate="replicate")
        )


@pytest.mark.distributed(world_size=4)
def test_default_groups_shard_within_a_node(rank, process_group, monkeypatch):
    """Without groups, LOCAL_WORLD_SIZE ranks form a node: shard inside, replicate across."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    model = FSDP(nn.Linear(4, 4), sharding_strategy=HYBRID[0])
    again = FSDP(nn.Linear(4, 4), sharding_strategy=HYBRID[0])
    assert model._unit.groups.ranks() == (SHARD_GROUPS[rank // 2], REPLICATE_GROUPS[rank % 2])
    assert again._unit.groups is model._unit.groups  # created once, shared by instances


@pytest.mark.distributed(world_size=2)
def test_gpus_do_not_size_the_nodes_of_a_gloo_job(rank, process_group, monkeypatch):
    """A gloo job's ranks compute on the CPU: a GPU on the machine (one here, mocked) does not
    make each rank a node of its own, as it would over nccl."""
    from unittest import mock

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with (
        mock.patch.object(torch.cuda, "is_available", return_value=True),
        mock.patch.object(torch.cuda, "device_count", return_value=1),
    ):
        model = FSDP(nn.Linear(4, 4), sharding_strategy=HYBRID[0])
    assert model._unit.groups.ranks() == ((0, 1), (rank,))
    model(torch.ones(2, 4)).sum().backward()
