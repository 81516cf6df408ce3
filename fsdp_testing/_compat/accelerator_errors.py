"""Reading a torch test body's failure as "this machine has no accelerator".

The torch-style classes (``fsdp_testing.testcase``) run GPU-gated tests on CPU ranks when there
is no GPU; a body that then fails for want of one (it asks for CUDA, builds an indexed device,
passes ``device_ids``) is reported as a skip naming the need, as torch's harness would have
skipped it, instead of a failure.
"""

from __future__ import annotations

__all__ = ["needs_accelerator"]

# Messages of the errors torch raises when a test body asks for CUDA on a machine without it.
_NO_ACCELERATOR_ERRORS = (
    "Torch not compiled with CUDA enabled",
    "Found no NVIDIA driver",
    "No CUDA GPUs are available",
    "no CUDA-capable device",
    "Cannot access accelerator device when none is available",
    "Tried to instantiate dummy base class",
    "Distributed package doesn't have NCCL built in",
    # nccl asked for on a CUDA build of torch, on a machine with no GPU (torch 2.15).
    "nccl2 requires at least one CUDA device",
    "module 'torch.cpu' has no attribute",
    "FSDP needs a non-CPU accelerator device",
    # DDP(device_ids=[rank]) on a CPU module: the body assumes one accelerator per rank.
    "device_ids and output_device arguments only work with single-device/multiple-device GPU",
    # torch.device(device_type, torch.get_device_module(device_type).current_device()): on the
    # CPU, torch.cpu.current_device() returns the string "cpu", not an index.
    "device(): argument 'index' (position 2) must be int, not str",
    # FSDP2's FSDPParam built for torch.device("cpu", i), as for torch.device("cuda", i): CPU
    # tensors are never on an indexed device.
    "Expects the parameter to already be moved to device cpu:",
)


def needs_accelerator(exc: BaseException) -> str | None:
    """The first line of the no-accelerator error in ``exc``'s chain, if there is one."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        text = str(current)
        if any(pattern in text for pattern in _NO_ACCELERATOR_ERRORS):
            return f"{type(current).__name__}: {(text.splitlines() or [''])[0]}"
        current = current.__cause__ or current.__context__
    return None
