"""The fsdp-testing command line: check on a small matrix, a broken engine, and trace."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from fsdp_testing.cli import main
from fsdp_testing.cli._matrix import DEFAULTS, build_matrix, parse_axis
from fsdp_testing.cli._png import Canvas

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
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
    the mixed precision rows' tolerance of the autocast reference and sends exactly the
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
    assert "6 ok, 0 mismatched, 0 errors" in out, out
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
    assert parse_axis("strategy", "all") == ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
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
    assert {"forward", "backward", "optimizer", "all_gather_single"} <= names
    assert any(n.startswith("unshard ") for n in names) and any(
        n.startswith("reshard ") for n in names
    )
    slices = [e for e in events if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in slices)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert width == 900 and 150 < height < 400


def test_png_canvas_pixels_round_trip():
    import zlib

    canvas = Canvas(4, 3)
    canvas.rect(1, 1, 3, 2, (10, 20, 30))
    data = canvas.png()
    idat = data.index(b"IDAT")
    length = struct.unpack(">I", data[idat - 4 : idat])[0]
    raw = zlib.decompress(data[idat + 4 : idat + 4 + length])
    rows = [raw[i * 13 + 1 : (i + 1) * 13] for i in range(3)]
    assert rows[1][3:9] == bytes([10, 20, 30, 10, 20, 30])
    assert rows[0] == bytes([255]) * 12
