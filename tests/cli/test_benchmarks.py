"""The core-vs-FSDP2 benchmark runs end to end at a tiny size and reports its figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from core_vs_fsdp2 import paired_ratios  # noqa: E402


def test_paired_ratios_take_the_slower_rank_of_each_round():
    times = [
        {"fsdp_core": [1.0, 4.0], "torch_fsdp2": [2.0, 2.0]},
        {"fsdp_core": [3.0, 1.0], "torch_fsdp2": [1.0, 8.0]},
    ]
    assert paired_ratios(times, "fsdp_core", "torch_fsdp2") == [1.5, 0.5]


def test_core_vs_fsdp2_runs_and_matches_theory(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "core_vs_fsdp2.py"),
            *("--width", "32", "--blocks", "1", "--steps", "1", "--warmup", "1"),
            *("--rounds", "2", "--json", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "DIFFERS" not in proc.stdout, proc.stdout
    assert "fsdp_core / FSDP2 =" in proc.stdout and "paired rounds" in proc.stdout
    report = json.loads(out.read_text())
    for engine in ("fsdp_core", "torch_fsdp2"):
        rank0 = report["results"][engine][0]
        assert rank0["comm"] == rank0["theory"] != {}, engine
    assert len(report["paired_ratios"]["torch_fsdp2"]["ratios"]) == 2
    assert all(len(t["fsdp_core"]) == 2 for t in report["interleaved"])
