"""Train an fsdp_core model next to a data-parallel reference and compare them."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from fsdp_core import FSDP, MixedPrecision

from ._models import get_input

STEPS = 3


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of an FSDP model, unsharded, by original name.

    Independent of ``summon_full_params``: one ``dist.all_gather`` of each unit's padded flat
    shard, split by the layout in [Note: sharded and unsharded parameters].
    """
    names = {id(p): n for n, p in model.named_parameters()}
    params: dict[str, torch.Tensor] = {}
    for fsdp in FSDP.fsdp_modules(model):
        unit = fsdp._unit
        if unit is None:
            continue
        if unit.replicate:
            for sp in unit.params:
                params[names[id(sp.sharded)]] = sp.sharded.detach().clone()
            continue
        flat = unit._flat_shard.detach()
        blocks = [torch.empty_like(flat) for _ in range(unit.group_size)]
        dist.all_gather(blocks, flat, group=unit.group)
        gathered = torch.stack(blocks)  # (world, flat shard numel)
        offset = 0
        for sp in unit.params:
            block = gathered[:, offset : offset + sp.shard_numel]
            padded = block.reshape(sp.chunk_rows * unit.group_size, *sp.rest)
            params[names[id(sp.sharded)]] = padded[: sp.rows].clone()
            offset += sp.shard_numel
    return params


def train(
    model: nn.Module,
    kind: str,
    rank: int,
    *,
    after_backward: Callable[[], None] | None = None,
    steps: int = STEPS,
    save_load: bool = False,
) -> list[torch.Tensor]:
    """SGD with momentum for ``steps`` steps; return the per-step losses.

    With ``save_load`` (FSDP models only) every step ends with a full state dict save, zeroing
    every parameter through ``summon_full_params`` and loading the saved state dict.
    """
    optim = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(steps):
        out = model(get_input(kind, rank, step))
        loss = out.pow(2).mean()
        loss.backward()
        if after_backward is not None:
            after_backward()
        optim.step()
        optim.zero_grad()
        if save_load:
            save_zero_load(model)
        losses.append(loss.detach())
    return losses


def save_zero_load(model: nn.Module) -> None:
    """Save a full state dict, zero the model, load the state dict back."""
    state = model.state_dict()
    with FSDP.summon_full_params(model), torch.no_grad():
        for param in model.parameters():
            param.zero_()
    model.load_state_dict(state)


def reference(
    kind: str, model: nn.Module, rank: int, group: dist.ProcessGroup, *, steps: int = STEPS
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Losses and parameters of the data-parallel reference for ``model`` (unwrapped)."""
    model = copy.deepcopy(model)
    if kind != "moe":
        ddp = DDP(model, process_group=group)
        return train(ddp, kind, rank, steps=steps), _named(model)

    # Experts are per-rank: average only the shared parameters' gradients, as DDP would
    # (pre-divide by the world size, then sum).
    world = dist.get_world_size(group)
    shared = [p for n, p in model.named_parameters() if not n.startswith("expert.")]

    def reduce_shared() -> None:
        for p in shared:
            assert p.grad is not None
            p.grad.div_(world)
            dist.all_reduce(p.grad, group=group)

    return train(model, kind, rank, after_backward=reduce_shared, steps=steps), _named(model)


def precision_reference(
    kind: str,
    model: nn.Module,
    rank: int,
    group: dist.ProcessGroup,
    policy: MixedPrecision,
    *,
    steps: int = STEPS,
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """A replicated reference running ``policy``'s precision by hand.

    fp32 master parameters; each step computes on a copy cast to ``param_dtype`` (inputs
    too), casts each gradient to the reduce dtype, averages it like FSDP (pre-divide, SUM
    all-reduce; per-rank experts are not reduced but still cast) and steps the masters with
    the gradient cast back to fp32.
    """
    param_dtype = policy.param_dtype
    assert param_dtype is not None
    reduce_dtype = policy.reduce_dtype or param_dtype
    master = copy.deepcopy(model)
    masters = dict(master.named_parameters())
    world = dist.get_world_size(group)
    optim = torch.optim.SGD(master.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(steps):
        compute = copy.deepcopy(master).to(param_dtype)
        batch = get_input(kind, rank, step)
        if batch.is_floating_point():
            batch = batch.to(param_dtype)
        loss = compute(batch).pow(2).mean()
        loss.backward()
        for name, param in compute.named_parameters():
            if param.grad is None:
                continue
            grad = param.grad.to(reduce_dtype)
            if not name.startswith("expert."):
                grad.div_(world)
                dist.all_reduce(grad, group=group)
            masters[name].grad = grad.to(masters[name].dtype)
        optim.step()
        optim.zero_grad()
        losses.append(loss.detach())
    return losses, _named(master)


def _named(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# (rtol, atol) for results that may differ in rounding; None: bitwise equal.
Tolerance = tuple[float, float] | None

# Gloo sums the contributions of more than two ranks in a different order for reduce-scatter
# than for an all-reduce, so at world size 4 results differ in the last bits of the reduce
# dtype (at world size 2 every sum has two terms and is order independent: bitwise equal).
# fp32: 1e-5 relative is ~100 ulps, far above the few ulps three steps accumulate.
FP32_TOLERANCE = (1e-5, 1e-6)
# Parameters (fp32 masters) after 3 SGD+momentum steps (lr 0.05) whose gradients were summed in
# a low-precision dtype: one ulp of a gradient element g is |g| * 2^-8 (bf16) or |g| * 2^-11
# (fp16); the momentum sums of the three steps apply it 1 + 1.9 + 2.71 times, so with |g| <= 1
# a parameter moves by up to 0.05 * 5.6 * ulp, about 1.1e-3 (bf16) and 1.4e-4 (fp16), and the
# next steps' gradients, computed from the moved parameters, add to it. Measured maxima:
# 2.1e-3 (bf16) and 9.3e-5 (fp16). Absolute, because parameters near zero make any relative
# bound meaningless.
PARAM_TOLERANCE = {torch.bfloat16: (0.0, 5e-3), torch.float16: (0.0, 5e-4)}
# Low-precision losses computed from such parameters: a few ulps of the loss dtype (bf16 ulp
# 2^-8 ~ 3.9e-3 relative, fp16 2^-11 ~ 4.9e-4). Measured maxima: 9.4e-3 and 8.9e-4 relative.
LOSS_TOLERANCE = {torch.bfloat16: (2e-2, 1e-5), torch.float16: (4e-3, 1e-6)}


def assert_same(
    actual: dict[str, torch.Tensor],
    expected: dict[str, torch.Tensor],
    *,
    tolerance: Tolerance,
    what: str,
) -> None:
    assert actual.keys() == expected.keys(), (what, sorted(actual), sorted(expected))
    for name, value in expected.items():
        _assert_close(actual[name], value, tolerance=tolerance, what=f"{what}: {name}")


def assert_same_losses(
    actual: list[torch.Tensor],
    expected: list[torch.Tensor],
    *,
    tolerance: Tolerance,
    what: str,
) -> None:
    for step, (a, e) in enumerate(zip(actual, expected, strict=True)):
        _assert_close(a, e, tolerance=tolerance, what=f"{what}: loss at step {step}")


def _assert_close(a: torch.Tensor, e: torch.Tensor, *, tolerance: Tolerance, what: str) -> None:
    assert a.dtype == e.dtype, f"{what}: dtype {a.dtype}, expected {e.dtype}"
    if tolerance is None:
        assert torch.equal(a, e), f"{what} differs: max |diff| {(a - e).abs().max().item()}"
    else:
        rtol, atol = tolerance
        torch.testing.assert_close(a, e, rtol=rtol, atol=atol, msg=what)
