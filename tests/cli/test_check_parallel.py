"""``fsdp-testing check`` and ``trace`` on a user's own model-parallel code (``--parallelize``
with ``--reference``, ``--mesh``, ``--dp-dims``, ``--layout``), and every option checked before
any row runs ([Note: options before rows])."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fsdp_testing.cli import main

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"

#: examples/tensor_parallel.py's MLP (8 -> 16 -> 8) as plain shards over 2 ranks.
TP = ("--model", "tensor_parallel:build_mlp", "--input-shape", "6,8")
MLP_LAYOUT = ("--layout", "0.weight=0,0.bias=0,2.weight=1")


@pytest.fixture
def no_rows(monkeypatch):
    """Fails the test if anything is launched on ranks."""
    import fsdp_testing.launcher

    def launched(*args, **kwargs):
        raise AssertionError("a row was started before the options were checked")

    monkeypatch.setattr(fsdp_testing.launcher, "run_distributed", launched)
    monkeypatch.syspath_prepend(str(EXAMPLES))


_TP_PARALLEL = (*TP, "--parallelize", "tensor_parallel:mlp")
_ON_MESH = (*TP, "--parallelize", "tensor_parallel:data_and_tensor_parallel", "--mesh", "dp=2,tp=2")


@pytest.mark.parametrize(
    "args, message",
    [
        # --engine: a module that does not import, an attribute that is missing, not an engine.
        (
            ["check", "--engine", "no_such_engines:Engine"],
            "--engine no_such_engines:Engine: cannot import 'no_such_engines'",
        ),
        (
            ["check", "--engine", "zero2_wrapper:missing"],
            "--engine zero2_wrapper:missing: zero2_wrapper has no attribute 'missing'",
        ),
        (
            ["check", "--engine", "zero2_wrapper:build"],
            "--engine zero2_wrapper:build: 'zero2_wrapper:build' is 'function', not an engine",
        ),
        (["check", "--engine", "fsdp_cor"], "--engine: unknown value(s) fsdp_cor; valid:"),
        (["check", "--model", "no_such_models:build"], "cannot import 'no_such_models'"),
        (
            ["check", "--model", "zero2_wrapper:build", "--input-shape", "4,16", "--wrap", "Conv"],
            "--wrap Conv: no such module class in --model zero2_wrapper:build; its classes: "
            "Linear, ReLU, Sequential",
        ),
        (["check", "--timeout", "0"], "--timeout 0: give a positive number of seconds"),
        (["check", "--world-size", "0"], "--world-size 0: give at least 1 rank"),
        (
            ["check", "--json", "/no-such-fsdp-testing-dir/report.json"],
            "--json /no-such-fsdp-testing-dir/report.json: the directory "
            "/no-such-fsdp-testing-dir does not exist",
        ),
        # Placement options without --parallelize.
        (
            ["check", *TP, "--mesh", "tp=2"],
            "--mesh tp=2: describes where your own parallelization runs; give that code with "
            "--parallelize",
        ),
        (
            ["check", *TP, "--reference", "same-batch"],
            "--reference same-batch: engine rows are data parallel",
        ),
        # --parallelize and what it replaces or needs.
        (["check", "--parallelize", "tensor_parallel:mlp"], "needs --model package.module"),
        (
            ["check", "--model", "nested", "--parallelize", "tensor_parallel:mlp"],
            "--model nested with --parallelize tensor_parallel:mlp: reference models are sharded",
        ),
        (
            ["check", *_TP_PARALLEL, "--strategy", "FULL_SHARD"],
            "--strategy FULL_SHARD with --parallelize tensor_parallel:mlp: your callable",
        ),
        (["check", *_TP_PARALLEL, "--wrap", "Linear"], "--wrap Linear with --parallelize"),
        (["check", *_TP_PARALLEL, "--comm", "report"], "--comm report with --parallelize"),
        (["check", *_TP_PARALLEL, "--checkpoint", "4:2"], "--checkpoint 4:2 with --parallelize"),
        (
            ["check", *TP, "--parallelize", "tensor_parallel:missing"],
            "--parallelize tensor_parallel:missing: tensor_parallel has no callable 'missing'",
        ),
        (
            ["check", *TP, "--parallelize", "tensor_parallel:vocab_parallel_cross_entropy"],
            "cannot be called as vocab_parallel_cross_entropy(model, mesh_or_group)",
        ),
        (["check", *TP, "--parallelize", "mlp"], "--parallelize 'mlp': not package.module"),
        (
            ["check", *_TP_PARALLEL, "--reference", "one-device"],
            "--reference one-device: unknown reference; give data-parallel or same-batch",
        ),
        # --mesh, --dp-dims, --layout and the world size.
        (["check", *_TP_PARALLEL, "--mesh", "2x2"], "--mesh '2x2': check and trace name each"),
        (["check", *_TP_PARALLEL, "--mesh", "dp=2,dp=2"], "dim 'dp' is given twice"),
        (
            ["check", *_ON_MESH, "--dp-dims", "dp", "--world-size", "2"],
            "--world-size 2 does not fit --mesh dp=2,tp=2: its dims hold 4 ranks",
        ),
        (
            ["check", *_ON_MESH, "--dp-dims", "pp"],
            "--dp-dims 'pp': 'pp' is not a dim of --mesh dp=2,tp=2",
        ),
        (["check", *_TP_PARALLEL, "--dp-dims", "dp"], "--dp-dims dp names dims of a mesh"),
        (
            ["check", *_ON_MESH, "--reference", "data-parallel"],
            "--reference data-parallel with --mesh dp=2,tp=2 needs --dp-dims",
        ),
        (
            ["check", *_ON_MESH, "--dp-dims", "dp", "--reference", "same-batch"],
            "--reference same-batch with --dp-dims dp",
        ),
        (["check", *_TP_PARALLEL, "--layout", "0.weight"], "is not NAME=DIM[:MESH_DIM]"),
        (
            ["check", *_TP_PARALLEL, "--layout", "1.weight=0"],
            "--layout 1.weight=0: the model has no parameter '1.weight'",
        ),
        (["check", *_TP_PARALLEL, "--layout", "0.bias=1"], "0.bias has 1 dims (shape (16,))"),
        (
            [
                "check",
                *_TP_PARALLEL,
                "--model",
                "tensor_parallel:build_mlp:hidden=15",
                "--layout",
                "0.weight=0",
            ],
            "dim 0 of 0.weight has 15 rows, which 2 ranks cannot cut into equal chunks",
        ),
        (
            ["check", *_ON_MESH, "--dp-dims", "dp", "--layout", "w=0:ep"],
            "--layout w=0:ep: 'ep' is not a mesh dim; name a dim of --mesh (dp, tp)",
        ),
        (
            ["check", *_TP_PARALLEL, "--layout", "0.weight=0:tp"],
            "'tp' is not a mesh dim; give --mesh NAME=SIZE,... with a dim tp",
        ),
        (
            ["check", *_ON_MESH, "--dp-dims", "dp,tp", "--layout", "0.weight=0"],
            "--layout 0.weight=0: no model-parallel dim to split it across",
        ),
        # trace: what check takes, one value each; check-only options refused by name.
        (["trace", "--model", "nested,moe"], "trace runs one configuration; give one value"),
        (["trace", "--comm", "report"], "--comm report: check only; trace records a timeline"),
        (["trace", "--checkpoint", "4:2"], "--checkpoint 4:2: check only"),
        (["trace", "--junit-xml", "t.xml"], "--junit-xml t.xml: check only"),
        (
            ["trace", "--engine", "no_such_engines:Engine"],
            "--engine no_such_engines:Engine: cannot import",
        ),
        (["trace", *TP, "--mesh", "tp=2"], "--mesh tp=2: describes where your own"),
        (["trace", *_ON_MESH, "--world-size", "2"], "--world-size 2 does not fit --mesh"),
    ],
)
def test_option_mistakes_exit_2_before_any_row(args, message, no_rows, capsys):
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert err.startswith(f"fsdp-testing {args[0]}: "), err
    assert message in err, err
    assert out == ""  # not even the header: nothing ran


@pytest.mark.parametrize(
    "args",
    [
        # What the mistakes above are measured against: each valid, so it reaches the rows.
        ["check", *_TP_PARALLEL, "--model", "tensor_parallel:build_mlp:hidden=15"],
        ["check", *_ON_MESH, "--dp-dims", "dp", *MLP_LAYOUT, "--world-size", "4"],
        ["check", *_ON_MESH, "--reference", "same-batch", "--layout", "0.weight=0:tp"],
        ["trace", *_TP_PARALLEL, "--reference", "same-batch", *MLP_LAYOUT, "--no-png"],
    ],
)
def test_valid_command_lines_get_to_the_rows(args, no_rows, capsys):
    with pytest.raises(AssertionError, match="a row was started"):
        main(args)
    assert capsys.readouterr().err == ""


def test_a_bad_engine_exits_2_before_the_default_matrix(tmp_path):
    """The issue's case: the default 180 rows with an engine that does not import used to run
    every row and exit 1; it is an option error now, before the pool starts."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "fsdp_testing", "check", "--engine", "no_such_engines:Engine"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.startswith(
        "fsdp-testing check: --engine no_such_engines:Engine: cannot import 'no_such_engines' "
    )
    assert "put it on PYTHONPATH, or give a registered name (fsdp_core," in proc.stderr
    # An interpreter, torch and the engine registry; no ranks (a row takes seconds more).
    assert time.monotonic() - started < 120


def _check(tmp_path, *args: str) -> tuple[int, dict]:
    report = tmp_path / "check.json"
    code = main(["check", *args, "--json", str(report)])
    (row,) = json.loads(report.read_text())["rows"]
    return code, row


def test_a_tensor_parallel_mlp_passes_with_the_same_batch_and_mismatches_data_parallel(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    code, row = _check(tmp_path, *_TP_PARALLEL, *MLP_LAYOUT, "--reference", "same-batch")
    out = capsys.readouterr().out
    assert code == 0, out
    assert row["label"] == "tensor_parallel:build_mlp parallelize=tensor_parallel:mlp same-batch"
    assert row["status"] == "ok", row
    # Both within FP32_TOLERANCE of one replica; the parameters are the assembled full ones.
    assert row["loss_max_abs_diff"] < 1e-5 and row["param_max_abs_diff"] < 1e-6, row
    # The row-parallel layer's forward all-reduce of the [6, 8] float32 output, counted; no
    # theory to judge it by.
    assert row["collectives_per_step"] == {"all_reduce": {"count": 1, "bytes": 192}}
    assert row["theory_per_step"] is None
    assert row["config"]["reference"] == "same-batch"

    # The data-parallel default feeds each rank's own batch into one replica: a mismatch, with
    # the coordinates whose shards differ.
    code, row = _check(tmp_path, *_TP_PARALLEL, *MLP_LAYOUT)
    out = capsys.readouterr().out
    assert code == 1, out
    assert row["status"] == "MISMATCH", row
    assert "[rank 0] parity: step 1: loss: max abs diff" in row["problems"][0], row
    assert any(
        p.startswith("step 1: 0.weight: the shards of 2 of 2 mesh coordinates differ from the "
                     "reference's: (rank=0), (rank=1)")
        for p in row["problems"]
    ), row["problems"]  # fmt: skip
    assert (
        "MISMATCH: tensor_parallel:build_mlp parallelize=tensor_parallel:mlp data-parallel" in out
    )


def test_trace_runs_a_user_model_on_a_mesh(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    trace = tmp_path / "t.json"
    code = main(
        ["trace", *TP, "--parallelize", "tensor_parallel:data_and_tensor_parallel",
         "--mesh", "dp=1,tp=2", "--dp-dims", "dp", *MLP_LAYOUT, "--steps", "2",
         "--json", str(trace), "--no-png"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "mesh dp=1,tp=2 dp-dims=dp, 2 steps on 2 ranks" in out
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] != "M"]
    for rank in (0, 1):
        mine = [e for e in events if e["pid"] == rank]
        assert [e["name"] for e in mine if e["cat"] == "step"] == ["forward", "backward",
                                                                   "optimizer"] * 2  # fmt: skip
        reduces = [e for e in mine if e["cat"] == "collective" and e["args"]["op"] == "all_reduce"]
        assert len(reduces) == 2, mine  # the row-parallel layer's, one per step
    assert "rank 1: 2 all_reduce" in out


def test_trace_runs_a_user_model_under_a_root_only_engine(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    trace = tmp_path / "t.json"
    code = main(
        ["trace", "--engine", "zero2_wrapper:ZeRO2Engine", "--model", "zero2_wrapper:build",
         "--input-shape", "4,16", "--strategy", "SHARD_GRAD_OP", "--steps", "2",
         "--json", str(trace), "--no-png"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] != "M"]
    ops = {e["args"]["op"] for e in events if e["cat"] == "collective"}
    assert any("all_gather" in op for op in ops) and any("reduce_scatter" in op for op in ops)
    assert not [e for e in events if e["cat"] in ("unshard", "reshard")]  # it names no units
