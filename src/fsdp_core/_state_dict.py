"""Full state dicts: save and load unsharded tensors under the unwrapped names (the sharded and
local ones are in ``_sharded_state_dict``, the choice between them in ``_state_dict_types``).

[Note: full state dict]
Saving summons the full parameters of every unit in the tree (``writeback=False``, honouring
``FullStateDictConfig``'s ``rank0_only`` and ``offload_to_cpu``) and runs plain
``nn.Module.state_dict`` over the wrapper tree; nested wrappers see ``in_state_dict`` and do the
same instead of summoning again. The keys lose every ``_fsdp_wrapped_module`` component and each
buffer owned by an instance with ``buffer_dtype`` goes back to the dtype it had at wrap time
(see [Note: mixed precision]).

Loading summons with ``writeback=True``, renames the incoming keys to the wrapper tree's names,
runs ``nn.Module.load_state_dict`` (which copies into the summoned full parameters and into the
compute-dtype buffers, casting) and lets the summon write each rank's rows back to its shards.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from ._full_params import summon_full_params
from ._runtime import FSDPState, clean_fqn, state_of, states_in
from .api import FullStateDictConfig, TrainingState

__all__ = [
    "copy_metadata",
    "full_state_dict",
    "give_metadata",
    "load_full_state_dict",
    "saved_entry",
    "validate_idle",
]

IDLE = TrainingState.IDLE


def validate_idle(api: str, states: list[FSDPState]) -> None:
    """Sharded and local state dicts are taken between training steps, from the shards."""
    busy = [s.fqn or type(s.owner).__name__ for s in states]
    busy = [n for s, n in zip(states, busy, strict=True) if s.training_state is not IDLE]
    unsharded = [s.fqn for s in states if s.unit is not None and s.unit.is_unsharded]
    if busy or unsharded:
        raise RuntimeError(
            f"{api} with a sharded or local state dict type runs between training steps, on "
            f"the shards; FSDP instances {busy or unsharded} are inside a step (or hold "
            "unsharded parameters from a forward whose backward has not run). Call it after "
            "the backward, or run that forward under torch.no_grad()."
        )


def full_state_dict(module: nn.Module, prefix: str = "") -> OrderedDict[str, Any]:
    """The full state dict of the FSDP instance ``module``. See [Note: full state dict]."""
    own = state_of(module)
    if own is None:
        raise AssertionError(f"[rank {dist.get_rank()}] full_state_dict needs an FSDP instance")
    config = own.state_dict_settings.state_dict_config
    if not isinstance(config, FullStateDictConfig):
        raise AssertionError(f"[rank {dist.get_rank()}] FULL_STATE_DICT with {config!r}")
    with (
        _plain_state_dicts(module),
        summon_full_params(
            module,
            recurse=True,
            writeback=False,
            rank0_only=config.rank0_only,
            offload_to_cpu=config.offload_to_cpu,
        ),
    ):
        raw = nn.Module.state_dict(module, prefix=prefix)
    result: OrderedDict[str, Any] = OrderedDict()
    if config.rank0_only and dist.get_rank() != 0:
        return result
    orig_dtypes = _buffer_orig_dtypes(module, prefix)
    for key, value in raw.items():
        name = clean_fqn(key)
        result[name] = saved_entry(value, orig_dtypes.get(name), config.offload_to_cpu)
    copy_metadata(raw, result)
    return result


def saved_entry(value: Any, orig_dtype: torch.dtype | None, offload: bool) -> Any:
    """A state dict value as saved: tensors detached, a buffer back in its original dtype
    (``orig_dtype``, under mixed precision), on the CPU when ``offload``."""
    if isinstance(value, torch.Tensor):
        value = value.detach()
        if orig_dtype is not None:
            value = value.to(orig_dtype)
        if offload:
            value = value.cpu()
    return value


def copy_metadata(raw: Mapping[str, Any], result: OrderedDict[str, Any]) -> None:
    """Give ``result`` the ``_metadata`` of ``raw`` under clean names (the versions modules
    check on load); the inner module's entry comes after its wrapper's and wins."""
    metadata = getattr(raw, "_metadata", None)
    if metadata is not None:
        result._metadata = OrderedDict(  # type: ignore[attr-defined]
            (clean_fqn(k), v) for k, v in metadata.items()
        )


def load_full_state_dict(
    module: nn.Module, state_dict: Mapping[str, Any], *, strict: bool = True
) -> _IncompatibleKeys:
    """Load a full state dict into the FSDP instance ``module``. See [Note: full state dict]."""
    own = state_of(module)
    if own is None:
        raise AssertionError(f"[rank {dist.get_rank()}] load_full_state_dict needs FSDP")
    # DTensors (DCP passes them with full_state_dict=True) become full tensors first: a
    # collective per tensor, in the state dict's order, which is the same on every rank.
    full = OrderedDict((k, _full(v)) for k, v in state_dict.items())
    with _plain_state_dicts(module), summon_full_params(module, recurse=True, writeback=True):
        real_names = {clean_fqn(k): k for k in nn.Module.state_dict(module, keep_vars=True)}
        renamed: OrderedDict[str, Any] = OrderedDict(
            (real_names.get(k, k), v) for k, v in full.items()
        )
        give_metadata(module, state_dict, renamed)
        result = nn.Module.load_state_dict(module, renamed, strict=False)
    missing = [clean_fqn(k) for k in result.missing_keys]
    unexpected = [clean_fqn(k) for k in result.unexpected_keys]
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"Error(s) in loading state_dict for {type(module).__name__}: missing keys "
            f"{missing}, unexpected keys {unexpected}. A full state dict uses the unwrapped "
            "module's names; pass strict=False to load a partial one."
        )
    return _IncompatibleKeys(missing, unexpected)


def give_metadata(module: nn.Module, state_dict: Mapping[str, Any], renamed: Any) -> None:
    """Give ``renamed`` (what ``nn.Module.load_state_dict`` gets on the wrapper tree) the
    ``_metadata`` of ``state_dict`` under the wrapper tree's module names, which the modules'
    ``_load_from_state_dict`` look their versions up by."""
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        renamed._metadata = OrderedDict(
            (name, metadata[clean_fqn(name)])
            for name, _ in module.named_modules(remove_duplicate=False)
            if clean_fqn(name) in metadata
        )


def _full(value: Any) -> Any:
    full_tensor = getattr(value, "full_tensor", None)
    return full_tensor() if full_tensor is not None else value


@contextlib.contextmanager
def _plain_state_dicts(module: nn.Module) -> Iterator[None]:
    """Nested instances' ``state_dict`` behaves like ``nn.Module``'s while this is active."""
    states = states_in(module)
    for state in states:
        state.in_state_dict = True
    try:
        yield
    finally:
        for state in states:
            state.in_state_dict = False


def _buffer_orig_dtypes(module: nn.Module, prefix: str) -> dict[str, torch.dtype]:
    """State dict key (clean) -> wrap-time dtype of every buffer an instance casts."""
    names = {id(m): clean_fqn(name) for name, m in module.named_modules()}
    found: dict[str, torch.dtype] = {}
    for state in states_in(module):
        if state.config.buffer_dtype is None:
            continue
        for slot in state.buffers:
            owner = names.get(id(slot.module))
            if owner is None:
                continue
            found[clean_fqn(prefix + (f"{owner}." if owner else "") + slot.name)] = slot.orig_dtype
    return found
