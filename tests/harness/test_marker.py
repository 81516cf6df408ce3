"""Parsing the ``distributed`` marker, in-process: every accepted spelling and every error."""

from __future__ import annotations

import pytest

from fsdp_testing._launch.spec import DistSpec, Mode, parse_marker


@pytest.mark.parametrize(
    ("args", "kwargs", "expected"),
    [
        ((), {}, [DistSpec(2)]),
        ((4,), {}, [DistSpec(4)]),
        ((), {"world_size": [2, 4]}, [DistSpec(2), DistSpec(4)]),
        (((1, 3),), {}, [DistSpec(1), DistSpec(3)]),
        ((2,), {"mode": "thread"}, [DistSpec(2, mode=Mode.THREAD)]),
        ((8,), {"mode": "fake"}, [DistSpec(8, mode=Mode.FAKE)]),
        ((2,), {"backend": "gloo", "timeout": 5}, [DistSpec(2, "gloo", timeout=5)]),
    ],
)
def test_accepted(args: tuple, kwargs: dict, expected: list[DistSpec]) -> None:
    assert parse_marker(args, kwargs) == expected


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "words"),
    [
        ((), {"wolrd_size": 2}, TypeError, "unexpected keyword argument 'wolrd_size'"),
        ((2, 3), {}, TypeError, "Accepted arguments: distributed(world_size=2"),
        ((0,), {}, ValueError, "world_size must be at least 1, got 0"),
        (("2",), {}, TypeError, "world_size must be an int or a list of ints, got '2'"),
        ((True,), {}, TypeError, "got True"),
        (([],), {}, ValueError, "world_size list must not be empty"),
        ((2,), {"mode": "threads"}, ValueError, "unknown mode 'threads'; use one of process"),
        ((2,), {"backend": "mpi"}, ValueError, "unknown backend 'mpi'"),
        ((2,), {"timeout": 0}, ValueError, "timeout must be a positive number of seconds, got 0"),
        ((2,), {"timeout": "5"}, ValueError, "got '5'"),
    ],
)
def test_rejected(args: tuple, kwargs: dict, error: type, words: str) -> None:
    with pytest.raises(error) as info:
        parse_marker(args, kwargs)
    assert words in str(info.value)
