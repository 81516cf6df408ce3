"""Which state dict layout an FSDP instance produces and takes: the settings torch's
``FSDP.state_dict_type`` / ``set_state_dict_type`` / ``get_state_dict_type`` manage, and the
save/load entry points that dispatch on them.

Every FSDP state in a tree holds a ``StateDictType``, a model ``StateDictConfig`` and an
``OptimStateDictConfig``; setting them on a module sets every state below it (as torch does),
and ``FSDP.optim_state_dict`` reads the optimizer configuration from the same place.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Mapping
from typing import Any

from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from ._runtime import FSDPState, state_of, states_in
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
    _refuse_dcp_model_and_optimizer_functions(module)
    kind = _own(module).state_dict_settings.state_dict_type
    if kind is StateDictType.FULL_STATE_DICT:
        return full_state_dict(module, prefix)
    return sharded_state_dict(module, prefix, local=kind is StateDictType.LOCAL_STATE_DICT)


def load_state_dict(
    module: nn.Module, state_dict: Mapping[str, Any], *, strict: bool = True
) -> _IncompatibleKeys:
    """Load ``state_dict`` (in the current layout) into the FSDP instance ``module``."""
    _refuse_dcp_model_and_optimizer_functions(module)
    kind = _own(module).state_dict_settings.state_dict_type
    if kind is StateDictType.FULL_STATE_DICT:
        return load_full_state_dict(module, state_dict, strict=strict)
    local = kind is StateDictType.LOCAL_STATE_DICT
    return load_sharded_state_dict(module, state_dict, strict=strict, local=local)


# [Note: DCP's state dict functions and the wrapper]
# ``torch.distributed.checkpoint.state_dict.get_state_dict``/``set_state_dict`` (and their
# optimizer halves) recognise only torch's own FSDP class. On fsdp_core's wrapper they take the
# model state as it is (full tensors: correct) but each rank's optimizer state as it is too: row
# shards as plain tensors, which ``dcp.save`` stores as if replicated, keeping rank 0's rows for
# every rank. Loading that checkpoint would corrupt the other ranks' optimizer state silently.
# Those functions always pass through the model's state_dict()/load_state_dict(), so the wrapper
# refuses there, naming fsdp_core.checkpoint (same signatures). The model-only functions
# (get_model_state_dict/set_model_state_dict) stay allowed: their result is right.
_DCP_STATE_DICT_FILE = os.path.join("distributed", "checkpoint", "state_dict.py")
_DCP_FUNCTIONS_WITH_OPTIMIZER = frozenset(
    {"get_state_dict", "set_state_dict", "get_optimizer_state_dict", "set_optimizer_state_dict"}
)


def _refuse_dcp_model_and_optimizer_functions(module: nn.Module) -> None:
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_name in _DCP_FUNCTIONS_WITH_OPTIMIZER and code.co_filename.endswith(
            _DCP_STATE_DICT_FILE
        ):
            raise RuntimeError(
                f"torch.distributed.checkpoint.state_dict.{code.co_name} was called on a model "
                f"holding fsdp_core's FullyShardedDataParallel ({type(module).__name__}): it "
                "recognises only torch's FSDP class and would save or load each rank's "
                "optimizer shard as if replicated (rank 0's rows for every rank). Use "
                f"fsdp_core.checkpoint.{code.co_name} (same signature), or "
                "fsdp_core.checkpoint.save/load; get_model_state_dict/set_model_state_dict "
                "alone work."
            )
        frame = frame.f_back  # type: ignore[assignment]


def _own(module: nn.Module) -> FSDPState:
    state = state_of(module)
    if state is None:
        raise AssertionError(f"{type(module).__name__} is not an FSDP instance")
    return state
