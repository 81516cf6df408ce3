"""The benchmarks run end to end at a tiny size, report their figures and draw their charts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import core_step_parts  # noqa: E402
import harness_overhead  # noqa: E402
from core_vs_fsdp2 import median_interval, paired_ratios, wrapper_roles  # noqa: E402

from ._images import assert_drawn_png  # noqa: E402


def test_paired_ratios_take_the_slower_rank_of_each_round():
    times = [
        {"fsdp_core": [1.0, 4.0], "torch_fsdp2": [2.0, 2.0]},
        {"fsdp_core": [3.0, 1.0], "torch_fsdp2": [1.0, 8.0]},
    ]
    assert paired_ratios(times, "fsdp_core", "torch_fsdp2") == [1.5, 0.5]


def test_the_median_interval_is_the_order_statistics_around_the_middle():
    # n = 101: 50.5 -+ 0.98 * sqrt(101) = 40.65 .. 60.35, so the 41st and 62nd values.
    values = [float(v) for v in range(1, 102)]
    assert median_interval(list(reversed(values))) == (41.0, 62.0)
    assert median_interval([2.0]) == (2.0, 2.0)


def test_the_wrapper_copies_trade_roles_so_each_plays_every_role_equally():
    roles = ("fsdp_core", "fsdp_core_untagged", "fsdp_core_no_overlap")
    played = [wrapper_roles(r, roles) for r in range(6)]
    assert played[0] == {"fsdp_core": 0, "fsdp_core_untagged": 1, "fsdp_core_no_overlap": 2}
    assert played[1] == {"fsdp_core": 1, "fsdp_core_untagged": 2, "fsdp_core_no_overlap": 0}
    for round_roles in played:  # one copy per role in every round
        assert sorted(round_roles.values()) == [0, 1, 2]
    for role in roles:  # every copy plays every role twice in six rounds
        assert sorted(p[role] for p in played) == [0, 0, 1, 1, 2, 2]
    assert wrapper_roles(5, ("fsdp_core",)) == {"fsdp_core": 0}


def test_core_vs_fsdp2_runs_matches_theory_and_draws_its_png(tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "core_vs_fsdp2.py"),
            *("--width", "32", "--blocks", "1", "--steps", "1", "--warmup", "1"),
            *("--rounds", "2", "--json", str(out), "--png", str(png)),
            "--forward-prefetch",  # the default configuration runs in the test below
            "--exact-memory",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "DIFFERS" not in proc.stdout, proc.stdout
    assert "fsdp_core / FSDP2 =" in proc.stdout and "paired rounds" in proc.stdout
    assert "sharded engines prefetch one unit in backward and forward" in proc.stdout
    assert "peak RSS follows the tensors (--exact-memory)" in proc.stdout
    report = json.loads(out.read_text())
    for engine in ("fsdp_core", "fsdp_core_fully_shard", "torch_fsdp2"):
        rank0 = report["results"][engine][0]
        assert rank0["comm"] == rank0["theory"] != {}, engine
    assert len(report["paired_ratios"]["torch_fsdp2"]["ratios"]) == 2
    door = report["paired_ratios"]["fsdp_core_fully_shard/torch_fsdp2"]
    assert len(door["ratios"]) == 2 and door["peak_rss_ratio"] > 0
    assert "fsdp_core_fully_shard / FSDP2 =" in proc.stdout
    assert all(len(t[e]) == 2 for t in report["interleaved"] for e in report["results"])
    # Plain lines in a pipe: the tables as aligned text, no escape codes.
    assert "\x1b" not in proc.stdout
    assert "engine                 median ms  min ms  max ms" in proc.stdout
    assert f"wrote {png}" in proc.stdout
    assert_drawn_png(png, width=1000, height=450)


def test_core_vs_fsdp2_variants_only_reports_the_order_check_and_the_overlap():
    """--variants-only steps fsdp_core next to its untagged and its unoverlapped copies only,
    and prints both paired ratios with their intervals; it needs a variant to measure."""
    script = str(ROOT / "benchmarks" / "core_vs_fsdp2.py")
    small = ("--width", "32", "--blocks", "1", "--warmup", "1", "--rounds", "3")
    proc = subprocess.run(
        [sys.executable, script, *small, "--variants-only", "--order-check-cost",
         "--overlap-cost"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "fsdp_core and its variants interleaved" in proc.stdout
    assert "isolated" not in proc.stdout and "torch_fsdp2" not in proc.stdout
    for label in ("order check", "overlap"):
        line = next(x for x in proc.stdout.splitlines() if x.startswith(f"{label}: "))
        assert "median of 3 paired rounds" in line and "95% interval of the median" in line
    refused = subprocess.run(
        [sys.executable, script, "--variants-only"], capture_output=True, text=True, timeout=60
    )
    assert refused.returncode == 2
    assert "--variants-only needs --order-check-cost, --overlap-cost or both" in refused.stderr


def _phases(*totals: float) -> list[dict[str, float]]:
    return [{"setup": t / 4, "call": t / 2, "teardown": t / 4} for t in totals]


def test_harness_overhead_prints_its_table_and_draws_its_png(tmp_path, capsys):
    rows = [
        ("plain pytest test, no ranks (the floor)", _phases(0.0012, 0.0013)),
        ("fsdp_testing warm pool", _phases(0.002, 0.0021, 0.0019)),
        ("fsdp_testing fresh processes (--no-dist-pool)", _phases(0.078, 0.08)),
        ("fsdp_testing thread mode", _phases(0.002)),
        ("torch MultiProcessTestCase", _phases(3.318, 3.3)),
        ("torch MultiThreadedTestCase", _phases(0.004)),
    ]
    harness_overhead._print_report(rows)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == [
        *("harness", "tests", "median", "ms", "setup", "call", "teardown"),
        *("torch", "MP", "/", "this"),
    ]
    pool = next(line for line in lines if line.startswith("fsdp_testing warm pool"))
    # The median test (2.0 ms) and each phase's median: a quarter, a half and a quarter of it.
    assert pool.split()[3:] == ["3", "2.00", "0.50", "1.00", "0.50", "1654.5x"]
    png = tmp_path / "overhead.png"
    harness_overhead._write_png(str(png), rows)
    assert_drawn_png(png, width=1000, height=450)


def test_harness_overhead_reads_each_phase_from_pytests_reports(tmp_path):
    tests = harness_overhead._run(tmp_path, "plain", harness_overhead.PLAIN.format(n=4))
    assert len(tests) == 3  # the first test is left out
    for test in tests:
        assert set(test) == {"setup", "call", "teardown"}
        assert all(0 < seconds < 5 for seconds in test.values())


def test_rank_resets_times_each_reset_that_rank_state_restore_runs():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "rank_resets.py"), "--repeat", "5"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    from fsdp_testing._rank.state_reset import RankState

    names = [name for name, _ in RankState().steps()]
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["reset", "median", "us"]
    for name in ["flight recorder (before the task)", *map("RankState: {}".format, names)]:
        row = next(x for x in lines if x.startswith(name))
        assert float(row.removeprefix(name).strip()) >= 0, row
    assert any(x.startswith("RankState.restore, all of it") for x in lines)


def test_core_step_parts_subtracts_what_a_part_calls_and_puts_a_wait_under_its_caller(monkeypatch):
    class Outer:
        def run(self) -> None:
            inner.run()
            wait()

    class Inner:
        def run(self) -> None:
            pass

    holder = type("holder", (), {"wait": staticmethod(lambda: None)})
    clocks = core_step_parts.Clocks()
    clocks.wrap(Outer, "run", "Outer.run")
    clocks.wrap(Inner, "run", "Inner.run")
    clocks.wrap(holder, "wait", core_step_parts.WAIT)
    inner, wait = Inner(), holder.wait
    # outer 0..10 s; inner 1..3 s (2 s); the wait 4..8 s (4 s): outer's own time is 4 s.
    ticks = iter([0.0, 1.0, 3.0, 4.0, 8.0, 10.0])
    monkeypatch.setattr(core_step_parts.time, "perf_counter", lambda: next(ticks))
    Outer().run()
    assert dict(clocks.own) == {"Inner.run": 2.0, "wait in Outer.run": 4.0, "Outer.run": 4.0}
    assert dict(clocks.calls) == {"Inner.run": 1, "wait in Outer.run": 1, "Outer.run": 1}


def test_core_step_parts_counts_each_part_per_step():
    proc = subprocess.run(
        [
            *(sys.executable, str(ROOT / "benchmarks" / "core_step_parts.py")),
            *("--engine", "fsdp_core", "--width", "32", "--blocks", "1"),
            *("--steps", "2", "--warmup", "1"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[2].startswith("minor page faults per step, ranks 0 / 1:"), proc.stdout
    calls, faults = {}, {}
    for line in lines[5:-1]:  # the rows, not "all of the above"
        label, *figures = line.rsplit(maxsplit=4)
        if len(figures) == 4:
            calls[label.strip()] = float(figures[2])
            faults[label.strip()] = [int(n) for n in figures[3].split("/")]
    # One block (12 parameters) gathered in forward and again in backward, the root (6) once.
    assert calls["FSDPUnit._gather"] == 3.0
    assert calls["ShardedParam.copy_from_gathered"] == 2 * 12 + 6
    assert calls["UnitGrads._reduce_input"] == 2.0  # one reduction per unit
    assert any(label.startswith("wait in ") for label in calls), proc.stdout
    assert all(len(n) == 2 and min(n) >= 0 for n in faults.values()), proc.stdout
    assert lines[-1].startswith("all of the above")
