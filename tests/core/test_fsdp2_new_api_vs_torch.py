"""fsdp_core's door and the installed torch's FSDP2, side by side on CPU ranks over gloo, for
the FSDP2 features torch 2.13 to 2.15 added (issue 42): manual backward finalization,
``set_keep_unsharded_storage``, ``set_reduce_scatter_unused_params``,
the deprecated ``set_reduce_scatter_divide_factor``,
the ``reduce_dtype=None`` rule, ``param_dtype_override_fn``, and FSDP2's ``replicate`` of a
list and with ``dp_mesh_dims``. Each test runs one scenario through both engines and
compares what torch's own tests of the feature compare: the gradients (bit for bit, the same
arithmetic), their dtypes, which parameters get one, and the errors' types. A feature the
installed torch lacks is skipped with its name: under the project's pinned torch (2.13) the
torch 2.15 features skip; ``scripts/torch_matrix.sh 2.15.0
tests/core/test_fsdp2_new_api_vs_torch.py`` runs them all. (``set_separate_reduce_scatter_group``
is compared in ``test_fsdp2_new_api.py``'s test of it: one new group per test.)"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import fsdp_core

from .test_fsdp2_new_api import _batch, _full_grads, _mesh, _stack

Shard = Callable[..., Any]


def _torch_has(name: str, owner: Any = TorchFSDPModule) -> pytest.MarkDecorator:
    return pytest.mark.skipif(
        not hasattr(owner, name), reason=f"torch {torch.__version__} has no {name}"
    )


def _torch_policy_has(field: str) -> pytest.MarkDecorator:
    fields = getattr(TorchMixedPrecisionPolicy, "__dataclass_fields__", {})
    return pytest.mark.skipif(
        field not in fields,
        reason=f"torch {torch.__version__}'s MixedPrecisionPolicy has no {field}",
    )


def _torch_replicate() -> Any:
    """torch's FSDP2-style ``replicate``, where it takes FSDP2's ``mesh=`` (2.9's took
    ``device_mesh=``)."""
    try:
        from torch.distributed._composable.replicate_with_fsdp import replicate
    except ImportError:
        return None
    return replicate if "mesh" in inspect.signature(replicate).parameters else None


ENGINES = ("fsdp_core", "torch")


def _fully_shard(engine: str) -> Shard:
    return fsdp_core.fully_shard if engine == "fsdp_core" else torch_fully_shard


def _policy(engine: str, **kw: Any) -> Any:
    cls = fsdp_core.MixedPrecisionPolicy if engine == "fsdp_core" else TorchMixedPrecisionPolicy
    return cls(**kw)


def _handle_class(engine: str) -> Any:
    if engine == "fsdp_core":
        return fsdp_core.GradientReductionHandle
    import torch.distributed.fsdp as torch_fsdp

    return torch_fsdp.GradientReductionHandle  # type: ignore[attr-defined]


def _shard_stack(engine: str, mesh: DeviceMesh, **kw: Any) -> Any:
    shard = _fully_shard(engine)
    model = _stack()
    shard(model[0], mesh=mesh, **kw)
    shard(model[2], mesh=mesh, **kw)
    return shard(model, mesh=mesh, **kw)


def _assert_same(
    ours: dict[str, torch.Tensor | None], theirs: dict[str, Any], *, exact: bool = True
) -> None:
    """The same parameters with a gradient, of the same dtype and bits (``exact``), else
    values within float32 rounding."""
    assert ours.keys() == theirs.keys()
    for name, grad in ours.items():
        other = theirs[name]
        assert (grad is None) == (other is None), (name, grad, other)
        if grad is not None:
            assert grad.dtype == other.dtype, (name, grad.dtype, other.dtype)
            if exact:
                assert torch.equal(grad, other), name
            else:
                torch.testing.assert_close(grad, other, rtol=1e-6, atol=1e-7, msg=name)


def _both(scenario: Callable[[str], dict[str, Any]], *, exact: bool = True) -> None:
    """Run ``scenario`` with each engine and compare the gradients it returns."""
    ours, theirs = (scenario(engine) for engine in ENGINES)
    _assert_same(ours, theirs, exact=exact)


# ---------------------------------------------------------------------- manual finalization
@_torch_has("finalize_backward")
@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.distributed(world_size=2)
def test_manual_finalization_with_accumulation(async_op, rank, process_group):
    """As a pipeline stage: backwards with sync off, then ``finalize_backward`` with sync
    back on; two steps. Nothing is reduced before it; after it, torch's gradients."""
    mesh = _mesh(process_group)

    def scenario(engine: str) -> dict[str, Any]:
        model = _shard_stack(engine, mesh)
        model.set_manual_backward_finalization(True)
        for step in range(2):
            model.zero_grad()
            model.set_requires_gradient_sync(False)
            for i in range(3):
                model(_batch(rank, 10 * step + i)).sum().backward()
            assert all(p.grad is None for p in model.parameters()), engine
            model.set_requires_gradient_sync(True)
            handle: Any = model.finalize_backward(async_op=async_op)
            assert (handle is None) != async_op, engine
            if handle is not None:
                assert isinstance(handle, _handle_class(engine)), type(handle)
                handle.wait()
        return _full_grads(model)

    _both(scenario)


@_torch_has("finalize_backward")
@pytest.mark.distributed(world_size=2)
def test_manual_finalization_every_backward_synced(rank, process_group):
    """Manual mode with sync on, two backwards, then ``finalize_backward``: every parameter
    gets torch's gradient. Within rounding, not bit for bit: torch leaves a unit whose
    forward inputs need no gradient (here the first layer's and the root's) to the end of
    backward, which under manual finalization defers it to ``finalize_backward``, so it
    sums the two backwards' gradients before one reduction; fsdp_core reduces each unit as
    soon as its gradients are ready, in each backward, and sums the reduced shards. The same
    sum in another order."""
    mesh = _mesh(process_group)

    def scenario(engine: str) -> dict[str, Any]:
        model = _shard_stack(engine, mesh)
        model.set_manual_backward_finalization(True)
        for i in range(2):
            model(_batch(rank, i)).sum().backward()
        model.finalize_backward()
        return _full_grads(model)

    _both(scenario, exact=False)


@_torch_has("finalize_backward")
@pytest.mark.distributed(world_size=2)
def test_manual_finalization_misuse_raises_what_torch_raises(rank, process_group):
    """``finalize_backward`` without the mode, and on a module that is not the root after
    lazy init: both engines raise ``RuntimeError``."""
    mesh = _mesh(process_group)
    for engine in ENGINES:
        model = _shard_stack(engine, mesh)
        model(_batch(rank)).sum().backward()
        with pytest.raises(RuntimeError, match="requires manual backward finalization"):
            model.finalize_backward()
        with pytest.raises(RuntimeError):
            model[0].finalize_backward()


# ---------------------------------------------------------------------- unsharded storage
@_torch_has("set_keep_unsharded_storage")
@pytest.mark.distributed(world_size=2)
def test_keep_unsharded_storage_keeps_the_data_pointer(rank, process_group):
    """With ``set_keep_unsharded_storage(True)`` both engines unshard into the same memory
    each time (a stable ``data_ptr``), and training gives torch's gradients."""
    mesh = _mesh(process_group)

    def scenario(engine: str) -> dict[str, Any]:
        model = _shard_stack(engine, mesh)
        model.set_keep_unsharded_storage(True)
        pointers = []
        for _ in range(2):
            model[0].unshard()
            weight = model[0].weight
            assert not isinstance(weight, DTensor), engine
            pointers.append(weight.data_ptr())
            model[0].reshard()
        assert pointers[0] == pointers[1], engine
        for i in range(2):
            model(_batch(rank, i)).sum().backward()
        return _full_grads(model)

    _both(scenario)


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


def _moe() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(_Experts(), nn.Linear(8, 4))


@_torch_has("set_reduce_scatter_unused_params")
@pytest.mark.distributed(world_size=2)
def test_reduce_scatter_unused_params(rank, process_group):
    """An expert unused on rank 1: with ``set_reduce_scatter_unused_params(True)`` every
    rank gets its gradient, the sum of what the ranks that used it sent; as torch's."""
    mesh = _mesh(process_group)

    def scenario(engine: str) -> dict[str, Any]:
        shard = _fully_shard(engine)
        model: Any = _moe()
        shard(model[0], mesh=mesh)
        shard(model, mesh=mesh)
        model.set_reduce_scatter_unused_params(True)
        for i in range(2):
            model(_batch(rank, i)).sum().backward()
        return _full_grads(model)

    _both(scenario)


# ---------------------------------------------------------------------- divide factor
@_torch_has("set_reduce_scatter_divide_factor")
@pytest.mark.distributed(world_size=2)
def test_reduce_scatter_divide_factor(rank, process_group):
    """``set_reduce_scatter_divide_factor(f)``: the summed gradients divided by ``f``, as
    torch's (with ``set_force_sum_reduction_for_comms(True)``: gloo has no ``PREMUL_SUM``,
    which torch otherwise reduces with); where torch deprecates it, both warn."""
    mesh = _mesh(process_group)
    warned: dict[str, bool] = {}

    def scenario(engine: str) -> dict[str, Any]:
        model = _shard_stack(engine, mesh)
        for module in (model, model[0], model[2]):
            module.set_force_sum_reduction_for_comms(True)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                module.set_reduce_scatter_divide_factor(4.0)
            warned[engine] = any(w.category is DeprecationWarning for w in caught)
        model(_batch(rank)).sum().backward()
        return _full_grads(model)

    _both(scenario)
    assert warned["fsdp_core"] or not warned["torch"]


# ---------------------------------------------------------------------- mixed precision
@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.distributed(world_size=2)
def test_reduce_dtype_none_follows_the_installed_torch(param_dtype, rank, process_group):
    """``reduce_dtype=None`` with a low ``param_dtype`` on fp32 parameters: reduced in
    ``param_dtype`` before torch 2.15, in fp32 from 2.15 on; either way the same gradients
    as the installed torch's."""
    mesh = _mesh(process_group)

    def scenario(engine: str) -> dict[str, Any]:
        model = _shard_stack(engine, mesh, mp_policy=_policy(engine, param_dtype=param_dtype))
        for i in range(2):
            model(_batch(rank, i)).float().sum().backward()
        return _full_grads(model)

    _both(scenario)


class _ToFloat(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float()


@_torch_policy_has("param_dtype_override_fn")
@pytest.mark.distributed(world_size=2)
def test_param_dtype_override_fn(rank, process_group):
    """``param_dtype_override_fn`` keeps the chosen parameters (here the head's) in their
    fp32 while the rest compute in bf16: the same unsharded dtypes and gradients as
    torch's."""
    mesh = _mesh(process_group)

    def scenario(engine: str) -> dict[str, Any]:
        torch.manual_seed(0)
        model: Any = nn.Sequential(nn.Linear(8, 8), _ToFloat(), nn.Linear(8, 4))
        head = {id(p) for p in model[2].parameters()}

        def keep_head(param: nn.Parameter) -> torch.dtype | None:
            return param.dtype if id(param) in head else None

        policy = _policy(
            engine,
            param_dtype=torch.bfloat16,
            reduce_dtype=torch.float32,
            param_dtype_override_fn=keep_head,
        )
        _fully_shard(engine)(model, mesh=mesh, mp_policy=policy)
        model.unshard()
        assert model[0].weight.dtype == torch.bfloat16, engine
        assert model[2].weight.dtype == torch.float32, engine
        model.reshard()
        for i in range(2):
            model(_batch(rank, i)).sum().backward()
        return _full_grads(model)

    _both(scenario)


# ---------------------------------------------------------------------- replicate
@pytest.mark.skipif(
    _torch_replicate() is None, reason=f"torch {torch.__version__} has no FSDP2 replicate(mesh=)"
)
@pytest.mark.distributed(world_size=2)
def test_replicate_a_list_of_modules(rank, process_group):
    """FSDP2's ``replicate([a, b])``: one unit of two modules, then the root; torch's
    gradients."""
    torch_replicate = _torch_replicate()
    mesh = _mesh(process_group)

    def scenario(engine: str) -> dict[str, Any]:
        replicate = fsdp_core.replicate if engine == "fsdp_core" else torch_replicate
        model = _stack()
        replicate([model[0], model[2]], mesh=mesh)
        replicate(model, mesh=mesh)
        for i in range(2):
            model(_batch(rank, i)).sum().backward()
        return _full_grads(model)

    _both(scenario)
