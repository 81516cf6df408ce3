"""How many ranks a torch-style test class gets on this machine, and how long it may take.

torch's FSDP tests size their world from the accelerator count (``torch.cuda.device_count()``,
``DEVICE_COUNT``), which is 0 (or torch's placeholder 1) on a CPU-only machine. torch's harness
then skips the test, or, for a world of 0, spawns no process and passes it vacuously.

[Note: CPU world size]
On a machine without an accelerator a test class whose ``world_size`` comes out below 1 runs on
``cpu_world_size()`` gloo ranks (``--cpu-world-size``, ini ``cpu_world_size``, environment
``FSDP_TESTING_CPU_WORLD_SIZE``; default 2), and never on fewer ranks than its
``skip_if_lt_x_gpu(n)`` asks for: that decorator's promise is "this test sees at least n ranks".
The substitution is reported with the test ("ran on 2 CPU ranks ..."). A machine with
accelerators runs the world the class declares. This module imports no torch, so the pytest
plugin can configure it at start-up.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
from collections.abc import Iterator

__all__ = [
    "CPU_WORLD_SIZE_ENV",
    "DEFAULT_CPU_WORLD_SIZE",
    "WorldChoice",
    "choose_world_size",
    "cpu_world_size",
    "in_test_world",
    "running_world_size",
    "scaled_timeout",
    "set_cpu_world_size",
]

CPU_WORLD_SIZE_ENV = "FSDP_TESTING_CPU_WORLD_SIZE"
DEFAULT_CPU_WORLD_SIZE = 2

# The world size of the test method running on this rank (thread ranks each have their own).
_running: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "fsdp_testing_running_world_size", default=None
)


@contextlib.contextmanager
def in_test_world(world_size: int) -> Iterator[None]:
    """Within the block, :func:`running_world_size` is ``world_size``: the unittest classes enter
    it on each rank around a test method, so that decorators checked on the rank
    (``skip_if_odd_worldsize``) see the world the test actually got.

    Args:
        world_size: the ranks of the running test.
    """
    token = _running.set(_validate_world(world_size, "in_test_world"))
    try:
        yield
    finally:
        _running.reset(token)


def running_world_size() -> int | None:
    """The world size of the test method running on this rank, or ``None`` outside one."""
    return _running.get()


def _validate_world(value: object, source: str) -> int:
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{source} must be a positive number of ranks, got {value!r}")
    return value


def set_cpu_world_size(world_size: int | None) -> None:
    """Set the number of CPU ranks for torch-style tests whose world size comes out as 0 on a
    machine without accelerators (see [Note: CPU world size]). Stored in the environment so the
    rank processes and child sessions see the same value.

    Args:
        world_size: ranks, at least 1; None restores the default (2).
    """
    if world_size is None:
        os.environ.pop(CPU_WORLD_SIZE_ENV, None)
        return
    os.environ[CPU_WORLD_SIZE_ENV] = str(_validate_world(world_size, "set_cpu_world_size"))


def cpu_world_size() -> int:
    """The configured CPU world size (default 2)."""
    raw = os.environ.get(CPU_WORLD_SIZE_ENV)
    if raw in (None, ""):
        return DEFAULT_CPU_WORLD_SIZE
    return _validate_world(raw, f"environment variable {CPU_WORLD_SIZE_ENV}")


@dataclasses.dataclass(frozen=True)
class WorldChoice:
    """The world a test runs at and, when it differs from what the class declared, why."""

    world_size: int
    note: str | None = None


def choose_world_size(
    declared: object,
    *,
    accelerators: int,
    min_ranks: int | None = None,
    owner: str = "world_size",
) -> WorldChoice:
    """Apply [Note: CPU world size].

    Args:
        declared: the class's ``world_size``.
        accelerators: accelerators on this machine.
        min_ranks: the ``n`` of the method's ``skip_if_lt_x_gpu(n)``, if any.
        owner: how to name the attribute in errors, e.g. ``"TestFoo.world_size"``.
    """
    if isinstance(declared, bool) or not isinstance(declared, int):
        raise TypeError(f"{owner} must be an int, got {declared!r}")
    if accelerators > 0:
        if declared < 1:
            raise ValueError(
                f"{owner} is {declared} on a machine with {accelerators} accelerator(s): return "
                "at least 1"
            )
        return WorldChoice(declared)
    wanted = min_ranks or 0
    if declared < 1:
        size = max(cpu_world_size(), wanted)
        return WorldChoice(
            size,
            f"ran on {size} CPU ranks (no GPU: {owner} came out as {declared}; set the size "
            "with --cpu-world-size)",
        )
    if declared < wanted:
        return WorldChoice(
            wanted,
            f"ran on {wanted} CPU ranks (no GPU: {owner} is {declared}, skip_if_lt_x_gpu asks "
            f"for at least {wanted})",
        )
    return WorldChoice(declared)


def scaled_timeout(base: float, world_size: int, cpus: int | None = None) -> float:
    """``base`` stretched by ``world_size / cpus`` when there are more ranks than CPU cores, so
    an 8-rank test on 2 cores gets four times the per-test timeout instead of timing out for
    slowness.

    Args:
        base: the session's per-test timeout in seconds.
        world_size: ranks of the test.
        cpus: CPU cores (default ``os.cpu_count()``).
    """
    cores = cpus if cpus is not None else (os.cpu_count() or 1)
    return base * max(1.0, world_size / max(cores, 1))
