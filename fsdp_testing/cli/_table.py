"""What ``fsdp-testing check`` prints once its rows have run.

Plain text when stdout is not a terminal (the lines CI logs and tests grep, one row per line with
its full configuration). On a terminal (see [Note: plain output] in ``_render.py``): a summary
first (counts per status and the worst rows), then a table that fits 120 columns, its
configuration columns abbreviated and grouped by engine and model with a legend under it, then
what went wrong in each row that is not ``ok``.
"""

from __future__ import annotations

from rich.console import Console, Group
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from ._matrix import Config
from ._render import STATUS_STYLES, format_table, is_rich, new_table
from ._report import ERROR, MISMATCH, OK, UNAVAILABLE, RowResult, comm_problems, count_statuses

__all__ = ["plain_table", "print_results", "rich_table", "worst_rows"]

_KINDS = ("all_gather", "reduce_scatter", "all_reduce")
_SHORT_KIND = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR"}
#: Abbreviations of the terminal table, explained in its legend.
_STRATEGY = {
    "FULL_SHARD": "FULL",
    "SHARD_GRAD_OP": "GRAD",
    "NO_SHARD": "NO",
    "HYBRID_SHARD": "HYB",
    "_HYBRID_SHARD_ZERO2": "HYB2",
}
_PREFETCH = {"BACKWARD_PRE": "pre", "BACKWARD_POST": "post", "none": "none"}
_ENGINE = {
    "torch_fsdp1": "fsdp1",
    "torch_fsdp2": "fsdp2",
    "fsdp_core_fully_shard": "core-fs",
    "fsdp_core_graph": "core-graph",
}
_LEGEND = (
    "shard FULL/GRAD/NO: FULL_SHARD/SHARD_GRAD_OP/NO_SHARD, HYB/HYB2: HYBRID_SHARD/"
    "_HYBRID_SHARD_ZERO2 on 4 ranks (2 x 2; AG and RS inside the shard group, AR across the "
    "replicate group, checked per group) · pf: backward prefetch (pre, post, "
    "none) · cpu: parameters offloaded to the CPU · mp: mixed precision, compute/reduce dtypes · "
    "per step: AG all-gathers, RS reduce-scatters, AR all-reduces, calls x bytes (≠: not the "
    "theoretical volume) · diffs: largest loss and parameter differences from the reference · "
    "peak RSS MiB per rank (lowest-highest beyond two) · step ms: median step · time s: the "
    "row's wall time"
)
_WORST = 5


def _ran(row: RowResult) -> bool:
    return row.status not in (ERROR, UNAVAILABLE)


def _fmt_diff(value: float | None) -> str:
    if value is None:
        return "-"
    return "0" if value == 0 else f"{value:.1e}"


def _fmt_comm(
    comm: dict[str, tuple[int, int]],
    kinds: tuple[str, ...],
    groups: dict[str, dict[str, tuple[int, int]]] | None = None,
) -> str:
    """Calls and bytes of ``kinds``; with ``groups`` (hybrid rows), each family's groups."""
    parts = []
    for kind in kinds:
        if kind in comm:
            count, size = comm[kind]
            where = " ".join(f"{{{g}}}" for g in sorted((groups or {}).get(kind, {})))
            parts.append(
                f"{count} {_SHORT_KIND[kind]} {size:,} B" + (f" in {where}" if groups else "")
            )
    return ", ".join(parts) if parts else "none"


def _theory_cell(row: RowResult) -> str:
    if not _ran(row):
        return "-"
    if row.theory is None:
        return "n/a"
    if not comm_problems(row.comm, row.theory):
        # The totals agree; a family over another group than the theory's is still a
        # difference ([Note: hybrid rows]).
        by_group = any("] communication: " in p for p in [*row.problems, *row.notes])
        return "≠ theory per group" if by_group else "= theory"
    return "theory: " + _fmt_comm(row.theory, _KINDS)


def _parity_cell(row: RowResult) -> str:
    if not _ran(row):
        return row.status
    return "FAIL" if any("parity:" in p for p in row.problems) else "ok"


def _step_ms(row: RowResult) -> str:
    return f"{row.step_s * 1e3:.1f}" if row.step_s is not None else "-"


def plain_table(rows: list[RowResult]) -> str:
    """The plain-text table: one line per configuration, its full label first."""
    headers = [
        "configuration",
        "parity",
        "loss diff",
        "param diff",
        "all-gather/step",
        "reduce/step",
        "vs theory",
        "peak RSS MiB",
        "step ms",
        "time s",
    ]
    body = []
    for row in rows:
        ran = _ran(row)
        groups = row.comm_groups if row.config.hybrid else None  # rank 0's groups
        body.append(
            [
                row.config.label,
                _parity_cell(row),
                _fmt_diff(row.loss_diff) if ran else "-",
                _fmt_diff(row.param_diff) if ran else "-",
                _fmt_comm(row.comm, ("all_gather",), groups) if ran else "-",
                _fmt_comm(row.comm, ("reduce_scatter", "all_reduce"), groups) if ran else "-",
                _theory_cell(row),
                "/".join(f"{b / 2**20:.0f}" for b in row.peak_rss) or "-",
                _step_ms(row),
                f"{row.time_s:.2f}",
            ]
        )
    return format_table(headers, body)


def _calls_cell(row: RowResult, kinds: tuple[str, ...], tag: bool) -> Text:
    """Calls x bytes per step of ``kinds``; red with a trailing ``≠`` where they differ from
    the theory (so a narrow table that leaves out the theory column still shows it)."""
    if not _ran(row):
        return Text("-")
    parts = []
    for kind in kinds:
        if kind in row.comm:
            count, size = row.comm[kind]
            parts.append(f"{count}{' ' + _SHORT_KIND[kind] if tag else ''} x {size:,}")
    text = ", ".join(parts) if parts else "-"
    theory = row.theory
    if theory is not None and any(row.comm.get(k) != theory.get(k) for k in kinds):
        return Text(f"{text} ≠", style=STATUS_STYLES["differs"])
    return Text(text)


def _rss_cell(peaks: list[int]) -> str:
    mib = [round(b / 2**20) for b in peaks]
    if not mib:
        return "-"
    if len(mib) <= 2:
        return "/".join(map(str, mib))
    return f"{min(mib)}-{max(mib)}"


def _styled(text: str, style: str = "") -> Text:
    return Text(text, style=style or STATUS_STYLES.get(text, ""))


def _config_cell(config: Config) -> str:
    if config.cell is not None:  # a model-parallel row: [Note: model-parallel rows]
        return config.cell
    offload = "cpu" if config.offload == "on" else "-"
    mp = config.mp if config.mp != "off" else "-"
    strategy = _STRATEGY.get(config.strategy, config.strategy)
    return f"{strategy:<5} {_PREFETCH.get(config.prefetch, config.prefetch):<4} {offload:<3} {mp}"


#: The terminal table's columns: header (two lines at most), numeric, and for the columns a
#: narrow terminal may leave out, their order of leaving (lowest first).
_COLUMNS: tuple[tuple[str, bool, int | None], ...] = (
    ("configuration\nshard pf   cpu mp", False, None),
    ("parity", False, None),
    ("loss\ndiff", True, None),
    ("param\ndiff", True, None),
    ("all-gather\n/step", True, None),
    ("reduce\n/step", True, None),
    ("vs\ntheory", False, 3),
    ("peak RSS\nMiB", True, 1),
    ("step\nms", True, 2),
    ("time\ns", True, 0),
)


def _row_cells(row: RowResult) -> list[Text]:
    ran = _ran(row)
    parity = _parity_cell(row)
    theory = _theory_cell(row)
    verdict = {"= theory": "exact", "n/a": "n/a", "-": "-"}.get(theory, "differs")
    return [
        Text(_config_cell(row.config)),
        _styled("n/a" if parity == UNAVAILABLE else parity, STATUS_STYLES.get(parity, "")),
        _styled(_fmt_diff(row.loss_diff) if ran else "-"),
        _styled(_fmt_diff(row.param_diff) if ran else "-"),
        _calls_cell(row, ("all_gather",), tag=False),
        _calls_cell(row, ("reduce_scatter", "all_reduce"), tag=True),
        _styled(verdict),
        _styled(_rss_cell(row.peak_rss)),
        _styled(_step_ms(row)),
        _styled(f"{row.time_s:.2f}"),
    ]


def rich_table(rows: list[RowResult], *, width: int = 120) -> Group:
    """The terminal table: one row per configuration, in groups titled by the model (and the
    engine, when there are several) under one header, the configuration abbreviated (the legend
    under the table says how), numbers aligned, statuses in colour.

    Args:
        rows: the results.
        width: the terminal's columns (default 120). Where the table is wider, the time, peak
            memory, step time and theory columns are left out in that order (the legend says
            which; communication that differs from the theory is still marked ``≠``); what
            still does not fit is folded by rich.
    """
    engines = list(dict.fromkeys(row.config.engine_name for row in rows))
    groups: list[tuple[str, list[list[Text]]]] = []
    for row in rows:
        config = row.config
        engine = _ENGINE.get(config.engine_name, config.engine_name)
        name = config.model if len(engines) == 1 else f"{engine} · {config.model}"
        if not groups or groups[-1][0] != name:
            groups.append((name, []))
        groups[-1][1].append(_row_cells(row))
    # Every group is a table of its own (so that its title never widens a column), with the
    # same column widths.
    natural = [max(len(line) for line in header.split("\n")) for header, _, _ in _COLUMNS]
    for _, body in groups:
        for cells in body:
            natural = [max(n, c.cell_len) for n, c in zip(natural, cells, strict=True)]
    keep = list(range(len(_COLUMNS)))
    optional = sorted((i for i, c in enumerate(_COLUMNS) if c[2] is not None),
                      key=lambda i: _COLUMNS[i][2] or 0)  # fmt: skip
    left_out = []
    while optional and sum(natural[i] for i in keep) + 2 * (len(keep) - 1) > width:
        dropped = optional.pop(0)
        keep.remove(dropped)
        left_out.append(_COLUMNS[dropped][0].replace("\n", " "))

    def table(title: str | None, body: list[list[Text]]) -> Table:
        made = new_table([_COLUMNS[i][0] for i in keep], numeric=[_COLUMNS[i][1] for i in keep])
        for column, i in zip(made.columns, keep, strict=True):
            column.width = natural[i]
        made.columns[0].no_wrap = True
        made.title = title
        made.show_header = title is None
        for cells in body:
            made.add_row(*(cells[i] for i in keep))
        return made

    parts: list[Table | Text] = []
    if len(engines) == 1:
        parts.append(Text(rows[0].config.engine_title, style="bold"))
    parts.append(table(None, []))
    for index, (name, body) in enumerate(groups):
        if index:
            parts.append(Text())
        parts.append(table(name, body))
    shortened = [f"{_ENGINE[e]}: {e}" for e in engines if e in _ENGINE and len(engines) > 1]
    narrow = f" Left out to fit {width} columns: {', '.join(left_out)}." if left_out else ""
    if any(row.config.cell is not None for row in rows):  # [Note: model-parallel rows]
        shortened.append(
            "a --parallelize row's configuration: where its batch comes from (data-parallel, "
            "same-batch, or a mesh and its data-parallel dims), n/a: no theory to compare with"
        )
    legend = _LEGEND + "".join(f" · {s}" for s in shortened) + "." + narrow
    parts.append(Text(legend, style="dim"))
    return Group(*parts)


def worst_rows(rows: list[RowResult], limit: int = _WORST) -> list[tuple[RowResult, str]]:
    """Up to ``limit`` rows, worst first, each with why: errors, mismatches, then unavailable
    configurations (their first problem), then ``ok`` rows with notes, then the ``ok`` rows with
    the largest loss differences (rows in exact parity are never listed)."""
    rank = {ERROR: 0, MISMATCH: 1, UNAVAILABLE: 2}

    def key(row: RowResult) -> tuple[int, float, float]:
        if row.status in rank:
            return (rank[row.status], 0.0, 0.0)
        return (3 if row.notes else 4, -(row.loss_diff or 0.0), -(row.param_diff or 0.0))

    interesting = [
        row
        for row in rows
        if row.status != OK
        or row.notes
        or (row.loss_diff or 0.0) > 0
        or (row.param_diff or 0.0) > 0
    ]
    chosen = sorted(interesting, key=key)[:limit]
    out = []
    for row in chosen:
        if row.status != OK:
            why = row.problems[0] if row.problems else row.status
        elif row.notes:
            why = row.notes[0]
        else:
            why = f"loss diff {_fmt_diff(row.loss_diff)}, param diff {_fmt_diff(row.param_diff)}"
        out.append((row, why))
    return out


def _summary(rows: list[RowResult], total_s: float) -> Group:
    counts = count_statuses(rows)
    line = Text()
    for status, word in ((OK, "ok"), (MISMATCH, "mismatched"), (ERROR, "errors")):
        style = STATUS_STYLES[status] if counts[status] else ""
        line.append(f"{counts[status]} {word}", style=style)
        line.append(", ")
    line.append(
        f"{counts[UNAVAILABLE]} unavailable",
        style=STATUS_STYLES[UNAVAILABLE] if counts[UNAVAILABLE] else "",
    )
    line.append(f" in {total_s:.1f} s")
    chosen = worst_rows(rows)
    failing = any(row.status != OK or row.notes for row, _ in chosen)
    worst = Table.grid(padding=(0, 2, 0, 0))
    worst.add_column(no_wrap=True)
    worst.add_column()
    for row, why in chosen:
        detail = Group(
            Text(row.config.label), Text(why, style="dim", no_wrap=True, overflow="ellipsis")
        )
        worst.add_row(_styled(row.status), detail)
    heading = Text("worst rows" if failing else "largest differences", style="bold")
    if not chosen:
        return Group(line)
    return Group(line, Text(), heading, worst)


def _cause_lines(row: RowResult) -> list[str]:
    """A parity mismatch's likely causes, one line each (none where the numbers make none
    clear)."""
    return [f"likely cause: {cause}" for cause in row.causes]


def print_results(console: Console, rows: list[RowResult], total_s: float) -> None:
    """Everything after the progress lines: the table, the counts and each problem row."""
    counts = count_statuses(rows)
    if not is_rich(console):
        out = console.file
        print(file=out)
        print(plain_table(rows), file=out)
        print(
            f"\n{counts[OK]} ok, {counts[MISMATCH]} mismatched, {counts[ERROR]} errors, "
            f"{counts[UNAVAILABLE]} unavailable in {total_s:.1f} s",
            file=out,
        )
        for row in rows:
            if row.status != OK or row.notes:
                print(f"\n{row.status}: {row.config.label}", file=out)
                for problem in [*row.problems[:8], *_cause_lines(row), *row.notes]:
                    print(f"  {problem}", file=out)
        return
    console.print()
    console.print(_summary(rows, total_s))
    console.print()
    console.print(rich_table(rows, width=console.width))
    for row in rows:
        if row.status != OK or row.notes:
            console.print()
            console.print(Text.assemble((row.status, STATUS_STYLES.get(row.status, "")), ": ",
                                        row.config.label))  # fmt: skip
            for problem in [*row.problems[:8], *_cause_lines(row), *row.notes]:
                console.print(Padding(Text(problem), (0, 0, 0, 2)))
