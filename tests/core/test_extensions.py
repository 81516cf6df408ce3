"""FSDP2's all-gather extensions on ``fully_shard`` (issue 23; [Note: all-gather extensions] in
``fsdp_core/_extensions.py``): ``fsdp_pre_all_gather``/``fsdp_post_all_gather`` set on a
sharded parameter's local tensor decide what is all-gathered and what the module computes
with."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from fsdp_core import MixedPrecisionPolicy, fully_shard


class _Bf16Gather:
    """An extension that all-gathers in bf16 and upcasts after (what float8 training does
    with float8), recording its calls."""

    def __init__(self, signature: int = 5) -> None:
        self.pre_calls: list[tuple] = []
        self.post_outs: list[torch.Tensor | None] = []
        self.results: list[torch.Tensor] = []
        self.signature = signature

    def install(self, local: torch.Tensor) -> None:
        recorder = self

        def pre_v2(self, mesh, outer_size, outer_stride, module, mp_policy):
            recorder.pre_calls.append((mesh, outer_size, outer_stride, module, mp_policy))
            return (self.to(torch.bfloat16),), "meta"

        def pre_v1(self, mesh):
            recorder.pre_calls.append((mesh,))
            return (self.to(torch.bfloat16),), "meta"

        def post(self, outputs, metadata, param_dtype, *, out=None):
            assert metadata == "meta"
            (gathered,) = outputs
            recorder.post_outs.append(out)
            if out is not None:
                out.copy_(gathered)
                return None
            result = gathered.to(param_dtype)
            recorder.results.append(result)
            return result, (gathered,)

        pre = pre_v2 if self.signature == 5 else pre_v1
        local.fsdp_pre_all_gather = pre.__get__(local)
        local.fsdp_post_all_gather = post.__get__(local)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))  # 5 rows: uneven at 2, 3


def _rounded(model: nn.Module) -> nn.Module:
    """``model`` with its weights rounded to bf16, as the extension all-gathers them."""
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in rounded.named_parameters():
            if name.endswith("weight"):
                p.copy_(p.to(torch.bfloat16).float())
    return rounded


@pytest.mark.distributed(world_size=[2, 3])
@pytest.mark.parametrize("signature", [5, 1])
def test_an_extension_decides_what_is_gathered_and_computed_with(
    rank, world_size, process_group, signature
):
    """Weights gathered through a bf16 extension: forward and gradients are those of the
    bf16-rounded weights (exactly), biases take the unit's own path. The pre-hook gets the
    shard mesh, the global size and stride, the module and the policy (five-parameter
    form); later unshards pass the first result back as ``out``; reshard frees the kept
    outputs; removing the methods returns the weight to the unit's own path."""
    mesh = DeviceMesh.from_group(process_group, "cpu")
    plain = _model()
    policy = MixedPrecisionPolicy()
    model = fully_shard(copy.deepcopy(plain), mesh=mesh, mp_policy=policy)
    extension = _Bf16Gather(signature)
    for name, p in model.named_parameters():
        if name.endswith("weight"):
            extension.install(p._local_tensor)
    reference = _rounded(plain)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(rank))

    for _step in range(2):
        out = model(x)
        torch.testing.assert_close(out, reference(x), rtol=0, atol=0)
        out.sum().backward()
        reference(x).sum().backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            want = q.grad.clone()
            dist.all_reduce(want, group=process_group)
            torch.testing.assert_close(p.grad.full_tensor(), want / world_size, msg=name)
            q.grad = None
        model.zero_grad()

    # 2 weights, 2 steps, one unshard each: the root keeps its parameters from forward to backward
    assert len(extension.pre_calls) == 2 * 2
    got_mesh = extension.pre_calls[0][0]
    assert got_mesh.ndim == 1 and got_mesh.size() == world_size
    if signature == 5:
        _, outer_size, outer_stride, module, mp_policy = extension.pre_calls[0]
        assert (tuple(outer_size), tuple(outer_stride)) == ((5, 4), (4, 1))
        assert module is model and mp_policy is policy
    assert extension.post_outs[:2] == [None, None]  # first unshard of each weight
    assert all(out is not None for out in extension.post_outs[2:])
    assert all(r.untyped_storage().nbytes() == 0 for r in extension.results)  # resharded

    for name, p in model.named_parameters():
        if name.endswith("weight"):
            del p._local_tensor.fsdp_pre_all_gather, p._local_tensor.fsdp_post_all_gather
    full = model(x)
    torch.testing.assert_close(full, plain(x), rtol=0, atol=0)


@pytest.mark.distributed(world_size=2)
def test_an_extension_on_a_parameter_sharded_on_another_dim_raises(rank, process_group):
    mesh = DeviceMesh.from_group(process_group, "cpu")
    model = fully_shard(nn.Linear(4, 6), mesh=mesh, shard_placement_fn=lambda p: Shard(p.dim() - 1))
    _Bf16Gather().install(model.weight._local_tensor)
    with pytest.raises(NotImplementedError, match=r"'weight' has all-gather extensions .* dim 1"):
        model(torch.ones(2, 4))
