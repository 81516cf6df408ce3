"""CUDA side streams for all-gather, gradient reduction and offload copies.

[Note: streams and events]
On the CPU (gloo) collectives and copies are synchronous and a unit runs every step inline on
the calling thread: there are no stream objects at all, ``FSDPUnit.streams`` is ``None``.

On CUDA the root creates one :class:`CudaStreams` at lazy init and shares it with every unit
under it. Work is split over three side streams so that communication overlaps compute:

- ``all_gather``: cast of the local shard to ``param_dtype`` and the all-gather. The copy-out of
  the gathered bytes into the unsharded parameters runs on the compute (current) stream in
  ``FSDPUnit.wait_for_unshard``, so the unsharded parameters are allocated, used and freed on
  one stream.
- ``reduce_scatter``: the gradient collective and the cast of its result.
- ``offload``: host-to-device copies of offloaded shards and device-to-host copies of reduced
  gradients.

Cross-stream lifetimes are tracked with events, never ``Tensor.record_stream`` (which ties a
block to a stream until an unknown later point and makes memory use hard to reason about):

1. A tensor made on a side stream and read on the compute stream (the all-gather output) stays
   referenced until the compute stream has queued its read; an event recorded after that read
   (``copy_out_done``) is waited on by the all-gather stream before its next allocation, so the
   caching allocator cannot hand the block to a new all-gather while the read is pending.
2. A tensor made on the compute stream and read on a side stream (the reduce-scatter input) is
   held in ``pending_reduce`` with the event recorded after the collective; the compute stream
   waits on that event before the reference is dropped (at the next reduction, or at the end of
   backward, when the compute stream also needs the reduced gradients).
3. Blocks freed on the compute stream and then reused by a side stream are safe because each
   side stream waits on the compute stream (``begin_iteration`` and each reduction) before it
   allocates.

With parameter offload the optimizer runs on the CPU right after backward, so the end of
backward synchronizes the device: no host-to-device copy may still read a pinned shard that the
optimizer is about to overwrite, and every reduced gradient has landed on the host.
"""

from __future__ import annotations

import collections

import torch

__all__ = ["CudaStreams", "uses_streams"]


def uses_streams(device: torch.device) -> bool:
    """Whether units computing on ``device`` overlap work on side streams (CUDA only)."""
    return device.type == "cuda"


class CudaStreams:
    """The side streams and pending cross-stream state shared by the units of one root.

    See [Note: streams and events].
    """

    def __init__(self, device: torch.device) -> None:
        if not uses_streams(device):
            raise AssertionError(f"CudaStreams needs a CUDA device, got {device}")
        self.device = device
        # Higher priority (lower number) for communication so it is not starved by compute.
        self.all_gather = torch.cuda.Stream(device=device, priority=-1)
        self.reduce_scatter = torch.cuda.Stream(device=device, priority=-1)
        self.offload = torch.cuda.Stream(device=device)
        self.copy_out_done: torch.cuda.Event | None = None
        # Reduce inputs in flight, oldest first, at most ``max_pending_reduces`` (the largest
        # ``set_reduce_scatter_max_input_buffers`` of the root's units, read at lazy init).
        self.pending_reduces: collections.deque[tuple[torch.Tensor, torch.cuda.Event]] = (
            collections.deque()
        )
        self.max_pending_reduces = 1

    def begin_iteration(self, post_optim_event: torch.cuda.Event | None = None) -> None:
        """Root pre-forward: the side streams see this step's parameters (optimizer writes):
        they wait for the compute stream, or for ``post_optim_event`` when the user recorded
        one after the optimizer step (``FSDPModule.set_post_optim_event``)."""
        if post_optim_event is not None:
            self.all_gather.wait_event(post_optim_event)
            self.offload.wait_event(post_optim_event)
            return
        current = torch.cuda.current_stream(self.device)
        self.all_gather.wait_stream(current)
        self.offload.wait_stream(current)

    def before_all_gather(self) -> None:
        """Rule 1: the previous copy-out has read the block an all-gather may now reuse."""
        if self.copy_out_done is not None:
            self.all_gather.wait_event(self.copy_out_done)

    def record_copy_out(self) -> None:
        self.copy_out_done = torch.cuda.current_stream(self.device).record_event()

    def hold_reduce_input(self, reduce_input: torch.Tensor, done: torch.cuda.Event) -> None:
        """Rule 2: keep ``reduce_input`` alive until the compute stream waited on ``done``.
        Beyond ``max_pending_reduces`` inputs held, the compute stream first waits for the
        oldest reduction (one by default: for the previous one)."""
        while len(self.pending_reduces) >= self.max_pending_reduces:
            self._release_oldest()
        self.pending_reduces.append((reduce_input, done))

    def release_reduce_input(self) -> None:
        """The compute stream waits for every reduction held."""
        while self.pending_reduces:
            self._release_oldest()

    def _release_oldest(self) -> None:
        _, done = self.pending_reduces.popleft()
        torch.cuda.current_stream(self.device).wait_event(done)

    def end_backward(self, *, offload: bool) -> None:
        """The compute stream (and, with offload, the host) sees every reduced gradient."""
        self.release_reduce_input()
        if offload:
            torch.cuda.synchronize(self.device)
