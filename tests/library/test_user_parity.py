"""``check_parity``: a user's own wrapper (the ZeRO-2 example) or step function against DDP or
a single process, with any batch structure, accumulation and renamed parameters; a planted bug
is reported by step and tensor name."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from examples.zero2_wrapper import ZeRO2, batch, build, mse, sgd
from fsdp_testing.parity import check_parity


def _zero2(cls: type[ZeRO2]):
    return lambda module, group: cls(module, group, optimizer=sgd)


class ForgetsTheLastParameter(ZeRO2):
    """Wrong gradient scaling: the last parameter in the flat buffer (``2.bias``) is summed
    over the ranks instead of averaged."""

    def average(self, flat_grad: torch.Tensor) -> torch.Tensor:
        last = self.params[-1].numel()
        padding = flat_grad.numel() - sum(p.numel() for p in self.params)
        flat_grad[: flat_grad.numel() - last - padding].div_(self.world_size)
        return flat_grad


def _zero2_parity(group, wrapper=ZeRO2, **options):
    return check_parity(
        build,
        _zero2(wrapper),
        batch,
        process_group=group,
        loss_fn=mse,
        make_optimizer=sgd,
        wrapped_optimizer=lambda model: model,
        **options,
    )


@pytest.mark.parametrize("reference", ["ddp", "local"])
@pytest.mark.distributed(world_size=2)
def test_zero2_matches_each_reference_bitwise(reference, process_group):
    reports = _zero2_parity(process_group, reference=reference, exact=True, num_steps=3)
    assert [r.step for r in reports] == [1, 2, 3]
    assert all(r.loss_diff == 0 and r.param_diff == 0 for r in reports)
    assert reports[0].loss != reports[2].loss  # it trained


@pytest.mark.parametrize("reference", ["ddp", "local"])
@pytest.mark.distributed(world_size=2)
def test_a_wrong_gradient_scaling_is_reported_by_step_and_parameter(reference, process_group):
    with pytest.raises(AssertionError) as caught:
        _zero2_parity(process_group, ForgetsTheLastParameter, reference=reference)
    message = str(caught.value)
    assert "check_parity[ForgetsTheLastParameter, reference " in message
    assert "the wrapped model diverged from the reference" in message
    assert "at step 1 of 3" in message
    assert "2.bias: max abs diff" in message
    # Only that parameter: the others were averaged. The likely cause says so, with the factor.
    assert "0.weight" not in message and "2.weight" not in message
    assert message.endswith(
        "likely cause:\n  every diverging gradient (2.bias; 3 other parameters match) is 2.000x "
        "the reference's (world size 2): gradients summed, not averaged"
    )


@pytest.mark.distributed(world_size=2, mode="thread")
def test_accumulation_uses_each_micro_batch_once(rank, process_group):
    seen: list[int] = []

    def recorded(i: int, r: int):
        if r == rank:
            seen.append(i)
        return batch(i, r)

    check_parity(
        build,
        _zero2(ZeRO2),
        recorded,
        process_group=process_group,
        loss_fn=mse,
        make_optimizer=sgd,
        wrapped_optimizer=lambda model: model,
        num_steps=2,
        accum_steps=3,
        reference="local",
    )
    # Both models read forwards 0..5 (2 steps x 3 micro-batches), each once.
    assert sorted(seen) == sorted([*range(6), *range(6)])


class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 6)
        self.head = nn.Linear(6, 2)

    def forward(self, *, features: torch.Tensor, scale: float) -> dict[str, torch.Tensor]:
        hidden = self.body(features)
        return {"out": self.head(hidden) * scale, "aux": hidden}


def _dict_batch(i: int, rank: int) -> dict[str, object]:
    generator = torch.Generator().manual_seed(10 * i + rank)
    return {"features": torch.randn(3, 6, generator=generator), "scale": 0.5}


@pytest.mark.distributed(world_size=2)
def test_a_step_function_and_a_dict_batch_with_the_default_loss(process_group):
    """No wrapper: the user's step averages gradients by hand. The default loss calls the
    model with the dict's keywords and sums the mean squares of every float output."""

    def step(model: nn.Module, batch: dict[str, object]) -> torch.Tensor:
        loss = model(**batch)["out"].pow(2).mean() + model(**batch)["aux"].pow(2).mean()
        loss.backward()
        for param in model.parameters():
            assert param.grad is not None
            param.grad.div_(dist.get_world_size(process_group))
            dist.all_reduce(param.grad, group=process_group)
        return loss

    check_parity(_TwoHeads, None, _dict_batch, process_group=process_group, step_fn=step)

    def forgets_to_average(model: nn.Module, batch: dict[str, object]) -> torch.Tensor:
        loss = model(**batch)["out"].pow(2).mean() + model(**batch)["aux"].pow(2).mean()
        loss.backward()
        return loss

    with pytest.raises(AssertionError, match=r"at step 1 of 3.*\n.*body\.weight: max abs diff"):
        check_parity(
            _TwoHeads, None, _dict_batch, process_group=process_group, step_fn=forgets_to_average
        )


@pytest.mark.distributed(world_size=2)
def test_a_wrapper_that_renames_parameters_with_full_state(process_group):
    def ddp(module: nn.Module, group: dist.ProcessGroup) -> DistributedDataParallel:
        return DistributedDataParallel(module, process_group=group)

    # The default drops DDP's ``module.`` prefix; full_state gives the names explicitly.
    check_parity(build, ddp, batch, process_group=process_group, loss_fn=mse, exact=True)
    check_parity(
        build,
        ddp,
        batch,
        process_group=process_group,
        loss_fn=mse,
        full_state=lambda wrapped: dict(wrapped.module.named_parameters()),
    )


class _Flat(nn.Module):
    """Keeps one flat parameter: its names cannot be matched to the model's."""

    def __init__(self, module: nn.Module, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.flat = nn.Parameter(torch.cat([p.detach().reshape(-1) for p in module.parameters()]))
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.flat[: 16 * 32].view(32, 16))


def test_user_mistakes_name_the_api_the_value_and_the_fix():
    with pytest.raises(ValueError, match=r"check_parity: wrap=None and step_fn=None"):
        check_parity(build, None, batch)
    with pytest.raises(ValueError, match=r"check_parity: unknown reference 'single'; valid"):
        check_parity(build, _zero2(ZeRO2), batch, reference="single")
    with pytest.raises(ValueError, match=r"num_steps=0 and accum_steps=1 must be at least 1"):
        check_parity(build, _zero2(ZeRO2), batch, num_steps=0)


@pytest.mark.distributed(world_size=2, mode="thread")
def test_unmatched_parameters_ask_for_full_state(process_group):
    with pytest.raises(ValueError, match=r"not in the model: flat.*pass full_state="):
        check_parity(build, _Flat, batch, process_group=process_group, loss_fn=mse)
    with pytest.raises(ValueError, match=r"full_state\(wrapped\) do not match.*missing: 0\.bias"):
        check_parity(
            build,
            _Flat,
            batch,
            process_group=process_group,
            loss_fn=mse,
            full_state=lambda wrapped: {"0.weight": wrapped.flat[: 16 * 32].view(32, 16)},
        )
    calls = []

    def not_deterministic() -> nn.Module:  # a bias that counts the calls
        calls.append(None)
        model = nn.Linear(2, 2)
        with torch.no_grad():
            model.bias.fill_(float(len(calls)))
        return model

    with pytest.raises(ValueError, match=r"two calls of build_model\(\).*\n.*bias"):
        check_parity(not_deterministic, _zero2(ZeRO2), batch, process_group=process_group)
