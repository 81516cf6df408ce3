"""Which state dict layout an FSDP instance produces and takes: the settings torch's
``FSDP.state_dict_type`` / ``set_state_dict_type`` / ``get_state_dict_type`` manage, and the
save/load entry points that dispatch on them.

Every FSDP state in a tree holds a ``StateDictType``, a model ``StateDictConfig`` and an
``OptimStateDictConfig``; setting them on a module sets every state below it (as torch does),
and ``FSDP.optim_state_dict`` reads the optimizer configuration from the same place.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from ._runtime import WRAPPED_MODULE_NAME, FSDPState, state_of, states_in
from ._sharded_state_dict import load_sharded_state_dict, sharded_state_dict
from ._state_dict import full_state_dict, load_full_state_dict
from .api import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
    default_state_dict_settings,
)

__all__ = [
    "fqn_modifiers",
    "get_state_dict_type",
    "load_state_dict",
    "save_state_dict",
    "set_state_dict_type",
    "state_dict_type",
]

# state dict type -> (model config class, optimizer config class), as in torch
_CONFIGS: dict[StateDictType, tuple[type[StateDictConfig], type[OptimStateDictConfig]]] = {
    StateDictType.FULL_STATE_DICT: (FullStateDictConfig, FullOptimStateDictConfig),
    StateDictType.LOCAL_STATE_DICT: (LocalStateDictConfig, LocalOptimStateDictConfig),
    StateDictType.SHARDED_STATE_DICT: (ShardedStateDictConfig, ShardedOptimStateDictConfig),
}


def set_state_dict_type(
    module: nn.Module,
    state_dict_type: StateDictType,
    state_dict_config: StateDictConfig | None = None,
    optim_state_dict_config: OptimStateDictConfig | None = None,
) -> StateDictSettings:
    """Set the state dict layout of every FSDP instance in ``module`` (torch's
    ``FSDP.set_state_dict_type``); returns the previous settings.

    Args:
        module: an FSDP instance or a module containing some.
        state_dict_type: ``FULL_STATE_DICT`` (the default), ``SHARDED_STATE_DICT``
            (``DTensor`` shards, what DCP saves and reshards) or ``LOCAL_STATE_DICT`` (flat
            local shards). See docs/core.md, "Checkpoints".
        state_dict_config: the matching ``FullStateDictConfig``, ``ShardedStateDictConfig``
            or ``LocalStateDictConfig`` (default ``None``: its defaults).
        optim_state_dict_config: the matching ``FullOptimStateDictConfig``,
            ``ShardedOptimStateDictConfig`` or ``LocalOptimStateDictConfig`` that
            ``FSDP.optim_state_dict`` follows (default ``None``: its defaults).
    """
    if not isinstance(state_dict_type, StateDictType):
        raise TypeError(
            f"state_dict_type takes a StateDictType, got {state_dict_type!r}; e.g. "
            "StateDictType.SHARDED_STATE_DICT."
        )
    model_cls, optim_cls = _CONFIGS[state_dict_type]
    config = model_cls() if state_dict_config is None else state_dict_config
    optim_config = optim_cls() if optim_state_dict_config is None else optim_state_dict_config
    for given, expected, arg in (
        (config, model_cls, "state_dict_config"),
        (optim_config, optim_cls, "optim_state_dict_config"),
    ):
        if type(given) is not expected:
            raise TypeError(
                f"state_dict_type({state_dict_type}, {arg}=...) takes a {expected.__name__}, "
                f"got {given!r}; pass {expected.__name__}(...) or None for its defaults."
            )
    states = states_in(module)
    previous = states[0].state_dict_settings if states else default_state_dict_settings()
    settings = StateDictSettings(state_dict_type, config, optim_config)
    for state in states:
        state.state_dict_settings = settings
    return previous


def get_state_dict_type(module: nn.Module) -> StateDictSettings:
    """The state dict settings of the FSDP instances in ``module`` (they must all agree).

    Args:
        module: an FSDP instance or a module containing some.
    """
    settings = {state.state_dict_settings for state in states_in(module)}
    if not settings:
        raise ValueError(
            f"get_state_dict_type: {type(module).__name__} contains no FSDP instance; pass a "
            "module wrapped with FullyShardedDataParallel (or containing one)."
        )
    if len(settings) > 1:
        raise ValueError(
            f"get_state_dict_type: the FSDP instances in {type(module).__name__} disagree: "
            f"{sorted(map(str, settings))}. Set them together with "
            "FSDP.set_state_dict_type(root, ...)."
        )
    return settings.pop()


@contextlib.contextmanager
def state_dict_type(
    module: nn.Module,
    state_dict_type: StateDictType,
    state_dict_config: StateDictConfig | None = None,
    optim_state_dict_config: OptimStateDictConfig | None = None,
) -> Iterator[None]:
    """Context manager: ``set_state_dict_type`` with the same arguments for its duration,
    each instance's previous settings restored on exit (torch's ``FSDP.state_dict_type``)."""
    states = states_in(module)
    previous = [s.state_dict_settings for s in states]
    set_state_dict_type(module, state_dict_type, state_dict_config, optim_state_dict_config)
    try:
        yield
    finally:
        for state, settings in zip(states, previous, strict=True):
            state.state_dict_settings = settings


def save_state_dict(module: nn.Module, prefix: str = "") -> Any:
    """The state dict of the FSDP instance ``module`` in its current layout."""
    kind = _own(module).state_dict_settings.state_dict_type
    if kind is StateDictType.FULL_STATE_DICT:
        return full_state_dict(module, prefix)
    return sharded_state_dict(module, prefix, local=kind is StateDictType.LOCAL_STATE_DICT)


def load_state_dict(
    module: nn.Module, state_dict: Mapping[str, Any], *, strict: bool = True
) -> _IncompatibleKeys:
    """Load ``state_dict`` (in the current layout) into the FSDP instance ``module``."""
    kind = _own(module).state_dict_settings.state_dict_type
    if kind is StateDictType.FULL_STATE_DICT:
        return load_full_state_dict(module, state_dict, strict=strict)
    local = kind is StateDictType.LOCAL_STATE_DICT
    return load_sharded_state_dict(module, state_dict, strict=strict, local=local)


# [Note: DCP's state dict functions and the wrapper]
# ``torch.distributed.checkpoint.state_dict``'s functions (``get_state_dict``,
# ``set_state_dict``, their model and optimizer halves) special-case only torch's own FSDP
# class; any other model they treat as torch treats FSDP2 and DDP models, and fsdp_core's
# wrapper gives them what that takes:
#
# - the model state is ``model.state_dict()`` / ``load_state_dict()`` in the layout the
#   wrapper's ``state_dict_type`` sets (full tensors by default, ``DTensor`` shards under
#   ``SHARDED_STATE_DICT``); a full load also takes ``DTensor``s, which is what DCP passes with
#   ``full_state_dict=True``;
# - the optimizer state is ``optim.state_dict()`` keyed by ``model.named_parameters()``
#   names: the sharded parameters are ``DTensor``s (see [Note: the wrapper's DTensor
#   parameters] in ``_param``), so the optimizer's state tensors are ``DTensor``s laid out like
#   them, which DCP saves, gathers (``full_state_dict``) and reshards like FSDP2's;
# - DCP walks the module tree (``named_children``) for the names of the parameters it
#   loads optimizer state into; :func:`fqn_modifiers` tells it to leave out the wrapper's
#   ``_fsdp_wrapped_module`` level, as ``named_parameters()`` and ``state_dict()`` do.
#
# DCP switches torch's FSDP class to ``SHARDED_STATE_DICT`` itself; for the wrapper the caller
# does (``FSDP.set_state_dict_type``), or ``fsdp_core.checkpoint`` does it for the call.


def fqn_modifiers(module: nn.Module) -> dict[str, str]:
    """DCP's ``_fqn_modifiers`` of a wrapper instance: every name directly on the wrapped
    module maps to the wrapper level that state dict keys leave out."""
    wrapped = module._modules.get(WRAPPED_MODULE_NAME)
    if wrapped is None:
        return {}
    names = [*wrapped._modules, *wrapped._parameters, *wrapped._buffers]
    return dict.fromkeys(names, WRAPPED_MODULE_NAME)


def _own(module: nn.Module) -> FSDPState:
    state = state_of(module)
    if state is None:
        raise AssertionError(f"{type(module).__name__} is not an FSDP instance")
    return state
