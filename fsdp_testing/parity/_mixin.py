"""torch's parity methods for unittest-style test cases (``FSDPTest`` mixes this in)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from ..models import DEVICEInitMode, FSDPInitMode, FSDPTestModel
from ._lockstep import check_fsdp_parity
from ._training import train_for_several_steps

__all__ = ["FSDPParityMixin"]


class FSDPParityMixin:
    """Adds torch's ``_train_for_several_steps`` and ``_test_fsdp_parity`` methods to a test
    case that has ``process_group`` (and optionally ``device`` and ``fsdp_engine``)."""

    def _parity_device(self) -> torch.device | None:
        return getattr(self, "device", None)

    def _train_for_several_steps(
        self,
        model: nn.Module,
        num_steps: int,
        autocast: bool,
        lr: float = 0.01,
        fsdp_cpu_offload: Any = None,
        save_model: bool = False,
        mixed_precision: Any = None,
        enable_sharded_grad_scaler: bool = False,
        use_pure_fp16: bool = False,
        sharded_grad_scaler_kwargs: dict[str, Any] | None = None,
    ) -> torch.Tensor:
        """See :func:`train_for_several_steps`."""
        return train_for_several_steps(
            model,
            num_steps,
            autocast,
            lr,
            fsdp_cpu_offload,
            save_model,
            mixed_precision,
            enable_sharded_grad_scaler,
            use_pure_fp16,
            sharded_grad_scaler_kwargs,
            device=self._parity_device(),
        )

    def _test_fsdp_parity(
        self,
        model_class: type[FSDPTestModel],
        fsdp_init_mode: FSDPInitMode,
        device_init_mode: DEVICEInitMode,
        ref_init_fn: Callable[[nn.Module], nn.Module] | None = None,
        num_iters: int = 2,
        save_model: bool = True,
        cpu_offload: Any = None,
        backward_prefetch: Any = None,
        sharding_strategy: Any = None,
        mixed_precision: Any = None,
        forward_prefetch: bool = False,
        use_orig_params: bool = False,
        enable_sharded_grad_scaler: bool = False,
        use_pure_fp16: bool = False,
        init_kwargs: dict[str, Any] | None = None,
        sharded_grad_scaler_kwargs: dict[str, Any] | None = None,
        **fsdp_kwargs: Any,
    ) -> None:
        """See :func:`check_fsdp_parity`; uses ``self.process_group`` and ``self.device``."""
        check_fsdp_parity(
            model_class,
            fsdp_init_mode,
            device_init_mode,
            ref_init_fn,
            num_iters,
            save_model,
            cpu_offload,
            backward_prefetch,
            sharding_strategy,
            mixed_precision,
            forward_prefetch,
            use_orig_params,
            enable_sharded_grad_scaler,
            use_pure_fp16,
            init_kwargs,
            sharded_grad_scaler_kwargs,
            process_group=getattr(self, "process_group", None),
            device=self._parity_device(),
            engine=getattr(self, "fsdp_engine", None),
            **fsdp_kwargs,
        )
