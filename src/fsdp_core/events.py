"""A tiny publish/subscribe hook that makes the engine's data movement observable.

The engine publishes one event per unshard, reshard, collective and offload copy. A test
recorder (or a profiler) subscribes a callback::

    from fsdp_core import events

    seen = []
    handle = events.subscribe(seen.append)
    ...  # train
    handle.remove()

Callbacks run synchronously on the thread that issued the event, so with thread-mode ranks
several threads may call one callback; every event carries the global ``rank`` that issued it.
Publishing costs one truthiness check of a list when nobody subscribes: call sites guard event
construction with :func:`has_subscribers`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, TypeAlias

__all__ = [
    "Collective",
    "Event",
    "OffloadCopy",
    "OffloadDirection",
    "Reshard",
    "ReshardReason",
    "Subscription",
    "Unshard",
    "UnshardReason",
    "has_subscribers",
    "publish",
    "subscribe",
]

UnshardReason: TypeAlias = Literal[
    "forward", "forward_prefetch", "backward", "backward_prefetch", "explicit"
]
ReshardReason: TypeAlias = Literal["forward", "backward", "explicit"]
OffloadDirection: TypeAlias = Literal["to_device", "to_host"]


@dataclass(frozen=True, kw_only=True)
class Unshard:
    """A unit's parameters became unsharded (all-gathered, or aliased for ``NO_SHARD``).

    Args:
        unit: the unit's module FQN relative to the root (``""`` for the root).
        reason: why the unit was unsharded.
        devices: device of each unsharded parameter, in registration order.
        rank: global rank that issued the event.
    """

    unit: str
    reason: UnshardReason
    devices: tuple[str, ...]
    rank: int


@dataclass(frozen=True, kw_only=True)
class Reshard:
    """A unit's unsharded parameters were freed; the module sees the local shards again.

    Args:
        unit: the unit's module FQN relative to the root (``""`` for the root).
        reason: ``"forward"`` (after forward), ``"backward"`` (after its gradients were reduced,
            or at the end of backward) or ``"explicit"``.
        devices: device of each sharded parameter, in registration order.
        rank: global rank that issued the event.
    """

    unit: str
    reason: ReshardReason
    devices: tuple[str, ...]
    rank: int


@dataclass(frozen=True, kw_only=True)
class Collective:
    """One collective issued by the engine.

    Args:
        op: the ``torch.distributed`` function called, e.g. ``"all_gather_single"``.
        bytes: size of the unsharded buffer the collective works on: the output of an
            all-gather, the input of a reduce-scatter, the tensor of an all-reduce.
        shapes: shapes of the tensors passed, in call order (output first).
        dtype: element type.
        group_size: number of ranks in the process group.
        unit: FQN of the unit the collective serves (``""`` for the root).
        rank: global rank that issued the event.
    """

    op: str
    bytes: int
    shapes: tuple[tuple[int, ...], ...]
    dtype: str
    group_size: int
    unit: str
    rank: int


@dataclass(frozen=True, kw_only=True)
class OffloadCopy:
    """One copy of offloaded data made for ``CPUOffload(offload_params=True)``.

    ``"to_device"``: a unit's flat CPU shard copied to the compute device before it is gathered
    (for an unshard, or for ``summon_full_params``, which also copies the gradient shard with
    ``with_grads``). ``"to_host"``: a unit's reduced gradient shard copied back to the CPU. The
    copy is made even when the compute device is the CPU, so the logic runs and is observable
    on CPU-only machines. ``summon_full_params(offload_to_cpu=True)`` copies are not offload
    copies in this sense and publish nothing.

    Args:
        unit: FQN of the unit (``""`` for the root).
        direction: ``"to_device"`` or ``"to_host"``.
        bytes: size of the copied tensor.
        rank: global rank that issued the event.
    """

    unit: str
    direction: OffloadDirection
    bytes: int
    rank: int


Event: TypeAlias = Unshard | Reshard | Collective | OffloadCopy

_subscribers: list[Callable[[Event], None]] = []
_lock = threading.Lock()


class Subscription:
    """Handle returned by :func:`subscribe`; ``remove()`` stops the deliveries (idempotent)."""

    def __init__(self, callback: Callable[[Event], None]) -> None:
        self._callback: Callable[[Event], None] | None = callback

    def remove(self) -> None:
        with _lock:
            if self._callback is not None and self._callback in _subscribers:
                _subscribers.remove(self._callback)
            self._callback = None

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()


def subscribe(callback: Callable[[Event], None]) -> Subscription:
    """Deliver every future event to ``callback`` until the returned handle is removed.

    Args:
        callback: called with each :data:`Event`; exceptions it raises propagate into the
            training step, so keep it simple (append to a list).
    """
    if not callable(callback):
        raise TypeError(f"events.subscribe(callback) takes a callable, got {callback!r}.")
    with _lock:
        _subscribers.append(callback)
    return Subscription(callback)


def has_subscribers() -> bool:
    """Whether anyone listens; call sites skip building events when this is ``False``."""
    return bool(_subscribers)


def publish(event: Event) -> None:
    """Deliver ``event`` to every subscriber, in subscription order."""
    for callback in tuple(_subscribers):
        callback(event)
