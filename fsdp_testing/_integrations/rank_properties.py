"""Per-rank report properties: how each rank of a distributed test ended, for ``--junitxml``
and any plugin that reads a report's ``user_properties``.

[Note: per-rank properties]
pytest writes a test's ``user_properties`` as ``<property>`` elements of its ``<testcase>``
in the JUnit XML (whatever ``junit_family``). A distributed test is one testcase for all its
ranks, so the plugin adds one property per rank that reported or was seen to end, named
``rank N``, whose value says how it ended and in how long: ``passed in 0.012 s``,
``failed in 0.030 s: AssertionError: ...``, ``failed in 0.026 s (broken by a peer): ...``,
``died: killed by SIGKILL``, ``stopped: still running at the timeout``; in a job across
nodes the rank's node follows in parentheses. Under pytest-randomly each rank's seed follows
as ``rank N seed`` (see [Note: per-rank seeds] in ``seeds.py``).

``record_property`` itself is a fixture of the pytest process: rank threads (thread, local and
fake mode) may call it, and what they record lands here too; a process-mode rank cannot (the
fixture's function does not travel), and the plugin says so when the test is sent.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RECORDING_FIXTURES", "rank_properties"]

RECORDING_FIXTURES = ("record_property", "record_xml_attribute", "record_testsuite_property")
"""pytest's fixtures that record into the pytest process's report: not for process-mode ranks."""


def rank_properties(obs: Any, *, test_id: str, seed: int | None = None) -> list[tuple[str, str]]:
    """The ``(name, value)`` properties of each rank of ``obs`` (an ``Observation``); with
    ``seed`` (pytest-randomly's), each rank's seed too."""
    from fsdp_testing._integrations.seeds import rank_seed

    properties: list[tuple[str, str]] = []
    for rank in sorted(set(obs.results) | obs.dead | obs.stragglers):
        properties.append((f"rank {rank}", _ending(obs, rank)))
        if seed is not None:
            properties.append((f"rank {rank} seed", str(rank_seed(seed, test_id, rank))))
    return properties


def _ending(obs: Any, rank: int) -> str:
    result = obs.results.get(rank)
    if result is not None:
        text = f"{result.outcome.value} in {result.duration:.3f} s"
        if result.outcome.value == "failed" and result.comm_error:
            text += " (broken by a peer)"
        if result.outcome.value == "failed" and result.summary:
            text += f": {result.summary}"
    elif rank in obs.dead:
        text = f"died: {obs.exit_status.get(rank, 'exited')}"
    elif obs.timed_out:
        text = "stopped: still running at the timeout"
    else:
        text = "stopped: still running after a peer failed"
    where = obs.where.get(rank)
    return f"{text} ({where})" if where else text
