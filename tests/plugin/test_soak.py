"""The short version of scripts/soak.py (the long one runs 500 tests): warm-pool tests that pass,
fail, crash and hang leave a constant number of processes, file descriptors and shared-memory
files, bounded rank memory, and nothing running."""

from __future__ import annotations

from ._scripts import load_script


def test_short_soak_holds_steady() -> None:
    soak = load_script("soak")
    figures = soak.soak(30, max_rss_growth_mib=64.0)
    kinds = figures["kinds"]
    failing = kinds["fail"] + kinds["crash"] + kinds["hang"]
    assert kinds["hang"] >= 1 and kinds["crash"] >= 1 and kinds["fail"] >= 1
    assert figures["pytest_summary"].startswith(f"{failing} failed, {kinds['pass']} passed")
    assert figures["processes"][0] == figures["processes"][1] == 3  # fork server + 2 ranks
    assert figures["parent_fds"][0] == figures["parent_fds"][1]
    assert figures["rank_fds"][0] == figures["rank_fds"][1]
    assert figures["shm_files"][0] == figures["shm_files"][1]
    assert figures["rank_rss_growth_mib"] <= 64.0
    assert figures["left_running"] == []
    assert figures["ok"] is True
