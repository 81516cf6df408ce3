"""Root-only engines: one wrapper around the whole model (DDP-, ZeRO-1- or ZeRO-2-style), no
units nested inside it. :class:`RootOnlyEngine` is the protocol's defaults for them, so a user's
wrapper becomes an engine of ``fsdp-testing check`` and the reference models with a name, the
wrapper class and ``wrap``.

[Note: root-only engines]
An engine with ``nested_units = False`` shards a model at its root only. The reference models
then build with every submodule plain where they would make it a unit (``sharder``,
``wrap_if_enabled``, the auto-wrap policies of ``AlwaysWrapNestedWrappedModule`` and
``TransformerWithSharedParams``), and whoever trains them wraps the root, as for any model whose
``init`` leaves the root plain (``Lockstep.build``, ``fsdp-testing check``): the engine sees the
whole model once. ``MixtureOfExperts`` needs its per-rank expert kept out of the averaging,
which a root-only engine cannot do: it raises ``NotImplementedError`` (an ``unavailable`` row).
What such an engine does with the strategy, prefetch, offload and precision options of a row is
its own business: it raises ``NotImplementedError`` for those it does not implement.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ._base import BaseEngine, PatchTarget, clean_param_name

__all__ = ["RootOnlyEngine"]


class RootOnlyEngine(BaseEngine):
    """Defaults for a root-only engine (see [Note: root-only engines]) whose parameters are full
    on every rank (data parallel, ZeRO-1 and ZeRO-2: gradients and optimizer state may be
    sharded, parameters are not). A subclass sets ``name`` and ``unit_class`` (the wrapper's
    class) and defines ``wrap``; it overrides :meth:`inner` if the wrapper keeps the user's
    module elsewhere than in ``.module``, :meth:`make_optimizer` if it shards the optimizer,
    and the full-parameter methods if it shards the parameters (ZeRO-3).

    Example::

        class ZeRO2Engine(RootOnlyEngine):
            name = "zero2"
            unit_class = ZeRO2

            def wrap(self, module, process_group=None, **fsdp_kwargs):
                return ZeRO2(module, process_group)
    """

    nested_units = False
    #: The wrapper's class (``is_wrapped`` is an ``isinstance`` check).
    unit_class: type = nn.Module

    def wrap(
        self, module: nn.Module, process_group: dist.ProcessGroup | None = None, **fsdp_kwargs: Any
    ) -> nn.Module:
        raise NotImplementedError(f"{type(self).__name__} must define wrap()")

    def inner(self, module: nn.Module) -> nn.Module:
        """The user's module inside the wrapper ``module`` (default: ``module.module``, where
        DDP keeps it)."""
        inner = getattr(module, "module", None)
        if not isinstance(inner, nn.Module):
            raise TypeError(
                f"engine {self.name!r}: {type(module).__name__} keeps no module in .module; "
                f"override {type(self).__name__}.inner() to return the wrapped module"
            )
        return inner

    def is_wrapped(self, module: nn.Module) -> bool:
        return isinstance(module, self.unit_class) and self.unit_class is not nn.Module

    def manages(self, module: nn.Module) -> bool:
        return any(self.is_wrapped(m) for m in module.modules())

    def module_wrap_policy(self, module_classes: Iterable[type[nn.Module]]) -> Any:
        raise NotImplementedError(
            f"engine {self.name!r} wraps the root only: it has no auto-wrap policies"
        )

    def always_wrap_policy(self) -> Any:
        raise NotImplementedError(
            f"engine {self.name!r} wraps the root only: it has no auto-wrap policies"
        )

    @contextlib.contextmanager
    def enable_wrap(
        self, process_group: dist.ProcessGroup | None = None, **fsdp_kwargs: Any
    ) -> Iterator[None]:
        yield  # nothing inside a model is wrapped: see [Note: root-only engines]

    def wrap_if_enabled(self, module: nn.Module) -> nn.Module:
        return module

    def full_params(
        self, module: nn.Module, *, recurse: bool = True, writeback: bool = True
    ) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # the parameters are full on every rank

    def named_full_params(self, module: nn.Module) -> list[tuple[str, torch.Tensor]]:
        return [
            (clean_param_name(name), param.detach().clone())
            for name, param in self.inner(module).named_parameters()
        ]

    def full_state_dict(self, module: nn.Module) -> dict[str, Any]:
        return {k: v.detach().clone() for k, v in self.inner(module).state_dict().items()}

    def load_full_state_dict(self, module: nn.Module, state_dict: dict[str, Any]) -> None:
        self.inner(module).load_state_dict(state_dict)

    def patch_target(self, event: str) -> PatchTarget:
        raise ValueError(
            f"engine {self.name!r} wraps the root only and names no unit transitions to patch "
            f"({event!r}); record or patch its collectives instead"
        )

    def make_optimizer(
        self, module: nn.Module, build: Callable[[Iterable[nn.Parameter]], Any]
    ) -> Any:
        return build(module.parameters())
