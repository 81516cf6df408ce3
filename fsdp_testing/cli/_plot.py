"""The pictures of the command line and the benchmarks, drawn with matplotlib.

matplotlib is an optional dependency (the ``plot`` extra, which ``scripts/setup.sh`` installs):
nothing here imports it at module level, and :func:`require_matplotlib` turns its absence into
an error that names the extra. Figures are built on ``matplotlib.figure.Figure`` directly and
saved through the Agg canvas, so no display and no pyplot state are involved.

- :func:`draw_timeline`: one lane per rank from a merged ``fsdp-testing trace``.
- :func:`draw_bars`: side-by-side bar charts (the benchmarks' step time, memory, overhead).
"""

from __future__ import annotations

import dataclasses
import importlib
import textwrap
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["BarPanel", "draw_bars", "draw_timeline", "require_matplotlib", "save_png"]

PLOT_EXTRA = "plot"
INSTALL_HINT = "pip install 'fsdp-testing[plot]' (bash scripts/setup.sh installs it)"

#: Colours of the timeline, by step phase, collective family and unit transition.
COLORS: dict[str, str] = {
    "forward": "#cdd7e6",
    "backward": "#aab9d2",
    "optimizer": "#d7cdaa",
    "all_gather": "#1f77b4",
    "reduce_scatter": "#ff7f0e",
    "all_reduce": "#9467bd",
    "other collective": "#7f7f7f",
    "unshard": "#2ca02c",
    "reshard": "#d62728",
    "offload": "#17becf",
}
_PHASES = ("forward", "backward", "optimizer")
#: Rows of a rank's lane, bottom to top: (y of the row's lower edge, label).
_ROWS = {"offload": 0.0, "unit": 1.0, "collective": 2.0, "phase": 3.0}
_ROW_LABELS = ("offload copies", "unshard / reshard", "collectives", "step phases")


def require_matplotlib(what: str) -> None:
    """Raise ``ImportError`` naming the ``plot`` extra when matplotlib is missing.

    Args:
        what: the command or option that needs it, e.g. ``"fsdp-testing trace --png"``.
    """
    try:
        importlib.import_module("matplotlib")
    except ImportError as error:
        raise ImportError(
            f"{what} draws with matplotlib, which is not installed. Install the "
            f"'{PLOT_EXTRA}' extra: {INSTALL_HINT}."
        ) from error


def _figure(width_px: int, height_px: int, dpi: int = 100) -> Figure:
    require_matplotlib("drawing a PNG")
    from matplotlib.figure import Figure

    return Figure(figsize=(width_px / dpi, height_px / dpi), dpi=dpi, layout="constrained")


def save_png(figure: Figure, path: str) -> None:
    """Write ``figure`` to ``path`` as PNG, at the figure's own size in pixels."""
    figure.savefig(path, format="png", dpi=figure.dpi, metadata={"Software": None})


def _family(op: str) -> str:
    from fsdp_testing.collectives import family_of

    return family_of(op) or (op if op in COLORS else "other collective")


def _placement(event: dict[str, Any]) -> tuple[str, float, float] | None:
    """The colour and the vertical extent (in lane units) of one span, or None."""
    category = event.get("cat")
    if category == "step":
        return COLORS.get(event["name"], COLORS["optimizer"]), _ROWS["phase"] + 0.1, 0.8
    if category == "collective":
        family = _family(event["args"]["op"])
        return COLORS.get(family, COLORS["other collective"]), _ROWS["collective"] + 0.1, 0.8
    if category == "unshard":
        return COLORS["unshard"], _ROWS["unit"] + 0.5, 0.4
    if category == "reshard":
        return COLORS["reshard"], _ROWS["unit"] + 0.1, 0.4
    return None


def draw_timeline(trace: dict[str, Any], *, width: int = 1400) -> Figure:
    """One lane per rank (trace process), with a shared time axis in milliseconds.

    Each lane has four rows, top to bottom: the step phases (forward, backward, optimizer,
    also shaded behind the whole lane); collectives as spans coloured by family (all-gather,
    reduce-scatter, all-reduce); unit transitions (unshard in the upper half, reshard in the
    lower half); offload copies as marks (pointing down to the device, up to the host).

    Args:
        trace: a trace from :func:`~fsdp_testing.cli.trace.merge_traces` (or any recorder
            export).
        width: the picture's width in pixels (at least 400; default 1400).

    Raises:
        ValueError: ``width`` is below 400.
        ImportError: matplotlib (the ``plot`` extra) is not installed.
    """
    if width < 400:
        raise ValueError(f"draw_timeline: width={width} is too narrow; give at least 400 pixels")
    from matplotlib.artist import Artist
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    events = [e for e in trace["traceEvents"] if e["ph"] != "M"]
    ranks = sorted({e["pid"] for e in trace["traceEvents"]}) or [0]
    lane_px, frame_px = 150, 150
    figure = _figure(width, frame_px + lane_px * len(ranks))
    axes = figure.subplots(len(ranks), 1, sharex=True, squeeze=False)[:, 0]
    lanes = dict(zip(ranks, axes, strict=True))
    t_end = max((e["ts"] + e.get("dur", 0.0) for e in events), default=1.0) / 1e3
    spans: dict[tuple[int, str, float, float], list[tuple[float, float]]] = {}
    marks: dict[tuple[int, str], list[float]] = {}
    for event in events:
        if event.get("cat") == "offload":
            direction = event.get("args", {}).get("direction", "")
            marks.setdefault((event["pid"], direction), []).append(event["ts"] / 1e3)
            continue
        placed = _placement(event)
        if placed is None or "dur" not in event:
            continue
        color, y, height = placed
        key = (event["pid"], color, y, height)
        spans.setdefault(key, []).append((event["ts"] / 1e3, event["dur"] / 1e3))
        if event.get("cat") == "step":
            ax = lanes[event["pid"]]
            if event["name"] == "forward" and event["dur"] / 1e3 > 0.03 * t_end:
                step = event.get("args", {}).get("step")
                ax.text(event["ts"] / 1e3 + 0.004 * t_end, _ROWS["phase"] + 0.5,
                        f"step {step}", va="center", fontsize=8, zorder=3)  # fmt: skip
            ax.axvspan(
                event["ts"] / 1e3,
                (event["ts"] + event["dur"]) / 1e3,
                color=color,
                alpha=0.25,
                linewidth=0,
                zorder=0,
            )
    # A span shorter than two pixels is drawn two pixels wide, so every event shows.
    min_width = 2 * t_end / width
    for (pid, color, y, height), ranges in spans.items():
        widened = [(start, max(length, min_width)) for start, length in ranges]
        lanes[pid].broken_barh(widened, (y, height), facecolors=color, linewidth=0, zorder=2)
    for (pid, direction), times in marks.items():
        up = direction == "to_host"
        lanes[pid].scatter(
            times,
            [_ROWS["offload"] + 0.5] * len(times),
            marker="^" if up else "v",
            s=30,
            color=COLORS["offload"],
            edgecolors="#0b6f7a",
            linewidths=0.5,
            zorder=3,
        )
    for rank, ax in lanes.items():
        _style_lane(ax, rank, t_end)
    axes[-1].set_xlabel("time since the first event (ms)")
    title = trace.get("otherData", {}).get("configuration", "")
    figure.suptitle(f"fsdp-testing trace: {title}" if title else "fsdp-testing trace")
    legend: list[Artist] = [Patch(facecolor=COLORS[n], label=n.replace("_", "-")) for n in _PHASES]
    families = {_family(e["args"]["op"]) for e in events if e.get("cat") == "collective"}
    legend += [
        Patch(facecolor=COLORS[name], label=name.replace("_", "-"))
        for name in ("all_gather", "reduce_scatter", "all_reduce", "other collective")
        if name in families
    ]
    legend += [Patch(facecolor=COLORS[n], label=n) for n in ("unshard", "reshard")]
    for direction, marker in (("to_device", "v"), ("to_host", "^")):
        if any(d == direction for _, d in marks):
            label = f"offload {direction.replace('_', ' ')}"
            legend.append(
                Line2D([], [], marker=marker, linestyle="", color=COLORS["offload"], label=label)
            )
    columns = _legend_columns([str(h.get_label()) for h in legend], width)
    figure.legend(handles=legend, loc="outside lower center", ncol=columns, frameon=False)
    return figure


def _legend_columns(labels: list[str], width: int) -> int:
    """As many legend columns as fit in ``width`` pixels (about 7 per character at 10 points,
    40 for the key and the gap)."""
    for rows in range(1, len(labels) + 1):
        columns = -(-len(labels) // rows)
        widest = [
            max(len(labels[i]) for i in range(c, len(labels), columns)) for c in range(columns)
        ]
        if sum(40 + 7 * n for n in widest) <= width - 20:
            return columns
    return 1


def _style_lane(ax: Axes, rank: int, t_end: float) -> None:
    ax.set_xlim(0, t_end * 1.01)
    ax.set_ylim(0, 4)
    ax.set_yticks([v + 0.5 for v in _ROWS.values()], _ROW_LABELS, fontsize=8)
    ax.set_ylabel(f"rank {rank}", fontweight="bold")
    for y in (1.0, 2.0, 3.0):
        ax.axhline(y, color="#dddddd", linewidth=0.6, zorder=1)
    ax.grid(axis="x", color="#e6e6e6", linewidth=0.6)
    ax.set_axisbelow(True)
    ax.tick_params(axis="y", length=0)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BarPanel:
    """One bar chart: a bar per group and series, its value written on it.

    Args:
        title: the panel's title.
        unit: the value axis' label.
        groups: the categories along the horizontal axis (engines, launchers).
        series: per series label, one value per group (None: no bar).
        log: a logarithmic value axis (default False).
    """

    title: str
    unit: str
    groups: Sequence[str]
    series: dict[str, Sequence[float | None]]
    log: bool = False

    def __post_init__(self) -> None:
        bad = [k for k, v in self.series.items() if len(v) != len(self.groups)]
        if bad:
            raise ValueError(
                f"BarPanel {self.title!r}: series {', '.join(bad)} must have one value per "
                f"group ({len(self.groups)}: {', '.join(self.groups)})"
            )


def draw_bars(panels: Sequence[BarPanel], *, title: str, width: int = 1000) -> Figure:
    """Panels side by side, sharing one title.

    Args:
        panels: the charts.
        title: above them all.
        width: the picture's width in pixels (default 1000; the height is 45% of it).

    Raises:
        ImportError: matplotlib (the ``plot`` extra) is not installed.
    """
    figure = _figure(width, int(width * 0.45))
    axes = figure.subplots(1, len(panels), squeeze=False)[0]
    palette = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b")
    for ax, panel in zip(axes, panels, strict=True):
        count = len(panel.series)
        bar_width = 0.8 / count
        for index, (label, values) in enumerate(panel.series.items()):
            xs = [g + (index - (count - 1) / 2) * bar_width for g in range(len(panel.groups))]
            shown = [(x, v) for x, v in zip(xs, values, strict=True) if v is not None]
            bars = ax.bar(
                [x for x, _ in shown],
                [v for _, v in shown],
                width=bar_width * 0.95,
                label=label,
                color=palette[index % len(palette)],
            )
            ax.bar_label(bars, fmt="{:,.1f}", fontsize=7, padding=2)
        # Labels wrap to the width of their slot (about 6 pixels per character at 8 points).
        slot_chars = max(8, int(width * 0.85 / len(panels) / max(len(panel.groups), 1) / 6))
        labels = [textwrap.fill(g, slot_chars) for g in panel.groups]
        ax.set_xticks(range(len(panel.groups)), labels, fontsize=8)
        ax.set_title(panel.title, fontsize=10)
        ax.set_ylabel(panel.unit)
        if panel.log:
            ax.set_yscale("log")
        ax.margins(y=0.15)
        ax.grid(axis="y", color="#e6e6e6", linewidth=0.6)
        ax.set_axisbelow(True)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
        if count > 1:
            ax.legend(fontsize=8, frameon=False)
    figure.suptitle(title)
    return figure
