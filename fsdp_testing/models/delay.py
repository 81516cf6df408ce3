"""Models that sleep at chosen points, and the thread-safe patch that inserts the sleeps.

[Note: delays under thread ranks]
A delay replaces a function shared by every rank in the process (``dist.reduce_scatter_tensor``,
an engine's reshard). With thread ranks, one rank restoring the original while another is still
inside its ``with`` block would silently drop the other's delay, or restore the patched function
forever. :func:`delayed_calls` therefore installs one wrapper per target, reference counted, and
keeps each thread's delay in thread-local storage: a rank that asked for no delay (or is outside
the block) runs the original at full speed.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ..engines import PatchTarget
from ._base import DEVICEInitMode, FSDPInitMode, FSDPTestModel

__all__ = ["ModuleWithDelay", "NestedWrappedModuleWithDelay", "delayed_calls", "sleep_ms"]

_lock = threading.Lock()
_installed: dict[tuple[int, str], tuple[Callable[..., Any], int]] = {}  # key -> original, count
_per_thread = threading.local()


def sleep_ms(milliseconds: float, device: torch.device) -> None:
    """Sleeps on ``device``: a CUDA kernel that spins (asynchronous) or a host sleep on CPU."""
    if milliseconds <= 0:
        return
    if device.type == "cuda":
        torch.cuda._sleep(int(milliseconds * _cuda_cycles_per_ms()))
    else:
        time.sleep(milliseconds / 1000.0)


@functools.lru_cache(maxsize=1)
def _cuda_cycles_per_ms() -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 1_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / max(start.elapsed_time(end), 1e-3)


def _thread_delays() -> dict[tuple[int, str], tuple[float, torch.device]]:
    delays = getattr(_per_thread, "delays", None)
    if delays is None:
        delays = _per_thread.delays = {}
    return delays


@contextlib.contextmanager
def delayed_calls(target: PatchTarget, milliseconds: float, device: torch.device) -> Iterator[None]:
    """Within the block, calls to ``target`` from this thread sleep ``milliseconds`` first.

    Args:
        target: where the callable lives (see :meth:`FSDPEngine.patch_target`).
        milliseconds: the delay; 0 makes the block a no-op.
        device: where to sleep (CUDA sleeps are asynchronous kernels).
    """
    # See [Note: delays under thread ranks]
    key = (id(target.owner), target.attribute)
    with _lock:
        original, count = _installed.get(key, (None, 0))
        if original is None:
            original = target.get()
            setattr(target.owner, target.attribute, _delaying(key, original))
        _installed[key] = (original, count + 1)
    delays = _thread_delays()
    previous = delays.get(key)
    delays[key] = (milliseconds, device)
    try:
        yield
    finally:
        if previous is None:
            delays.pop(key, None)
        else:
            delays[key] = previous
        with _lock:
            original, count = _installed[key]
            if count == 1:
                setattr(target.owner, target.attribute, original)
                del _installed[key]
            else:
                _installed[key] = (original, count - 1)


def _delaying(key: tuple[int, str], original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def delayed(*args: Any, **kwargs: Any) -> Any:
        milliseconds, device = _thread_delays().get(key, (0.0, torch.device("cpu")))
        sleep_ms(milliseconds, device)
        return original(*args, **kwargs)

    return delayed


def _module_device(module: nn.Module) -> torch.device:
    for param in module.parameters():
        return param.device
    return torch.device("cpu")


class ModuleWithDelay(FSDPTestModel):
    """Wraps an :class:`FSDPTestModel` and sleeps after the loss and/or before each gradient
    reduction (``reduce_scatter_tensor`` or ``all_reduce`` from Python), on CPU or CUDA.

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
        sleep_ms(self.delay_after_loss_ms, _module_device(self))
        return loss

    def run_backward(self, loss: torch.Tensor) -> None:
        device = _module_device(self)
        with contextlib.ExitStack() as stack:
            for name in ("reduce_scatter_tensor", "all_reduce"):
                target = PatchTarget(dist, name)
                stack.enter_context(delayed_calls(target, self.delay_before_reduction_ms, device))
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
        from .nested import NestedWrappedModule

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
