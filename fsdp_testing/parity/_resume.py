"""Resume parity: a run checkpointed with DCP and resumed at another world size continues with
the losses of the uninterrupted run.

[Note: resuming at another world size]
The harness launches one world per test, so :func:`check_resume_parity` runs both world sizes
inside it on subgroups: the ranks ``0 .. from_world - 1`` of ``process_group`` train first and
the ranks ``0 .. to_world - 1`` resume, each phase on its own ``dist.new_group`` (the launched
world must hold ``max(from_world, to_world)`` ranks; the others wait at a barrier). The
checkpoint directory must be one that every rank sees: pytest's ``tmp_path`` is made in the
parent and travels to every rank, so it is.

For the losses of two world sizes to be comparable every step consumes one *global* batch
(``get_batch(step)``), split by rows across the ranks of the phase: with equal row counts
per rank the average of the ranks' mean losses (what the reported loss is) and of their
gradients (what the engines reduce) is the global batch's, at any world size.

1. Phase A (``from_world`` ranks): build, shard, train ``num_steps`` steps, recording every
   loss (the reference); after step ``save_after`` save the model and optimizer state with
   DCP's own functions, the way a user of any engine does: ``dcp.save`` of ``{"model": ...,
   "optim": ...}`` from ``torch.distributed.checkpoint.state_dict.get_state_dict(model, optim,
   options=options)``, and keep the full parameters.
2. Phase B (``to_world`` ranks): build and shard a fresh model (``resume_shard``, another door
   if given), ``dcp.load`` the checkpoint into the state dicts of its ``get_state_dict`` (same
   options), load them with DCP's ``set_state_dict``, and train steps
   ``save_after .. num_steps - 1``.

What the model's state dict holds is the engine's business: ``DTensor`` shards for FSDP2 and
``fully_shard``, the state dict type's layout for torch's FSDP1 (DCP picks sharded) and for
``fsdp_core.FSDP`` (full tensors unless the ``shard`` function set ``SHARDED_STATE_DICT``).
3. Compare, on every rank: the full parameters right after loading must equal the saved ones
   bitwise (a load moves bytes, no arithmetic); the resumed losses must equal the reference's,
   bitwise when the world size is unchanged, else within ``tolerance`` (default
   ``FP32_TOLERANCE``: the reductions sum the ranks' terms in another order).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ._compare import FP32_TOLERANCE, Tolerance, compare_named, format_divergences

__all__ = ["ResumeReport", "check_resume_parity"]

Shard = Callable[[nn.Module, dist.ProcessGroup], nn.Module]


@dataclass(frozen=True)
class ResumeReport:
    """What :func:`check_resume_parity` compared (every rank gets the same report)."""

    from_world: int
    to_world: int
    save_after: int
    #: The uninterrupted run's loss at every step (phase A).
    reference_losses: tuple[float, ...]
    #: The resumed run's losses, steps ``save_after`` onwards (phase B).
    resumed_losses: tuple[float, ...]


def _adamw(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def _mean_square(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).float().pow(2).mean()


def check_resume_parity(
    build_model: Callable[[], nn.Module],
    shard: Shard,
    get_batch: Callable[[int], Any],
    *,
    process_group: dist.ProcessGroup,
    checkpoint_dir: str | os.PathLike[str],
    from_world: int,
    to_world: int,
    num_steps: int = 4,
    save_after: int = 2,
    resume_shard: Shard | None = None,
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] = _adamw,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] = _mean_square,
    tolerance: Tolerance = FP32_TOLERANCE,
    options: Any = None,
) -> ResumeReport:
    """Train at ``from_world``, checkpoint with DCP, resume at ``to_world``, compare with the
    uninterrupted run; raise ``AssertionError`` on every rank if they differ. See
    [Note: resuming at another world size]. Every rank of the default group must call it.

    Args:
        build_model: a new unsharded model, identical on every rank and every call.
        shard: ``shard(model, group)`` applies the engine (e.g. ``fsdp_core.FSDP`` or
            ``fully_shard`` on ``DeviceMesh.from_group(group, ...)``) and returns the model.
        get_batch: the global batch of a step: a tensor, or a tuple, list or dict of tensors
            with one row count (dim 0), divisible by both world sizes; each rank gets its
            rows of every tensor.
        process_group: the launched group, at least ``max(from_world, to_world)`` ranks.
        checkpoint_dir: a directory every rank sees (``tmp_path``).
        from_world: ranks of the uninterrupted run.
        to_world: ranks of the resumed run.
        num_steps: steps of the uninterrupted run (default 4).
        save_after: the checkpoint is taken after this many steps (default 2).
        resume_shard: the engine of the resumed run (default ``None``: ``shard``).
        make_optimizer: builds the optimizer (default AdamW, lr 1e-2, weight decay 0.01).
        loss_fn: ``loss_fn(model, local_batch)``, a mean over the rows; ``local_batch`` has
            ``get_batch``'s structure (default: mean square of ``model(local_batch)``).
        tolerance: for losses across different world sizes (default ``FP32_TOLERANCE``).
        options: the ``torch.distributed.checkpoint.state_dict.StateDictOptions`` of the
            saving and the loading calls (default ``None``: DCP's defaults, sharded values);
            ``full_state_dict=True`` saves and loads full tensors. ``cpu_offload`` together
            with ``full_state_dict`` is not supported (only rank 0 would get a state dict).
    """
    world = dist.get_world_size(process_group)
    if not (1 <= from_world <= world and 1 <= to_world <= world):
        raise ValueError(
            f"check_resume_parity: from_world={from_world} and to_world={to_world} must be "
            f"between 1 and the launched world size {world}; launch "
            f"max(from_world, to_world) = {max(from_world, to_world)} ranks."
        )
    if options is not None and options.full_state_dict and options.cpu_offload:
        raise ValueError(
            "check_resume_parity: options with full_state_dict=True and cpu_offload=True give "
            "rank 0 alone a state dict, which dcp.save/dcp.load cannot use on every rank; "
            "drop one of the two."
        )
    if not 0 < save_after < num_steps:
        raise ValueError(
            f"check_resume_parity: save_after={save_after} must be between 1 and "
            f"num_steps - 1 = {num_steps - 1}."
        )
    group_a = _first_ranks(process_group, from_world)
    group_b = _first_ranks(process_group, to_world)
    reference: list[float] = []
    saved: dict[str, torch.Tensor] = {}
    if group_a is not None:
        model = shard(build_model(), group_a)
        optim = make_optimizer(model.parameters())
        for step in range(num_steps):
            reference.append(_train_step(model, optim, loss_fn, get_batch(step), group_a))
            if step + 1 == save_after:
                _save(model, optim, checkpoint_dir, group_a, options)
                saved = _full_state(model)
    dist.barrier(group=process_group)  # the checkpoint is complete before anyone loads it
    resumed: list[float] = []
    loaded: dict[str, torch.Tensor] = {}
    if group_b is not None:
        model = (resume_shard or shard)(build_model(), group_b)
        optim = make_optimizer(model.parameters())
        _load(model, optim, checkpoint_dir, group_b, options)
        loaded = _full_state(model)
        for step in range(save_after, num_steps):
            resumed.append(_train_step(model, optim, loss_fn, get_batch(step), group_b))
    # Rank 0 is in both phases: its view decides, and every rank raises the same error.
    message = _compare(
        saved, loaded, reference, resumed, save_after, from_world, to_world, tolerance
    )
    shared: list[Any] = [(message, tuple(reference), tuple(resumed))]
    dist.broadcast_object_list(
        shared, src=dist.get_global_rank(process_group, 0), group=process_group
    )
    message, reference_losses, resumed_losses = shared[0]
    if message:
        raise AssertionError(f"[rank {dist.get_rank()}] {message}")
    return ResumeReport(from_world, to_world, save_after, reference_losses, resumed_losses)


def _first_ranks(group: dist.ProcessGroup, n: int) -> dist.ProcessGroup | None:
    """The group of ``group``'s first ``n`` ranks, or ``None`` on the ranks outside it."""
    ranks = dist.get_process_group_ranks(group)
    sub = group if n == len(ranks) else dist.new_group(ranks=ranks[:n])
    return sub if dist.get_rank(group) < n else None


def _rows(batch: Any) -> set[int]:
    if isinstance(batch, torch.Tensor):
        return {batch.shape[0]} if batch.dim() else set()
    if isinstance(batch, dict):
        return set().union(*(_rows(v) for v in batch.values()))
    if isinstance(batch, (list, tuple)):
        return set().union(*(_rows(v) for v in batch))
    return set()


def _split(batch: Any, size: int, rank: int, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.chunk(size)[rank].to(device) if batch.dim() else batch.to(device)
    if isinstance(batch, dict):
        return {k: _split(v, size, rank, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        parts = [_split(v, size, rank, device) for v in batch]
        return type(batch)(*parts) if hasattr(batch, "_fields") else type(batch)(parts)
    return batch


def _local_rows(batch: Any, size: int, rank: int, device: torch.device) -> Any:
    """This rank's rows of every tensor of the global batch (a tensor, or tuples, lists and
    dicts of them; other values are passed as they are)."""
    rows = _rows(batch)
    if len(rows) != 1:
        found = "no tensor with rows" if not rows else f"tensors of {sorted(rows)} rows"
        raise ValueError(
            f"check_resume_parity: get_batch returned {type(batch).__name__} with {found}; "
            "return the global batch as a tensor, or a tuple, list or dict of tensors with one "
            "row count (dim 0), which the ranks split."
        )
    (count,) = rows
    if count % size:
        raise ValueError(
            f"check_resume_parity: the global batch has {count} rows, which {size} "
            "ranks cannot split evenly; return a row count divisible by both world sizes "
            "(12 serves 2, 3 and 4)."
        )
    return _split(batch, size, rank, device)


def _train_step(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    batch: Any,
    group: dist.ProcessGroup,
) -> float:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    device = next(iter(model.parameters())).device
    loss = loss_fn(model, _local_rows(batch, size, rank, device))
    loss.backward()
    optim.step()
    optim.zero_grad()
    total = loss.detach().float().reshape(1).clone()
    dist.all_reduce(total, group=group)
    return float(total.item()) / size


def _save(
    model: nn.Module, optim: torch.optim.Optimizer, path: Any, group: Any, options: Any
) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optim, options=options)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path, process_group=group)


def _load(
    model: nn.Module, optim: torch.optim.Optimizer, path: Any, group: Any, options: Any
) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    # The fresh model's own state dicts (DCP gives a fresh optimizer its state tensors) are
    # what dcp.load fills, resharded to this world size.
    model_sd, optim_sd = get_state_dict(model, optim, options=options)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path, process_group=group)
    set_state_dict(
        model, optim, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options
    )


def _full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full copies of the model's parameters and buffers, by name (collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    model_sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {
        name: value.detach().cpu().clone()
        for name, value in model_sd.items()
        if isinstance(value, torch.Tensor)
    }


def _compare(
    saved: dict[str, torch.Tensor],
    loaded: dict[str, torch.Tensor],
    reference: list[float],
    resumed: list[float],
    save_after: int,
    from_world: int,
    to_world: int,
    tolerance: Tolerance,
) -> str:
    what = f"resumed at world size {to_world} from a checkpoint saved at {from_world}"
    divergences = compare_named(sorted(saved.items()), sorted(loaded.items()), exact=True)
    if divergences:
        return (
            f"check_resume_parity: the model {what} after step {save_after} does not hold the "
            f"saved state:\n{format_divergences(divergences)}"
        )
    expected = torch.tensor(reference[save_after:], dtype=torch.float64)
    actual = torch.tensor(resumed, dtype=torch.float64)
    exact = from_world == to_world
    close = (
        torch.equal(expected, actual)
        if exact
        else torch.allclose(actual, expected, rtol=tolerance.rtol, atol=tolerance.atol)
    )
    if close:
        return ""
    rule = "bitwise" if exact else f"within rtol={tolerance.rtol}, atol={tolerance.atol}"
    return (
        f"check_resume_parity: the run {what} diverged from the uninterrupted run ({rule}): "
        f"losses from step {save_after} on: uninterrupted {reference[save_after:]}, "
        f"resumed {resumed}."
    )
