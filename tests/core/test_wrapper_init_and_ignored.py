"""The wrapper's param_init_fn (meta-device init), ignored_modules/ignored_states and apply()."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp_core import FSDP, CPUOffload, events, unit_views
from fsdp_core.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy

from ._models import NestedModel, get_input
from ._parity import full_params

BLOCKS = ModuleWrapPolicy({nn.Sequential})


def _fill(module: nn.Module) -> None:
    """A deterministic init that does not depend on the order modules are visited in."""
    with torch.no_grad():
        for name, param in module.named_parameters(recurse=False):
            gen = torch.Generator().manual_seed(param.numel() * 10 + len(name))
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3)


def _names(model: nn.Module) -> dict[nn.Module, str]:
    return {m: name for name, m in model.named_modules()}


@pytest.mark.distributed(world_size=2)
def test_param_init_fn_materializes_meta_model_like_cpu(rank, process_group):
    """A model built on meta and materialized by ``param_init_fn`` equals the same model built
    on the CPU: same full parameters, same outputs and gradients after a step."""
    with torch.device("meta"):
        meta = NestedModel()
    names = _names(meta)
    called: list[str] = []

    def init(module: nn.Module) -> None:
        called.append(names[module])
        module.to_empty(device="cpu", recurse=False)
        _fill(module)

    model = FSDP(meta, process_group, auto_wrap_policy=BLOCKS, param_init_fn=init)
    # The nested unit materializes its subtree first, then the root the rest, breadth first.
    assert called == ["block", "block.0", "block.1", "block.2", "", "inp", "out"]
    ref = NestedModel()
    ref.apply(_fill)
    expected = dict(ref.named_parameters())
    got = full_params(model)
    assert sorted(got) == sorted(expected)
    for name, tensor in got.items():
        assert torch.equal(tensor, expected[name]), name
    x = get_input("nested", 0, 0)  # the same batch on every rank: the average is local
    out = model(x)
    assert torch.equal(out, ref(x))
    out.sum().backward()
    ref(x).sum().backward()
    with FSDP.summon_full_params(model, with_grads=True):
        for name, param in model.named_parameters():
            assert torch.equal(param.grad, expected[name].grad), name


@pytest.mark.distributed(world_size=2)
def test_meta_model_without_param_init_fn_uses_reset_parameters(rank, process_group):
    """Without ``param_init_fn``: ``to_empty`` on the CPU and ``reset_parameters()`` of each
    module holding parameters, breadth first, as torch's FSDP1 does."""
    with torch.device("meta"):
        meta = NestedModel()
    torch.manual_seed(3)
    model = FSDP(meta, process_group)
    ref = NestedModel()
    torch.manual_seed(3)
    for module in (ref.inp, ref.out, ref.block[0], ref.block[2]):  # breadth-first order
        module.reset_parameters()
    expected = dict(ref.named_parameters())
    for name, tensor in full_params(model).items():
        assert torch.equal(tensor, expected[name]), name


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.distributed(world_size=256, mode="fake")
def test_device_id_meta_keeps_a_meta_model_on_meta_for_planning(rank, world_size, offload):
    """``device_id="meta"``: no materialization; every tensor of the shards, the steps and the
    optimizer stays on meta (with offload, its shards and gradient copies too): sharding math
    and whole steps at 256 ranks allocate nothing."""
    with torch.device("meta"):
        meta = NestedModel()
    model = FSDP(
        meta,
        auto_wrap_policy=BLOCKS,
        device_id="meta",
        cpu_offload=CPUOffload(offload_params=offload),
    )
    optim = torch.optim.Adam(model.parameters())
    copies: list[events.Event] = []
    with events.subscribe(copies.append):
        for _ in range(2):
            model(torch.empty(4, 8, device="meta")).sum().backward()
            optim.step()
    assert all(p.is_meta and p.grad is not None and p.grad.is_meta for p in model.parameters())
    state = [t for s in optim.state.values() for t in s.values()]
    assert state and all(t.is_meta for t in state if t.dim())
    # The offload copies are made (and published) as on a CPU run.
    made = [e for e in copies if isinstance(e, events.OffloadCopy)]
    assert bool(made) is offload
    assert {str(view.compute_device) for view in unit_views(model)} == {"meta"}


class _NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 2))


@pytest.mark.distributed(world_size=2)
def test_param_init_fn_errors(rank, process_group):
    """A non-callable, an init that leaves meta tensors, a module without reset_parameters."""
    with torch.device("meta"):
        meta = NestedModel()
    with pytest.raises(TypeError, match="param_init_fn takes a callable"):
        FSDP(meta, process_group, param_init_fn="reset")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"\['inp.weight', 'inp.bias', 'out.weight'"):
        FSDP(meta, process_group, param_init_fn=lambda m: None)
    with torch.device("meta"):
        bare = _NoReset()
    with pytest.raises(ValueError, match="_NoReset is on the meta device and has no reset_para"):
        FSDP(bare, process_group)


def _as_buffers(model: nn.Module, modules: list[nn.Module]) -> None:
    """Turn the parameters of ``modules`` into buffers: the same forward, nothing to shard."""
    for module in modules:
        for name, param in list(module.named_parameters(recurse=False)):
            del module._parameters[name]
            module.register_buffer(name, param.detach().clone())


def _collectives(model: nn.Module, x: torch.Tensor, rank: int) -> list[tuple]:
    seen: list[events.Event] = []
    with events.subscribe(seen.append):
        model(x).sum().backward()
    return [
        (e.op, e.bytes, e.shapes, e.unit)
        for e in seen
        if isinstance(e, events.Collective) and e.rank == rank
    ]


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("form", ["ignored_modules", "ignored_states_modules", "params"])
def test_ignored_parameters_stay_local_and_unmanaged(rank, process_group, form):
    """Ignored parameters are in no unit, stay the same full local tensors, get local
    (unreduced) gradients, and the collectives are those of the managed parameters only."""
    torch.manual_seed(0)
    plain = NestedModel()
    ref = copy.deepcopy(plain)
    ignored = [plain.out, plain.block[0]]
    kwargs: dict[str, object] = {
        "ignored_modules": {"ignored_modules": ignored},
        "ignored_states_modules": {"ignored_states": ignored},
        "params": {"ignored_states": [p for m in ignored for p in m.parameters()]},
    }[form]
    kept = {n: p for n, p in plain.named_parameters() if n.startswith(("out.", "block.0."))}
    model = FSDP(plain, process_group, auto_wrap_policy=BLOCKS, **kwargs)  # type: ignore[arg-type]
    owned = [p.fqn for fsdp in FSDP.fsdp_modules(model) for p in fsdp._unit.params]
    assert owned == ["inp.weight", "inp.bias", "2.weight", "2.bias"]  # root, then block
    current = dict(model.named_parameters())
    for name, param in kept.items():
        assert current[name] is param and torch.equal(param, ref.get_parameter(name)), name

    # The collectives equal those of the same model whose ignored parameters are buffers.
    without = copy.deepcopy(ref)
    _as_buffers(without, [without.out, without.block[0]])
    baseline = FSDP(without, process_group, auto_wrap_policy=BLOCKS)
    x = get_input("nested", rank, 0)  # a different batch per rank
    got = _collectives(model, x, rank)
    assert got and got == _collectives(baseline, x, rank)

    ref(x).sum().backward()
    grads = [torch.empty_like(kept["out.weight"].grad) for _ in range(2)]
    dist.all_gather(grads, kept["out.weight"].grad, group=process_group)
    assert not torch.equal(grads[0], grads[1])  # not averaged across ranks
    for name, param in kept.items():
        assert torch.equal(param.grad, ref.get_parameter(name).grad), name


@pytest.mark.distributed(world_size=2)
def test_size_based_auto_wrap_leaves_ignored_parameters_out_of_the_count(rank, process_group):
    """As torch's recursive wrap: nonwrapped_numel counts only what FSDP will shard, so a
    child whose parameters are mostly ignored falls under the threshold and stays unwrapped."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10))  # 110 parameters each
    policy = functools.partial(size_based_auto_wrap_policy, min_num_params=50)
    model = FSDP(plain, process_group, auto_wrap_policy=policy, ignored_states=[plain[0].weight])
    wrapped = [name for name, m in model.named_modules() if isinstance(m, FSDP) and name]
    assert wrapped == ["_fsdp_wrapped_module.1"]  # child 0 counts its 10-element bias only


@pytest.mark.distributed(world_size=2)
def test_ignored_argument_errors(rank, process_group):
    """Both arguments, mixed kinds, an FSDP instance: errors naming the fix."""
    model = NestedModel()
    with pytest.raises(ValueError, match="Cannot pass both ignored_modules and ignored_states"):
        FSDP(model, process_group, ignored_modules=[model.out], ignored_states=[model.inp])
    # torch's FSDP1 types and words (its test_fsdp_ignored_modules matches them).
    with pytest.raises(
        ValueError,
        match=r"FullyShardedDataParallel: ignored_states expects all nn.Parameter or all "
        r"nn.Module list elements but got types \[<class 'torch.nn.modules.linear.Linear'>, "
        r"<class 'torch.nn.parameter.Parameter'>\]",
    ):
        FSDP(model, process_group, ignored_states=[model.out, model.inp.weight])
    with pytest.raises(
        ValueError,
        match=r"FullyShardedDataParallel: ignored_modules expects nn.Module list elements but got "
        r"types \[<class 'torch.nn.parameter.Parameter'>\]",
    ):
        FSDP(model, process_group, ignored_modules=[model.inp.weight])
    inner = FSDP(nn.Linear(2, 2), process_group)
    with pytest.raises(ValueError, match="must not be FSDP instances"):
        FSDP(nn.Sequential(inner), process_group, ignored_modules=[inner])


@pytest.mark.distributed(world_size=2)
def test_apply_runs_on_full_parameters_and_writes_back(rank, world_size, process_group):
    """``apply(fn)`` shows ``fn`` the full parameters of every unit and keeps its changes."""
    model = FSDP(NestedModel(), process_group, auto_wrap_policy=BLOCKS)
    shapes: dict[str, tuple[int, ...]] = {}

    def init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            shapes[f"{module.in_features}->{module.out_features}"] = tuple(module.weight.shape)
            with torch.no_grad():
                module.weight.copy_(torch.arange(module.weight.numel()).view_as(module.weight))

    assert model.apply(init) is model
    assert shapes == {"8->4": (4, 8), "4->16": (16, 4), "16->16": (16, 16), "16->8": (8, 16)}
    for name, tensor in full_params(model).items():
        if name.endswith("weight"):
            assert torch.equal(tensor, torch.arange(tensor.numel()).view_as(tensor).float()), name
    # Each rank's shard holds its rows of the written values.
    rows = -(-16 // world_size)
    expected = torch.arange(256.0).view(16, 16)[rank * rows : (rank + 1) * rows]
    assert torch.equal(model.block[2].weight.to_local(), expected)


@pytest.mark.distributed(world_size=2)
def test_apply_inside_summon_full_params_raises(rank, process_group):
    """apply gathers itself: inside summon_full_params of the same instance it is refused."""
    model = FSDP(NestedModel(), process_group, auto_wrap_policy=BLOCKS)
    with FSDP.summon_full_params(model):
        # torch's type and words (its test_apply_in_summon_raises_error matches them).
        with pytest.raises(ValueError, match="inside summon_full_params of the same instance"):
            model.apply(lambda m: None)
        with pytest.raises(ValueError, match="expected to be in states"):
            model.apply(lambda m: None)
        with pytest.raises(ValueError, match="wrapping Sequential was called inside summon"):
            model.block.apply(lambda m: None)
    model.apply(lambda m: None)  # outside, it runs
