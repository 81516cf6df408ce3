"""The marker's ``rank=`` (fake mode plays any rank; a list parametrizes the test with ids like
``[rank517]``) and ``mode="local"``: parsing in-process, ids and fixtures through pytest."""

from __future__ import annotations

import pytest

from fsdp_testing._launch.spec import DistSpec, Mode, fake_ranks, mode_named, parse_marker
from fsdp_testing.launcher import resolve_backend


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"mode": "fake"}, [DistSpec(1024, mode=Mode.FAKE)]),
        ({"mode": "fake", "rank": 517}, [DistSpec(1024, mode=Mode.FAKE, rank=517)]),
        (
            {"mode": "fake", "rank": [0, 1023]},
            [DistSpec(1024, mode=Mode.FAKE, rank=0), DistSpec(1024, mode=Mode.FAKE, rank=1023)],
        ),
        ({"mode": "local"}, [DistSpec(1024, mode=Mode.LOCAL)]),
    ],
)
def test_accepted(kwargs: dict, expected: list[DistSpec]) -> None:
    assert parse_marker((1024,), kwargs) == expected


def test_world_sizes_and_ranks_multiply() -> None:
    specs = parse_marker((), {"world_size": [8, 16], "mode": "fake", "rank": [0, 7]})
    assert [(s.world_size, s.rank) for s in specs] == [(8, 0), (8, 7), (16, 0), (16, 7)]


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"rank": 1}, ValueError, "rank=1 needs mode='fake'"),
        ({"mode": "local", "rank": 1}, ValueError, "rank=1 needs mode='fake'"),
        ({"mode": "fake", "rank": 8}, ValueError, "rank=8 is not a rank of a world of 8; use 0..7"),
        ({"mode": "fake", "rank": -1}, ValueError, "rank=-1 is not a rank of a world of 8"),
        ({"mode": "fake", "rank": []}, ValueError, "rank list must not be empty"),
        ({"mode": "fake", "rank": "3"}, TypeError, "rank must be an int or a list of ints"),
        ({"mode": "fake", "rank": True}, TypeError, "got True"),
    ],
)
def test_rejected(kwargs: dict, error: type, words: str) -> None:
    with pytest.raises(error) as info:
        parse_marker((8,), kwargs)
    assert words in str(info.value)


def test_local_mode_has_its_own_backend() -> None:
    assert resolve_backend(DistSpec(64, mode=Mode.LOCAL)) == "local"
    with pytest.raises(ValueError, match="mode='local' runs on its own in-process backend"):
        resolve_backend(DistSpec(4, backend="gloo", mode=Mode.LOCAL))
    with pytest.raises(ValueError, match="backend='local' needs mode='local'"):
        resolve_backend(DistSpec(4, backend="local"))


def test_unittest_attributes_are_checked() -> None:
    assert mode_named(None, Mode.THREAD, "T") is Mode.THREAD
    assert mode_named("local", Mode.PROCESS, "T") is Mode.LOCAL
    with pytest.raises(ValueError, match=r"T\.dist_mode = 'locale': use one of"):
        mode_named("locale", Mode.PROCESS, "T")
    assert fake_ranks([0, 517], 1024, "T") == [0, 517]
    with pytest.raises(ValueError, match=r"T\.fake_rank: 1024 is not a rank of a world of 1024"):
        fake_ranks(1024, 1024, "T")


def test_rank_list_ids_and_fixtures(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest, torch.distributed as dist

        @pytest.mark.distributed(world_size=1024, mode="fake", rank=[0, 517, 1023])
        def test_played(rank, world_size):
            assert dist.get_rank() == rank and dist.get_world_size() == world_size == 1024

        @pytest.mark.distributed(world_size=[8, 16], mode="fake", rank=[0, 7])
        def test_both(rank, world_size):
            assert (dist.get_rank(), dist.get_world_size()) == (rank, world_size)

        @pytest.mark.distributed(world_size=64, mode="fake", rank=63)
        def test_one(rank):
            assert rank == 63
        """
    )
    result = pytester.runpytest("-v", "-p", "no:randomly")
    result.assert_outcomes(passed=8)
    result.stdout.fnmatch_lines(
        [
            "*test_played[[]rank0[]] PASSED*",
            "*test_played[[]rank517[]] PASSED*",
            "*test_played[[]rank1023[]] PASSED*",
            "*test_both[[]ws8-rank7[]] PASSED*",
            "*test_both[[]ws16-rank0[]] PASSED*",
            "*test_one PASSED*",
        ]
    )
