"""The FSDP2 names fsdp_core's door gained to match torch 2.15 (issue 42): manual backward
finalization, ``set_keep_unsharded_storage``, ``set_reduce_scatter_unused_params``,
``set_separate_reduce_scatter_group``, ``set_symm_mem_for_comm``, the deprecated
``set_reduce_scatter_divide_factor``, ``MixedPrecisionPolicy.param_dtype_override_fn``, the
``reduce_dtype=None`` rule of the installed torch, ``replicate`` of a list and with
``dp_mesh_dims``, and the policies' positional arguments. Each behaviour as torch's own tests
of it check it (test_fully_shard_training, _mixed_precision, _comm, test_replicate_*)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.nn.parallel import DistributedDataParallel as DDP

from fsdp_core import (
    CPUOffloadPolicy,
    DataParallelMeshDims,
    FSDPModule,
    GradientReductionHandle,
    MixedPrecisionPolicy,
    fully_shard,
    replicate,
)
from fsdp_core._collectives import _REDUCE_SCATTER
from fsdp_core._composable._api import reduce_follows_grad_dtype
from fsdp_core._runtime import states_in
from fsdp_testing.recording import record_fsdp

from ._spmd import on_spmd_mesh


def _mesh(group: dist.ProcessGroup) -> DeviceMesh:
    return DeviceMesh.from_group(group, "cpu")


def _stack(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 4)
    )


def _shard_stack(model: nn.Sequential, mesh: DeviceMesh, **kw) -> nn.Sequential:
    fully_shard(model[0], mesh=mesh, **kw)
    fully_shard(model[2], mesh=mesh, **kw)
    return fully_shard(model, mesh=mesh, **kw)


def _batch(rank: int, i: int = 0) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * rank + i))


def _full_grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    out: dict[str, torch.Tensor | None] = {}
    for name, p in model.named_parameters():
        grad = p.grad
        out[name] = grad.full_tensor() if isinstance(grad, DTensor) else grad
    return out


def _ddp_grads(model: nn.Module, batches: list[torch.Tensor], group, **kw) -> dict:
    ddp = DDP(model, process_group=group, **kw)
    for x in batches:
        ddp(x).sum().backward()
    return {n.removeprefix("module."): p.grad for n, p in ddp.named_parameters()}


def _assert_grads(ours: dict, ref: dict, *, exact: bool = False) -> None:
    assert ours.keys() == ref.keys()
    for name, grad in ours.items():
        assert grad is not None, name
        if exact:
            assert torch.equal(grad, ref[name]), name
        else:  # DDP sums in buckets, FSDP per unit: the order of float additions differs
            torch.testing.assert_close(grad, ref[name], rtol=1e-5, atol=1e-6, msg=name)


# ---------------------------------------------------------------------- manual finalization
@pytest.mark.distributed(world_size=2)
def test_manual_finalization_reduces_accumulated_gradients(rank, process_group):
    """As a pipeline stage: backwards with sync off reduce nothing; with sync back on,
    ``finalize_backward(async_op=True)`` reduces the sum and the handle's ``wait`` ends the
    iteration; the gradients equal DDP's over the same micro-batches, for two steps."""
    batches = [_batch(rank, i) for i in range(3)]
    ref = _ddp_grads(_stack(), batches, process_group)
    model = _shard_stack(_stack(), _mesh(process_group))
    model.set_manual_backward_finalization(True)
    for _ in range(2):
        model.zero_grad()
        model.set_requires_gradient_sync(False)
        for x in batches:
            model(x).sum().backward()
        assert all(p.grad is None for p in model.parameters())  # nothing reduced yet
        model.set_requires_gradient_sync(True)
        handle = model.finalize_backward(async_op=True)
        assert isinstance(handle, GradientReductionHandle)
        handle.wait()
        _assert_grads(_full_grads(model), ref)
    for state in states_in(model):
        assert state.unit is not None and not state.unit.is_unsharded


@pytest.mark.distributed(world_size=2)
def test_manual_finalization_matches_automatic(rank, process_group):
    """One backward with sync on, then ``finalize_backward()``: the same gradients, bit for
    bit, as the automatic end of backward."""
    x = _batch(rank)
    auto = _shard_stack(_stack(), _mesh(process_group))
    auto(x).sum().backward()
    manual = _shard_stack(_stack(), _mesh(process_group))
    manual.set_manual_backward_finalization(True)
    manual(x).sum().backward()
    assert manual.finalize_backward() is None
    _assert_grads(_full_grads(manual), _full_grads(auto), exact=True)


@pytest.mark.parametrize("manual", [False, True])
@pytest.mark.distributed(world_size=2)
def test_manual_finalization_leaves_the_rest_to_finalize(manual, rank, process_group):
    """A unit whose gradients are not all ready when backward ends (an expert rank 1 sends
    nothing to) is reduced by the automatic end of backward, but under manual finalization
    only by ``finalize_backward()``, which also waits for the reductions in flight; the
    gradients are then the same."""
    x = _batch(rank)
    ref = _ddp_grads(_Moe(), [x], process_group, find_unused_parameters=True)
    mesh = _mesh(process_group)
    model = _Moe()
    fully_shard(model.experts, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.set_manual_backward_finalization(manual)
    model(x).sum().backward()
    left = model.experts.a.weight.grad is None
    if rank == 1 or not manual:  # rank 0's reduction may be in flight until finalization
        assert left == manual
    if manual:
        model.finalize_backward()
    _assert_grads(
        _full_grads_of(model, skip="experts.b"),
        {n: g for n, g in ref.items() if not n.startswith("experts.b")},
    )


def _full_grads_of(model: nn.Module, *, skip: str) -> dict[str, torch.Tensor | None]:
    """As ``_full_grads``, leaving out the parameters named ``skip...`` (before any
    collective: their ``.grad`` may be set on one rank only)."""
    out: dict[str, torch.Tensor | None] = {}
    for name, p in model.named_parameters():
        if not name.startswith(skip):
            grad = p.grad
            out[name] = grad.full_tensor() if isinstance(grad, DTensor) else grad
    return out


@pytest.mark.distributed(world_size=2)
def test_manual_finalization_misuse_raises(rank, process_group):
    """torch's errors: finalize without the mode, on a non-root, with a handle pending, a
    forward with a handle pending, a mode change after backward started or on a non-root; a
    handle invalidated by ``reset_iter_state``; a no-op before the first forward."""
    mesh = _mesh(process_group)
    model = _shard_stack(_stack(), mesh)
    assert model.finalize_backward() is None  # before the first forward: nothing to do
    assert isinstance(model.finalize_backward(async_op=True), GradientReductionHandle)
    model(_batch(rank)).sum().backward()
    with pytest.raises(RuntimeError, match="requires manual backward finalization"):
        model.finalize_backward()
    with pytest.raises(RuntimeError, match="must be called on the root"):
        model[0].set_manual_backward_finalization(True)

    model.set_manual_backward_finalization(True)
    model(_batch(rank)).sum().backward()
    with pytest.raises(RuntimeError, match="cannot change mode after backward starts"):
        model.set_manual_backward_finalization(False)
    with pytest.raises(RuntimeError, match="finalize_backward must be called on the root"):
        model[0].finalize_backward()
    handle = model.finalize_backward(async_op=True)
    with pytest.raises(RuntimeError, match="must be waited on before finalizing"):
        model.finalize_backward()
    with pytest.raises(RuntimeError, match="must be waited on before forward"):
        model(_batch(rank))
    model.reset_iter_state()
    with pytest.raises(RuntimeError, match="invalidated"):
        handle.wait()
    model(_batch(rank)).sum().backward()  # usable again
    model.finalize_backward()

    nested = _stack()
    _shard_stack(nested, mesh)
    nested[0].set_manual_backward_finalization(True)  # before lazy init: not yet known
    with pytest.raises(RuntimeError, match="must be called on the root FSDP module"):
        nested(_batch(rank))


# ---------------------------------------------------------------------- unsharded storage
@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.distributed(world_size=2)
def test_keep_unsharded_storage(keep, rank, process_group):
    """With ``set_keep_unsharded_storage(True)`` a reshard keeps the unsharded storage, so
    the next unshard writes into the same memory; by default it is freed."""
    model = _shard_stack(_stack(), _mesh(process_group))
    model.set_keep_unsharded_storage(keep)
    model[0].unshard()
    weight = model[0].weight
    assert not isinstance(weight, DTensor)
    pointer, nbytes = weight.untyped_storage().data_ptr(), weight.untyped_storage().nbytes()
    model[0].reshard()
    assert isinstance(model[0].weight, DTensor)
    assert weight.untyped_storage().nbytes() == (nbytes if keep else 0)
    model[0].unshard()
    assert model[0].weight is weight
    assert (weight.untyped_storage().data_ptr() == pointer) or not keep
    model[0].reshard()
    model(_batch(rank)).sum().backward()  # and trains as before
    assert model[0].weight.grad is not None


# ---------------------------------------------------------------------- unused parameters
class _Experts(nn.Module):
    """Two experts in one unit; rank 1 sends nothing to the second."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.a(x)
        if dist.get_rank() == 0:
            out = out + self.b(x)
        return out


class _Moe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.experts = _Experts()
        self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.experts(x))


@pytest.mark.parametrize("unused", [False, True])
@pytest.mark.distributed(world_size=2)
def test_reduce_scatter_unused_params(unused, rank, process_group):
    """With ``set_reduce_scatter_unused_params(True)`` a parameter no gradient reached on
    this rank takes part with zeros: every rank gets its ``.grad``, DDP's with
    ``find_unused_parameters``; without it, that rank's ``.grad`` stays ``None``."""
    x = _batch(rank)
    ref = _ddp_grads(_Moe(), [x], process_group, find_unused_parameters=True)
    mesh = _mesh(process_group)
    model = _Moe()
    fully_shard(model.experts, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.set_reduce_scatter_unused_params(unused)
    model(x).sum().backward()
    if not unused:
        unreached = [n for n, p in model.named_parameters() if p.grad is None]
        assert unreached == ([] if rank == 0 else ["experts.b.weight", "experts.b.bias"])
        return
    _assert_grads(_full_grads(model), ref)


# ---------------------------------------------------------------------- reduce-scatter group
@pytest.mark.distributed(world_size=2)
def test_separate_reduce_scatter_group(rank, process_group, monkeypatch):
    """``set_separate_reduce_scatter_group()`` reduce-scatters over a group of its own (one,
    shared by the units) with the shard group's ranks; the gradients are the same bits, and
    torch's; ``False`` goes back to the shard group."""
    x = _batch(rank)
    plain = _shard_stack(_stack(), _mesh(process_group))
    plain(x).sum().backward()

    groups: list[object] = []
    scatter = getattr(dist, _REDUCE_SCATTER)

    def spy(output, input, *args, group=None, **kwargs):
        groups.append(group)
        return scatter(output, input, *args, group=group, **kwargs)

    monkeypatch.setattr(dist, _REDUCE_SCATTER, spy)
    model = _shard_stack(_stack(), _mesh(process_group))
    model.set_separate_reduce_scatter_group()
    model(x).sum().backward()
    assert len(groups) == 3 and len({id(g) for g in groups}) == 1
    assert groups[0] is not process_group
    assert dist.get_process_group_ranks(groups[0]) == dist.get_process_group_ranks(process_group)
    _assert_grads(_full_grads(model), _full_grads(plain), exact=True)
    groups.clear()
    model.set_separate_reduce_scatter_group(False)
    model(x).sum().backward()
    assert len(groups) == 3 and all(g is process_group for g in groups)
    # torch's, where the installed torch has it: the same bits. In this test, not a test of
    # its own: a group made with use_local_synchronization=True is named by its ranks, and a
    # second test's group of the same ranks in the same rank processes finds the first one's
    # addresses under that name in the store.
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    if hasattr(TorchFSDPModule, "set_separate_reduce_scatter_group"):
        theirs = _stack()
        for module in (theirs[0], theirs[2], theirs):
            torch_fully_shard(module, mesh=_mesh(process_group))
        theirs.set_separate_reduce_scatter_group()
        theirs(x).sum().backward()
        _assert_grads(_full_grads(theirs), _full_grads(plain), exact=True)


# ---------------------------------------------------------------------- divide factor, symm mem
@pytest.mark.distributed(world_size=2)
def test_reduce_scatter_divide_factor_is_a_deprecated_alias(rank, process_group):
    """``set_reduce_scatter_divide_factor(f)`` warns and acts as
    ``set_gradient_divide_factor(f)``."""
    x = _batch(rank)
    grads = []
    for deprecated in (False, True):
        model = fully_shard(_stack(), mesh=_mesh(process_group))
        if deprecated:
            with pytest.warns(DeprecationWarning, match="set_gradient_divide_factor"):
                model.set_reduce_scatter_divide_factor(1.0)
        else:
            model.set_gradient_divide_factor(1.0)
        model(x).sum().backward()
        grads.append(_full_grads(model))
    _assert_grads(grads[1], grads[0], exact=True)


@pytest.mark.distributed(world_size=2)
def test_symm_mem_for_comm_names_what_it_needs(rank, process_group):
    """Symmetric memory needs CUDA and NCCL: on the CPU over gloo the error says so; only
    the NCCL backend is accepted."""
    model = fully_shard(_stack(), mesh=_mesh(process_group))
    with pytest.raises(RuntimeError, match="set_symm_mem_for_comm needs CUDA"):
        model.set_symm_mem_for_comm()
    with pytest.raises(ValueError, match="only 'NCCL'"):
        model.set_symm_mem_for_comm("NVSHMEM")


# ---------------------------------------------------------------------- mixed precision
@pytest.mark.distributed(world_size=2)
def test_reduce_dtype_none_follows_the_installed_torch(rank, process_group):
    """fp32 parameters with ``param_dtype=bf16`` and no ``reduce_dtype``: torch 2.15 and later
    reduce in fp32 (the gradients' dtype), earlier torch in bf16; an explicit reduce_dtype
    wins either way."""
    expected = "float32" if reduce_follows_grad_dtype() else "bfloat16"
    assert reduce_follows_grad_dtype() == (
        tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 15)
    )
    for policy, dtype in (
        (MixedPrecisionPolicy(param_dtype=torch.bfloat16), expected),
        (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16), "bfloat16"),
    ):
        model = fully_shard(_stack(), mesh=_mesh(process_group), mp_policy=policy)
        with record_fsdp(model) as rec:
            model(_batch(rank)).sum().backward()
        assert {r.dtype for r in rec.collectives("reduce_scatter")} == {dtype}, policy
        assert {r.dtype for r in rec.collectives("all_gather")} == {"bfloat16"}
        assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


class _KeepsLast(nn.Module):
    """A bf16 layer, then an fp32 one (the override keeps it), casting between them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(8, 8)
        self.last = nn.Linear(8, 4)
        self.seen: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = [self.first.weight.dtype, self.last.weight.dtype]
        return self.last(self.first(x).float())


@pytest.mark.distributed(world_size=2)
def test_param_dtype_override_fn_keeps_chosen_parameters(rank, process_group):
    """``param_dtype_override_fn`` returning the parameter's own dtype keeps it for compute
    while the rest use ``param_dtype``; the gradients equal a local run that casts the same
    way (same input on every rank, so the average is the local gradient)."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(7))
    ref = _KeepsLast()
    first = copy.deepcopy(ref.first).to(torch.bfloat16)
    ref.last(first(x.to(torch.bfloat16)).float()).sum().backward()
    reduce_dtype = torch.float32 if reduce_follows_grad_dtype() else torch.bfloat16
    expected = {
        "first.weight": first.weight.grad.to(reduce_dtype).float(),
        "first.bias": first.bias.grad.to(reduce_dtype).float(),
        "last.weight": ref.last.weight.grad.to(reduce_dtype).float(),
        "last.bias": ref.last.bias.grad.to(reduce_dtype).float(),
    }

    asked: list[tuple[int, ...]] = []

    def keep_last(param: nn.Parameter) -> torch.dtype | None:
        asked.append(tuple(param.shape))
        return param.dtype if param.shape[0] == 4 else None

    model = _KeepsLast()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, param_dtype_override_fn=keep_last)
    fully_shard(model, mesh=_mesh(process_group), mp_policy=policy)
    assert sorted(asked) == [(4,), (4, 8), (8,), (8, 8)]  # once per parameter
    model(x).sum().backward()
    assert model.seen == [torch.bfloat16, torch.float32]
    _assert_grads(_full_grads(model), expected, exact=True)


@pytest.mark.distributed(world_size=2)
def test_param_dtype_override_fn_bad_answers_raise(rank, process_group):
    """An answer other than None, param_dtype or the parameter's dtype is a ValueError naming
    the parameter; a non-callable a TypeError."""
    for answer, match in ((torch.float16, "must return None, param_dtype"), ("x", "torch.dtype")):
        policy = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, param_dtype_override_fn=lambda p, a=answer: a
        )
        with pytest.raises(ValueError, match=rf"{match}.*'0.weight'"):
            fully_shard(_stack(), mesh=_mesh(process_group), mp_policy=policy)
    with pytest.raises(TypeError, match="param_dtype_override_fn"):
        MixedPrecisionPolicy(param_dtype_override_fn=3)  # type: ignore[arg-type]


def test_policies_take_torchs_positional_arguments():
    """As torch's dataclasses: positional fields; ``param_dtype_override_fn`` keyword-only."""
    assert DataParallelMeshDims("fs", "dp") == DataParallelMeshDims(shard="fs", replicate="dp")
    assert CPUOffloadPolicy(False).pin_memory is False
    policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32, None, False)
    assert policy.reduce_dtype is torch.float32 and policy.cast_forward_inputs is False
    with pytest.raises(TypeError):
        MixedPrecisionPolicy(torch.bfloat16, None, None, True, lambda p: None)  # type: ignore[misc]


# ---------------------------------------------------------------------- replicate
@pytest.mark.distributed(world_size=2)
def test_replicate_a_list_is_one_unit(rank, process_group):
    """``replicate([a, b])`` makes one unit of both (one all-reduce per backward) and trains
    as DDP."""
    x = _batch(rank)
    ref = _ddp_grads(_stack(), [x], process_group)
    model = _stack()
    out = replicate([model[0], model[2]], mesh=_mesh(process_group))
    assert out == [model[0], model[2]]
    assert isinstance(model[0], FSDPModule) and isinstance(model[2], FSDPModule)
    assert model[0]._get_fsdp_state() is model[2]._get_fsdp_state()
    fully_shard(model, mesh=_mesh(process_group))
    with record_fsdp(model) as rec:
        model(x).sum().backward()
    assert len(rec.collectives("all_reduce")) == 1
    _assert_grads(_full_grads(model), ref)


@pytest.mark.parametrize("names", ["dp", ("dp", "tp")])
@pytest.mark.distributed(world_size=2)
def test_replicate_dp_mesh_dims(names, rank, process_group):
    """On a 2-D SPMD mesh, ``dp_mesh_dims`` names the dimension(s) to replicate over
    (several are flattened): the parameters stay ``DTensor``s on the full mesh and train as
    DDP. Shard dims, unknown names and plain parameters are refused with FSDP2's errors."""
    x = _batch(rank)
    ref = _ddp_grads(_stack(), [x], process_group)
    shape = (2, 1) if names == "dp" else (1, 2)
    mesh = DeviceMesh("cpu", torch.arange(2).view(shape), mesh_dim_names=("dp", "tp"))
    dims = DataParallelMeshDims(replicate=names)
    model = replicate(on_spmd_mesh(_stack(), mesh), mesh=mesh, dp_mesh_dims=dims)
    weight = model[0].weight
    assert isinstance(weight, DTensor) and weight.placements == (Replicate(), Replicate())
    assert weight.device_mesh is mesh
    model(x).sum().backward()
    _assert_grads(_full_grads(model), ref)
    with pytest.raises(ValueError, match="requires replicate-only dims"):
        replicate(_stack(), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="tp"))
    with pytest.raises(ValueError, match=r"'pp' not found in mesh\.mesh_dim_names"):
        replicate(_stack(), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(replicate="pp"))
    with pytest.raises(ValueError, match=r"must be DTensors on the full SPMD mesh.*'0\.weight'"):
        replicate(_stack(), mesh=mesh, dp_mesh_dims=dims)
