"""CPU offload copies: a shard to the compute device before its all-gather, a reduced gradient
shard back to the host; each copy is published as an ``events.OffloadCopy``, also when the
compute device is the CPU.

[Note: CPU offload]
With ``CPUOffload(offload_params=True)`` the flat shard buffer (so every sharded parameter and
the optimizer state built on it) and the sharded gradients live on the CPU, pinned when CUDA is
available. The unit computes on ``compute_device`` (the parameters' device at wrap time, or
``device_id``): each unshard copies the flat shard there first, each reduction copies the
reduced gradient shard back. The copies are made even when the compute device is the CPU, so a
CPU-only run exercises (and publishes, as ``events.OffloadCopy``) the same steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from . import events
from ._streams import CudaStreams

if TYPE_CHECKING:
    from ._unit import FSDPUnit

__all__ = ["copy_to_device", "copy_to_host", "validate_offloaded_devices"]


def validate_offloaded_devices(units: list[FSDPUnit]) -> None:
    """Offloaded shards must stay on the CPU (the module was not moved after wrapping). A unit
    computing on the meta device (``device_id="meta"``, planning) has no host: its shards stay
    on meta too."""
    moved: dict[str, list[str]] = {}
    for unit in units:
        if not unit.offload_params or unit.device.type == "meta":
            continue
        for p in unit.params:
            # ``module.to()`` may move the shard in place or swap in a new Parameter.
            exposed = [m._parameters[name] for m, name in p.slots]
            devices = {t.device for t in (p.sharded, *exposed) if t is not None}
            for device in devices - {torch.device("cpu")}:
                moved.setdefault(str(device), []).append(p.fqn)
    if moved:
        device_types = sorted({torch.device(d).type for d in moved})
        raise RuntimeError(
            "An FSDP-managed module with parameter CPU offloading enabled has parameters on "
            f"{', '.join(device_types)} ({moved}). With CPUOffload(offload_params=True) the "
            "sharded parameters must stay on the CPU: do not move the module to an "
            "accelerator after wrapping; pass device_id=... to compute there instead."
        )


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
