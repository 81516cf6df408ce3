"""Hybrid rows of ``fsdp-testing check``: 4 ranks as 2 x 2 whatever ``--world-size`` says,
parity with DDP, the theoretical volume per family and per group ([Note: hybrid rows] in
``fsdp_testing/cli/_hybrid.py``), and engines whose hybrid reduction is wrong."""

from __future__ import annotations

import json

from fsdp_testing.cli import main
from fsdp_testing.cli._matrix import DEFAULTS, Config, build_matrix, parse_axis, row_world_size
from fsdp_testing.cli._report import group_problems

_ONE_ROW_EACH = ("--prefetch", "BACKWARD_PRE", "--offload", "off", "--mp", "off")
_STRATEGIES = ("--strategy", "HYBRID_SHARD,_HYBRID_SHARD_ZERO2")


def test_hybrid_rows_run_on_four_ranks_in_parity_with_the_theory_per_group(tmp_path, capsys):
    """Both doors of fsdp_core, both hybrid strategies, at the default --world-size 2: every
    row runs on 4 ranks, matches DDP and sends the theory: all-gathers and reduce-scatters
    inside rank 0's shard group {0, 1}, the all-reduce of the reduced shard (half the
    reduce-scatter's payload) across its replicate group {0, 2}."""
    report = tmp_path / "check.json"
    code = main(["check", "--model", "nested", *_STRATEGIES, *_ONE_ROW_EACH,
                 "--engine", "fsdp_core,fsdp_core_fully_shard", "--json", str(report)])  # fmt: skip
    out = capsys.readouterr().out
    assert "4 configurations on 4 gloo ranks (2 x 2), 3 steps each" in out, out
    assert "4 ok, 0 mismatched, 0 errors, 0 unavailable" in out, out
    assert code == 0
    rows = [line for line in out.splitlines() if line.startswith("nested ") and "theory" in line]
    assert len(rows) == 4 and all("= theory" in line for line in rows), "\n".join(rows)
    # The plain table names each family's group (rank 0's).
    assert all("RS 2,112 B in {0,1}, 4 AR 1,056 B in {0,2}" in line for line in rows), rows

    data = json.loads(report.read_text())
    assert data["world_sizes"] == [4]
    for row in data["rows"]:
        assert row["status"] == "ok" and len(row["peak_rss_bytes"]) == 4, row
        assert row["collectives_per_step"] == row["theory_per_step"], row
        groups = row["collectives_per_group_rank0"]
        assert set(groups["all_gather"]) == {"0,1"} and set(groups["reduce_scatter"]) == {"0,1"}
        assert set(groups["all_reduce"]) == {"0,2"}
        scatter, reduce = groups["reduce_scatter"]["0,1"], groups["all_reduce"]["0,2"]
        assert scatter["count"] == reduce["count"] == 4
        # The shard is half of the padded gradients; each side carries its order tags
        # (fp32: 2 elements per shard rank per row of the reduce-scatter, 2 per replica).
        assert reduce["bytes"] - 4 * 2 * 2 * 4 == (scatter["bytes"] - 4 * 2 * 2 * 2 * 4) // 2
        # The reference is DDP over all 4 ranks; hybrid sums in another order (rounding only).
        assert row["loss_max_abs_diff"] < 1e-5 and row["param_max_abs_diff"] < 1e-5
    gathers = {r["config"]["strategy"]: r["collectives_per_step"]["all_gather"] for r in
               data["rows"] if r["config"]["engine"] == "fsdp_core"}  # fmt: skip
    # HYBRID_SHARD gathers the non-root units again in backward; ZERO2 keeps them.
    assert gathers["HYBRID_SHARD"]["count"] > gathers["_HYBRID_SHARD_ZERO2"]["count"]


def _problems(tmp_path, capsys, strategy: str, engine: str) -> tuple[str, list[str]]:
    report = tmp_path / "check.json"
    code = main(["check", "--model", "nested", "--strategy", strategy, *_ONE_ROW_EACH,
                 "--engine", f"tests.cli._engines:{engine}", "--json", str(report)])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 1
    assert "0 ok, 1 mismatched" in out, out
    (row,) = json.loads(report.read_text())["rows"]
    assert row["status"] == "MISMATCH"
    return out, row["problems"]


def test_a_hybrid_reduction_without_the_replica_all_reduce_is_caught(tmp_path, capsys):
    """An engine that reduce-scatters inside the shard group but never all-reduces across
    replicas: the replicas drift apart from DDP and the all-reduce the theory expects is
    missing."""
    out, problems = _problems(tmp_path, capsys, "HYBRID_SHARD", "NoReplicaReduceEngine")
    missing = "communication: all_reduce 0 calls / 0 B per step, theory 4 calls / 1,056 B"
    assert missing in problems, problems
    assert any(p.startswith("[rank 0] parity: step 1:") for p in problems), problems
    assert "= theory" not in out


def test_an_all_reduce_over_the_wrong_group_is_caught_per_group(tmp_path, capsys):
    """An engine whose all-reduce goes over the grid's anti-diagonal: calls and bytes per
    family equal the theory, so only the per-group comparison can tell (and parity)."""
    out, problems = _problems(tmp_path, capsys, "_HYBRID_SHARD_ZERO2", "WrongReplicaGroupEngine")
    assert not any(p.startswith("communication:") for p in problems), problems  # totals agree
    assert (
        "[rank 0] communication: all_reduce over ranks {0,2} 0 calls / 0 B per step, theory 4 calls / 1,056 B"
        in problems
    )
    assert (
        "[rank 0] communication: all_reduce over ranks {0,3} 4 calls / 1,056 B per step, theory 0 calls / 0 B"
        in problems
    )
    assert (
        "[rank 1] communication: all_reduce over ranks {1,2} 4 calls / 1,056 B per step, theory 0 calls / 0 B"
        in problems
    )
    assert "≠ theory per group" in out


def test_group_problems_compares_every_family_and_group():
    theory = {"all_gather": {"0,1": [4, 100]}, "all_reduce": {"0,2": [2, 40]}}
    assert group_problems({"all_gather": {"0,1": [4, 100]}, "all_reduce": {"0,2": [2, 40]}},
                          theory) == []  # fmt: skip
    assert group_problems({}, None) == []
    found = group_problems(
        {"all_gather": {"0,1": [4, 100]}, "all_reduce": {"0,1,2,3": [2, 40]}}, theory
    )
    assert found == [
        "communication: all_reduce over ranks {0,1,2,3} 2 calls / 40 B per step, theory "
        "0 calls / 0 B",
        "communication: all_reduce over ranks {0,2} 0 calls / 0 B per step, theory 2 calls / 40 B",
    ]


def test_hybrid_rows_are_asked_for_and_always_use_four_ranks():
    assert {c.strategy for c in build_matrix(DEFAULTS)} == {"FULL_SHARD", "SHARD_GRAD_OP",
                                                            "NO_SHARD"}  # fmt: skip
    assert "HYBRID_SHARD" in parse_axis("strategy", "all")
    axes = dict(model="nested", prefetch="none", offload="off", mp="off", engine="fsdp_core")
    hybrid = Config(strategy="_HYBRID_SHARD_ZERO2", **axes)
    assert hybrid.hybrid and row_world_size(hybrid, 2) == 4 and row_world_size(hybrid, 8) == 4
    assert row_world_size(Config(strategy="FULL_SHARD", **axes), 3) == 3


def test_every_reference_model_trains_in_parity_under_hybrid_sharding_on_both_doors(capsys):
    """Every model of the default matrix, both hybrid strategies on the wrapper and a 2-D mesh
    on fully_shard, 4 ranks as 2 x 2: parity with DDP and exactly the theoretical volume."""
    models = ",".join(DEFAULTS["model"])
    code = main(["check", "--model", models, *_STRATEGIES, *_ONE_ROW_EACH, "--comm", "strict",
                 "--engine", "fsdp_core,fsdp_core_fully_shard"])  # fmt: skip
    out = capsys.readouterr().out
    rows = 2 * 2 * len(DEFAULTS["model"])
    assert f"{rows} ok, 0 mismatched, 0 errors, 0 unavailable" in out, out
    assert code == 0
