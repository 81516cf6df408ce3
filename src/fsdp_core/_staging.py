"""A root's staging buffers on the CPU, kept from one use to the next.

[Note: staging buffers on the CPU]
A unit's all-gather output and its reduce input are the largest transient tensors of a step
(a whole unit's parameters, or its gradients, times the group size). On CUDA the caching
allocator hands a freed block to the next request of its size. On the CPU each was a fresh
``torch.empty``: glibc served it from the top of its heap, which grew and was trimmed several
times a step (on the benchmark model, 12 MiB up and 24 MiB down at a time, seen with strace),
and every page of a regrown heap faults again when it is first written. The order tags, which
lengthen both buffers by a few elements, changed how the heap fell, and with it the step time
by 0.4 to 2% from one run to the next (docs/benchmarks.md).

So on the CPU a root keeps the buffers its units let go of and hands them out again
(:class:`StagingBuffers`, shared by the root's units as ``CpuOverlap`` is):

- A buffer's size is rounded up to ``GRAIN_BYTES``, so that a unit's all-gather output and its
  reduce input (the same elements but for their order tags) take each other's buffers, tags
  or not.
- An all-gather output comes back once its parameters are copied out, unless an all-gather
  extension (``fsdp_post_all_gather``) got views of it; ``post_forward`` keeps a copy.
- A reduce input comes back once its reduce-scatter is issued, where the engine no longer
  reads it: gloo's reduce-scatter copies its input when it is issued (``tests/core/
  test_staging.py`` checks it on the installed torch), and a synchronous one has completed.
  Only where the reduce-scatter wrote a buffer of its own: over a shard group of one the
  reduced gradient is the input itself, and the ``.grad``\\ s may be views of it.
- At most ``KEEP`` idle buffers per size; one more goes back to the allocator. A backward
  holds at most two at a time (an all-gather prefetched while a reduce input is written).
- Not for a custom all-gather or reduce-scatter (their ``allocate`` makes their buffers), not
  on CUDA, and only buffers that this object handed out are taken back.

Only what the engine allocates changes: the collectives, their order, sizes and bytes stay
the same. What the reuse changed on the benchmark model (half the page faults of a step) is in
docs/benchmarks.md.
"""

from __future__ import annotations

import torch

__all__ = ["GRAIN_BYTES", "KEEP", "StagingBuffers"]

GRAIN_BYTES = 64 * 1024
KEEP = 2


class StagingBuffers:
    """Idle 1D CPU buffers of one root, by dtype and rounded size."""

    def __init__(self) -> None:
        self._idle: dict[tuple[torch.dtype, int], list[torch.Tensor]] = {}
        # The buffers in use, by data pointer: their dtype and size, no reference, so that one
        # never given back is freed. (Not a weak reference to the buffer: while lent, only
        # views of it are held, and on torch 2.9 such a reference can come back as a tensor
        # without storage.) A stale entry is overwritten when its address is lent again.
        self._lent: dict[int, tuple[torch.dtype, int]] = {}

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1D tensor of ``numel`` elements of ``dtype`` on ``device`` (uninitialized): on the
        CPU the first ``numel`` elements of an idle buffer of its rounded size, or of a new
        one; elsewhere (``meta``, a planner's fake tensors) a new tensor, never kept."""
        if device.type != "cpu":
            return torch.empty(numel, dtype=dtype, device=device)
        per = max(1, GRAIN_BYTES // dtype.itemsize)
        size = -(-numel // per) * per
        idle = self._idle.get((dtype, size))
        buffer = idle.pop() if idle else torch.empty(size, dtype=dtype)
        if type(buffer) is torch.Tensor:  # not under a fake mode, which has no memory to keep
            self._lent[buffer.data_ptr()] = (dtype, size)
        return buffer[:numel]

    def give(self, tensor: torch.Tensor) -> None:
        """Take back the buffer that ``tensor`` (a view from :meth:`take`, or a view of one)
        lies in; the caller holds no other view of it. A tensor this object did not hand out
        is left alone."""
        if type(tensor) is not torch.Tensor or tensor.device.type != "cpu":
            return
        buffer = tensor._base if tensor._base is not None else tensor
        if tensor.data_ptr() != buffer.data_ptr() or buffer.dim() != 1:
            return  # not the start of a whole 1D buffer
        key = (buffer.dtype, buffer.numel())
        if self._lent.get(buffer.data_ptr()) != key:
            return
        del self._lent[buffer.data_ptr()]
        idle = self._idle.setdefault(key, [])
        if len(idle) < KEEP:
            idle.append(buffer)

    def idle(self) -> list[torch.Tensor]:
        """The idle buffers (whole, 1D)."""
        return [buffer for idle in self._idle.values() for buffer in idle]
