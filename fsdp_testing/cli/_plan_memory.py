"""The bytes a step holds, counted on fake tensors: every storage alive, its high-water mark and
where in the step it was reached.

[Note: counting storages]
The planner runs a training step of the sharded model on fake tensors (no data, no
allocation: ``torch._subclasses.FakeTensorMode``) in a fake world, and counts what a real step
would hold. :class:`StorageCounter` is a dispatch mode that sees every op's outputs; each new
storage counts from the op that makes it until it is freed (a weak reference's callback says
when), and a storage resized in place (the engine frees unsharded parameters with
``untyped_storage().resize_(0)``) counts at its new size. Storages alive before the step (the
sharded parameters, last step's gradients, the optimizer state, buffers) are handed to it with
:meth:`StorageCounter.hold`, so the count is everything the rank holds. The backend's own
buffers are not tensors the step sees: gloo stages an all-gather's output and a reduce-scatter's
input in a buffer of their size while the collective runs, so each such collective (an
``fsdp_core.events.Collective``) counts that much on top, for its duration (``--backend nccl``:
nothing; NCCL works in place). What it leaves out is what a caching-free allocator would not
show either: temporaries inside one op and allocator slack (and, on CUDA, the caching
allocator and stream-ordered frees). The high-water mark is labelled with the phase of the step
and the last unit event (:mod:`fsdp_core.events`), e.g. ``backward, in reduce_scatter_single
of layers.1``.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["StorageCounter", "storage_of"]


def storage_of(tensor: torch.Tensor) -> Any:
    """``tensor``'s untyped storage; a DTensor's is its local tensor's (it has none itself)."""
    local = getattr(tensor, "_local_tensor", None)
    return (local if isinstance(local, torch.Tensor) else tensor).untyped_storage()


class StorageCounter(TorchDispatchMode):
    """Counts the bytes of every live tensor storage. See [Note: counting storages].

    Use it as a context manager around the step (inside the fake tensor mode); set
    :attr:`phase` as the step goes on and feed it the engine's events (:meth:`on_event`).
    """

    def __init__(self, *, backend: str = "gloo") -> None:
        super().__init__()
        self.backend = backend
        self.alive = 0
        self.peak = 0
        self.peak_at = ""
        self.phase = ""
        self.max_units_unsharded = 0
        self._last_event = ""
        self._unsharded: set[str] = set()
        self._sizes: dict[int, int] = {}  # id(storage) -> bytes counted
        self._refs: dict[int, weakref.ref[Any]] = {}
        self._resize: Any = None

    # -- counting -------------------------------------------------------------------------------

    def hold(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count the storages of ``tensors`` (alive before the step) from now on."""
        for tensor in tensors:
            self._add(storage_of(tensor))

    def _add(self, storage: Any) -> None:
        key = id(storage)
        if key in self._sizes:
            return
        self._sizes[key] = storage.nbytes()

        def freed(_: object, key: int = key) -> None:
            self._freed(key)

        self._refs[key] = weakref.ref(storage, freed)
        self._grow(self._sizes[key])

    def _freed(self, key: int) -> None:
        self.alive -= self._sizes.pop(key, 0)
        self._refs.pop(key, None)

    def _grow(self, nbytes: int) -> None:
        self.alive += nbytes
        if self.alive > self.peak:
            self.peak = self.alive
            where = f", {self._last_event}" if self._last_event else ""
            self.peak_at = f"{self.phase}{where}"

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                try:
                    storage = storage_of(value)
                except (RuntimeError, NotImplementedError):
                    continue  # a tensor without a storage of its own (sparse, nested)
                self._add(storage)
        return out

    def _resized(self, storage: Any, nbytes: int) -> None:
        key = id(storage)
        if key not in self._sizes:
            self._add(storage)
            return
        old = self._sizes[key]
        self._sizes[key] = nbytes
        if nbytes > old:
            self._grow(nbytes - old)
        else:
            self.alive -= old - nbytes

    def __enter__(self) -> StorageCounter:
        # ``UntypedStorage.resize_`` is not an op a dispatch mode sees: follow it here.
        original = torch.UntypedStorage.resize_
        counter = self

        def resize_(storage: Any, size: int) -> Any:
            result = original(storage, size)
            counter._resized(storage, storage.nbytes())
            return result

        self._resize = original
        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign, assignment]
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]

    def workspace(self, op: str, nbytes: int) -> int:
        """Bytes the backend holds while collective ``op`` of ``nbytes`` (all-gather output,
        reduce-scatter input) runs: gloo stages an all-gather's output and a reduce-scatter's
        input in a buffer of their size (``benchmarks/plan_vs_measured.py`` measures it);
        NCCL works in place."""
        if self.backend != "gloo":
            return 0
        if "all_gather" in op or "reduce_scatter" in op:
            return nbytes
        return 0

    # -- where in the step ----------------------------------------------------------------------

    def on_event(self, event: Any) -> None:
        """An ``fsdp_core.events`` event: unshards and reshards label the peak and count the
        units unsharded at once."""
        kind = type(event).__name__
        if kind == "Unshard":
            self._unsharded.add(event.unit)
            self.max_units_unsharded = max(self.max_units_unsharded, len(self._unsharded))
            self._last_event = f"after unshard of {event.unit or '<root>'}"
        elif kind == "Reshard":
            self._unsharded.discard(event.unit)
            self._last_event = f"after reshard of {event.unit or '<root>'}"
        elif kind == "Collective":
            self._last_event = f"in {event.op} of {event.unit or '<root>'}"
            # The backend's own buffer while the collective runs: see [Note: counting
            # storages].
            workspace = self.workspace(event.op, event.bytes)
            self._grow(workspace)
            self.alive -= workspace
