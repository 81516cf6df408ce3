"""fully_shard as a drop-in for torch's FSDP2 (issue 23): behaviour torch's own FSDP2 tests
rely on, each checked against a reference computed here."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from fsdp_core import MixedPrecisionPolicy, events, fully_shard, unit_views
from fsdp_core.graph import trace_train_step


def _mesh(group: dist.ProcessGroup) -> DeviceMesh:
    return DeviceMesh.from_group(group, "cpu")


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))


@pytest.mark.distributed(world_size=2)
def test_no_sync_accumulates_in_the_reduce_dtype(rank, world_size, process_group):
    """bf16 compute, fp32 reduce_dtype, four micro-batches without gradient sync and one with:
    the micro-batches' bf16 gradients are summed in fp32 (FSDP2's rule), then averaged."""
    plain = _mlp()
    local = copy.deepcopy(plain).to(torch.bfloat16)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mesh = _mesh(process_group)
    fully_shard(plain[0], mesh=mesh, mp_policy=policy)
    model = fully_shard(plain, mesh=mesh, mp_policy=policy)
    batches = [
        torch.randn(4, 8, generator=torch.Generator().manual_seed(rank * 10 + i)) for i in range(5)
    ]

    expected = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in local.named_parameters()}
    for x in batches:
        local.zero_grad()
        local(x.to(torch.bfloat16)).sum().backward()
        for n, p in local.named_parameters():
            expected[n] += p.grad.float()
    for value in expected.values():
        dist.all_reduce(value, group=process_group)
        value.div_(world_size)

    model.set_requires_gradient_sync(False)
    for x in batches[:-1]:
        model(x).sum().backward()
    model.set_requires_gradient_sync(True)
    model(batches[-1]).sum().backward()
    for name, p in model.named_parameters():
        assert p.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad.full_tensor(), expected[name], rtol=0, atol=0, msg=name)


def _largest_dim(param: nn.Parameter) -> Shard:
    return Shard(param.shape.index(max(param.shape)))


def _train(model: nn.Module, rank: int, steps: int = 3) -> list[torch.Tensor]:
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(rank * 100 + step))
        optim.zero_grad()
        loss = model(x).sum()
        loss.backward()
        optim.step()
        losses.append(loss.detach())
    return losses


@pytest.mark.distributed(world_size=2)
def test_shard_placement_fn_shards_on_the_dim_it_returns_and_trains_alike(rank, process_group):
    """Weights sharded on their largest dim (1) show Shard(1) with contiguous local chunks of
    the right rows and train to the same numbers, bitwise, as dim-0 sharding and DDP's."""
    mesh = _mesh(process_group)

    def build() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 8))

    plain = build()
    by_dim = fully_shard(build(), mesh=mesh, shard_placement_fn=_largest_dim)
    by_rows = fully_shard(build(), mesh=mesh)
    ddp = nn.parallel.DistributedDataParallel(build(), process_group=process_group)
    for (name, p), q in zip(by_dim.named_parameters(), plain.parameters(), strict=True):
        dim = 1 if p.dim() == 2 else 0
        assert p.placements == (Shard(dim),), name
        assert p.to_local().is_contiguous(), name
        assert torch.equal(p.to_local(), q.detach().chunk(2, dim=dim)[rank]), name
        assert torch.equal(p.full_tensor(), q.detach()), name
    losses = _train(by_dim, rank)
    assert all(torch.equal(a, b) for a, b in zip(losses, _train(by_rows, rank), strict=True))
    _train(ddp, rank)
    for (name, p), q, r in zip(
        by_dim.named_parameters(), by_rows.parameters(), ddp.module.parameters(), strict=True
    ):
        assert torch.equal(p.full_tensor(), q.full_tensor()), name
        assert p.grad.placements == p.placements and p.grad.to_local().is_contiguous(), name
        torch.testing.assert_close(p.full_tensor(), r.detach(), msg=name)


@pytest.mark.distributed(world_size=2)
def test_shard_placement_fn_rules_are_fsdp2s(rank, process_group):
    """Negative dims count from the end; None means dim 0; a dim outside the tensor, an uneven
    split on dim > 0 and a non-Shard result raise with FSDP2's types, naming fully_shard."""
    mesh = _mesh(process_group)
    model = fully_shard(nn.Linear(4, 6), mesh=mesh, shard_placement_fn=lambda p: Shard(-1))
    assert model.weight.placements == (Shard(1),) and model.bias.placements == (Shard(0),)
    # fsdp_core.unit_views counts rows along the shard dim.
    weight, bias = unit_views(model)[0].params
    assert (weight.shard_dim, weight.padded_rows, weight.start_row) == (1, 2, 2 * rank)
    assert weight.local_shape == (6, 2) == tuple(model.weight.to_local().shape)
    assert weight.local_rows == 2 and weight.padding_numel == 0
    assert (bias.shard_dim, bias.local_shape) == (0, (3,))
    model = fully_shard(nn.Linear(4, 6), mesh=mesh, shard_placement_fn=lambda p: None)
    assert model.weight.placements == (Shard(0),)
    with pytest.raises(AssertionError, match=r"fully_shard: Shard dim 1 is invalid for 1D"):
        fully_shard(nn.Linear(4, 6), mesh=mesh, shard_placement_fn=lambda p: Shard(1))
    with pytest.raises(ValueError, match=r"Shard dim 1 is invalid for 1D tensor: bias"):
        fully_shard(nn.Linear(4, 6), mesh=mesh, shard_placement_fn=lambda p: Shard(1))
    with pytest.raises(NotImplementedError, match=r"uneven sharding on dim 1: weight"):
        fully_shard(nn.Linear(5, 6), mesh=mesh, shard_placement_fn=lambda p: Shard(p.dim() - 1))
    with pytest.raises(ValueError, match=r"invalid shard_placement_fn result 1 for weight"):
        fully_shard(nn.Linear(4, 6), mesh=mesh, shard_placement_fn=lambda p: 1)
    model = fully_shard(nn.Linear(4, 6), mesh=mesh, shard_placement_fn=lambda p: Shard(-1))
    with pytest.raises(NotImplementedError, match=r"\['<root> \(shard_placement_fn\)'\]"):
        trace_train_step(model, lambda m, x: m(x).sum(), (torch.randn(2, 4),))


class _Normed(nn.Module):
    """A root parameter computed from two sharded layers' weights after they are materialized
    (FSDP2's test_reset_sharded_param_in_lazy_init)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer1 = nn.Linear(4, 4, bias=False)
        self.layer2 = nn.Linear(4, 4, bias=False)
        self.scale = nn.Parameter(torch.empty(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer2(self.layer1(x)) * self.scale


@pytest.mark.distributed(world_size=2)
def test_parameters_replaced_after_sharding_are_adopted_at_lazy_init(rank, process_group):
    """Meta-device init, to_empty on the children, a root parameter assigned from their
    sharded weights and one loaded with load_state_dict(assign=True): the first forward adopts
    both (the objects the user holds stay the parameters) and training matches DDP's."""
    mesh = _mesh(process_group)
    torch.manual_seed(0)
    reference = _Normed()
    with torch.no_grad():
        reference.scale.copy_(reference.layer1.weight.norm(dim=1))
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(reference), process_group=process_group)
    with torch.device("meta"):
        model = _Normed()
    for module in (model.layer1, model.layer2, model):
        fully_shard(module, mesh=mesh)
    model.layer1.to_empty(device="cpu")
    model.layer2.to_empty(device="cpu")
    model.layer2.load_state_dict(
        {"weight": distribute_tensor(reference.layer2.weight.detach(), mesh, [Shard(0)])},
        assign=True,
    )
    with torch.no_grad():
        model.layer1.weight.copy_(
            distribute_tensor(reference.layer1.weight.detach(), mesh, [Shard(0)])
        )
        model.scale = nn.Parameter(model.layer1.weight.norm(dim=1))  # a DTensor, Shard(0)
    held = list(model.parameters())
    optim = torch.optim.SGD(held, lr=0.1)
    ddp_optim = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(2):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank * 10 + step))
        for m, o in ((model, optim), (ddp, ddp_optim)):
            o.zero_grad()
            m(x).sum().backward()
            o.step()
    assert [p is q for p, q in zip(held, model.parameters(), strict=True)] == [True] * 3
    for (name, p), q in zip(model.named_parameters(), ddp.module.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), q.detach(), msg=name)


@pytest.mark.distributed(world_size=2)
def test_training_on_meta_parameters_raises_naming_them(rank, process_group):
    """FSDP2's error, before any collective: the first unit still on meta, by full name."""
    mesh = _mesh(process_group)
    with torch.device("meta"):
        model = nn.Sequential(_mlp(), _mlp())
    for module in (model[0], model[1], model):
        fully_shard(module, mesh=mesh)
    model[1].to_empty(device="cpu")
    with pytest.raises(
        RuntimeError,
        match=r"fully_shard: FSDP parameters should be materialized from meta device before "
        r"training, but the following were still on meta device: \['0.0.weight', '0.0.bias', "
        r"'0.2.weight', '0.2.bias'\]",
    ):
        model(torch.randn(2, 8))


@pytest.mark.distributed(world_size=2)
def test_module_cast_to_another_dtype_after_sharding_trains_in_it(rank, process_group):
    """module.to(float64) after fully_shard: parameters, gradients and compute are float64 and
    the numbers match DDP's on a float64 copy."""
    mesh = _mesh(process_group)
    plain = _mlp()
    ddp = nn.parallel.DistributedDataParallel(
        copy.deepcopy(plain).to(torch.float64), process_group=process_group
    )
    fully_shard(plain[0], mesh=mesh)
    model = fully_shard(plain, mesh=mesh).to(torch.float64)
    for x in [
        torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    ]:
        model(x).sum().backward()
        ddp(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), ddp.module.parameters(), strict=True):
        assert p.dtype == p.to_local().dtype == p.grad.dtype == torch.float64, name
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, msg=name)


@pytest.mark.distributed(world_size=2)
def test_a_policy_naming_the_original_dtype_holds_after_a_cast(rank, process_group):
    """bf16 parameters under a bf16 policy, then module.to(float32): compute, gathers and
    reductions stay in bf16 (the policy named it), parameters and gradients become float32."""
    mesh = _mesh(process_group)
    model = nn.Sequential(*(nn.Linear(8, 8, dtype=torch.bfloat16) for _ in range(2)))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    for layer in model:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy).to(torch.float32)
    seen: list[events.Event] = []
    with events.subscribe(seen.append):
        out = model(torch.randn(4, 8))
        out.sum().backward()
    assert out.dtype == torch.bfloat16
    collectives = [e for e in seen if isinstance(e, events.Collective)]
    assert collectives and all(e.dtype == "bfloat16" for e in collectives)
    assert all(p.dtype == p.grad.dtype == torch.float32 for p in model.parameters())


@pytest.mark.distributed(world_size=2)
def test_state_dicts_reshard_a_unit_left_unsharded_by_forward(rank, process_group):
    """With reshard_after_forward=False a forward leaves the parameters unsharded; state_dict()
    reshards first and holds the same DTensor shards as before the forward, and a load after
    a forward writes into the shards (the next forward computes with the loaded values)."""
    mesh = _mesh(process_group)
    model = _mlp()
    fully_shard(model[0], mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    before = model.state_dict()
    x = torch.randn(2, 8)
    model(x)
    after = model.state_dict()
    assert before.keys() == after.keys()
    for key, value in after.items():
        assert isinstance(value, DTensor), key
        assert torch.equal(value.to_local(), before[key].to_local()), key
    zeros = {k: torch.zeros_like(v.full_tensor()) for k, v in before.items()}
    model(x)
    model.load_state_dict(zeros)
    assert torch.equal(model(x), torch.zeros(2, 8))


def test_mixed_precision_policy_takes_fsdp2s_positional_fields():
    policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32, torch.float16, False)
    assert policy == MixedPrecisionPolicy(
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
        output_dtype=torch.float16,
        cast_forward_inputs=False,
    )


@pytest.mark.distributed(world_size=4)
def test_mesh_and_parameter_errors_are_fsdp2s(rank, process_group):
    """A 2-D mesh without dim names (FSDP2: AssertionError), a 3-D mesh (ValueError with
    FSDP2's words) and a channels-last parameter (NotImplementedError), each naming fully_shard."""
    ranks = torch.tensor(dist.get_process_group_ranks(process_group))
    with pytest.raises(AssertionError, match=r"fully_shard: Please init the 2D mesh for HSDP"):
        fully_shard(_mlp(), mesh=DeviceMesh("cpu", ranks.view(2, 2)))
    with pytest.raises(ValueError, match=r"fully_shard expects a 1D or 2D DeviceMesh but got"):
        fully_shard(_mlp(), mesh=DeviceMesh("cpu", ranks.view(4, 1, 1)))
    conv = nn.Conv2d(4, 4, 3).to(memory_format=torch.channels_last)
    with pytest.raises(
        NotImplementedError,
        match=r"fully_shard: FSDP does not support non-contiguous parameters yet: \['weight",
    ):
        fully_shard(conv, mesh=_mesh(process_group))


@pytest.mark.distributed(world_size=4)
def test_tensor_parallel_parameters_shard_over_the_data_parallel_mesh(rank, process_group):
    """[Note: tensor-parallel parameters]: an MLP made tensor parallel over 'tp' and sharded
    over 'dp' shows FSDP2's 2-D placements, the original full values, and trains like its
    replicas averaged over 'dp'."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    from torch.distributed.tensor.placement_types import _StridedShard

    ranks = torch.tensor(dist.get_process_group_ranks(process_group)).view(2, 2)
    mesh = DeviceMesh("cpu", ranks, mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 8))
    reference = copy.deepcopy(model)
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    expected = {
        "0.weight": (_StridedShard(0, split_factor=2), Shard(0)),
        "0.bias": (_StridedShard(0, split_factor=2), Shard(0)),
        "2.weight": (Shard(0), Shard(1)),
        "2.bias": (Shard(0), Replicate()),
    }
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert p.device_mesh.mesh_dim_names == ("dp", "tp"), name
        assert tuple(p.placements) == expected[name], (name, p.placements)
        assert torch.equal(p.full_tensor(), q.detach()), name
    dp_group = mesh["dp"].get_group()
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(rank // 2))
    model(x).sum().backward()
    reference(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        grad = q.grad.clone()
        dist.all_reduce(grad, group=dp_group)
        torch.testing.assert_close(p.grad.full_tensor(), grad / 2, msg=name)
