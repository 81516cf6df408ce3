"""The short version of scripts/thread_stress.py (the long one runs 20 rounds at 128 thread
ranks): thread-mode worlds whose ranks all fail together, fail while peers wait in a
collective, hang, or never enter one, each ended with its report within its deadline, the
next test run, and no rank thread left behind."""

from __future__ import annotations

from ._scripts import load_script


def test_short_thread_stress_ends_every_world() -> None:
    stress = load_script("thread_stress")
    figures = stress.stress(rounds=1, world_size=16)
    assert figures["reported"] == figures["tests"] == 5, figures
    assert figures["wrong"] == [] and figures["slow"] == [], figures
    low, high = figures["threads_after_each_test"]
    assert low == high, figures  # no rank thread left behind by any test
    assert figures["ok"] is True
