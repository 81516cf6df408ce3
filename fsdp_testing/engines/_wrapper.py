"""Shared implementation for engines with the FSDP1 wrapper API.

torch's ``FullyShardedDataParallel`` and ``fsdp_core.FullyShardedDataParallel`` share one
surface (constructor arguments, ``summon_full_params``, ``state_dict_type``, ``wrap`` policies),
so one class implements :class:`~fsdp_testing.engines.FSDPEngine` for both; subclasses say where
the API lives and how to prepare constructor arguments.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ._base import UNIT_EVENTS, BaseEngine, PatchTarget, clean_param_name, translate_kwargs

__all__ = ["WrapperEngine"]

_contexts = threading.local()


def _wrap_stack(engine: object) -> list[tuple[dist.ProcessGroup | None, dict[str, Any]]]:
    """This thread's ``enable_wrap`` stack for ``engine``."""
    stacks = _contexts.__dict__.setdefault("stacks", {})
    return stacks.setdefault(id(engine), [])


class WrapperEngine(BaseEngine):
    """An engine whose sharded modules are instances of an FSDP1-style wrapper class.

    Subclasses implement :meth:`_load_api`, returning a namespace with ``FSDP`` (the wrapper
    class), ``wrap_module`` (the module with ``ModuleWrapPolicy``, ``always_wrap_policy``,
    ``enable_wrap``, ``wrap``), ``StateDictType``, ``option_types`` (option name to type, for
    :func:`translate_kwargs`), ``unit_class`` and ``patch_targets`` (event to
    :class:`PatchTarget`).
    """

    name: str = ""
    _api_cache: SimpleNamespace | None = None

    def _load_api(self) -> SimpleNamespace:
        raise NotImplementedError

    @property
    def api(self) -> SimpleNamespace:
        """The lazily imported API namespace described in the class docstring."""
        if self._api_cache is None:
            self._api_cache = self._load_api()
        return self._api_cache

    def _prepare_kwargs(
        self,
        module: nn.Module,
        process_group: dist.ProcessGroup | None,
        fsdp_kwargs: dict[str, Any],
    ) -> dict[str, Any]:
        """Hook for engine-specific argument fix-ups; returns the constructor kwargs."""
        return fsdp_kwargs

    # -- wrapping -------------------------------------------------------------------------------

    def wrap(
        self, module: nn.Module, process_group: dist.ProcessGroup | None = None, **fsdp_kwargs: Any
    ) -> nn.Module:
        kwargs = translate_kwargs(fsdp_kwargs, self.api.option_types)
        kwargs = self._prepare_kwargs(module, process_group, kwargs)
        return self.api.FSDP(module, process_group, **kwargs)

    def is_wrapped(self, module: nn.Module) -> bool:
        return isinstance(module, self.api.FSDP)

    def manages(self, module: nn.Module) -> bool:
        return any(isinstance(m, self.api.FSDP) for m in module.modules())

    def module_wrap_policy(self, module_classes: Iterable[type[nn.Module]]) -> Any:
        return self.api.wrap_module.ModuleWrapPolicy(set(module_classes))

    def always_wrap_policy(self) -> Any:
        return self.api.wrap_module.always_wrap_policy

    # torch's enable_wrap keeps its context in class attributes, shared by every thread: thread
    # ranks entering it at once would wrap with each other's process group (or be refused). The
    # engine keeps its own context per thread instead, and wraps through wrap() (so the engine's
    # argument fix-ups apply); outside it, the wrapper package's own wrap() still honours a
    # context the caller opened with that package's enable_wrap.

    @contextlib.contextmanager
    def enable_wrap(
        self, process_group: dist.ProcessGroup | None = None, **fsdp_kwargs: Any
    ) -> Iterator[None]:
        translate_kwargs(fsdp_kwargs, self.api.option_types)  # reject bad options on entry
        stack = _wrap_stack(self)
        stack.append((process_group, fsdp_kwargs))
        try:
            yield
        finally:
            stack.pop()

    def wrap_if_enabled(self, module: nn.Module) -> nn.Module:
        stack = _wrap_stack(self)
        if stack:
            process_group, fsdp_kwargs = stack[-1]
            return self.wrap(module, process_group, **fsdp_kwargs)
        return self.api.wrap_module.wrap(module)

    # -- full parameters and state dicts ---------------------------------------------------------

    def full_params(
        self, module: nn.Module, *, recurse: bool = True, writeback: bool = True
    ) -> contextlib.AbstractContextManager[None]:
        if not self.manages(module):
            return contextlib.nullcontext()
        summon = self._require("summon_full_params")
        return summon(module, recurse=recurse, writeback=writeback)

    def named_full_params(self, module: nn.Module) -> list[tuple[str, torch.Tensor]]:
        with self.full_params(module, writeback=False):
            return [
                (clean_param_name(name), param.detach().clone())
                for name, param in module.named_parameters()
            ]

    @contextlib.contextmanager
    def _full_state_dict_type(self, module: nn.Module) -> Iterator[None]:
        if not self.manages(module):
            yield
            return
        state_dict_type = self._require("state_dict_type")
        if self.api.StateDictType is None:
            raise NotImplementedError(
                f"engine {self.name!r} has no StateDictType; run this test with another engine "
                "(use_engine('torch_fsdp1') or --fsdp-engine torch_fsdp1)"
            )
        with state_dict_type(module, self.api.StateDictType.FULL_STATE_DICT):
            yield

    def full_state_dict(self, module: nn.Module) -> dict[str, Any]:
        with self._full_state_dict_type(module):
            state = module.state_dict()
        return {
            k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()
        }

    def load_full_state_dict(self, module: nn.Module, state_dict: dict[str, Any]) -> None:
        with self._full_state_dict_type(module):
            module.load_state_dict(state_dict)

    # -- patching --------------------------------------------------------------------------------

    @property
    def unit_class(self) -> type:
        return self.api.unit_class

    def patch_target(self, event: str) -> PatchTarget:
        if event not in UNIT_EVENTS:
            raise ValueError(
                f"{self.name}.patch_target: unknown event {event!r}; "
                f"expected one of {', '.join(UNIT_EVENTS)}"
            )
        return self.api.patch_targets[event]

    def _require(self, attribute: str) -> Any:
        found = getattr(self.api.FSDP, attribute, None)
        if found is None:
            raise NotImplementedError(
                f"engine {self.name!r}: {self.api.FSDP.__module__}.{self.api.FSDP.__name__} "
                f"has no {attribute}() yet; run this test with another engine "
                "(use_engine('torch_fsdp1') or --fsdp-engine torch_fsdp1)"
            )
        return found
