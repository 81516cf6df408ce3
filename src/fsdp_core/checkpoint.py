"""``get_state_dict`` / ``set_state_dict`` for DCP (``torch.distributed.checkpoint``) that
also cover the wrapper door.

[Note: DCP and the two doors]
DCP is the checkpoint engine: ``dcp.save`` / ``dcp.load`` write and read ``DTensor`` shards
and reshard them to whatever layout the loading ranks have. Its model and optimizer state dict
functions, ``torch.distributed.checkpoint.state_dict.get_state_dict`` / ``set_state_dict``,
work on the composable door as they are: a ``fully_shard``-ed module's ``state_dict()`` and its
optimizer's state are ``DTensor``s under the original names. For the wrapper door they cannot:
they find FSDP1 modules with torch's own ``FullyShardedDataParallel.fsdp_modules`` and call
torch's ``FSDP.optim_state_dict`` only for those, so for ``fsdp_core.FSDP`` they would return
the optimizer state as each rank's plain local tensors, which DCP takes for replicated values
(it would save rank 0's rows only). The two functions here keep DCP's signatures: with no
wrapper instance in the model they call DCP's own; otherwise they use the wrapper's
``SHARDED_STATE_DICT`` (``FULL_STATE_DICT`` with ``options.full_state_dict``) and
``FSDP.optim_state_dict`` / ``optim_state_dict_to_load``, whose values DCP saves and reshards
like the composable door's. A checkpoint written through either door loads through the other.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from . import _optim_state
from ._state_dict_types import state_dict_type
from .api import StateDictType

__all__ = ["get_state_dict", "load", "save", "set_state_dict"]


def get_state_dict(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    *,
    options: Any = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's and the optimizers' state dicts, ready for ``dcp.save`` / ``dcp.load``.

    Every rank must call it. See [Note: DCP and the two doors].

    Args:
        model: a model with ``fsdp_core.FSDP`` instances or ``fully_shard``-ed modules.
        optimizers: the optimizer(s) stepping ``model``'s parameters.
        options: a ``torch.distributed.checkpoint.state_dict.StateDictOptions`` (default
            ``None``: sharded ``DTensor`` values). For the wrapper door only
            ``full_state_dict`` and ``cpu_offload`` are honoured.

    Returns:
        ``(model_state_dict, optimizer_state_dict)``, keyed by parameter names.
    """
    from torch.distributed.checkpoint import state_dict as dcp_state_dict

    optims = _as_tuple(optimizers)
    if not _has_wrapper(model):
        return dcp_state_dict.get_state_dict(model, optims, options=options)
    with state_dict_type(model, *_settings(options)):
        model_sd = model.state_dict()
        optim_sd: dict[str, Any] = {"state": {}, "param_groups": []}
        for optim in optims:
            _init_optim_state(optim)
            one = _optim_state.optim_state_dict(model, optim)
            optim_sd["state"].update(one.get("state", {}))
            optim_sd["param_groups"].extend(one.get("param_groups", []))
    return model_sd, optim_sd


def set_state_dict(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    *,
    model_state_dict: dict[str, Any],
    optim_state_dict: dict[str, Any],
    options: Any = None,
) -> Any:
    """Load what :func:`get_state_dict` gave (after ``dcp.load`` filled it) into the model
    and the optimizers. Every rank must call it.

    Args:
        model: as for :func:`get_state_dict`.
        optimizers: as for :func:`get_state_dict`.
        model_state_dict: the model's state dict.
        optim_state_dict: the optimizers' state dict, keyed by parameter names.
        options: as for :func:`get_state_dict`; ``strict`` is honoured for the wrapper door.

    Returns:
        The model's missing and unexpected keys.
    """
    from torch.distributed.checkpoint import state_dict as dcp_state_dict

    optims = _as_tuple(optimizers)
    if not _has_wrapper(model):
        return dcp_state_dict.set_state_dict(
            model,
            optims,
            model_state_dict=model_state_dict,
            optim_state_dict=optim_state_dict,
            options=options,
        )
    strict = True if options is None else bool(options.strict)
    with state_dict_type(model, *_settings(options)):
        result = model.load_state_dict(model_state_dict, strict=strict)
        names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        for optim in optims:
            _init_optim_state(optim)
            mine = {names.get(id(p)) for g in optim.param_groups for p in g["params"]}
            own = {
                "state": {k: v for k, v in optim_state_dict["state"].items() if k in mine},
                "param_groups": [
                    g for g in optim_state_dict["param_groups"] if set(g["params"]) <= mine
                ],
            }
            optim.load_state_dict(_optim_state.optim_state_dict_to_load(model, optim, own))
    return result


def save(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] = (),
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
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] = (),
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


def _checkpoint_state(
    model: nn.Module, optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer]
) -> dict[str, Any]:
    """What :func:`save` writes and :func:`load` fills: ``{"model": ..., "optim": ...}``
    from :func:`get_state_dict` (no ``"optim"`` entry without optimizers)."""
    model_sd, optim_sd = get_state_dict(model, optimizers)
    return {"model": model_sd, "optim": optim_sd} if _as_tuple(optimizers) else {"model": model_sd}


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


def _has_wrapper(model: nn.Module) -> bool:
    from .fully_sharded_data_parallel import FullyShardedDataParallel

    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


def _settings(options: Any) -> tuple[StateDictType, Any, Any]:
    from .api import (
        FullOptimStateDictConfig,
        FullStateDictConfig,
        ShardedOptimStateDictConfig,
        ShardedStateDictConfig,
    )

    offload = bool(getattr(options, "cpu_offload", False))
    if options is not None and options.full_state_dict:
        return (
            StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(offload_to_cpu=offload),
            FullOptimStateDictConfig(offload_to_cpu=offload),
        )
    return (
        StateDictType.SHARDED_STATE_DICT,
        ShardedStateDictConfig(offload_to_cpu=offload),
        ShardedOptimStateDictConfig(offload_to_cpu=offload),
    )


def _as_tuple(
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
) -> tuple[torch.optim.Optimizer, ...]:
    if isinstance(optimizers, torch.optim.Optimizer):
        return (optimizers,)
    return tuple(optimizers)


def _init_optim_state(optim: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer its state tensors (a step with zero gradients and a learning
    rate of zero), so that ``dcp.load`` has tensors to read the saved state into."""
    if optim.state:
        return
    params = [p for g in optim.param_groups for p in g["params"] if p.requires_grad]
    if any(p.grad is not None for p in params):
        return
    for param in params:
        param.grad = torch.zeros_like(param)
    lrs = [g["lr"] for g in optim.param_groups]
    for group in optim.param_groups:
        group["lr"] = 0.0
    optim.step()
    for group, lr in zip(optim.param_groups, lrs, strict=True):
        group["lr"] = lr
    optim.zero_grad(set_to_none=True)
