"""What ``fsdp-testing check`` prints: plain lines for pipes (unchanged), and on a terminal a
summary first, then a table that fits 120 (and 80) columns, colour, and a live progress bar."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from fsdp_testing.cli._matrix import Config
from fsdp_testing.cli._render import ProgressDisplay, is_rich, make_console, print_table
from fsdp_testing.cli._report import RowResult
from fsdp_testing.cli._table import print_results, worst_rows

MiB = 2**20


def _config(model: str, strategy: str, prefetch: str, offload: str, mp: str, engine: str) -> Config:
    return Config(model=model, strategy=strategy, prefetch=prefetch, offload=offload, mp=mp,
                  engine=engine)  # fmt: skip


def _rows() -> list[RowResult]:
    """One row of every kind: ok, ok under mixed precision, a mismatch (parity and bytes), an
    error, an unavailable configuration, and an ok row with a communication note."""
    return [
        RowResult(_config("nested", "FULL_SHARD", "BACKWARD_PRE", "off", "off", "fsdp_core"), "ok",
                  loss_diff=0.0, param_diff=0.0,
                  comm={"all_gather": (7, 3664), "reduce_scatter": (4, 1984)},
                  theory={"all_gather": (7, 3664), "reduce_scatter": (4, 1984)},
                  peak_rss=[264 * MiB, 265 * MiB], step_s=0.0161, time_s=5.1),
        RowResult(_config("nested", "NO_SHARD", "none", "on", "bf16/fp32", "fsdp_core"), "ok",
                  loss_diff=0.0123, param_diff=None, comm={"all_reduce": (4, 1984)},
                  theory={"all_reduce": (4, 1984)},
                  peak_rss=[266 * MiB, 266 * MiB], step_s=0.0113, time_s=0.06),
        RowResult(_config("transformer", "FULL_SHARD", "BACKWARD_POST", "on", "bf16/fp32",
                          "tests.cli._engines:NoAveragingEngine"), "MISMATCH",
                  problems=["[rank 0] parity: step 1: loss 23.1 against 5.5 (max abs diff 17.6)",
                            "communication: all_gather 11 calls / 32,848 B per step, theory 9 calls / 65,648 B"],
                  loss_diff=17.6, param_diff=None,
                  comm={"all_gather": (11, 32848), "reduce_scatter": (6, 33776)},
                  theory={"all_gather": (9, 65648), "reduce_scatter": (6, 33776)},
                  peak_rss=[1275 * MiB, 1276 * MiB], step_s=0.0825, time_s=0.44),
        RowResult(_config("always_wrap", "SHARD_GRAD_OP", "BACKWARD_POST", "off", "off", "torch_fsdp1"), "ERROR",
                  problems=["rank 1 died: signal 9 (SIGKILL)", "rank 0 hung in all_gather_into_tensor"],
                  peak_rss=[280 * MiB, 281 * MiB], time_s=12.5),
        RowResult(_config("nested", "NO_SHARD", "BACKWARD_PRE", "off", "off", "torch_fsdp2"), "unavailable",
                  problems=["NotImplementedError: engine 'torch_fsdp2' (torch.distributed.fsdp.fully_shard) does not support sharding_strategy=<ShardingStrategy.NO_SHARD: 3>: only FULL_SHARD/SHARD_GRAD_OP; run this configuration with engine 'torch_fsdp1' or 'fsdp_core'"],
                  peak_rss=[270 * MiB, 270 * MiB], time_s=0.01),
        RowResult(_config("nonuniform", "FULL_SHARD", "BACKWARD_PRE", "off", "off", "torch_fsdp2"), "ok",
                  notes=["communication: all_gather 8 calls / 4,096 B per step, theory 7 calls / 3,584 B"],
                  loss_diff=0.0, param_diff=0.0,
                  comm={"all_gather": (8, 4096), "reduce_scatter": (4, 1984)},
                  theory={"all_gather": (7, 3584), "reduce_scatter": (4, 1984)},
                  peak_rss=[271 * MiB, 272 * MiB], step_s=0.0239, time_s=0.22),
    ]  # fmt: skip


#: What the check printed for these rows before it had a terminal mode, byte for byte.
PLAIN = """
configuration                                                                   parity       loss diff  param diff  all-gather/step  reduce/step    vs theory                             peak RSS MiB  step ms  time s
------------------------------------------------------------------------------  -----------  ---------  ----------  ---------------  -------------  ------------------------------------  ------------  -------  ------
nested FULL_SHARD BACKWARD_PRE offload=off mp=off fsdp_core                     ok                   0           0     7 AG 3,664 B   4 RS 1,984 B  = theory                                   264/265     16.1    5.10
nested NO_SHARD none offload=on mp=bf16/fp32 fsdp_core                          ok             1.2e-02  -           none              4 AR 1,984 B  = theory                                   266/266     11.3    0.06
transformer FULL_SHARD BACKWARD_POST offload=on mp=bf16/fp32 NoAveragingEngine  FAIL           1.8e+01  -            11 AG 32,848 B  6 RS 33,776 B  theory: 9 AG 65,648 B, 6 RS 33,776 B     1275/1276     82.5    0.44
always_wrap SHARD_GRAD_OP BACKWARD_POST offload=off mp=off torch_fsdp1          ERROR        -          -           -                -              -                                          280/281  -         12.50
nested NO_SHARD BACKWARD_PRE offload=off mp=off torch_fsdp2                     unavailable  -          -           -                -              -                                          270/270  -          0.01
nonuniform FULL_SHARD BACKWARD_PRE offload=off mp=off torch_fsdp2               ok                   0           0     8 AG 4,096 B   4 RS 1,984 B  theory: 7 AG 3,584 B, 4 RS 1,984 B         271/272     23.9    0.22

3 ok, 1 mismatched, 1 errors, 1 unavailable in 18.3 s

MISMATCH: transformer FULL_SHARD BACKWARD_POST offload=on mp=bf16/fp32 NoAveragingEngine
  [rank 0] parity: step 1: loss 23.1 against 5.5 (max abs diff 17.6)
  communication: all_gather 11 calls / 32,848 B per step, theory 9 calls / 65,648 B

ERROR: always_wrap SHARD_GRAD_OP BACKWARD_POST offload=off mp=off torch_fsdp1
  rank 1 died: signal 9 (SIGKILL)
  rank 0 hung in all_gather_into_tensor

unavailable: nested NO_SHARD BACKWARD_PRE offload=off mp=off torch_fsdp2
  NotImplementedError: engine 'torch_fsdp2' (torch.distributed.fsdp.fully_shard) does not support sharding_strategy=<ShardingStrategy.NO_SHARD: 3>: only FULL_SHARD/SHARD_GRAD_OP; run this configuration with engine 'torch_fsdp1' or 'fsdp_core'

ok: nonuniform FULL_SHARD BACKWARD_PRE offload=off mp=off torch_fsdp2
  communication: all_gather 8 calls / 4,096 B per step, theory 7 calls / 3,584 B
"""


def _terminal(width: int, *, colour: bool = False) -> tuple[Console, io.StringIO]:
    """A terminal of ``width`` columns writing to a string; without colour, the layout alone
    (no escape codes), to measure it."""
    out = io.StringIO()
    console = Console(file=out, width=width, force_terminal=True, highlight=False,
                      color_system="standard" if colour else None)  # fmt: skip
    return console, out


def test_plain_output_for_pipes_is_unchanged():
    out = io.StringIO()
    console = make_console(out)  # a StringIO is not a terminal
    assert not is_rich(console)
    print_results(console, _rows(), 18.33)
    assert out.getvalue() == PLAIN
    assert "\x1b" not in out.getvalue()


def _table_lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.splitlines()]
    start = next(i for i, line in enumerate(lines) if line.startswith("configuration"))
    end = next(i for i, line in enumerate(lines) if line.startswith("shard FULL/GRAD/NO"))
    return lines[start:end]


ROW = re.compile(r"^(FULL|GRAD|NO) +(pre|post|none) +(cpu|-) +(bf16/fp32|-) +(ok|FAIL|ERROR|n/a)\b")


def test_terminal_table_fits_120_columns_with_one_line_per_row():
    console, out = _terminal(120)
    print_results(console, _rows(), 18.33)
    text = out.getvalue()
    assert max(len(line.rstrip()) for line in text.splitlines()) <= 120
    table = _table_lines(text)
    # Two header lines and a rule, then per group a title line and its rows, blank lines
    # between groups: nothing else, so no row was wrapped onto a second line.
    assert table[0].split() == ["configuration", "loss", "param", "all-gather", "reduce", "vs",
                                "peak", "RSS", "step", "time"]  # fmt: skip
    assert set(table[2]) == {"─"}
    titles = ["fsdp_core · nested", "NoAveragingEngine · transformer", "fsdp1 · always_wrap",
              "fsdp2 · nested", "fsdp2 · nonuniform"]  # fmt: skip
    body = [line for line in table[3:] if line]
    assert [line for line in body if line in titles] == titles
    rows = [line for line in body if line not in titles]
    assert len(rows) == 6 and all(ROW.match(line) for line in rows), rows
    ok, mp, mismatch, error, unavailable, noted = rows
    assert ok.split() == ["FULL", "pre", "-", "-", "ok", "0", "0", "7", "x", "3,664", "4", "RS",
                          "x", "1,984", "exact", "264/265", "16.1", "5.10"]  # fmt: skip
    assert mp.split()[:6] == ["NO", "none", "cpu", "bf16/fp32", "ok", "1.2e-02"]
    assert "4 AR x 1,984" in mp
    assert "FAIL" in mismatch and "11 x 32,848 ≠" in mismatch and "differs" in mismatch
    assert error.split()[4:7] == ["ERROR", "-", "-"] and error.endswith("12.50")
    assert unavailable.split()[4] == "n/a"
    assert "8 x 4,096 ≠" in noted and "differs" in noted
    # Numbers are right-aligned: the time column ends at the same place in every row.
    assert len({len(line) for line in rows}) == 1


def test_terminal_table_at_80_columns_leaves_out_columns_and_still_fits():
    console, out = _terminal(80)
    print_results(console, _rows(), 18.33)
    text = out.getvalue()
    assert max(len(line.rstrip()) for line in text.splitlines()) <= 80
    table = _table_lines(text)
    assert table[0].split() == ["configuration", "loss", "param", "all-gather", "reduce"]
    rows = [line for line in table[3:] if ROW.match(line)]
    assert len(rows) == 6  # still one line per row
    assert "11 x 32,848 ≠" in rows[2]  # the theory column is gone, its verdict is not
    legend = " ".join(text[text.index("shard FULL/GRAD/NO") :].split())
    assert "Left out to fit 80 columns: time s, peak RSS MiB, step ms, vs theory." in legend


def test_terminal_summary_comes_first_with_the_worst_rows():
    console, out = _terminal(120)
    print_results(console, _rows(), 18.33)
    lines = [line.rstrip() for line in out.getvalue().splitlines()]
    counts = lines.index("3 ok, 1 mismatched, 1 errors, 1 unavailable in 18.3 s")
    worst = lines.index("worst rows")
    table = next(i for i, line in enumerate(lines) if line.startswith("configuration"))
    assert counts < worst < table
    listed = [line.split()[0] for line in lines[worst + 1 : table] if line and line[0] != " "]
    assert listed == ["ERROR", "MISMATCH", "unavailable", "ok", "ok"]
    assert lines[worst + 2].strip() == "rank 1 died: signal 9 (SIGKILL)"
    # Details of every row that is not ok still follow the table.
    assert (
        "MISMATCH: transformer FULL_SHARD BACKWARD_POST offload=on mp=bf16/fp32 NoAveragingEngine"
        in lines
    )


def test_worst_rows_leave_out_rows_in_exact_parity():
    rows = _rows()
    exact = [rows[0], rows[5]]
    exact[1].notes = []
    assert worst_rows(exact) == []
    assert [r.status for r, _ in worst_rows(rows, limit=2)] == ["ERROR", "MISMATCH"]


def test_colour_only_on_a_terminal():
    console, out = _terminal(120, colour=True)
    print_results(console, _rows(), 18.33)
    assert "\x1b[1;31mMISMATCH" in out.getvalue() and "\x1b[32mok" in out.getvalue()


def test_layout_follows_the_stream_not_force_color(monkeypatch):
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.delenv("TTY_COMPATIBLE", raising=False)
    monkeypatch.delenv("TERM", raising=False)
    monkeypatch.setenv("FORCE_COLOR", "1")  # CI systems set it to colour their logs
    assert not is_rich(make_console(io.StringIO()))
    assert is_rich(make_console(Tty()))
    monkeypatch.setenv("TTY_COMPATIBLE", "0")
    assert not is_rich(make_console(Tty()))
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    assert is_rich(make_console(io.StringIO()))
    monkeypatch.setenv("TERM", "dumb")
    assert not is_rich(make_console(io.StringIO()))


def test_progress_plain_lines_off_a_terminal():
    out = io.StringIO()
    with ProgressDisplay(12, make_console(out)) as progress:
        progress.start("nested FULL_SHARD")
        progress.finish("nested FULL_SHARD", "ok", 5.1)
        progress.start("moe NO_SHARD")
        progress.finish("moe NO_SHARD", "MISMATCH", 0.25, "parity: step 1")
    assert out.getvalue() == (
        "[ 1/12] ok            5.10 s  nested FULL_SHARD\n"
        "[ 2/12] MISMATCH      0.25 s  moe NO_SHARD  parity: step 1\n"
    )


def test_progress_on_a_terminal_is_a_live_bar_with_problem_rows_above_it():
    console, out = _terminal(100, colour=True)
    with ProgressDisplay(3, console) as progress:
        progress.start("nested FULL_SHARD")
        progress.finish("nested FULL_SHARD", "ok", 5.1)
        progress.start("moe NO_SHARD " + "x" * 200)
        progress.finish("moe NO_SHARD", "ERROR", 0.25, "rank 1 died " + "y" * 200)
    text = out.getvalue()
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text).replace("\r", "\n")
    assert "━" in plain and "2/3" in plain  # the bar and its count
    assert "[2/3] ERROR" in plain and "rank 1 died" in plain
    assert "[1/3] ok" not in plain  # ok rows go to the table, not above the bar
    assert max(len(line) for line in plain.splitlines()) <= 100  # long labels are cut
    assert text.rstrip().endswith("\x1b[2K")  # the bar erases itself at the end


def test_print_table_plain_and_rich():
    rows = [["fsdp_core", "26.0", "exact"], ["ddp", "13.7", "-"]]
    out = io.StringIO()
    print_table(make_console(out), ["engine", "median ms", "vs theory"], rows, title="steps")
    assert out.getvalue() == (
        "steps\n"
        "engine     median ms  vs theory\n"
        "---------  ---------  ---------\n"
        "fsdp_core       26.0  exact\n"
        "ddp             13.7  -\n"
    )
    console, out = _terminal(60)
    print_table(console, ["engine", "median ms", "vs theory"], rows, title="steps")
    lines = [line.rstrip() for line in out.getvalue().splitlines()]
    assert lines[0] == "steps"
    assert lines[3] == "fsdp_core       26.0  exact" and lines[4] == "ddp             13.7  -"


@pytest.mark.parametrize("width", [80, 120])
def test_default_like_matrix_fits(width):
    """180 ok rows of the default matrix's shape (five models, every strategy, prefetch,
    offload and two precisions) keep one line per row at both widths."""
    from fsdp_testing.cli._matrix import DEFAULTS, build_matrix

    rows = []
    for i, config in enumerate(build_matrix(DEFAULTS)):
        rows.append(RowResult(config, "ok", loss_diff=0.0 if config.mp == "off" else 0.55,
                              param_diff=0.0 if config.mp == "off" else None,
                              comm={"all_gather": (11, 65_648), "reduce_scatter": (6, 33_776)},
                              theory={"all_gather": (11, 65_648), "reduce_scatter": (6, 33_776)},
                              peak_rss=[281 * MiB, 281 * MiB], step_s=0.2371, time_s=10 + i / 100))  # fmt: skip
    console, out = _terminal(width)
    print_results(console, rows, 25.0)
    text = out.getvalue()
    assert max(len(line.rstrip()) for line in text.splitlines()) <= width
    assert sum(bool(ROW.match(line)) for line in _table_lines(text)) == 180


def test_a_mismatch_lists_its_likely_causes_after_its_problems_plain_and_rich():
    rows = _rows()
    mismatch = rows[2]
    mismatch.causes = ["every gradient is 2.000x the reference's (world size 2): gradients summed"]
    plain = io.StringIO()
    print_results(make_console(plain), rows, 1.0)
    details = plain.getvalue().split(f"MISMATCH: {mismatch.config.label}\n")[1].splitlines()
    assert details[:3] == [f"  {mismatch.problems[0]}", f"  {mismatch.problems[1]}",
                           f"  likely cause: {mismatch.causes[0]}"]  # fmt: skip
    console, out = _terminal(200)
    print_results(console, rows, 1.0)
    assert f"likely cause: {mismatch.causes[0]}" in out.getvalue()


def test_a_model_parallel_row_shows_where_its_batch_comes_from_plain_and_rich():
    from fsdp_testing.cli._parallel import ParallelConfig

    config = ParallelConfig(
        model="tensor_parallel:build_mlp", strategy="-", prefetch="-", offload="-", mp="-",
        engine="tensor_parallel:data_and_tensor_parallel",
        parallelize="tensor_parallel:data_and_tensor_parallel", reference="data-parallel",
        mesh=(("dp", 2), ("tp", 2)), dp_dims=("dp",),
    )  # fmt: skip
    row = RowResult(config, "ok", loss_diff=4.8e-7, param_diff=3e-8,
                    comm={"all_reduce": (1, 192)}, peak_rss=[272 * MiB] * 4)  # fmt: skip
    label = (
        "tensor_parallel:build_mlp parallelize=tensor_parallel:data_and_tensor_parallel "
        "mesh dp=2,tp=2 dp-dims=dp"
    )
    out = io.StringIO()
    print_results(make_console(out), [row], 1.0)
    assert f"{label}  ok" in out.getvalue()
    console, out = _terminal(120)
    print_results(console, [row], 1.0)
    lines = [line.rstrip() for line in out.getvalue().splitlines()]
    assert "parallelize: tensor_parallel:data_and_tensor_parallel" in lines
    (cells,) = [line for line in lines if line.startswith("mesh dp=2,tp=2 dp-dims=dp")]
    assert cells.split()[3:9] == ["ok", "4.8e-07", "3.0e-08", "-", "1", "AR"], cells
    assert "n/a" in cells.split()  # no theory of a user's parallelization
    assert "a --parallelize row's configuration: where its batch comes from" in " ".join(lines)
