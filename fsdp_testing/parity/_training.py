"""The training loop every parity check runs, on the sharded model and on its reference alike:
SGD with momentum (or the caller's optimizer), one step at a time, optionally accumulating
gradients over several forwards (torch's ``_train_for_several_steps``, and
:func:`~fsdp_testing.parity.check_parity` for a user's own code)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
import torch.nn as nn

from ..engines import FSDPEngine, StepsItself, clean_param_name, engine_for, engine_optimizer
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


#: ``loss_fn(model, inputs)``: forward and loss of one batch.
LossFn = Callable[[Any, Any], torch.Tensor]
#: ``step_fn(model, inputs)``: forward, loss and backward of one batch; returns the loss.
StepFn = Callable[[Any, Any], torch.Tensor]


class TrainingLoop:
    """One model, its optimizer (SGD with momentum by default) and grad scaler; :meth:`step`
    runs one iteration: zero the gradients, ``accum_steps`` times forward, loss and backward,
    optimizer step, and optionally save, zero and reload a full state dict.

    Args:
        model: the model, plain, data parallel or sharded by any engine, or a user's wrapped
            model (any callable; then give ``optimizer`` and ``full_state`` unless it is an
            ``nn.Module`` whose parameters are the full ones).
        engine: the engine that sharded ``model`` (default: found with ``engine_for`` when
            ``model`` is an ``nn.Module``; None for a reference).
        workload: where inputs, the loss and the backward come from (default: the
            :class:`FSDPTestModel` inside ``model``; not used when ``batches`` is given).
        batches: ``batches(i)``, the inputs of the ``i``-th forward (0-based, counting every
            forward of every step), of any structure; replaces ``workload.get_input``.
        loss_fn: ``loss_fn(model, inputs)``, forward and loss of one batch (default:
            ``workload.get_loss(inputs, model(*inputs))``).
        step_fn: ``step_fn(model, inputs)``, forward, loss and backward of one batch, returning
            the loss (a user's own step, or an engine that steps itself); replaces ``loss_fn``
            and the backward, so neither a grad scaler nor autocast apply. With
            ``accum_steps > 1`` it must backpropagate ``loss / accum_steps`` as the default
            backward does.
        optimizer: the optimizer, anything with ``step()`` and ``zero_grad()`` (default: SGD
            with momentum 0.9 and ``lr``, over ``model.parameters()`` or as the engine's
            ``make_optimizer`` builds it).
        accum_steps: forwards (and backwards) per optimizer step, each backpropagating its
            loss divided by ``accum_steps`` (default 1).
        full_state: ``full_state(model)``, the full parameters by name, for
            :meth:`named_full_params` (default: the engine's, or the parameters of the plain
            module inside the reference's wrappers).
        lr: learning rate of the default optimizer (default 0.01).
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
        batches: Callable[[int], Any] | None = None,
        loss_fn: LossFn | None = None,
        step_fn: StepFn | None = None,
        optimizer: Any = None,
        accum_steps: int = 1,
        full_state: Callable[[Any], Mapping[str, torch.Tensor]] | None = None,
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

        if accum_steps < 1:
            raise ValueError(f"TrainingLoop: accum_steps must be >= 1, got {accum_steps}")
        self.model = model
        self.engine = engine
        if engine is None and isinstance(model, nn.Module):
            self.engine = engine_for(model)
        self.test_model: Workload | None = workload
        if batches is None and workload is None:
            self.test_model = find_test_model(model)
        self.batches = batches
        self.forwards = 0
        self.accum_steps = accum_steps
        self.full_state = full_state
        self.loss_fn: LossFn = loss_fn if loss_fn is not None else self._workload_loss
        # A caller's own loss has its own dtype; the check is for the precision under test.
        self._check_loss_dtype = loss_fn is None
        self.step_fn = step_fn
        if step_fn is None and isinstance(self.engine, StepsItself):
            self.step_fn = self._engine_step
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

        def sgd(params: Any) -> torch.optim.Optimizer:
            # SGD with momentum: Adam is scale invariant, which hides gradient-scaling bugs.
            return torch.optim.SGD(params, lr=lr, momentum=0.9)

        if optimizer is None:
            # An engine that shards the optimizer (ZeRO) builds it over its shards.
            optimizer = engine_optimizer(self.engine, model, sgd)
        self.optim = optimizer

    @property
    def sharded(self) -> bool:
        return self.engine is not None

    def _autocast_dtype(self) -> torch.dtype:
        dtype = getattr(self.mixed_precision, "param_dtype", None)
        if dtype is not None:
            return dtype
        return torch.float16 if self.device.type == "cuda" else torch.bfloat16

    def step(self, save_model: bool = False) -> torch.Tensor:
        """One training step; returns the loss, detached (with ``accum_steps > 1``, the mean of
        the forwards' losses).

        Args:
            save_model: afterwards, save a full state dict, zero the parameters and load it.
        """
        model = self.model
        self.optim.zero_grad()
        losses = [self._forward_backward() for _ in range(self.accum_steps)]
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
        return losses[0] if len(losses) == 1 else torch.stack(losses).mean()

    def _next_input(self) -> Any:
        index, self.forwards = self.forwards, self.forwards + 1
        if self.batches is not None:
            return self.batches(index)
        assert self.test_model is not None  # for mypy: __init__ found one
        return self.test_model.get_input(self.device)

    def _forward_backward(self) -> torch.Tensor:
        """Forward, loss and backward of one batch; returns the loss, detached."""
        with torch.autocast(self.device.type, dtype=self._autocast_dtype(), enabled=self.autocast):
            inputs = self._next_input()
            if self.use_pure_fp16:
                inputs = _cast_floats(inputs, torch.float16)
            elif self.mixed_precision is not None and not self.sharded:
                # As torch: the reference gets the low-precision inputs the sharded model casts
                # its inputs to (a precision reference casts them anyway).
                inputs = _cast_floats(inputs, self._autocast_dtype())
            if self.step_fn is not None:
                return self.step_fn(self.model, inputs).detach()
            loss = self.loss_fn(self.model, inputs)
        loss = self.scaler.scale(loss)
        self._validate_loss_dtype(loss)
        self._backward(loss / self.accum_steps if self.accum_steps > 1 else loss)
        return loss.detach()

    def _workload_loss(self, model: Any, inputs: Any) -> torch.Tensor:
        assert self.test_model is not None  # for mypy: no workload means a loss_fn was given
        model_device = next(model.parameters()).device
        return self.test_model.get_loss(inputs, model(*inputs)).to(model_device)

    def _backward(self, loss: torch.Tensor) -> None:
        if self.test_model is not None:
            self.test_model.run_backward(loss)
        else:
            loss.backward()

    def _engine_step(self, model: Any, inputs: Any) -> torch.Tensor:
        """Forward, loss and backward by an engine that runs them itself (graph mode)."""
        engine = self.engine
        assert isinstance(engine, StepsItself)  # for mypy: __init__ chose this step
        if self.scaler.is_enabled() or self.autocast or self.use_pure_fp16 or self.accum_steps > 1:
            raise NotImplementedError(
                f"engine {getattr(engine, 'name', engine)!r} runs the step itself and supports "
                "neither a grad scaler, autocast, pure fp16 nor gradient accumulation "
                f"(enable_sharded_grad_scaler={self.scaler.is_enabled()}, autocast="
                f"{self.autocast}, use_pure_fp16={self.use_pure_fp16}, accum_steps="
                f"{self.accum_steps}); train without them or use another engine."
            )
        loss = engine.train_step(model, inputs, self.loss_fn)
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
        if self.full_state is not None:
            return [(n, t.detach().clone()) for n, t in self.full_state(self.model).items()]
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
