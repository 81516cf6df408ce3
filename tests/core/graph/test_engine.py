"""The ``fsdp_core_graph`` engine: the parity trainer lets an engine that steps the model itself
run forward, loss and backward, and ``fsdp-testing check`` reports graph mode's parity and
volume."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fsdp_testing.cli import main
from fsdp_testing.engines import StepsItself, get_engine
from fsdp_testing.parity import TrainingLoop


class _Workload:
    def get_input(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        return (torch.ones(2, 3, device=device),)

    def get_loss(self, input: Any, output: torch.Tensor) -> torch.Tensor:
        return output.sum()

    def run_backward(self, loss: torch.Tensor) -> None:
        raise AssertionError("an engine that steps itself runs the backward")


class _SelfStepping:
    """Runs the step eagerly, counting its calls: the trainer must call it, not the model."""

    name = "self_stepping"

    def __init__(self) -> None:
        self.calls = 0

    def train_step(self, module: nn.Module, inputs: tuple[Any, ...], loss_fn: Any) -> torch.Tensor:
        self.calls += 1
        loss = loss_fn(module, inputs)
        loss.backward()
        return loss.detach()


def test_the_trainer_lets_an_engine_that_steps_itself_run_the_step() -> None:
    assert isinstance(get_engine("fsdp_core_graph"), StepsItself)
    assert not isinstance(get_engine("fsdp_core_fully_shard"), StepsItself)
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    engine: Any = _SelfStepping()  # an engine in the trainer's eyes only through train_step
    loop = TrainingLoop(model, engine=engine, workload=_Workload(), lr=0.1, device="cpu")
    before, bias = model.weight.detach().clone(), model.bias.detach().clone()
    loss = loop.step()
    assert engine.calls == 1
    assert torch.equal(loss, F.linear(torch.ones(2, 3), before, bias).sum())
    # SGD with momentum, first step: w - lr * grad, grad of the sum over two rows of ones = 2.
    # (allclose: the optimizer's arithmetic order differs from this expression's)
    assert torch.allclose(model.weight.detach(), before - 0.1 * 2)
    scaled = TrainingLoop(
        nn.Linear(3, 1),
        engine=engine,
        workload=_Workload(),
        enable_sharded_grad_scaler=True,
        device="cpu",
    )
    with pytest.raises(
        NotImplementedError, match=r"'self_stepping' runs the step itself.*grad scaler"
    ):
        scaled.step()


def test_check_reports_graph_mode_parity_and_volume(capsys) -> None:
    code = main(
        [
            "check",
            "--model",
            "transformer,moe",
            "--strategy",
            "FULL_SHARD,SHARD_GRAD_OP",
            "--prefetch",
            "none",
            "--offload",
            "off",
            "--mp",
            "off,bf16",
            "--engine",
            "fsdp_core_graph",
            "--comm",
            "strict",
        ]
    )
    out = capsys.readouterr().out
    # Full precision: parity with the reference and exactly the theoretical volume; mixed
    # precision is not traced (unavailable, not wrong).
    assert re.search(r"4 ok, 0 mismatched, 0 errors, 4 unavailable", out), out
    assert "trace_train_step does not trace mixed precision" in out
    assert code == 0
