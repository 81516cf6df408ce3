"""Per-rank seeds under pytest-randomly.

[Note: per-rank seeds]
pytest-randomly reseeds Python's ``random`` and NumPy's global generator (and whatever a
``pytest_randomly.random_seeder`` entry point reseeds) in the pytest process before each test,
from ``--randomly-seed`` and the test's id. A rank is not the pytest process: a process-mode
rank keeps the state its fork server had, restored after every test, and rank threads get the
state of their own turn; so, without more, every rank of every test draws the same numbers,
whatever the seed, and ``--randomly-seed=N`` reproduces nothing on a rank.

While pytest-randomly is active and resets seeds (not ``--randomly-dont-reset-seed``), each
rank reseeds the same generators before the test body, with

    seed = (randomly_seed + crc32("<test id>@rank<N>")) mod 2**32

(:func:`rank_seed`): deterministic for a given ``--randomly-seed`` and test, different on each
rank, as separate processes seeded by rank would be, and not the next rank's seed under the
next ``--randomly-seed``. The parent puts ``randomly_seed`` in the environment (``ENV``) before
any rank process starts (:func:`export_for_ranks`); rank threads read the same variable. The
seeds are printed: the session's header says how they are made, and each distributed test
carries one junitxml property per rank (``rank N seed``), also shown in a failure's report.
torch's generator is left to the test (``torch.manual_seed``), as pytest-randomly leaves it:
the harness restores it after each test.

In a launched job (torchrun, srun) every process runs pytest-randomly with a seed of its own
unless ``--randomly-seed=N`` is given: there, the ranks are reseeded with that seed only (each
process exports it before it starts serving ranks), and otherwise left alone, with nothing
printed.
"""

from __future__ import annotations

import os
import random
import sys
import zlib
from collections.abc import Callable
from typing import Any

__all__ = ["ENV", "describe", "export_for_ranks", "rank_seed", "reseed_rank", "session_seed"]

ENV = "FSDP_TESTING_RANDOMLY_SEED"
"""pytest-randomly's seed of the session, for the ranks (absent: no reseeding)."""

_reseeders: list[Callable[[int], None]] | None = None


def session_seed(config: Any, *, in_a_job: bool = False) -> int | None:
    """pytest-randomly's seed when it is active and resets seeds before each test; else None.
    ``in_a_job``: only a seed given on the command line (``--randomly-seed=N``), which every
    process of a launched job shares; each picks a seed of its own otherwise."""
    if not config.pluginmanager.hasplugin("randomly"):
        return None
    if not config.getoption("randomly_reset_seed", True):
        return None
    if in_a_job:  # as parsed, before pytest-randomly's pytest_configure settles a seed
        seed = getattr(config.known_args_namespace, "randomly_seed", None)
    else:
        seed = config.getoption("randomly_seed", None)
    return seed if isinstance(seed, int) else None


def export_for_ranks(config: Any, *, in_a_job: bool = False) -> int | None:
    """In the parent (or a job's process, before it starts serving ranks): tell the ranks
    started from now on to reseed (see [Note: per-rank seeds]); returns the seed, None when
    the ranks are not reseeded."""
    seed = session_seed(config, in_a_job=in_a_job)
    if seed is None:
        os.environ.pop(ENV, None)
    else:
        os.environ[ENV] = str(seed)
    return seed


def rank_seed(seed: int, test_id: str, rank: int) -> int:
    """The seed rank ``rank`` uses for the test ``test_id`` under ``--randomly-seed=seed``."""
    return (seed + zlib.crc32(f"{test_id}@rank{rank}".encode(errors="surrogatepass"))) % 2**32


def describe(seed: int) -> str:
    """The session header's line."""
    return (
        f"fsdp_testing: pytest-randomly reseeds each rank before a distributed test: "
        f"random and numpy with ({seed} + crc32('<test id>@rank<N>')) mod 2**32"
    )


def reseed_rank(test_id: str, rank: int) -> None:
    """On a rank, before the test body: reseed as pytest-randomly would, with this rank's seed
    (nothing when the session does not reseed)."""
    raw = os.environ.get(ENV)
    if not raw:
        return
    seed = rank_seed(int(raw), test_id, rank)
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed)
    for reseed in _entry_point_reseeders():
        reseed(seed)


def _entry_point_reseeders() -> list[Callable[[int], None]]:
    # pytest-randomly's extension point: a package that registers a reseeder for its own
    # generator gets it called on the ranks too. Loaded once per process.
    global _reseeders
    if _reseeders is None:
        from importlib.metadata import entry_points

        _reseeders = [ep.load() for ep in entry_points(group="pytest_randomly.random_seeder")]
    return _reseeders
