"""``fsdp-testing trace``: a few training steps of one configuration as a Perfetto/Chrome trace
(JSON, open it at ui.perfetto.dev or chrome://tracing) and a PNG timeline, one lane per rank.

Each rank trains under :func:`fsdp_testing.recording.record_fsdp` and writes the recorder's own
export (:meth:`~fsdp_testing.recording.FSDPRecorder.export_chrome_trace`): every collective with
its duration, every unshard and reshard of a unit with its reason, post-backwards, sharded
forwards and (fsdp_core) offload copies, for every engine. The command merges the ranks' traces,
adds each rank's step phases (forward, backward, optimizer) on a track of their own, and draws
the PNG from the merged trace with matplotlib (``_plot.draw_timeline``; the ``plot`` extra).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
from collections import Counter
from typing import Any

from ._matrix import Config, row_world_size
from ._options import OptionError, add_row_options, parse_rows, validate_output_path
from ._parallel import ParallelConfig
from ._plot import draw_timeline, require_matplotlib, save_png

__all__ = ["TraceSteps", "add_parser", "draw_timeline", "merge_traces", "run"]

#: The trace thread of the step phases; the recorder's tracks start at 1.
_PHASE_TID = 0
_PHASES = ("forward", "backward", "optimizer")


#: ``trace``'s axes: one value each.
TRACE_DEFAULTS = {
    "model": ("transformer",),
    "strategy": ("FULL_SHARD",),
    "prefetch": ("BACKWARD_PRE",),
    "offload": ("off",),
    "mp": ("off",),
    "engine": ("fsdp_core",),
}

#: ``check``'s options that do not apply to ``trace``, and why.
CHECK_ONLY = {
    "comm": "trace records a timeline and compares nothing with the theoretical volume",
    "checkpoint": "checkpoint rows are check's (fsdp-testing check --checkpoint FROM:TO)",
    "junit_xml": "trace writes no test report; its files are --json (the trace) and --png",
}


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "trace",
        help="write a Perfetto/Chrome trace and a PNG timeline of a few steps",
        description=__doc__.splitlines()[0],
    )
    add_row_options(parser, one_value=True, defaults=TRACE_DEFAULTS)
    parser.add_argument(
        "--json", default="fsdp-trace.json", metavar="PATH", help="trace file (Chrome JSON)"
    )
    parser.add_argument(
        "--png",
        default="fsdp-trace.png",
        metavar="PATH",
        help="timeline image, drawn with matplotlib (the 'plot' extra)",
    )
    parser.add_argument(
        "--no-png", action="store_true", help="write only the JSON trace (no matplotlib needed)"
    )
    parser.add_argument(
        "--width", type=int, default=1400, help="PNG width in pixels (at least 400)"
    )
    for option in CHECK_ONLY:  # refused by name in run, rather than "unrecognized"
        parser.add_argument(f"--{option.replace('_', '-')}", help=argparse.SUPPRESS)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:  # see [Note: options before rows]
        config, world = _parse(args)
    except OptionError as error:
        print(f"fsdp-testing trace: {error}", file=sys.stderr)
        return 2
    if not args.no_png:
        try:
            require_matplotlib(f"fsdp-testing trace --png {args.png}")
        except ImportError as error:
            print(
                f"fsdp-testing trace: {error} Or pass --no-png to write only the JSON trace.",
                file=sys.stderr,
            )
            return 2
    print(f"fsdp-testing trace: {config.label}, {args.steps} steps on {world} ranks")
    ranks = _record(config, args.steps, world, args.timeout)
    if ranks is None:
        return 1
    trace = merge_traces(ranks, config)
    with open(args.json, "w") as f:
        json.dump(trace, f)
    if not args.no_png:
        save_png(draw_timeline(trace, width=args.width), args.png)
    for rank, counts in sorted(_counts(trace).items()):
        listed = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
        print(f"rank {rank}: {listed or 'no events'}")
    picture = "" if args.no_png else f" and {args.png}"
    print(f"wrote {args.json} ({len(trace['traceEvents'])} events){picture}")
    return 0


def _parse(args: argparse.Namespace) -> tuple[Config, int]:
    """The one configuration to trace and its world size, every option validated.

    Raises:
        OptionError: the message names the option, the value and the fix.
    """
    for option, why in CHECK_ONLY.items():
        value = getattr(args, option)
        if value is not None:
            flag = "--" + option.replace("_", "-")
            raise OptionError(f"{flag} {value}: check only; {why}")
    if args.width < 400:
        raise OptionError(f"--width {args.width}: give at least 400 pixels")
    rows = parse_rows(args, defaults=TRACE_DEFAULTS, one_value=True)
    validate_output_path("--json", args.json)
    if not args.no_png:
        validate_output_path("--png", args.png)
    (config,) = rows.configs
    return config, row_world_size(config, rows.world_size)  # hybrid: [Note: hybrid rows]


@dataclasses.dataclass
class TraceSteps:
    """A few training steps of one configuration under the recorder, run on every rank.

    Each rank writes ``rank{N}.json`` (the recorder's Chrome trace of its records) and
    ``rank{N}.phases.json`` (its step phases, ``[step, name, begin_us, end_us]`` on the
    recorder's clock).

    Args:
        config: the configuration (one value per axis).
        steps: training steps.
        out_dir: where each rank writes its files.
    """

    config: Config
    steps: int
    out_dir: str

    def run_on_rank(self, ctx: Any) -> None:
        from fsdp_testing.engines import has_nested_units
        from fsdp_testing.recording import record_comms, record_fsdp

        # The same model, reference and optimizer as a ``check`` row.
        from ._rankwork import make_setup

        models = make_setup(self.config, ctx)
        phases: list[list[Any]] = []
        # A user's mesh names the groups of its collectives ([Note: model-parallel rows]).
        mesh = models.mesh if isinstance(self.config, ParallelConfig) else None
        engine = models.engine
        if engine is not None and has_nested_units(engine):
            recorder = record_fsdp(models.sharded, engine=engine, mesh=mesh)
        else:  # a root-only engine or a user's parallelization: collectives, no units
            recorder = record_comms(mesh=mesh)
        with recorder:
            for step in range(self.steps):
                if step:
                    recorder.next_step()
                phases += self._step(models, step)
        recorder.export_chrome_trace(os.path.join(self.out_dir, f"rank{ctx.rank}.json"))
        with open(os.path.join(self.out_dir, f"rank{ctx.rank}.phases.json"), "w") as f:
            json.dump(phases, f)

    @staticmethod
    def _step(models: Any, step: int) -> list[list[Any]]:
        from fsdp_testing.recording import now_us

        t0 = now_us()
        models.optim.zero_grad()
        loss = models.forward(step)
        t1 = now_us()
        models.backward(loss)
        t2 = now_us()
        models.optim.step()
        t3 = now_us()
        bounds = (t0, t1, t2, t3)
        return [[step, name, bounds[i], bounds[i + 1]] for i, name in enumerate(_PHASES)]


def _record(
    config: Config, steps: int, world_size: int, timeout: float
) -> dict[int, dict[str, Any]] | None:
    from fsdp_testing._launch.spec import DistSpec, Mode
    from fsdp_testing._protocol import Task
    from fsdp_testing.launcher import LaunchSettings, run_distributed

    out_dir = tempfile.mkdtemp(prefix="fsdp-testing-trace-")
    try:
        task = Task(TraceSteps(config, steps, out_dir), {}, test_id=f"trace {config.label}")
        spec = DistSpec(world_size, backend="gloo", mode=Mode.PROCESS, timeout=timeout)
        verdict = run_distributed(task, spec, LaunchSettings(timeout=timeout))
        if verdict.outcome != "passed":
            print(f"fsdp-testing trace: the ranks {verdict.outcome}:\n{verdict.message}")
            return None
        ranks = {}
        for rank in range(world_size):
            with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
                trace = json.load(f)
            with open(os.path.join(out_dir, f"rank{rank}.phases.json")) as f:
                ranks[rank] = {"events": trace["traceEvents"], "phases": json.load(f)}
        return ranks
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def merge_traces(ranks: dict[int, dict[str, Any]], config: Config | None = None) -> dict[str, Any]:
    """One Chrome trace from every rank's recorder export and step phases.

    Args:
        ranks: per rank, ``events`` (the ``traceEvents`` of
            :meth:`~fsdp_testing.recording.FSDPRecorder.export_chrome_trace`) and ``phases``
            (``[step, name, begin_us, end_us]`` lists, see :class:`TraceSteps`).
        config: the configuration, named in the trace's ``otherData`` (default none).

    Returns:
        the trace: the recorders' events and a "step phases" track per rank, with time 0 at the
        first event of any rank.
    """
    starts = [e["ts"] for data in ranks.values() for e in data["events"] if e["ph"] != "M"]
    starts += [p[2] for data in ranks.values() for p in data["phases"]]
    origin = min(starts, default=0.0)
    events: list[dict[str, Any]] = []
    for rank, data in sorted(ranks.items()):
        for event in data["events"]:
            events.append(event if event["ph"] == "M" else {**event, "ts": event["ts"] - origin})
        events.append(
            {"name": "thread_name", "ph": "M", "pid": rank, "tid": _PHASE_TID,
             "args": {"name": "step phases"}}
        )  # fmt: skip
        for step, name, begin, end in data["phases"]:
            events.append(
                {"name": name, "cat": "step", "ph": "X", "pid": rank, "tid": _PHASE_TID,
                 "ts": begin - origin, "dur": max(end - begin, 0.001), "args": {"step": step}}
            )  # fmt: skip
    other = {"tool": "fsdp-testing trace"}
    if config is not None:
        other["configuration"] = config.label
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def _counts(trace: dict[str, Any]) -> dict[int, Counter[str]]:
    counts: dict[int, Counter[str]] = {}
    for event in trace["traceEvents"]:
        if event["ph"] == "M" or event.get("cat") in ("step", "forward"):
            continue
        key = event["args"]["op"] if event["cat"] == "collective" else event["cat"]
        counts.setdefault(event["pid"], Counter())[key] += 1
    return counts
