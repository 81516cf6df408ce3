"""The training loop every parity check runs, on the sharded model and on its reference alike:
SGD with momentum, one step at a time (torch's ``_train_for_several_steps``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn as nn

from ..engines import FSDPEngine, StepsItself, clean_param_name, engine_for
from ..models._base import resolve_device
from ..patching import rank_prefix
from ._reference import find_test_model, reference_body

__all__ = ["TrainingLoop", "Workload", "train_for_several_steps"]


class Workload(Protocol):
    """What one training step needs besides the model: the :class:`FSDPTestModel` methods."""

    def get_input(self, device: torch.device) -> tuple[Any, ...]: ...

    def get_loss(self, input: Any, output: Any) -> torch.Tensor: ...

    def run_backward(self, loss: torch.Tensor) -> None: ...


def _cast_floats(values: tuple[Any, ...], dtype: torch.dtype) -> tuple[Any, ...]:
    return tuple(
        v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for v in values
    )


def _fail(message: str) -> AssertionError:
    return AssertionError(f"{rank_prefix()}{message}")


class TrainingLoop:
    """One model, its SGD-with-momentum optimizer and grad scaler; :meth:`step` runs one
    iteration: zero the gradients, forward, loss, backward, optimizer step, and optionally save,
    zero and reload a full state dict.

    Args:
        model: the model, plain, data parallel or sharded by any engine.
        engine: the engine that sharded ``model`` (default: found with ``engine_for``; None for
            a reference).
        workload: where inputs, the loss and the backward come from (default: the
            :class:`FSDPTestModel` inside ``model``).
        lr: learning rate (default 0.01).
        autocast: run forward under ``torch.autocast`` for ``device`` (default False).
        fsdp_cpu_offload: the model's ``CPUOffload``; with ``offload_params`` a sharded model's
            parameters must be on the CPU after each backward (default None).
        mixed_precision: the model's ``MixedPrecision`` (sets the expected loss dtype).
        enable_sharded_grad_scaler: scale the loss with ``ShardedGradScaler`` (default False).
        use_pure_fp16: the model is in fp16; inputs are cast to fp16 (default False).
        sharded_grad_scaler_kwargs: extra ``ShardedGradScaler`` arguments.
        device: where inputs go, default CUDA if available else CPU.
        after_backward: run after each backward (a precision reference's rounding).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        engine: FSDPEngine | None = None,
        workload: Workload | None = None,
        lr: float = 0.01,
        autocast: bool = False,
        fsdp_cpu_offload: Any = None,
        mixed_precision: Any = None,
        enable_sharded_grad_scaler: bool = False,
        use_pure_fp16: bool = False,
        sharded_grad_scaler_kwargs: dict[str, Any] | None = None,
        device: torch.device | str | None = None,
        after_backward: Callable[[], None] | None = None,
    ) -> None:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        self.model = model
        self.test_model: Workload = workload if workload is not None else find_test_model(model)
        self.engine = engine if engine is not None else engine_for(model)
        self.autocast = autocast
        self.offload_params = bool(getattr(fsdp_cpu_offload, "offload_params", False))
        self.mixed_precision = mixed_precision
        self.use_pure_fp16 = use_pure_fp16
        self.device = resolve_device(device)
        self.after_backward = after_backward
        self.scaler = ShardedGradScaler(
            device=self.device.type,
            enabled=enable_sharded_grad_scaler,
            **(sharded_grad_scaler_kwargs or {}),
        )
        # SGD with momentum: Adam is scale invariant, which hides gradient-scaling bugs.
        self.optim = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)

    @property
    def sharded(self) -> bool:
        return self.engine is not None

    def _autocast_dtype(self) -> torch.dtype:
        dtype = getattr(self.mixed_precision, "param_dtype", None)
        if dtype is not None:
            return dtype
        return torch.float16 if self.device.type == "cuda" else torch.bfloat16

    def step(self, save_model: bool = False) -> torch.Tensor:
        """One training step; returns the loss, detached.

        Args:
            save_model: afterwards, save a full state dict, zero the parameters and load it.
        """
        model, test_model = self.model, self.test_model
        model_device = next(model.parameters()).device
        self.optim.zero_grad()
        with torch.autocast(self.device.type, dtype=self._autocast_dtype(), enabled=self.autocast):
            inputs = test_model.get_input(self.device)
            if self.use_pure_fp16:
                inputs = _cast_floats(inputs, torch.float16)
            elif self.mixed_precision is not None and not self.sharded:
                # As torch: the reference gets the low-precision inputs the sharded model casts
                # its inputs to (a precision reference casts them anyway).
                inputs = _cast_floats(inputs, self._autocast_dtype())
            if isinstance(self.engine, StepsItself):
                loss = self._engine_step(self.engine, inputs, model_device)
            else:
                output = model(*inputs)
                loss = test_model.get_loss(inputs, output).to(model_device)
        if not isinstance(self.engine, StepsItself):
            loss = self.scaler.scale(loss)
            self._validate_loss_dtype(loss)
            test_model.run_backward(loss)
        if self.after_backward is not None:
            self.after_backward()
        if self.offload_params and self.sharded:
            on_device = [n for n, p in model.named_parameters() if p.device.type != "cpu"]
            if on_device:
                raise _fail(
                    f"parameters offloaded to CPU are on the device after backward: {on_device}"
                )
        self.scaler.step(self.optim)
        self.scaler.update()
        if save_model:
            self._save_zero_load()
        return loss.detach()

    def _engine_step(
        self, engine: StepsItself, inputs: tuple[Any, ...], model_device: torch.device
    ) -> torch.Tensor:
        """Forward, loss and backward by an engine that runs them itself (graph mode)."""
        if self.scaler.is_enabled() or self.autocast or self.use_pure_fp16:
            raise NotImplementedError(
                f"engine {getattr(engine, 'name', engine)!r} runs the step itself and supports "
                "neither a grad scaler, autocast nor pure fp16 (enable_sharded_grad_scaler="
                f"{self.scaler.is_enabled()}, autocast={self.autocast}, use_pure_fp16="
                f"{self.use_pure_fp16}); train without them or use another engine."
            )
        test_model = self.test_model
        loss = engine.train_step(
            self.model, inputs, lambda m, i: test_model.get_loss(i, m(*i)).to(model_device)
        )
        self._validate_loss_dtype(loss)
        return loss

    def _validate_loss_dtype(self, loss: torch.Tensor) -> None:
        """The loss dtype says whether the precision under test took effect.

        As torch's ``_train_for_several_steps``: fp16 with ``use_pure_fp16``; ``param_dtype``
        under a mixed precision policy (the sharded model, or its precision reference); float32
        otherwise. A model under autocast may also end in the autocast dtype: which ops autocast
        keeps in float32 depends on the device (CUDA sums in float32, the CPU in bf16), so
        torch's "the DDP AMP loss is fp32" holds on CUDA only.
        """
        expected: tuple[torch.dtype | None, ...]
        if self.use_pure_fp16:
            expected = (torch.float16,)
        elif self.autocast:
            expected = (torch.float32, self._autocast_dtype())
        elif self.mixed_precision is not None:
            expected = (self.mixed_precision.param_dtype,)
        else:
            expected = (torch.float32,)
        if None not in expected and loss.dtype not in expected:
            raise _fail(
                f"loss dtype is {loss.dtype}, expected {' or '.join(map(str, expected))} "
                f"(mixed_precision={self.mixed_precision}, use_pure_fp16={self.use_pure_fp16}, "
                f"autocast={self.autocast})"
            )

    def _save_zero_load(self) -> None:
        # Zeroing between save and load makes a state dict that loses anything visible.
        model, engine = self.model, self.engine
        if engine is None:
            state = {k: v.clone() for k, v in model.state_dict().items()}
            full: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        else:
            state = engine.full_state_dict(model)
            full = engine.full_params(model, writeback=True)
        with full, torch.no_grad():
            for param in model.parameters():
                param.zero_()
        if engine is None:
            model.load_state_dict(state)
        else:
            engine.load_full_state_dict(model, state)

    def named_full_params(self) -> list[tuple[str, torch.Tensor]]:
        """Detached copies of the full parameters, named as in the unwrapped model (the
        engine's for a sharded model)."""
        if self.engine is not None:
            return self.engine.named_full_params(self.model)
        return [
            (clean_param_name(name), param.detach().clone())
            for name, param in reference_body(self.model).named_parameters()
        ]


def train_for_several_steps(
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
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Trains ``model`` (wrapping an :class:`FSDPTestModel`) for ``num_steps`` with SGD and
    momentum 0.9 and returns the last loss, detached. torch's ``_train_for_several_steps``.

    Args:
        model: the model, plain, DDP-wrapped or sharded by any engine.
        num_steps: number of optimizer steps.
        autocast: run forward under ``torch.autocast`` for ``device``.
        lr: learning rate (default 0.01).
        fsdp_cpu_offload: the model's ``CPUOffload``; with ``offload_params`` the parameters
            must be on the CPU after each backward (default None).
        save_model: after each step, save a full state dict, zero the parameters and load it.
        mixed_precision: the model's ``MixedPrecision`` (sets the expected loss dtype).
        enable_sharded_grad_scaler: scale the loss with ``ShardedGradScaler``.
        use_pure_fp16: the model is in fp16; inputs are cast to fp16.
        sharded_grad_scaler_kwargs: extra ``ShardedGradScaler`` arguments.
        device: where inputs go, default CUDA if available else CPU.
    """
    if num_steps < 1:
        raise ValueError(f"train_for_several_steps: num_steps must be >= 1, got {num_steps}")
    loop = TrainingLoop(
        model,
        autocast=autocast,
        lr=lr,
        fsdp_cpu_offload=fsdp_cpu_offload,
        mixed_precision=mixed_precision,
        enable_sharded_grad_scaler=enable_sharded_grad_scaler,
        use_pure_fp16=use_pure_fp16,
        sharded_grad_scaler_kwargs=sharded_grad_scaler_kwargs,
        device=device,
    )
    loss = loop.step(save_model)
    for _ in range(num_steps - 1):
        loss = loop.step(save_model)
    return loss
