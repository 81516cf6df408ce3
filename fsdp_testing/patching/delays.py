"""Delays: sleeping before chosen calls, per rank, to expose races between ranks and streams.

[Note: delays under thread ranks]
A delay replaces a function shared by every rank in the process (``dist.reduce_scatter_single``,
an engine's reshard). :func:`delayed_calls` installs it with
:func:`~fsdp_testing.patching.patched`, which dispatches each call to the calling rank's
replacement (see [Note: patching under thread ranks]): a rank that asked for no delay, or is
outside the block, runs the original at full speed, and one rank leaving its block never
removes another's delay. Delays chain with any other patch of the same function (a recorder, a
test's ``patch_reduce_scatter``).

The delay models (:class:`~fsdp_testing.models.ModuleWithDelay`,
``MixtureOfExperts(delay_before_free_ms=...)``) are built on these.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ..engines import PatchTarget
from ._dispatch import patched

__all__ = ["delayed_calls", "sleep_ms"]


def sleep_ms(milliseconds: float, device: torch.device) -> None:
    """Sleeps on ``device``: a CUDA kernel that spins (asynchronous) or a host sleep on CPU.

    Args:
        milliseconds: how long; 0 or less returns at once.
        device: where to sleep.
    """
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


@contextlib.contextmanager
def delayed_calls(
    target: PatchTarget | Sequence[PatchTarget], milliseconds: float, device: torch.device
) -> Iterator[None]:
    """Within the block, calls to ``target`` from this rank sleep ``milliseconds`` first
    (:func:`sleep_ms`, looked up when called, so a test can patch it).

    Args:
        target: where the callable lives (see :meth:`FSDPEngine.patch_target`), or several
            names of one function (as :func:`~fsdp_testing.patching.patched` takes them).
        milliseconds: the delay; 0 or less makes the block a no-op.
        device: where to sleep (CUDA sleeps are asynchronous kernels).
    """
    if milliseconds <= 0:
        yield
        return

    def delayed(*args: Any, **kwargs: Any) -> Any:
        sleep_ms(milliseconds, device)
        return call_next(*args, **kwargs)  # an outer patch of ``target``, or the original

    # See [Note: delays under thread ranks]. No barriers: ranks need not enter together.
    with patched(target, delayed, barrier=False) as call_next:
        yield
