"""fsdp_core's ``replicate``: whole parameters with all-reduced gradients (DDP semantics),
nested inside ``fully_shard`` or alone; parity with DDP, its collectives, state dicts and its
answers to bad input."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from fsdp_core import (
    FSDP,
    FSDPModule,
    MixedPrecision,
    MixedPrecisionPolicy,
    fully_shard,
    replicate,
)
from fsdp_core._runtime import states_in
from fsdp_testing.parity import check_sharded_parity
from fsdp_testing.recording import record_fsdp

from ._models import NestedModel, build
from ._parity import FP32_TOLERANCE, assert_same, assert_same_losses, precision_reference
from .test_fully_shard import train

LR = 0.05

Layout = Callable[[nn.Sequential, DeviceMesh], nn.Module]


def _mesh(group: dist.ProcessGroup) -> DeviceMesh:
    return DeviceMesh.from_group(group, "cpu")


def _stack() -> nn.Sequential:
    """Linear layers "0", "2", "4", "6" with ReLUs between, seeded alike on all ranks."""
    torch.manual_seed(0)
    rows = (8, 16, 12, 16, 4)
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(itertools.pairwise(rows)):
        layers += [nn.Linear(n_in, n_out)] + ([nn.ReLU()] if i < len(rows) - 2 else [])
    return nn.Sequential(*layers)


def _inside_fully_shard(model: nn.Sequential, mesh: DeviceMesh) -> nn.Module:
    """Layer "2" replicated, "0" and "4" sharded, the root shards "6"."""
    replicate(model[2], mesh=mesh)
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[4], mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _alone(model: nn.Sequential, mesh: DeviceMesh) -> nn.Module:
    return replicate(model, mesh=mesh)


def _over_fully_shard(model: nn.Sequential, mesh: DeviceMesh) -> nn.Module:
    """A replicated root ("0", "2", "6") over sharded "4"."""
    fully_shard(model[4], mesh=mesh)
    return replicate(model, mesh=mesh)


LAYOUTS: dict[str, Layout] = {
    "inside_fully_shard": _inside_fully_shard,
    "alone": _alone,
    "over_fully_shard": _over_fully_shard,
}


def _batch(rank: int, step: int, micro: int) -> torch.Tensor:
    return torch.randn(
        4, 8, generator=torch.Generator().manual_seed(100 * step + 10 * micro + rank)
    )


def _full(param: torch.Tensor) -> torch.Tensor:
    return (param.full_tensor() if isinstance(param, DTensor) else param).detach()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.distributed(world_size=[2, 4])
def test_parity_with_ddp_with_gradient_accumulation(layout, rank, world_size, process_group):
    """Three steps of three micro-batches each, the first two with
    set_requires_gradient_sync(False) (DDP: no_sync): the losses and the full parameters equal
    DDP's (bitwise at two ranks), and the replicated parameters stay Replicate() DTensors."""
    plain = _stack()
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(plain), process_group=process_group)
    model = LAYOUTS[layout](plain, _mesh(process_group))
    assert isinstance(model, FSDPModule)
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    # Four ranks sum in another order than DDP's one bucket: fp32 rounding.
    tol = {"rtol": 0.0, "atol": 0.0} if world_size == 2 else FP32_TOLERANCE._asdict()
    for step in range(3):
        for micro in range(3):
            x = _batch(rank, step, micro)
            sync = micro == 2
            model.set_requires_gradient_sync(sync)
            loss = model(x).pow(2).mean()
            loss.backward()
            if sync:
                ref = ddp(x).pow(2).mean()
                ref.backward()
            else:
                with ddp.no_sync():
                    ref = ddp(x).pow(2).mean()
                    ref.backward()
            torch.testing.assert_close(loss, ref, msg=f"{layout} step {step}.{micro}", **tol)
        for optim in (opt, ddp_opt):
            optim.step()
            optim.zero_grad()
    for (name, p), (q_name, q) in zip(
        ddp.module.named_parameters(), model.named_parameters(), strict=True
    ):
        assert q_name == name
        torch.testing.assert_close(_full(q), p.detach(), msg=f"{layout} {name}", **tol)
    placements = {n: q.placements for n, q in model.named_parameters()}  # type: ignore[union-attr]
    replicated = {n for n, pl in placements.items() if pl == (Replicate(),)}
    expected = {
        "inside_fully_shard": {"2.weight", "2.bias"},
        "alone": set(placements),
        "over_fully_shard": set(placements) - {"4.weight", "4.bias"},
    }[layout]
    assert replicated == expected, placements
    assert all(pl == (Shard(0),) for n, pl in placements.items() if n not in replicated)


@pytest.mark.distributed(world_size=2)
def test_the_unit_structure_and_the_class(rank, process_group):
    """replicate's parameters stay out of the enclosing fully_shard unit; the module is a
    Replicate<Cls>, an FSDPModule and its class; ignored parameters stay plain; a nested
    replicate leaves set_reshard_after_forward of the root usable."""
    mesh = _mesh(process_group)
    model = NestedModel()
    ignored = model.block[2].bias
    replicate(model.block, mesh=mesh, ignored_params={ignored})
    fully_shard(model, mesh=mesh)
    assert type(model.block).__name__ == "ReplicateSequential"
    assert isinstance(model.block, FSDPModule) and isinstance(model.block, nn.Sequential)
    assert type(model).__name__ == "FSDPNestedModel"
    names = {id(m): n for n, m in model.named_modules()}
    units = {
        names[id(s.owner)]: ([p.fqn for p in s.unit.params], s.unit.shard_world)
        for s in states_in(model)
        if s.unit is not None
    }
    assert units == {
        "": (["inp.weight", "inp.bias", "out.weight", "out.bias"], 2),
        "block": (["0.weight", "0.bias", "2.weight"], 1),  # whole on each of the 2 ranks
    }
    assert not isinstance(model.block[2].bias, DTensor)
    block_weight = model.block[0].weight
    assert isinstance(block_weight, DTensor) and block_weight.placements == (Replicate(),)
    assert block_weight.to_local().shape == (16, 4)  # whole on every rank
    model.set_reshard_after_forward(2)  # the shard world; replicate leaves its value alone
    block_state = model.block._get_fsdp_state()
    assert block_state.config.reshard_after_forward is False
    assert model._get_fsdp_state().config.reshard_after_forward is True


@pytest.mark.distributed(world_size=2)
def test_collectives_one_all_reduce_per_backward_and_no_all_gather(rank, process_group):
    """Per synced backward the replicated unit all-reduces its gradients once (the sharded
    units reduce-scatter once each) and never all-gathers; with the gradient sync off it sends
    nothing; its parameters stay whole and plain from forward to the end of backward."""
    model = _inside_fully_shard(_stack(), _mesh(process_group))
    x = _batch(rank, 0, 0)
    with record_fsdp(model, engine="fsdp_core_fully_shard") as rec:
        for step in range(3):
            model.set_requires_gradient_sync(step != 1)
            out = model(x)
            weight = model[2].weight
            assert not isinstance(weight, DTensor) and weight.shape == (12, 16)
            out.pow(2).mean().backward()
            assert isinstance(model[2].weight, DTensor)
            rec.next_step()
    for step in range(3):
        rec.assert_count("all_gather", 0, step=step, unit="2")
        rec.assert_count("reduce_scatter", 0, step=step, unit="2")
        rec.assert_count("all_reduce", 0 if step == 1 else 1, step=step, unit="2")
    rec.assert_count("reduce_scatter", 3, step=2)  # "0", "4" and the root
    rec.assert_count("all_reduce", 1, step=2)
    reduced = rec.collectives("all_reduce", step=2, unit="2")[0]
    numel = 12 * 16 + 12
    assert reduced.bytes >= numel * 4, reduced  # every gradient element, plus the order tag
    assert not rec.collectives("all_gather", unit="2")


@pytest.mark.distributed(world_size=2)
def test_state_dict_round_trip_and_optimizer(rank, process_group):
    """state_dict() gives Replicate() DTensors (whole locally) next to Shard(0) ones under
    the original names; load_state_dict takes full tensors or DTensors; an optimizer built on
    the parameters steps them; check_sharded_parity holds against a DDP reference."""
    plain = _stack()
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(plain), process_group=process_group)
    model = _inside_fully_shard(plain, _mesh(process_group))
    state = model.state_dict()
    assert list(state) == list(_stack().state_dict())
    assert state["2.weight"].placements == (Replicate(),)
    assert state["2.weight"].to_local().shape == (12, 16)
    assert state["0.weight"].placements == (Shard(0),)
    # As for a plain module, state_dict() values alias the parameters (Replicate() ones too):
    # copies keep the values from before the step.
    full = {k: v.full_tensor().clone() for k, v in state.items()}
    saved = {k: v.clone() for k, v in state.items()}

    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    for net in (model, ddp):
        net(_batch(rank, 0, 0)).pow(2).mean().backward()
    check_sharded_parity(ddp.module, model)  # parameters and gradients, rank by rank
    opt.step()
    ddp_opt.step()
    check_sharded_parity(ddp.module, model)
    stepped = {k: v.full_tensor() for k, v in model.state_dict().items()}
    assert not torch.equal(stepped["2.weight"], full["2.weight"])

    model.load_state_dict(full)  # full tensors
    for key, value in model.state_dict().items():
        assert torch.equal(value.full_tensor(), full[key]), key
    model.load_state_dict({k: torch.zeros_like(v) for k, v in full.items()})
    assert all(v.full_tensor().abs().sum() == 0 for v in model.state_dict().values())
    model.load_state_dict(saved)  # DTensors
    for key, value in model.state_dict().items():
        assert torch.equal(value.full_tensor(), full[key]), key
    # The unit computes with what was loaded: the same loss as the plain model.
    x = _batch(rank, 1, 0)
    torch.testing.assert_close(model(x), _stack()(x), rtol=0, atol=0)


@pytest.mark.distributed(world_size=2)
def test_mixed_precision_matches_the_precision_reference(rank, process_group):
    """bf16 compute with fp32 reduction on a replicated block inside a sharded root trains like
    the library's precision reference, bitwise at two ranks."""
    policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    ref_losses, ref_params = precision_reference(
        "nested", build("nested", rank), rank, process_group, policy
    )
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mesh = _mesh(process_group)
    model = build("nested", rank)
    replicate(model.block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    losses, params = train(model, "nested", rank, policy=policy)
    assert all(loss.dtype == torch.bfloat16 for loss in losses)
    assert_same_losses(losses, ref_losses, what="replicate bf16", tolerance=None)
    assert_same(params, ref_params, what="replicate bf16", tolerance=None)


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


@pytest.mark.distributed(world_size=2)
def test_bad_input_raises_naming_the_value_and_the_fix(rank, process_group):
    """Twice on one module, after or before fully_shard on it, top-down under fully_shard or
    replicate, a wrapper-door module or one inside, a 2-D mesh, wrong policy, mesh or
    ignored_params types, scalar parameters."""
    mesh = _mesh(process_group)

    model = NestedModel()
    replicate(model.block, mesh=mesh)
    with pytest.raises(
        ValueError,
        match=r"replicate was already applied to ReplicateSequential: each module is "
        r"replicated once\. Apply replicate bottom-up",
    ):
        replicate(model.block, mesh=mesh)
    with pytest.raises(
        ValueError,
        match=r"fully_shard\(ReplicateSequential\): replicate was already applied to this "
        r"module.*Keep one of the two calls",
    ):
        fully_shard(model.block, mesh=mesh)
    model = NestedModel()
    fully_shard(model.block, mesh=mesh)
    with pytest.raises(
        ValueError, match=r"replicate\(FSDPSequential\): fully_shard was already applied"
    ):
        replicate(model.block, mesh=mesh)

    block_params = r"\['0.weight', '0.bias', '2.weight', '2.bias'\]"
    model = NestedModel()
    fully_shard(model, mesh=mesh)
    with pytest.raises(
        ValueError,
        match=rf"replicate\(Sequential\) was applied top-down: its parameters {block_params} "
        r"are already sharded by fully_shard on an enclosing module.*Apply replicate bottom-up",
    ):
        replicate(model.block, mesh=mesh)
    model = NestedModel()
    replicate(model, mesh=mesh)
    for api in (replicate, fully_shard):
        with pytest.raises(
            ValueError,
            match=rf"{api.__name__}\(Sequential\) was applied top-down: its parameters "
            rf"{block_params} are already replicated by replicate on an enclosing module",
        ):
            api(model.block, mesh=mesh)

    with pytest.raises(
        ValueError,
        match=r"replicate got a FullyShardedDataParallel instance \(wrapping Sequential\): "
        r"the two doors do not nest\. Apply replicate to the plain module",
    ):
        replicate(FSDP(NestedModel().block, process_group), mesh=mesh)
    model = NestedModel()
    model.block = FSDP(model.block, process_group)
    with pytest.raises(
        ValueError,
        match=r"replicate\(NestedModel\) contains FullyShardedDataParallel instances "
        r"\['block'\].*do not nest",
    ):
        replicate(model, mesh=mesh)

    with pytest.raises(TypeError, match=r"replicate takes an nn.Module.*got 'block'"):
        replicate("block", mesh=mesh)  # type: ignore[type-var]
    ranks = torch.tensor(dist.get_process_group_ranks(process_group)).view(1, -1)
    with pytest.raises(ValueError, match=r"mesh must be 1-D, got a 2-D mesh.*dp_mesh_dims"):
        replicate(NestedModel(), mesh=DeviceMesh("cpu", ranks))
    with pytest.raises(TypeError, match=r"replicate: mesh takes a DeviceMesh or None, got 2"):
        replicate(NestedModel(), mesh=2)
    with pytest.raises(TypeError, match=r"replicate: mp_policy takes a MixedPrecisionPolicy"):
        replicate(NestedModel(), mesh=mesh, mp_policy=MixedPrecision())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"replicate: offload_policy takes OffloadPolicy\(\)"):
        replicate(NestedModel(), mesh=mesh, offload_policy=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"replicate: ignored_params takes nn.Parameters"):
        replicate(NestedModel(), mesh=mesh, ignored_params={torch.zeros(1)})  # type: ignore[arg-type]
    with pytest.raises(
        ValueError,
        match=r"replicate doesn't support scalar parameters \['scale'\].*Change scale to a 1D "
        r"tensor with numel equal to 1",
    ):
        replicate(_Scaled(), mesh=mesh)
    # Nothing above left a state behind on the modules it refused.
    refused = NestedModel()
    with pytest.raises(ValueError):
        replicate(refused, mesh=DeviceMesh("cpu", ranks))
    assert not isinstance(refused, FSDPModule)
    assert replicate(refused, mesh=mesh) is refused


class _TiedLM(nn.Module):
    """Embedding -> Linear -> output projection (with a bias) whose weight is the embedding's."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(11, 6)
        self.hidden = nn.Linear(6, 6)
        self.proj = nn.Linear(6, 11)
        self.proj.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.tanh(self.hidden(self.embed(tokens))))


@pytest.mark.distributed(world_size=2)
def test_a_weight_tied_out_of_the_replicated_module_moves_to_the_root(rank, process_group):
    """proj is replicated but shares its weight with embed: fully_shard on the root takes the
    weight out of proj's unit (which keeps its bias, replicated) and shards it; training
    equals DDP bitwise."""
    mesh = _mesh(process_group)
    plain = _TiedLM()
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(plain), process_group=process_group)
    replicate(plain.proj, mesh=mesh)
    fully_shard(plain.hidden, mesh=mesh)
    model = fully_shard(plain, mesh=mesh)
    names = {id(m): n for n, m in model.named_modules()}
    units = {
        names[id(s.owner)]: [p.fqn for p in s.unit.params] if s.unit else []
        for s in states_in(model)
    }
    assert units == {"": ["embed.weight"], "hidden": ["weight", "bias"], "proj": ["bias"]}
    assert model.proj.weight is model.embed.weight
    assert model.embed.weight.placements == (Shard(0),)
    assert model.proj.bias.placements == (Replicate(),)
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(3):
        tokens = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(rank + step))
        for net, optim in ((ddp, ddp_opt), (model, opt)):
            net(tokens).logsumexp(-1).mean().backward()
            optim.step()
            optim.zero_grad()
    for (name, p), (_, q) in zip(
        ddp.module.named_parameters(), model.named_parameters(), strict=True
    ):
        torch.testing.assert_close(_full(q), p.detach(), rtol=0, atol=0, msg=name)


@pytest.mark.distributed(world_size=2)
def test_a_replicated_unit_does_not_hold_back_backward_prefetch(rank, process_group):
    # limit_all_gathers skips a prefetch while two non-root units are gathered. A replicated
    # unit holds its full parameters from its forward to the end of backward, but it was never
    # gathered (nothing to limit), so it must not count.
    from fsdp_core import events

    mesh = _mesh(process_group)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    replicate(model[0], mesh=mesh)
    for block in model[1:]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model(torch.ones(2, 4)).sum().backward()  # first iteration: the order is recorded
    seen: list[events.Event] = []
    with events.subscribe(seen.append):
        model(torch.ones(2, 4)).sum().backward()
    unshards = [(e.unit, e.reason) for e in seen if isinstance(e, events.Unshard)]
    # Backward runs 3, 2, 1, then the replicated 0: while 3 computes, 2 is prefetched, and
    # while 2 computes, 1; only 3 was gathered by backward itself.
    backward = [u for u in unshards if u[1] != "forward"]
    assert backward == [("3", "backward"), ("2", "backward_prefetch"), ("1", "backward_prefetch")]
