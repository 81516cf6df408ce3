"""Models that sleep at chosen points (the sleeps themselves are
:mod:`fsdp_testing.patching.delays`: see [Note: delays under thread ranks] there)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ..patching import collective_targets, delays
from ..patching.delays import delayed_calls, sleep_ms
from ._base import DEVICEInitMode, FSDPInitMode, FSDPTestModel
from .nested import NestedWrappedModule

__all__ = ["ModuleWithDelay", "NestedWrappedModuleWithDelay", "delayed_calls", "sleep_ms"]


def _module_device(module: nn.Module) -> torch.device:
    for param in module.parameters():
        return param.device
    return torch.device("cpu")


class ModuleWithDelay(FSDPTestModel):
    """Wraps an :class:`FSDPTestModel` and sleeps after the loss and/or before each gradient
    reduction collective called from Python during :meth:`run_backward` (every spelling of the
    ``reduce_scatter`` and ``all_reduce`` families in :mod:`fsdp_testing.collectives`), on CPU
    or CUDA.

    Args:
        module: the wrapped test model (kept as ``self.module``).
        delay_after_loss_ms: sleep after computing the loss.
        delay_before_reduction_ms: sleep before each gradient reduction collective.
    """

    def __init__(
        self, module: nn.Module, delay_after_loss_ms: int, delay_before_reduction_ms: int
    ) -> None:
        super().__init__()
        self.module = module
        self.delay_after_loss_ms = delay_after_loss_ms
        self.delay_before_reduction_ms = delay_before_reduction_ms

    def _inner(self) -> FSDPTestModel:
        inner: Any = self.module
        while not isinstance(inner, FSDPTestModel) and hasattr(inner, "module"):
            inner = inner.module
        if not isinstance(inner, FSDPTestModel):
            raise TypeError(f"ModuleWithDelay wraps {type(inner).__name__}, not an FSDPTestModel")
        return inner

    def get_input(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        return self._inner().get_input(device)

    def forward(self, *args: Any) -> Any:
        return self.module(*args)

    def get_loss(self, input: Any, output: Any) -> torch.Tensor:
        loss = self._inner().get_loss(input, output)
        delays.sleep_ms(self.delay_after_loss_ms, _module_device(self))
        return loss

    def run_backward(self, loss: torch.Tensor) -> None:
        device = _module_device(self)
        delay = self.delay_before_reduction_ms
        with (
            delayed_calls(collective_targets("reduce_scatter"), delay, device),
            delayed_calls(collective_targets("all_reduce"), delay, device),
        ):
            self._inner().run_backward(loss)

    @staticmethod
    def init(
        module_class: type[FSDPTestModel],
        *model_args: Any,
        delay_after_loss_ms: int,
        delay_before_reduction_ms: int,
        **model_kwargs: Any,
    ) -> nn.Module:
        """Builds ``module_class.init(*model_args, **model_kwargs)`` and adds the delays.

        Args:
            module_class: the test model class to wrap.
            model_args: positional arguments of ``module_class.init``.
            delay_after_loss_ms: sleep after the loss (ms).
            delay_before_reduction_ms: sleep before each gradient reduction (ms).
            model_kwargs: keyword arguments of ``module_class.init``.
        """
        inner = module_class.init(*model_args, **model_kwargs)
        return ModuleWithDelay(inner, delay_after_loss_ms, delay_before_reduction_ms)


class NestedWrappedModuleWithDelay(ModuleWithDelay):
    """:class:`~fsdp_testing.models.NestedWrappedModule` with :class:`ModuleWithDelay` delays."""

    @staticmethod
    def init(  # type: ignore[override]
        group: dist.ProcessGroup,
        fsdp_init_mode: FSDPInitMode,
        device_init_mode: DEVICEInitMode = DEVICEInitMode.DEVICE_AFTER,
        fsdp_kwargs: Mapping[str, Any] | None = None,
        deterministic: bool = False,
        delay_after_loss_ms: int = 0,
        delay_before_reduction_ms: int = 0,
        *,
        device: torch.device | str | None = None,
    ) -> nn.Module:
        """Builds a delayed :class:`NestedWrappedModule`.

        Args:
            group: the process group.
            fsdp_init_mode: sharding of the nested modules.
            device_init_mode: device placement (default ``DEVICE_AFTER``).
            fsdp_kwargs: engine options, default none.
            deterministic: seed the initialization identically on every rank (default False).
            delay_after_loss_ms: sleep after the loss (ms, default 0).
            delay_before_reduction_ms: sleep before each gradient reduction (ms, default 0).
            device: compute device, default CUDA if available else CPU.
        """
        return ModuleWithDelay.init(
            NestedWrappedModule,
            group,
            fsdp_init_mode,
            device_init_mode,
            fsdp_kwargs,
            deterministic,
            device=device,
            delay_after_loss_ms=delay_after_loss_ms,
            delay_before_reduction_ms=delay_before_reduction_ms,
        )
