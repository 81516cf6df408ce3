"""A pipeline-parallel library written from scratch on ``torch.distributed`` (the kind of code
``examples/test_pipeline.py`` tests): a model cut into stages, one stage per rank, microbatches
passed between neighbours with point-to-point ops, and two schedules:

- :func:`gpipe_step`: every microbatch's forward, then every backward (blocking ``send`` and
  ``recv``);
- :func:`one_f_one_b_step`: 1F1B, each stage alternating one forward and one backward once the
  pipeline is full, with the sends and receives of a step issued together
  (``dist.P2POp`` + ``dist.batch_isend_irecv``).

Both return the batch's loss on every rank (the last stage computes it, then broadcasts it) and
leave on each stage's parameters the gradient of the mean loss over the whole batch.

Run as a script (``python examples/pipeline.py``), it trains a four-layer MLP on two processes
for a few steps and prints the losses.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = ["Stage", "full_parameters", "gpipe_step", "one_f_one_b_step", "split"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Stage:
    """The part of a pipeline that runs on this rank.

    Args:
        module: this stage's layers.
        index: the stage's place in the pipeline (0 is first).
        num_stages: the number of stages; stage ``i`` runs on rank ``i`` of ``group``.
        activation: the shape of one microbatch's activations between stages.
        group: the pipeline's ranks (default: the default group).
    """

    def __init__(
        self,
        module: nn.Module,
        index: int,
        num_stages: int,
        activation: tuple[int, ...],
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.module = module
        self.index = index
        self.num_stages = num_stages
        self.activation = activation
        self.group = group
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        self.prev = ranks[index - 1] if index > 0 else None
        self.next = ranks[index + 1] if index + 1 < num_stages else None
        self.last_rank = ranks[num_stages - 1]
        self._inputs: list[torch.Tensor] = []
        self._outputs: list[torch.Tensor] = []

    @property
    def is_first(self) -> bool:
        return self.prev is None

    @property
    def is_last(self) -> bool:
        return self.next is None

    def forward(self, microbatch: torch.Tensor | None) -> torch.Tensor:
        """Run one microbatch through this stage (the first stage gets it; the others receive
        their input from the previous stage) and keep what the backward needs."""
        if self.is_first:
            assert microbatch is not None
            x = microbatch
        else:
            x = torch.empty(self.activation)
            dist.recv(x, self.prev, group=self.group)
            x.requires_grad_(True)
        out = self.module(x)
        self._inputs.append(x)
        self._outputs.append(out)
        return out

    def backward(self, out_grad: torch.Tensor | None, loss: torch.Tensor | None = None) -> None:
        """Backpropagate the oldest microbatch still held: from its loss on the last stage,
        else from ``out_grad``, the gradient the next stage sent back."""
        x, out = self._inputs.pop(0), self._outputs.pop(0)
        if loss is not None:
            loss.backward()
        else:
            out.backward(out_grad)
        if not self.is_first:
            assert x.grad is not None
            dist.send(x.grad, self.prev, group=self.group)


def split(model: nn.Sequential, num_stages: int) -> list[nn.Sequential]:
    """``model``'s layers in ``num_stages`` consecutive stages of equal length."""
    per = len(model) // num_stages
    return [model[i * per : (i + 1) * per] for i in range(num_stages)]


def _losses_on_every_rank(stage: Stage, total: torch.Tensor) -> torch.Tensor:
    dist.broadcast(total, stage.last_rank, group=stage.group)
    return total


def gpipe_step(
    stage: Stage,
    batch: torch.Tensor,
    target: torch.Tensor,
    loss_fn: LossFn,
    num_microbatches: int,
) -> torch.Tensor:
    """One training step with GPipe's schedule: every forward, then every backward.

    Args:
        stage: this rank's stage.
        batch: the whole batch (read by the first stage only).
        target: the whole batch's targets (read by the last stage only).
        loss_fn: the loss of one microbatch, a mean over its samples.
        num_microbatches: how many equal microbatches the batch is cut into.

    Returns:
        the mean loss over the batch, on every rank.
    """
    inputs = batch.chunk(num_microbatches)
    targets = target.chunk(num_microbatches)
    losses = []
    for m in range(num_microbatches):
        out = stage.forward(inputs[m] if stage.is_first else None)
        if stage.is_last:
            losses.append(loss_fn(out, targets[m]) / num_microbatches)
        else:
            dist.send(out.detach(), stage.next, group=stage.group)
    for m in range(num_microbatches):
        if stage.is_last:
            stage.backward(None, losses[m])
        else:
            grad = torch.empty(stage.activation)
            dist.recv(grad, stage.next, group=stage.group)
            stage.backward(grad)
    total = torch.stack(losses).sum().detach() if losses else torch.zeros(())
    return _losses_on_every_rank(stage, total)


def one_f_one_b_step(
    stage: Stage,
    batch: torch.Tensor,
    target: torch.Tensor,
    loss_fn: LossFn,
    num_microbatches: int,
) -> torch.Tensor:
    """One training step with the 1F1B schedule: stage ``i`` runs ``num_stages - i - 1``
    forwards to fill the pipeline, then alternates one forward and one backward, then drains
    the backwards left. A stage's send of an activation and its receive of the gradient it
    waits for are issued together (``batch_isend_irecv``), so neighbours never wait on each
    other's order. Arguments and result as :func:`gpipe_step`."""
    inputs = batch.chunk(num_microbatches)
    targets = target.chunk(num_microbatches)
    warmup = min(stage.num_stages - stage.index - 1, num_microbatches)
    losses: list[torch.Tensor] = []
    to_backward: list[torch.Tensor] = []  # the last stage's losses not yet backpropagated
    grads: list[torch.Tensor] = []  # gradients received for outputs sent, oldest first

    def forward(m: int) -> torch.Tensor:
        out = stage.forward(inputs[m] if stage.is_first else None)
        if stage.is_last:
            losses.append(loss_fn(out, targets[m]) / num_microbatches)
            to_backward.append(losses[-1])
        return out

    def send_and_receive(out: torch.Tensor) -> None:
        # This microbatch's output goes on while the gradient of the oldest output sent comes
        # back: issued together, neither waits for the other's order.
        grad = torch.empty(stage.activation)
        ops = [
            dist.P2POp(dist.isend, out.detach(), stage.next, group=stage.group),
            dist.P2POp(dist.irecv, grad, stage.next, group=stage.group),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        grads.append(grad)

    def backward() -> None:
        if stage.is_last:
            stage.backward(None, to_backward.pop(0))
        else:
            stage.backward(grads.pop(0))

    for m in range(warmup):  # fill the pipeline (never the last stage: its warmup is 0)
        dist.send(forward(m).detach(), stage.next, group=stage.group)
    for m in range(warmup, num_microbatches):  # one forward, one backward
        out = forward(m)
        if not stage.is_last:
            send_and_receive(out)
        backward()
    while stage._inputs:  # drain
        if not stage.is_last:
            grad = torch.empty(stage.activation)
            dist.recv(grad, stage.next, group=stage.group)
            grads.append(grad)
        backward()
    total = torch.stack(losses).sum().detach() if losses else torch.zeros(())
    return _losses_on_every_rank(stage, total)


def full_parameters(stage: Stage, model: nn.Sequential) -> dict[str, torch.Tensor]:
    """Every stage's parameters, by ``model``'s names, on every rank: each stage broadcasts its
    own (``model`` is a full copy that holds the shapes; its values are not read)."""
    per = len(model) // stage.num_stages
    ranks = dist.get_process_group_ranks(stage.group or dist.group.WORLD)
    full: dict[str, torch.Tensor] = {}
    mine = dict(stage.module.named_parameters())
    for name, param in model.named_parameters():  # a stage keeps its layers' names
        owner = int(name.partition(".")[0]) // per
        value = mine[name].detach().clone() if owner == stage.index else torch.empty_like(param)
        dist.broadcast(value, ranks[owner], group=stage.group)
        full[name] = value
    return full


def _demo(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    stage = Stage(split(model, world_size)[rank], rank, world_size, activation=(4, 8))
    optim = torch.optim.SGD(stage.module.parameters(), lr=0.1)
    x, y = torch.randn(16, 8), torch.randn(16, 8)
    for step in range(3):
        loss = one_f_one_b_step(stage, x, y, nn.functional.mse_loss, num_microbatches=4)
        optim.step()
        optim.zero_grad()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}")


def _main(rank: int, world_size: int, address: str) -> None:
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=world_size)
    try:
        _demo(rank, world_size)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_main, args=(2, f"tcp://127.0.0.1:{port}"), nprocs=2)
