"""The fsdp-testing command line: check on a small matrix, a broken engine, and trace."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from fsdp_testing.cli import main
from fsdp_testing.cli._matrix import DEFAULTS, build_matrix, parse_axis

from .._spellings import ALL_GATHER
from ._images import assert_drawn_png

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args: str, cwd: Path, **env_vars: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **env_vars}
    return subprocess.run(
        [sys.executable, "-m", "fsdp_testing", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_check_small_matrix_passes_with_table_and_reports(tmp_path):
    report, junit = tmp_path / "check.json", tmp_path / "check.xml"
    proc = _cli(
        "check",
        "--model",
        "nested,moe",
        "--strategy",
        "FULL_SHARD,NO_SHARD",
        "--prefetch",
        "BACKWARD_PRE",
        "--offload",
        "off",
        "--mp",
        "off",
        "--json",
        str(report),
        "--junit-xml",
        str(junit),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "[1/4] ok" in out and "[4/4] ok" in out
    assert "nested FULL_SHARD BACKWARD_PRE offload=off mp=off fsdp_core  ok" in out
    # Two ranks: the sums are order independent, so parity is exact; bytes are the theory's.
    assert "7 AG 3,776 B  4 RS 2,112 B  = theory" in out
    assert "4 ok, 0 mismatched, 0 errors, 0 unavailable" in out

    data = json.loads(report.read_text())
    assert data["passed"] is True and data["summary"]["ok"] == 4
    row = data["rows"][0]
    assert row["label"] == "nested FULL_SHARD BACKWARD_PRE offload=off mp=off fsdp_core"
    assert row["loss_max_abs_diff"] == 0 and row["param_max_abs_diff"] == 0
    assert row["collectives_per_step"] == row["theory_per_step"]
    assert row["collectives_per_step"]["all_gather"] == {"count": 7, "bytes": 3776}
    assert len(row["peak_rss_bytes"]) == 2 and min(row["peak_rss_bytes"]) > 10 * 2**20
    no_shard = next(r for r in data["rows"] if r["label"].startswith("nested NO_SHARD"))
    assert set(no_shard["collectives_per_step"]) == {"all_reduce"}

    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite is not None
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == ("4", "0", "0")
    names = [case.get("name") for case in suite.iter("testcase")]
    assert "moe NO_SHARD BACKWARD_PRE offload=off mp=off fsdp_core" in names


def test_check_fails_and_names_the_row_of_an_engine_that_does_not_average(tmp_path, capsys):
    report, junit = tmp_path / "check.json", tmp_path / "check.xml"
    code = main(
        [
            "check",
            "--model",
            "nested",
            "--strategy",
            "FULL_SHARD",
            "--prefetch",
            "none",
            "--offload",
            "off",
            "--mp",
            "off",
            "--engine",
            "fsdp_core,tests.cli._engines:NoAveragingEngine",
            "--json",
            str(report),
            "--junit-xml",
            str(junit),
        ]
    )
    out = capsys.readouterr().out
    assert code == 1
    assert "1 ok, 1 mismatched" in out
    broken = "nested FULL_SHARD none offload=off mp=off NoAveragingEngine"
    assert f"MISMATCH: {broken}" in out
    assert "parity: step 1: module.0.weight: max abs diff" in out
    data = json.loads(report.read_text())
    assert data["passed"] is False
    statuses = {r["label"]: r["status"] for r in data["rows"]}
    assert statuses[broken] == "MISMATCH"
    assert statuses["nested FULL_SHARD none offload=off mp=off fsdp_core"] == "ok"
    failures = [
        case.get("name")
        for case in ET.parse(junit).getroot().iter("testcase")
        if case.find("failure") is not None
    ]
    assert failures == [broken]


def test_check_transformer_in_bf16_with_every_engine(capsys):
    """The transformer runs under bf16 mixed precision with all three engines, stays within
    the one mixed precision parity rule and sends exactly the
    theoretical volume (every engine, FSDP2's root kept from forward to backward)."""
    code = main(
        [
            "check",
            "--model",
            "transformer",
            "--strategy",
            "FULL_SHARD",
            "--prefetch",
            "none",
            "--offload",
            "off",
            "--mp",
            "bf16,bf16/fp32",
            "--engine",
            "all",
            "--comm",
            "strict",
        ]
    )
    out = capsys.readouterr().out
    from fsdp_testing.cli._matrix import AXES

    summary = re.search(r"(\d+) ok, 0 mismatched, 0 errors, (\d+) unavailable", out)
    assert summary, out
    # Two precisions per engine; an engine may declare a row unavailable, never get it wrong.
    assert int(summary[1]) + int(summary[2]) == 2 * len(AXES["engine"]), out
    assert int(summary[1]) >= 8, out
    assert code == 0


def test_check_fsdp1_bytes_under_mixed_precision_match_the_theory(capsys):
    """FSDP1 gathers its flat parameters in the compute dtype and reduces them in the reduce
    dtype: the theory counts those, so the strict comparison passes with and without an fp32
    reduce."""
    args = ["check", "--model", "nested", "--strategy", "FULL_SHARD,NO_SHARD"]
    args += ["--prefetch", "none", "--offload", "off", "--mp", "off,bf16,bf16/fp32"]
    code = main([*args, "--engine", "torch_fsdp1", "--comm", "strict"])
    out = capsys.readouterr().out
    assert "6 ok, 0 mismatched, 0 errors" in out, out
    assert code == 0
    table = [line for line in out.splitlines() if "theory" in line]
    bf16_row = next(line for line in table if "FULL_SHARD" in line and "mp=bf16 " in line)
    fp32_row = next(line for line in table if "FULL_SHARD" in line and "mp=off" in line)
    # Half the all-gather bytes of the fp32 row, and "= theory".
    assert "= theory" in bf16_row and "AG 1,832 B" in bf16_row and "AG 3,664 B" in fp32_row


def test_check_nonuniform_trains_only_what_requires_grad(capsys):
    """NonUniformReqGradNWM freezes parameters after wrapping; fsdp_core leaves them alone and
    matches DDP with exactly the theoretical volume (no gather for units without backward)."""
    code = main(["check", "--model", "nonuniform", "--offload", "off", "--mp", "off"])
    out = capsys.readouterr().out
    assert "9 ok, 0 mismatched, 0 errors" in out, out
    assert code == 0


def test_check_rejects_unknown_axis_values(capsys):
    assert main(["check", "--model", "nested,resnet"]) == 2
    assert "--model: unknown value(s) resnet; valid: nested" in capsys.readouterr().err


def test_default_matrix_and_axis_parsing():
    rows = build_matrix(DEFAULTS)
    assert len(rows) == 180
    assert {r.engine for r in rows} == {"fsdp_core"}
    assert {r.model for r in rows} == {"nested", "always_wrap", "transformer", "nonuniform", "moe"}
    assert {r.mp for r in rows} == {"off", "bf16/fp32"}
    assert parse_axis("strategy", "all")[:3] == ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
    assert parse_axis("engine", "pkg.mod:Engine") == ("pkg.mod:Engine",)
    with pytest.raises(ValueError, match="--prefetch: unknown value"):
        parse_axis("prefetch", "BACKWARD_SIDEWAYS")


def test_trace_writes_a_chrome_trace_and_a_png_timeline(tmp_path, capsys):
    trace, png = tmp_path / "t.json", tmp_path / "t.png"
    code = main(
        ["trace", "--model", "nested", "--steps", "2", "--json", str(trace), "--png", str(png),
         "--width", "900"]
    )  # fmt: skip
    assert code == 0, capsys.readouterr().out
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}
    names = {e["name"] for e in events if e["ph"] != "M"}
    assert {"forward", "backward", "optimizer", ALL_GATHER} <= names
    assert any(n.startswith("unshard ") for n in names) and any(
        n.startswith("reshard ") for n in names
    )
    slices = [e for e in events if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in slices)
    assert_drawn_png(png, width=900, height=450)  # two rank lanes of 150 pixels, 150 around


_SMALL = ("--model", "nested,moe", "--strategy", "FULL_SHARD,NO_SHARD", "--prefetch",
          "BACKWARD_PRE", "--offload", "off", "--mp", "off")  # fmt: skip
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def test_check_on_a_terminal_prints_summary_then_a_table_that_fits(tmp_path):
    """TTY_COMPATIBLE=1 makes rich treat the pipe as a 120-column terminal: the summary comes
    first, the table has one line per row and no line is wider than the terminal, and the
    statuses are coloured; the JSON report is the same as in plain mode."""
    report = tmp_path / "check.json"
    proc = _cli("check", *_SMALL, "--json", str(report), cwd=tmp_path, TTY_COMPATIBLE="1",
                COLUMNS="120", TERM="xterm-256color", NO_COLOR="")  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "\x1b[32mok" in proc.stdout  # colour on a terminal
    # Escape codes removed and carriage returns as line breaks: every frame of the live bar
    # is measured too.
    text = _ANSI.sub("", proc.stdout.replace("\r", "\n"))
    lines = [line.rstrip() for line in text.splitlines()]
    assert max(len(line) for line in lines) <= 120
    summary = next(i for i, line in enumerate(lines) if line.startswith("4 ok, 0 mismatched"))
    header = next(i for i, line in enumerate(lines) if line.startswith("configuration"))
    assert summary < header
    assert "engine: fsdp_core" in lines
    rows = [line for line in lines[header:] if re.match(r"(FULL|NO) +pre +- +- +ok", line)]
    assert len(rows) == 4, "\n".join(lines[header:])
    data = json.loads(report.read_text())
    first = data["rows"][0]["collectives_per_step"]  # nested FULL_SHARD: the first row
    gathers, scatters = first["all_gather"], first["reduce_scatter"]
    assert rows[0].startswith("FULL")
    assert f"{gathers['count']} x {gathers['bytes']:,}" in rows[0]
    assert f"{scatters['count']} RS x {scatters['bytes']:,}" in rows[0] and "exact" in rows[0]
    assert data["summary"]["ok"] == 4
