"""``fsdp-testing check`` with a root-only engine (the ZeRO-2 example's) and user models
(``--model package.module:callable`` with ``--input-shape``): the same matrix, table and JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from examples.zero2_wrapper import ZeRO2, ZeRO2Engine
from fsdp_testing.cli import main
from fsdp_testing.cli._matrix import parse_axis

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


class SummingZeRO2(ZeRO2):
    """Wrong gradient scaling: sums the ranks' gradients instead of averaging them."""

    def average(self, flat_grad: torch.Tensor) -> torch.Tensor:
        return flat_grad


class SummingZeRO2Engine(ZeRO2Engine):
    unit_class = SummingZeRO2

    def wrap(self, module, process_group=None, **fsdp_kwargs):
        return SummingZeRO2(module, process_group)  # the test runs a SHARD_GRAD_OP row only


def _check(tmp_path, *args: str) -> tuple[int, dict]:
    report = tmp_path / "check.json"
    code = main(["check", *args, "--prefetch", "none", "--offload", "off", "--json", str(report)])
    rows = json.loads(report.read_text())["rows"] if report.exists() else []
    return code, {r["label"]: r for r in rows}


def test_check_runs_the_matrix_for_a_root_only_engine_and_a_user_model(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    code, rows = _check(
        tmp_path,
        "--engine",
        "zero2_wrapper:ZeRO2Engine",
        "--model",
        "zero2_wrapper:build,nested",
        "--input-shape",
        "4,16",
        "--strategy",
        "SHARD_GRAD_OP,FULL_SHARD",
        "--mp",
        "off",
    )
    out = capsys.readouterr().out
    assert code == 0, out
    for model, flat in (("zero2_wrapper:build", 808), ("nested", 496)):
        ok = rows[f"{model} SHARD_GRAD_OP none offload=off mp=off ZeRO2Engine"]
        assert ok["status"] == "ok", ok
        assert ok["loss_max_abs_diff"] == 0 == ok["param_max_abs_diff"]
        per_step = {"count": 1, "bytes": flat * 4}  # one flat buffer, padded to 2 slices
        expected = {"all_gather": per_step, "reduce_scatter": per_step}
        assert ok["collectives_per_step"] == expected == ok["theory_per_step"]
        refused = rows[f"{model} FULL_SHARD none offload=off mp=off ZeRO2Engine"]
        assert refused["status"] == "unavailable"
    assert "zero2_wrapper:build" in out  # the table groups rows under the user's model


def test_check_reports_a_wrong_gradient_scaling_in_a_root_only_engine(tmp_path, capsys):
    code, rows = _check(
        tmp_path,
        "--engine",
        f"{__name__}:SummingZeRO2Engine",
        "--model",
        "nested",
        "--strategy",
        "SHARD_GRAD_OP",
        "--mp",
        "off",
    )
    out = capsys.readouterr().out
    assert code == 1, out
    (row,) = rows.values()
    assert row["status"] == "MISMATCH"
    assert any("step 1: module.0.weight: max abs diff" in p for p in row["problems"]), row
    # The likely cause, in the JSON report and under the row's mismatch details.
    summed = (
        "every gradient is 2.000x the reference's (world size 2): gradients summed, not averaged"
    )
    assert row["likely_causes"] == [summed], row
    assert f"likely cause: {summed}" in out


def test_a_user_model_gets_units_from_wrap_with_a_nested_engine(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    code, rows = _check(
        tmp_path,
        "--model",
        "zero2_wrapper:build",
        "--input-shape",
        "4,16",
        "--wrap",
        "Linear",
        "--strategy",
        "FULL_SHARD",
        "--mp",
        "off",
    )
    assert code == 0, capsys.readouterr().out
    (row,) = rows.values()
    assert row["status"] == "ok"
    # Two Linear units and the root (which holds no parameters of its own).
    assert row["collectives_per_step"]["reduce_scatter"]["count"] == 2


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "nested", "--input-shape", "4,16"], "--input-shape is for --model package"),
        (["--model", "no.such.module:build"], "cannot import 'no.such.module'"),
        (["--model", "zero2_wrapper:build"], "has no get_input(device); give its inputs"),
        (["--model", "zero2_wrapper:ZeRO2Engine", "--input-shape", "4,16"], "not an nn.Module"),
        (["--model", "zero2_wrapper:batch", "--input-shape", "4,16"], "calling batch() failed"),
        (["--model", "zero2_wrapper:build", "--input-shape", "4,x"], "--input-shape '4,x'"),
    ],
)
def test_user_model_mistakes_are_option_errors(args, message, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    assert main(["check", *args]) == 2
    assert message in capsys.readouterr().err


def test_the_model_axis_keeps_a_user_models_size_arguments_together():
    assert parse_axis("model", "pkg.mod:build:d=8,n=2,nested") == (
        "pkg.mod:build:d=8,n=2",
        "nested",
    )
    assert parse_axis("model", "nested,pkg.mod:build") == ("nested", "pkg.mod:build")
    with pytest.raises(ValueError, match=r"package\.module:callable"):
        parse_axis("model", "nestd")
