"""The ``distributed`` marker's arguments, parsed and validated without importing torch."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "KNOWN_BACKENDS",
    "DistSpec",
    "Mode",
    "fake_ranks",
    "mode_named",
    "parse_marker",
]

DEFAULT_TIMEOUT_S = 120.0
KNOWN_BACKENDS = ("gloo", "nccl", "fake", "threaded", "local")
MARKER_SIGNATURE = (
    "distributed(world_size=2, *, backend=None, mode='process', timeout=None, faults=(), rank=None)"
)


class Mode(str, enum.Enum):
    """How the ranks of one test are run."""

    PROCESS = "process"
    """One OS process per rank (a warm pool by default)."""
    THREAD = "thread"
    """One thread per rank over torch's threaded process group."""
    FAKE = "fake"
    """One process playing one rank (``rank=``, default 0) of a world of any size over torch's
    fake backend: sharding and engine state are that rank's, collectives move no data."""
    LOCAL = "local"
    """Every rank of the world in this process, one rank thread running at a time, over
    exact in-process collectives (gloo's numbers): worlds of 64+ ranks on one core."""


@dataclasses.dataclass(frozen=True)
class DistSpec:
    """One distributed test's launch parameters, as read from its marker.

    Args:
        world_size: number of ranks (an int here; a list on the marker parametrizes the test).
        backend: ``"gloo"``, ``"nccl"``, or None to pick nccl only when CUDA has enough devices.
        mode: see :class:`Mode`.
        timeout: seconds before the test is failed and its ranks are stopped; None for the
            configured default.
        faults: faults to inject (``fsdp_testing.faults``); checked against the mode and the
            world size when the test runs, so a bad one fails that test alone.
        rank: fake mode: the rank this process plays (default 0); a list on the marker
            parametrizes the test. Only fake mode takes it.
    """

    world_size: int
    backend: str | None = None
    mode: Mode = Mode.PROCESS
    timeout: float | None = None
    faults: tuple[Any, ...] = ()
    rank: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int):
            raise TypeError(
                f"distributed marker: world_size must be an int or a list of ints, got "
                f"{self.world_size!r}"
            )
        if self.world_size < 1:
            raise ValueError(
                f"distributed marker: world_size must be at least 1, got {self.world_size}"
            )
        if self.backend is not None and self.backend not in KNOWN_BACKENDS:
            raise ValueError(
                f"distributed marker: unknown backend {self.backend!r}; use one of "
                f"{', '.join(KNOWN_BACKENDS)} or None (nccl when CUDA has enough devices, else "
                "gloo)"
            )
        if self.timeout is not None and (
            isinstance(self.timeout, bool)
            or not isinstance(self.timeout, (int, float))
            or self.timeout <= 0
        ):
            raise ValueError(
                f"distributed marker: timeout must be a positive number of seconds, got "
                f"{self.timeout!r}"
            )
        if isinstance(self.rank, bool) or not isinstance(self.rank, int):
            raise TypeError(
                f"distributed marker: rank must be an int or a list of ints, got {self.rank!r}"
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"distributed marker: rank={self.rank} is not a rank of a world of "
                f"{self.world_size}; use 0..{self.world_size - 1}"
            )
        if self.faults:
            from fsdp_testing.faults import Fault

            bad = [f for f in self.faults if not isinstance(f, Fault)]
            if bad:
                raise TypeError(
                    f"distributed marker: faults must be made by fsdp_testing.faults.kill/fail/"
                    f"delay/hang, got {bad[0]!r}"
                )


def _signature(
    world_size: int | list[int] | tuple[int, ...] = 2,
    *,
    backend: str | None = None,
    mode: str = "process",
    timeout: float | None = None,
    faults: Any = (),
    rank: int | list[int] | tuple[int, ...] | None = None,
) -> tuple[list[int], str | None, Mode, float | None, tuple[Any, ...], list[int]]:
    sizes: list[int]
    if isinstance(world_size, (list, tuple)):
        if not world_size:
            raise ValueError("distributed marker: world_size list must not be empty")
        sizes = list(world_size)
    else:
        sizes = [world_size]
    try:
        parsed_mode = Mode(mode)
    except ValueError:
        raise ValueError(
            f"distributed marker: unknown mode {mode!r}; use one of "
            f"{', '.join(m.value for m in Mode)}"
        ) from None
    if not isinstance(faults, (list, tuple)):
        raise TypeError(
            f"distributed marker: faults must be a list of faults (fsdp_testing.faults.kill/fail/"
            f"delay/hang), got {faults!r}"
        )
    ranks: list[int] = [0]
    if rank is not None:
        if parsed_mode is not Mode.FAKE:
            raise ValueError(
                f"distributed marker: rank={rank!r} needs mode='fake' (a fake world plays one "
                f"rank; mode={parsed_mode.value!r} runs every rank, each with its own rank "
                "fixture)"
            )
        if isinstance(rank, (list, tuple)):
            if not rank:
                raise ValueError("distributed marker: rank list must not be empty")
            ranks = list(rank)
        else:
            ranks = [rank]
    return sizes, backend, parsed_mode, timeout, tuple(faults), ranks


def parse_marker(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[DistSpec]:
    """Return one :class:`DistSpec` per world size and rank named by a ``distributed`` marker
    (world sizes first: ``[ws8-rank0, ws8-rank7, ws16-rank0, ...]``).

    Raises ``TypeError`` listing the accepted arguments when the marker is malformed and
    ``ValueError`` for values out of range.
    """
    try:
        sizes, backend, mode, timeout, faults, ranks = _signature(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(
            f"malformed marker {MARKER_SIGNATURE.split('(')[0]}{_fmt_call(args, kwargs)}: "
            f"{exc}. Accepted arguments: {MARKER_SIGNATURE}"
        ) from None
    return [DistSpec(ws, backend, mode, timeout, faults, rank) for ws in sizes for rank in ranks]


def _fmt_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return "(" + ", ".join(parts) + ")"


def mode_named(value: str | None, default: Mode, owner: str) -> Mode:
    """The mode a unittest class's ``dist_mode`` attribute names (``default`` for None)."""
    if value is None:
        return default
    try:
        return Mode(value)
    except ValueError:
        raise ValueError(
            f"{owner}.dist_mode = {value!r}: use one of "
            f"{', '.join(repr(m.value) for m in Mode)} (or leave it None)"
        ) from None


def fake_ranks(value: Any, world_size: int, owner: str) -> list[int]:
    """The ranks a unittest class's ``fake_rank`` attribute names, each checked against
    ``world_size``."""
    ranks = list(value) if isinstance(value, (list, tuple)) else [value]
    for rank in ranks:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(
                f"{owner}.fake_rank: {rank!r} is not a rank of a world of {world_size}; use "
                f"0..{world_size - 1}"
            )
    return ranks
