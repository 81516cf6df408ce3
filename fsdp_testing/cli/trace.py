"""``fsdp-testing trace``: a few training steps of one configuration as a Perfetto/Chrome trace
(JSON, open it at ui.perfetto.dev or chrome://tracing) and a PNG timeline, one lane per rank.

Each rank records its step phases (forward, backward, optimizer), every collective with its
duration (all-gather, reduce-scatter, all-reduce; recorded at ``torch.distributed``, so for every
engine) and, for fsdp_core, every unshard, reshard and offload copy the engine publishes through
``fsdp_core.events``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from typing import Any

from ._matrix import AXES, Config
from ._png import Canvas, Color

__all__ = ["add_parser", "build_trace", "draw_timeline", "run"]

_TIDS = {"step": 0, "collectives": 1, "unshard/reshard": 2, "offload": 3}
_COLORS: dict[str, Color] = {
    "forward": (205, 215, 230),
    "backward": (170, 185, 210),
    "optimizer": (215, 205, 170),
    "all_gather": (31, 119, 180),
    "reduce_scatter": (255, 127, 14),
    "all_reduce": (148, 103, 189),
    "broadcast": (140, 86, 75),
    "all_to_all": (127, 127, 127),
    "unshard": (44, 160, 44),
    "reshard": (214, 39, 40),
    "offload": (23, 190, 207),
}


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "trace",
        help="write a Perfetto/Chrome trace and a PNG timeline of a few steps",
        description=__doc__.splitlines()[0],
    )
    defaults = {
        "model": "transformer",
        "strategy": "FULL_SHARD",
        "prefetch": "BACKWARD_PRE",
        "offload": "off",
        "mp": "off",
        "engine": "fsdp_core",
    }
    for axis, default in defaults.items():
        extra = "" if axis != "engine" else ", or module:attribute"
        parser.add_argument(
            f"--{axis}",
            default=default,
            help=f"one of {', '.join(AXES[axis])}{extra} (default {default})",
        )
    parser.add_argument("--world-size", type=int, default=2, help="gloo ranks (default 2)")
    parser.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds before giving up")
    parser.add_argument(
        "--json", default="fsdp-trace.json", metavar="PATH", help="trace file (Chrome JSON)"
    )
    parser.add_argument("--png", default="fsdp-trace.png", metavar="PATH", help="timeline image")
    parser.add_argument("--width", type=int, default=1400, help="PNG width in pixels")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    values = {axis: getattr(args, axis) for axis in AXES}
    bad = [
        f"--{axis} {value!r}"
        for axis, value in values.items()
        if value not in AXES[axis] and not (axis == "engine" and ":" in value)
    ]
    if bad or args.steps < 1 or args.world_size < 1:
        problem = ", ".join(bad) or "--steps and --world-size must be at least 1"
        print(f"fsdp-testing trace: invalid {problem}", file=sys.stderr)
        return 2
    config = Config(**values)
    print(f"fsdp-testing trace: {config.label}, {args.steps} steps on {args.world_size} ranks")
    ranks = _record(config, args.steps, args.world_size, args.timeout)
    if ranks is None:
        return 1
    trace = build_trace(ranks, config)
    with open(args.json, "w") as f:
        json.dump(trace, f)
    with open(args.png, "wb") as f:
        f.write(draw_timeline(ranks, config, width=args.width).png())
    for rank, data in sorted(ranks.items()):
        kinds: dict[str, int] = {}
        for call in data["collectives"]:
            kinds[call["kind"]] = kinds.get(call["kind"], 0) + 1
        events: dict[str, int] = {}
        for event in data["events"]:
            events[event["type"]] = events.get(event["type"], 0) + 1
        counts = ", ".join(f"{n} {k}" for k, n in sorted({**kinds, **events}.items()))
        print(f"rank {rank}: {counts or 'no events'}")
    print(f"wrote {args.json} ({len(trace['traceEvents'])} events) and {args.png}")
    return 0


def _record(
    config: Config, steps: int, world_size: int, timeout: float
) -> dict[int, dict[str, Any]] | None:
    from fsdp_testing._spec import DistSpec, Mode
    from fsdp_testing._task import Task
    from fsdp_testing.launcher import LaunchSettings, run_distributed

    from ._rankwork import TraceCase

    out_dir = tempfile.mkdtemp(prefix="fsdp-testing-trace-")
    try:
        task = Task(TraceCase(config, steps, out_dir), {}, test_id=f"trace {config.label}")
        spec = DistSpec(world_size, backend="gloo", mode=Mode.PROCESS, timeout=timeout)
        verdict = run_distributed(task, spec, LaunchSettings(timeout=timeout))
        if verdict.outcome != "passed":
            print(f"fsdp-testing trace: the ranks {verdict.outcome}:\n{verdict.message}")
            return None
        ranks = {}
        for rank in range(world_size):
            with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
                ranks[rank] = json.load(f)
        return ranks
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def _origin(ranks: dict[int, dict[str, Any]]) -> int:
    starts = [p["forward"][0] for data in ranks.values() for p in data["phases"]]
    starts += [c["start_ns"] for data in ranks.values() for c in data["collectives"]]
    return min(starts) if starts else 0


def _event_tid(kind: str) -> int:
    if kind in ("Unshard", "Reshard"):
        return _TIDS["unshard/reshard"]
    if "offload" in kind.lower():
        return _TIDS["offload"]
    return _TIDS["unshard/reshard"]


def build_trace(ranks: dict[int, dict[str, Any]], config: Config) -> dict[str, Any]:
    """The Chrome trace-event JSON object: one process per rank, one thread per category."""
    t0 = _origin(ranks)

    def us(ns: int) -> float:
        return (ns - t0) / 1000.0

    events: list[dict[str, Any]] = []
    for rank, data in sorted(ranks.items()):
        events.append(
            {"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}}
        )
        for name, tid in _TIDS.items():
            events.append(
                {"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": name}}
            )
        for phase in data["phases"]:
            for name in ("forward", "backward", "optimizer"):
                begin, end = phase[name]
                events.append(
                    {
                        "ph": "X",
                        "name": name,
                        "cat": "step",
                        "pid": rank,
                        "tid": _TIDS["step"],
                        "ts": us(begin),
                        "dur": (end - begin) / 1000.0,
                        "args": {"step": phase["step"]},
                    }
                )
        for call in data["collectives"]:
            events.append(
                {
                    "ph": "X",
                    "name": call["op"],
                    "cat": call["kind"],
                    "pid": rank,
                    "tid": _TIDS["collectives"],
                    "ts": us(call["start_ns"]),
                    "dur": (call["end_ns"] - call["start_ns"]) / 1000.0,
                    "args": {"bytes": call["bytes"], "group_size": call["group_size"]},
                }
            )
        for event in data["events"]:
            kind = event["type"]
            if kind == "Collective":
                continue  # the same call is on the collectives track, with its duration
            unit = event.get("unit", "")
            args = {k: v for k, v in event.items() if k not in ("type", "t_ns", "rank")}
            events.append(
                {
                    "ph": "i",
                    "s": "t",
                    "name": f"{kind.lower()} {unit or '<root>'}",
                    "cat": kind.lower(),
                    "pid": rank,
                    "tid": _event_tid(kind),
                    "ts": us(event["t_ns"]),
                    "args": args,
                }
            )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"tool": "fsdp-testing trace", "configuration": config.label},
    }


def draw_timeline(ranks: dict[int, dict[str, Any]], config: Config, *, width: int = 1400) -> Canvas:
    """One lane per rank with four rows: step phases, collectives, unshard (green, upper half)
    and reshard (red, lower half) marks, offload copies."""
    t0 = _origin(ranks)
    ends = [p["optimizer"][1] for data in ranks.values() for p in data["phases"]]
    ends += [c["end_ns"] for data in ranks.values() for c in data["collectives"]]
    span = max(max(ends, default=t0) - t0, 1)
    left, right, row_h, lane_gap, top = 120, 20, 16, 18, 64
    lane_h = 4 * row_h
    height = top + len(ranks) * (lane_h + lane_gap) + 40
    canvas = Canvas(max(width, 400), height)
    plot_w = canvas.width - left - right

    def x(ns: int) -> int:
        return left + int((ns - t0) * plot_w / span)

    canvas.text(8, 8, f"fsdp-testing trace: {config.label}")
    legend_x = 8
    for name in ("forward", "backward", "optimizer", "all_gather", "reduce_scatter",
                 "all_reduce", "unshard", "reshard", "offload"):  # fmt: skip
        canvas.rect(legend_x, 34, legend_x + 14, 46, _COLORS[name])
        legend_x = canvas.text(legend_x + 18, 35, name) + 14
    for index, (rank, data) in enumerate(sorted(ranks.items())):
        y = top + index * (lane_h + lane_gap)
        canvas.rect(left, y, left + plot_w, y + lane_h, (246, 246, 246))
        canvas.text(8, y + 2, f"rank {rank}")
        for row, label in enumerate(("step", "comm", "unit", "offload")):
            canvas.text(8 + 8, y + row * row_h + 3, label, (90, 90, 90), scale=1)
        for phase in data["phases"]:
            for name in ("forward", "backward", "optimizer"):
                begin, end = phase[name]
                canvas.rect(
                    x(begin), y + 1, max(x(end), x(begin) + 1), y + row_h - 1, _COLORS[name]
                )
        for call in data["collectives"]:
            color = _COLORS.get(call["kind"], (0, 0, 0))
            x0 = x(call["start_ns"])
            canvas.rect(x0, y + row_h + 1, max(x(call["end_ns"]), x0 + 1), y + 2 * row_h - 1, color)
        for event in data["events"]:
            kind = event["type"]
            x0 = x(event["t_ns"])
            if kind == "Unshard":
                canvas.rect(
                    x0, y + 2 * row_h + 1, x0 + 2, y + 2 * row_h + row_h // 2, _COLORS["unshard"]
                )
            elif kind == "Reshard":
                canvas.rect(
                    x0, y + 2 * row_h + row_h // 2, x0 + 2, y + 3 * row_h - 1, _COLORS["reshard"]
                )
            elif "offload" in kind.lower():
                canvas.rect(x0, y + 3 * row_h + 1, x0 + 2, y + 4 * row_h - 1, _COLORS["offload"])
    axis_y = top + len(ranks) * (lane_h + lane_gap)
    canvas.rect(left, axis_y, left + plot_w, axis_y + 1, (0, 0, 0))
    ticks = 5
    for i in range(ticks + 1):
        tx = left + i * plot_w // ticks
        canvas.rect(tx, axis_y, tx + 1, axis_y + 6, (0, 0, 0))
        canvas.text(max(0, tx - 20), axis_y + 10, f"{span * i / ticks / 1e6:.1f} ms", scale=1)
    return canvas
