"""CPU offload copies: a shard to the compute device before its all-gather, a reduced gradient
shard back to the host. See [Note: CPU offload] in ``_unit``; each copy is published as an
``events.OffloadCopy``, also when the compute device is the CPU."""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import events
from ._streams import CudaStreams

__all__ = ["copy_to_device", "copy_to_host"]


def copy_to_device(
    host: torch.Tensor,
    device: torch.device,
    streams: CudaStreams | None,
    *,
    unit: str,
    extra: int = 0,
) -> torch.Tensor:
    """A copy of 1D ``host`` on ``device`` (made even if that is the CPU).

    The copy is followed by ``extra`` uninitialized elements (default none).
    """
    # Allocated on the calling stream (the all-gather stream on CUDA), which reuses it.
    buffer = torch.empty(host.numel() + extra, dtype=host.dtype, device=device)
    device_copy = buffer[: host.numel()]
    if streams is None:
        device_copy.copy_(host)
    else:
        current = torch.cuda.current_stream(device)
        streams.offload.wait_stream(current)  # the block may be in use on ``current``
        with torch.cuda.stream(streams.offload):
            device_copy.copy_(host, non_blocking=True)
        current.wait_stream(streams.offload)
    _publish(unit, "to_device", device_copy)
    return buffer


def copy_to_host(
    grad: torch.Tensor,
    device: torch.device,
    streams: CudaStreams | None,
    *,
    unit: str,
    pin: bool,
) -> torch.Tensor:
    """A CPU copy of the reduced gradient shard ``grad``, complete when this returns (a meta
    copy of a meta shard: planning on the meta device, ``device_id="meta"``, has no host)."""
    host_device = "meta" if grad.is_meta else "cpu"
    host = torch.empty(grad.shape, dtype=grad.dtype, device=host_device, pin_memory=pin)
    if streams is None:
        host.copy_(grad)
    else:
        streams.offload.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(streams.offload):
            host.copy_(grad, non_blocking=True)
            landed = streams.offload.record_event()
        # The CPU accumulates into ``sharded.grad`` next and ``grad`` may be freed: wait.
        landed.synchronize()
    _publish(unit, "to_host", host)
    return host


def _publish(unit: str, direction: events.OffloadDirection, copy: torch.Tensor) -> None:
    if events.has_subscribers():
        events.publish(
            events.OffloadCopy(
                unit=unit,
                direction=direction,
                bytes=copy.numel() * copy.element_size(),
                rank=dist.get_rank(),
            )
        )
