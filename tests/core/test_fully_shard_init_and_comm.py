"""``fully_shard`` beyond the parity matrix: meta-device init, empty shards, the collectives
each ``reshard_after_forward`` sends, explicit prefetch lists, and the unit structure torch's
FSDP2 builds for the reference models."""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Callable
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from fsdp_core import FSDPModule, fully_shard
from fsdp_core._runtime import states_in
from fsdp_testing.engines import get_engine, use_engine
from fsdp_testing.models import (
    AlwaysWrapNestedWrappedModule,
    DEVICEInitMode,
    FSDPInitMode,
    MixtureOfExperts,
    NestedWrappedModule,
    NonUniformReqGradNWM,
    TransformerWithSharedParams,
)
from fsdp_testing.recording import record_fsdp

from ._models import NestedModel, build
from ._parity import FP32_TOLERANCE, assert_same, assert_same_losses, reference
from .test_fully_shard import train

CPU = torch.device("cpu")


def _mesh(group: dist.ProcessGroup) -> DeviceMesh:
    return DeviceMesh.from_group(group, "cpu")


def _stack(rows: tuple[int, ...] = (8, 8, 8, 4)) -> nn.Sequential:
    """Linear layers (units "0", "2", "4", ...) with ReLUs between, seeded alike on all ranks."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(itertools.pairwise(rows)):
        layers += [nn.Linear(n_in, n_out)] + ([nn.ReLU()] if i < len(rows) - 2 else [])
    return nn.Sequential(*layers)


def train_side_by_side(
    plain: nn.Module,
    shard_fn: Callable[[nn.Module], nn.Module],
    rank: int,
    group: dist.ProcessGroup,
    *,
    in_features: int = 8,
    steps: int = 3,
    tolerance: float | None = None,
) -> nn.Module:
    """Train DDP on a copy of ``plain`` and ``shard_fn(plain)`` on the same batches (SGD);
    assert equal losses and full parameters; return the sharded model."""
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(plain), process_group=group)
    model = shard_fn(plain)
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tol = {} if tolerance is None else {"rtol": tolerance, "atol": tolerance}
    for step in range(steps):
        x = torch.randn(4, in_features, generator=torch.Generator().manual_seed(rank * 10 + step))
        losses = []
        for net, optim in ((ddp, ddp_opt), (model, opt)):
            loss = net(x).pow(2).mean()
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], **(tol or {"rtol": 0, "atol": 0}))
    for (name, p), (_, q) in zip(
        ddp.module.named_parameters(), model.named_parameters(), strict=True
    ):
        full = q.full_tensor() if isinstance(q, DTensor) else q
        torch.testing.assert_close(full, p, msg=name, **(tol or {"rtol": 0, "atol": 0}))
    return model


@pytest.mark.distributed(world_size=2)
def test_meta_device_init_allocates_only_shards_and_trains_like_ddp(rank, process_group):
    """Build on the meta device, fully_shard, to_empty(device="cpu"), then an init function
    writing each rank's rows: the unit holds only the padded shards, nothing full is
    allocated, and training equals DDP on the same initial values (bitwise at two ranks)."""
    initial = build("nested", rank)
    full = {n: p.detach().clone() for n, p in initial.named_parameters()}
    ref_losses, ref_params = reference("nested", initial, rank, process_group)

    with torch.device("meta"):
        model = NestedModel()
    mesh = _mesh(process_group)
    fully_shard(model.block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")

    with torch.no_grad():  # the init function: this rank's rows of each parameter
        for name, p in model.named_parameters():
            local = p.to_local()
            start = rank * math.ceil(p.shape[0] / 2)
            local.copy_(full[name][start : start + local.shape[0]])

    world = dist.get_world_size(process_group)
    for state in states_in(model):
        unit = state.unit
        assert unit is not None
        padded = sum(math.ceil(p.rows / world) * math.prod(p.rest) for p in unit.params)
        assert unit.flat_shard.numel() == padded, unit.name
        assert unit._flat_shard.device == CPU, unit.name
        assert all(p.unsharded.untyped_storage().nbytes() == 0 for p in unit.params), unit.name
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and not p.is_meta, name
        chunk = math.ceil(p.shape[0] / world)
        assert p.to_local().shape[0] == min(chunk, p.shape[0] - rank * chunk), name
    losses, params = train(model, "nested", rank)
    assert_same_losses(ref_losses, losses, what="meta init", tolerance=None)
    assert_same(ref_params, params, what="meta init", tolerance=None)


@pytest.mark.distributed(world_size=4)
def test_empty_shards_train_like_ddp(rank, process_group):
    """A Linear with 3 output rows at world size 4: the last rank's shards of its weight and
    bias are empty, and training still equals DDP."""
    mesh = _mesh(process_group)

    def shard(model: nn.Module) -> nn.Module:
        fully_shard(model[0], mesh=mesh)
        fully_shard(model[2], mesh=mesh)
        return fully_shard(model, mesh=mesh)

    # Four ranks average in another order than DDP: fp32 rounding.
    model = train_side_by_side(
        _stack((8, 3, 5)), shard, rank, process_group, tolerance=FP32_TOLERANCE.atol
    )
    weight = model[0].weight
    assert isinstance(weight, DTensor) and weight.shape == (3, 8)
    assert weight.to_local().shape[0] == (0 if rank == 3 else 1)
    assert model[0].bias.to_local().numel() == (0 if rank == 3 else 1)


@pytest.mark.parametrize("rsf", [True, False, 2])
@pytest.mark.distributed(world_size=4)
def test_collectives_per_step_follow_the_theory(rsf, rank, world_size, process_group):
    """Per step, three non-root units: True all-gathers each twice (forward and backward),
    False once, 2 once over the world and once inside a group of two ranks; one
    reduce-scatter each; the counts equal the engine's theoretical volume."""
    mesh = _mesh(process_group)
    model = _stack()
    for i in (0, 2, 4):
        fully_shard(model[i], mesh=mesh, reshard_after_forward=rsf)
    fully_shard(model, mesh=mesh)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    with record_fsdp(model, engine="fsdp_core_fully_shard") as rec:
        for _ in range(2):
            model(x).sum().backward()
            rec.next_step()
    gathers = rec.collectives("all_gather", step=1)
    sizes = sorted(g.group_size for g in gathers)
    expected = {True: [4] * 6, False: [4] * 3, 2: [2] * 3 + [4] * 3}[rsf]
    assert sizes == expected, [(g.unit, g.group_size) for g in gathers]
    rec.assert_count("reduce_scatter", 3, step=1)
    theory = get_engine("fsdp_core_fully_shard").theoretical_volume(model, full_shard=True)
    assert theory is not None
    totals = theory.totals()
    assert totals["all_gather"][0] == len(gathers)
    assert totals["reduce_scatter"][0] == 3


@pytest.mark.distributed(world_size=2)
def test_explicit_prefetch_lists_set_the_order_and_keep_parity(rank, process_group):
    """set_modules_to_forward_prefetch/backward_prefetch in an order of our choosing: the
    recorder sees exactly those prefetches, and training equals DDP."""
    mesh = _mesh(process_group)

    def shard(model: nn.Module) -> nn.Module:
        for i in (0, 2, 4):
            fully_shard(model[i], mesh=mesh)
        fully_shard(model, mesh=mesh)
        model[0].set_modules_to_forward_prefetch([model[4], model[2]])
        model[4].set_modules_to_backward_prefetch([model[0], model[2]])
        return model

    model = train_side_by_side(_stack(), shard, rank, process_group)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    with record_fsdp(model, engine="fsdp_core_fully_shard") as rec:
        model(x).sum().backward()
    rec.assert_prefetch_order(["4", "2"], direction="forward")
    rec.assert_prefetch_order(["0", "2"], direction="backward")


REFERENCE_MODELS = [
    NestedWrappedModule,
    AlwaysWrapNestedWrappedModule,
    NonUniformReqGradNWM,
    MixtureOfExperts,
    TransformerWithSharedParams,
]


@pytest.mark.parametrize("model_class", REFERENCE_MODELS, ids=lambda c: c.__name__)
@pytest.mark.distributed(world_size=2)
def test_units_are_the_ones_torch_fsdp2_builds(model_class, rank, process_group):
    """The engine shards each reference model into the same units (by qualified name) as
    torch's FSDP2 engine."""
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    units = {}
    for engine, unit_class in (("torch_fsdp2", TorchFSDPModule), ("fsdp_core_fully_shard", None)):
        with use_engine(engine):
            model = model_class.init(
                process_group,
                FSDPInitMode.RECURSIVE,
                DEVICEInitMode.DEVICE_BEFORE,
                deterministic=True,
                device=CPU,
            )
        cls = unit_class or FSDPModule
        units[engine] = sorted(n for n, m in model.named_modules() if isinstance(m, cls))
    assert units["fsdp_core_fully_shard"] == units["torch_fsdp2"]
    assert units["torch_fsdp2"], "the reference model has no units"


class _TiedLM(nn.Module):
    """Embedding -> Linear -> output projection whose weight is the embedding's."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(11, 6)
        self.hidden = nn.Linear(6, 6)
        self.proj = nn.Linear(6, 11, bias=False)
        self.proj.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.tanh(self.hidden(self.embed(tokens))))


@pytest.mark.distributed(world_size=2)
def test_a_weight_tied_across_units_moves_to_their_ancestor_and_trains_like_ddp(
    rank, process_group
):
    """embed and proj share one weight, each in its own unit: the weight leaves embed's unit
    for the root's (their lowest common ancestor), both see the same DTensor, and training
    equals DDP bitwise. torch's FSDP2 raises on this model."""
    mesh = _mesh(process_group)

    def shard(model: nn.Module) -> nn.Module:
        for child in (model.embed, model.hidden, model.proj):
            fully_shard(child, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    plain = _TiedLM()
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(plain), process_group=process_group)
    model = shard(plain)
    names = {id(m): n for n, m in model.named_modules()}
    units = {
        names[id(s.owner)]: [p.fqn for p in s.unit.params] if s.unit else []
        for s in states_in(model)
    }
    assert units == {"": ["embed.weight"], "embed": [], "hidden": ["weight", "bias"], "proj": []}
    assert model.embed.weight is model.proj.weight
    assert isinstance(model.embed.weight, DTensor)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in _TiedLM().named_parameters()]
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        tokens = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(rank + step))
        for net, optim in ((ddp, ddp_opt), (model, opt)):
            loss = net(tokens).logsumexp(-1).mean()
            loss.backward()
            optim.step()
            optim.zero_grad()
    for (name, p), (_, q) in zip(
        ddp.module.named_parameters(), model.named_parameters(), strict=True
    ):
        torch.testing.assert_close(q.full_tensor(), p, rtol=0, atol=0, msg=name)
    assert model.embed.weight is model.proj.weight


@pytest.mark.distributed(world_size=2)
def test_a_weight_tied_inside_one_group_of_modules_is_one_parameter_of_its_unit(
    rank, process_group
):
    """fully_shard([embed, proj]) on modules sharing one weight (FSDP2's way to tie across
    modules): the group's unit holds it once with both slots, and training equals DDP."""
    mesh = _mesh(process_group)
    plain = _TiedLM()
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(plain), process_group=process_group)
    fully_shard([plain.embed, plain.proj], mesh=mesh)
    model = fully_shard(plain, mesh=mesh)
    (group,) = [s for s in states_in(model) if s.owner is model.embed]
    assert [p.fqn for p in group.unit.params] == ["weight"]
    assert model.embed.weight is model.proj.weight
    tokens = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(rank))
    for net in (ddp, model):
        net(tokens).logsumexp(-1).mean().backward()
    for (name, p), (_, q) in zip(
        ddp.module.named_parameters(), model.named_parameters(), strict=True
    ):
        torch.testing.assert_close(q.grad.full_tensor(), p.grad, msg=name)


@pytest.mark.distributed(world_size=2)
def test_a_weight_tied_across_units_without_a_sharded_ancestor_raises_fsdp2s_error(
    rank, process_group
):
    """embed and proj share one weight, each sharded, the model that encloses both is not: proj
    would compute with an original copy that never trains, so the first forward raises FSDP2's
    ValueError naming it (it used to run)."""
    mesh = _mesh(process_group)
    model = _TiedLM()
    fully_shard(model.embed, mesh=mesh)
    fully_shard(model.proj, mesh=mesh)
    tokens = torch.randint(0, 11, (4, 5))
    with pytest.raises(
        ValueError,
        match=r"fully_shard: Parameter 'weight' is shared with a parameter already managed by "
        r"another FSDP group \('weight'\)",
    ):
        model.proj(model.hidden(model.embed(tokens)))


@pytest.mark.parametrize(
    "backend", ["gloo", "nccl", "cpu:gloo,cuda:nccl", "local", "threaded", "fake", "cpu:gloo"]
)
def test_a_default_mesh_takes_cuda_only_from_a_backend_that_moves_device_memory(backend):
    from fsdp_core._groups import backend_moves_cuda_memory

    with mock.patch.object(dist, "get_backend", return_value=backend):
        assert backend_moves_cuda_memory() == ("nccl" in backend)


@pytest.mark.distributed(world_size=2)
def test_a_gloo_job_on_a_machine_with_a_gpu_keeps_its_default_mesh_on_the_cpu(process_group):
    # A test written on a CPU-only machine, run where a GPU exists: torch's FSDP2 would take the
    # GPU and move the module there, away from the CPU inputs the gloo ranks feed it.
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with mock.patch.object(torch.cuda, "is_available", return_value=True):
        fully_shard(model[0])
        fully_shard(model)
    for p in model.parameters():
        assert isinstance(p, DTensor) and p.device_mesh.device_type == "cpu", p
    model(torch.ones(3, 4)).sum().backward()
