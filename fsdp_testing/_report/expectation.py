"""An expected failure report: a test that passes only when the named rank fails and the
report says what the test expects (``fsdp_testing.faults.expect``).

``pytest.mark.xfail(strict=True)`` passes whenever the test fails, for any reason: a fault test
written with it also passes when the harness blames the wrong rank or the test breaks somewhere
else. An :class:`ExpectedFailure` checks the rank and the report's text instead, and turns the
verdict around: the expected failure passes (its report kept as a section, so it can be read),
anything else fails and says what was expected and what happened.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

__all__ = ["ExpectedFailure", "expect", "expectation_of"]

_F = TypeVar("_F", bound=Callable[..., Any])
_ATTR = "_fsdp_testing_expect"


@dataclasses.dataclass(frozen=True)
class ExpectedFailure:
    """What the failure of a test must look like; see :func:`expect`."""

    ranks: tuple[int, ...] | None
    """Ranks of which each must fail itself; None: any rank."""
    match: str | None
    """A regular expression searched (``re.search``, DOTALL) in the failure report."""

    def __call__(self, test: _F) -> _F:
        if not callable(test):
            raise TypeError(f"faults.expect(...) decorates a test function or method, got {test!r}")
        setattr(test, _ATTR, self)
        return test

    def describe(self) -> str:
        who = "a rank" if self.ranks is None else _ranks_words(self.ranks)
        what = "" if self.match is None else f" with a report matching {self.match!r}"
        return f"{who} to fail{what}"

    def judge(self, obs: Any, verdict: Any) -> Any:
        """The verdict of the test with this expectation: ``verdict`` is what the harness
        judged from ``obs`` (an :class:`~fsdp_testing._report.observation.Observation`)."""
        from fsdp_testing._report.verdict import Verdict, VerdictOutcome

        expected = f"expected {self.describe()}"
        if verdict.outcome is VerdictOutcome.SKIPPED:
            return verdict
        if verdict.outcome is not VerdictOutcome.FAILED:
            return Verdict(
                VerdictOutcome.FAILED,
                f"{expected}, but the test {verdict.outcome.value} on every rank",
                verdict.sections,
            )
        problems = []
        culprits = failed_ranks(obs)
        outside = [r for r in self.ranks or () if r >= obs.world_size]
        if outside:
            problems.append(
                f"{_ranks_words(tuple(outside))} is not a rank of this world of {obs.world_size}"
            )
        elif self.ranks is not None:
            innocent = [r for r in self.ranks if r not in culprits]
            if innocent:
                who = ", ".join(str(r) for r in sorted(culprits)) or "none"
                problems.append(
                    f"{_ranks_words(tuple(innocent))} did not fail (ranks that failed: {who})"
                )
        if self.match is not None and not re.search(self.match, verdict.message, re.DOTALL):
            problems.append(f"the report does not match {self.match!r}")
        if problems:
            return Verdict(
                VerdictOutcome.FAILED,
                f"{expected}, but {'; '.join(problems)}. The report:\n{verdict.message}",
                verdict.sections,
            )
        return Verdict(
            VerdictOutcome.PASSED,
            "",
            [*verdict.sections, (f"expected failure: {self.describe()}", verdict.message + "\n")],
        )


def failed_ranks(obs: Any) -> set[int]:
    """Ranks that failed themselves: the body raised (not a collective broken by a peer), the
    process died, or the rank was still running when the test timed out."""
    from fsdp_testing._protocol import Outcome

    ranks = {
        r for r, res in obs.results.items() if res.outcome is Outcome.FAILED and not res.comm_error
    }
    ranks |= set(obs.dead)
    if obs.timed_out:
        ranks |= set(obs.stragglers) | set(obs.stacks)
    return ranks


def _ranks_words(ranks: tuple[int, ...]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(str(r) for r in ranks)


def expect(*, rank: int | Iterable[int] | None = None, match: str | None = None) -> ExpectedFailure:
    """Decorate a distributed test that must fail, and say how.

    The test passes only when it fails, each named rank failed itself (its body raised, its
    process died, or it was still running at the timeout; a rank whose collective broke because
    a peer failed does not count), and the failure report matches ``match``. Otherwise it fails
    and says what was expected and what happened, with the report. An expected failure's report
    is kept as a section of the passing test (``-rA`` shows it). Works on pytest tests with the
    ``distributed`` marker and on methods of the unittest classes (``FSDPTest`` and friends)::

        @faults.expect(rank=1, match=r"rank 1 killed by SIGKILL at all_reduce #1")
        @pytest.mark.distributed(world_size=2, faults=[faults.kill(rank=1, at=1)])
        def test_kill_is_reported(process_group): ...

    Args:
        rank: the rank (or ranks) that must fail; None (default): any rank.
        match: a regular expression searched in the failure report (``re.search``, ``.``
            matches newlines); None (default): any report.
    """
    if rank is None:
        ranks = None
    else:
        ranks = (rank,) if isinstance(rank, int) else tuple(rank)
        if not ranks or any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in ranks):
            raise ValueError(
                f"faults.expect: rank must be a rank number (an int >= 0), a list of them or "
                f"None for any rank, got {rank!r}"
            )
    if match is not None:
        if not isinstance(match, str):
            raise TypeError(
                f"faults.expect: match must be a regular expression string, got {match!r}"
            )
        try:
            re.compile(match)
        except re.error as exc:
            raise ValueError(
                f"faults.expect: match={match!r} is not a regular expression: {exc}"
            ) from None
    return ExpectedFailure(ranks, match)


def expectation_of(test: Any) -> ExpectedFailure | None:
    """The expectation :func:`expect` put on ``test`` (a function or method), if any."""
    return getattr(test, _ATTR, None)
