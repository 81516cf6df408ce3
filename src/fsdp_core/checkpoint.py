"""DCP (``torch.distributed.checkpoint``) checkpoints of either door in one call each.

[Note: DCP and the two doors]
DCP is the checkpoint engine: ``dcp.save`` / ``dcp.load`` write and read ``DTensor`` shards and
reshard them to whatever layout the loading ranks have, and its state dict functions
(``torch.distributed.checkpoint.state_dict.get_state_dict`` / ``set_state_dict`` and their
model and optimizer halves) work on both doors as they are: the sharded parameters, and so the
optimizer state, are ``DTensor``s under the original names on both (see [Note: DCP's state dict
functions and the wrapper] in ``_state_dict_types``). One difference stays: DCP switches torch's
FSDP1 class to ``SHARDED_STATE_DICT`` for the call and cannot know fsdp_core's wrapper, whose
``state_dict()`` then gives what its ``state_dict_type`` says, full tensors by default (right,
but every rank gathers the whole model). This module is a thin layer over DCP's own functions:

- :func:`get_state_dict` / :func:`set_state_dict`: DCP's, with every wrapper instance in
  ``SHARDED_STATE_DICT`` for the call, so the model state is ``DTensor`` shards as for
  ``fully_shard`` (DCP gathers them itself with ``options.full_state_dict``);
- :func:`save` / :func:`load`: ``dcp.save`` / ``dcp.load`` of ``{"model": ..., "optim": ...}``
  from them; :func:`load` first compares the parameter shapes with the checkpoint's and names
  each one that differs.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ._state_dict_types import state_dict_type
from .api import StateDictType

__all__ = ["get_state_dict", "load", "save", "set_state_dict"]

Optimizers = torch.optim.Optimizer | Iterable[torch.optim.Optimizer]


def get_state_dict(
    model: nn.Module, optimizers: Optimizers, *, options: Any = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """DCP's ``get_state_dict`` with the wrapper's sharded state dict: the model's and the
    optimizers' state dicts under parameter names, ``DTensor`` shards unless ``options`` ask
    for full tensors. Every rank must call it. See [Note: DCP and the two doors].

    Args:
        model: a model with ``fsdp_core.FSDP`` instances or ``fully_shard``-ed modules (or
            any model DCP's function takes).
        optimizers: the optimizer(s) stepping ``model``'s parameters (may be empty).
        options: a ``torch.distributed.checkpoint.state_dict.StateDictOptions`` (default
            ``None``: DCP's defaults).

    Returns:
        ``(model_state_dict, optimizer_state_dict)``.
    """
    from torch.distributed.checkpoint import state_dict as dcp_state_dict

    with _sharded_wrappers(model):
        return dcp_state_dict.get_state_dict(model, _as_tuple(optimizers), options=options)


def set_state_dict(
    model: nn.Module,
    optimizers: Optimizers,
    *,
    model_state_dict: dict[str, Any],
    optim_state_dict: dict[str, Any],
    options: Any = None,
) -> Any:
    """DCP's ``set_state_dict`` with the wrapper's sharded state dict: load what
    :func:`get_state_dict` gave (after ``dcp.load`` filled it). Every rank must call it.

    Args:
        model: as for :func:`get_state_dict`.
        optimizers: as for :func:`get_state_dict`.
        model_state_dict: the model's state dict.
        optim_state_dict: the optimizers' state dict, keyed by parameter names (``{}`` without
            optimizers).
        options: as for :func:`get_state_dict`.

    Returns:
        The model's missing and unexpected keys.
    """
    from torch.distributed.checkpoint import state_dict as dcp_state_dict

    with _sharded_wrappers(model):
        return dcp_state_dict.set_state_dict(
            model,
            _as_tuple(optimizers),
            model_state_dict=model_state_dict,
            optim_state_dict=optim_state_dict,
            options=options,
        )


def save(
    model: nn.Module,
    optimizers: Optimizers = (),
    *,
    checkpoint_id: str | os.PathLike[str],
    process_group: Any = None,
) -> None:
    """``dcp.save`` of ``{"model": ..., "optim": ...}`` from :func:`get_state_dict`.

    Args:
        model: as for :func:`get_state_dict`.
        optimizers: as for :func:`get_state_dict` (default: none, the model only).
        checkpoint_id: the checkpoint directory, shared by the ranks.
        process_group: the ranks that save (default ``None``: the default group).
    """
    import torch.distributed.checkpoint as dcp

    state = _checkpoint_state(model, optimizers)
    dcp.save(state, checkpoint_id=checkpoint_id, process_group=process_group)


def load(
    model: nn.Module,
    optimizers: Optimizers = (),
    *,
    checkpoint_id: str | os.PathLike[str],
    process_group: Any = None,
) -> None:
    """Load what :func:`save` wrote, at any world size: the model's and optimizers' state
    dicts are filled by ``dcp.load`` (which reshards) and loaded with :func:`set_state_dict`.

    A parameter whose shape differs from the checkpoint's raises ``ValueError`` naming it
    before anything is read (DCP alone would fail inside ``dcp.load`` with a size mismatch).

    Args:
        model: as for :func:`get_state_dict`.
        optimizers: as for :func:`get_state_dict` (default: none, the model only).
        checkpoint_id: the checkpoint directory, shared by the ranks.
        process_group: the ranks that load (default ``None``: the default group).
    """
    import torch.distributed.checkpoint as dcp

    state = _checkpoint_state(model, optimizers)
    _validate_shapes(
        state["model"], dcp.FileSystemReader(checkpoint_id).read_metadata(), checkpoint_id
    )
    dcp.load(state, checkpoint_id=checkpoint_id, process_group=process_group)
    set_state_dict(
        model,
        optimizers,
        model_state_dict=state["model"],
        optim_state_dict=state.get("optim", {}),
    )


def _checkpoint_state(model: nn.Module, optimizers: Optimizers) -> dict[str, Any]:
    """What :func:`save` writes and :func:`load` fills: ``{"model": ..., "optim": ...}``
    from :func:`get_state_dict` (no ``"optim"`` entry without optimizers)."""
    optims = _as_tuple(optimizers)
    model_sd, optim_sd = get_state_dict(model, optims)
    return {"model": model_sd, "optim": optim_sd} if optims else {"model": model_sd}


def _validate_shapes(model_sd: dict[str, Any], metadata: Any, path: object) -> None:
    saved = metadata.state_dict_metadata
    differ = [
        (name, tuple(saved[f"model.{name}"].size), tuple(value.shape))
        for name, value in model_sd.items()
        if isinstance(value, torch.Tensor)
        and hasattr(saved.get(f"model.{name}"), "size")
        and tuple(saved[f"model.{name}"].size) != tuple(value.shape)
    ]
    if differ:
        listed = "; ".join(f"{n!r}: {a} in the checkpoint, {b} in the model" for n, a, b in differ)
        raise ValueError(
            f"fsdp_core.checkpoint.load: the checkpoint at {str(path)!r} was saved from a model "
            f"with other parameter shapes ({listed}). Build the model with the configuration "
            "the checkpoint was saved from; a checkpoint reshards across world sizes, not "
            "across architectures."
        )


@contextlib.contextmanager
def _sharded_wrappers(model: nn.Module) -> Iterator[None]:
    """Every wrapper instance in ``model`` in ``SHARDED_STATE_DICT`` (default configs) for
    the duration, as DCP does for torch's FSDP class; the previous settings come back."""
    from .fully_sharded_data_parallel import FullyShardedDataParallel

    if not any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        yield
        return
    with state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        yield


def _as_tuple(optimizers: Optimizers) -> tuple[torch.optim.Optimizer, ...]:
    if isinstance(optimizers, torch.optim.Optimizer):
        return (optimizers,)
    return tuple(optimizers)
