"""``fsdp-testing check``: the parity and communication matrix of a sharding engine on CPU ranks.

Every row trains a reference model sharded by the engine next to a data parallel reference on
gloo ranks of the warm pool, then reports loss and parameter parity, the collectives and bytes
of one step against the theoretical volume, peak resident memory per rank and time. The exit
status is 1 if any row mismatches or errors, so CI can run it as is.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from typing import TYPE_CHECKING, Any

from ._checkpoint_row import checkpoint_configs, parse_reshard, run_checkpoint_rows
from ._matrix import AXES, DEFAULTS, HYBRID_GRID, Config, build_matrix, parse_axis, row_world_size
from ._render import ProgressDisplay, echo, make_console
from ._report import (
    ERROR,
    MISMATCH,
    OK,
    UNAVAILABLE,
    RowResult,
    comm_problems,
    group_problems,
    write_json,
    write_junit,
)
from ._table import print_results

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["add_parser", "run", "run_matrix"]


_NAMED_HELP = {
    "engine": "; or module:attribute naming an engine",
    "model": "; or package.module:callable[:k=v,...] returning an nn.Module",
}


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "check",
        help="run the parity and communication matrix on CPU ranks",
        description=__doc__.splitlines()[0],
    )
    for axis, values in AXES.items():
        parser.add_argument(
            f"--{axis}",
            default=",".join(DEFAULTS[axis]),
            metavar="A,B",
            help=f"values: {', '.join(values)}, all (default: {','.join(DEFAULTS[axis])})"
            + _NAMED_HELP.get(axis, ""),
        )
    parser.add_argument(
        "--input-shape",
        action="append",
        metavar="SHAPE[:DTYPE]",
        help="package.module:callable models without get_input: one positional input, e.g. "
        "8,1024 or 8,512:int64 (repeat for several)",
    )
    parser.add_argument(
        "--wrap",
        metavar="CLASS,...",
        help="package.module:callable models: module classes that become units (default: "
        "the root only)",
    )
    parser.add_argument("--world-size", type=int, default=2, help="gloo ranks (default 2)")
    parser.add_argument("--steps", type=int, default=3, help="training steps per row (default 3)")
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="seconds per row before it counts as hung"
    )
    parser.add_argument(
        "--comm",
        choices=("strict", "report"),
        default="strict",
        help="strict (default): communication that differs from the theoretical volume is a "
        "mismatch; report: show it without failing (e.g. to compare torch's engines)",
    )
    parser.add_argument(
        "--checkpoint",
        metavar="FROM:TO",
        help="also run a checkpoint row per engine: save with DCP at FROM ranks, resume at TO "
        "ranks, compare the losses with the uninterrupted run's (e.g. 4:2)",
    )
    parser.add_argument("--json", metavar="PATH", help="write a JSON report")
    parser.add_argument("--junit-xml", metavar="PATH", help="write a JUnit XML report")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        selection = {axis: parse_axis(axis, getattr(args, axis)) for axis in AXES}
    except ValueError as error:
        print(f"fsdp-testing check: {error}", file=sys.stderr)
        return 2
    if args.world_size < 1 or args.steps < 1:
        print("fsdp-testing check: --world-size and --steps must be at least 1", file=sys.stderr)
        return 2
    try:
        reshard = parse_reshard(args.checkpoint) if args.checkpoint else None
    except ValueError as error:
        print(f"fsdp-testing check: {error}", file=sys.stderr)
        return 2
    try:
        user_models = _validate_user_models(selection["model"], args)
    except ValueError as error:
        print(f"fsdp-testing check: {error}", file=sys.stderr)
        return 2
    configs = [
        dataclasses.replace(
            c,
            inputs=tuple(args.input_shape or ()),
            units=tuple(w.strip() for w in (args.wrap or "").split(",") if w.strip()),
        )
        if c.model in user_models
        else c
        for c in build_matrix(selection)
    ]
    console = make_console()
    worlds = sorted({row_world_size(c, args.world_size) for c in configs})
    hybrid = [c for c in configs if c.hybrid]
    where = f"{args.world_size} gloo ranks"
    if hybrid:  # see [Note: hybrid rows]
        grid = f"{HYBRID_GRID[0] * HYBRID_GRID[1]} gloo ranks ({HYBRID_GRID[0]} x {HYBRID_GRID[1]})"
        where = grid if len(hybrid) == len(configs) else f"{where}, hybrid rows on {grid}"
    echo(
        console,
        f"fsdp-testing check: {len(configs)} configurations on {where}, {args.steps} steps each",
    )
    started = time.monotonic()
    rows = run_matrix(
        configs,
        world_size=args.world_size,
        steps=args.steps,
        timeout=args.timeout,
        strict_comm=args.comm == "strict",
        console=console,
    )
    if reshard is not None:  # see [Note: checkpoint rows]
        configs = checkpoint_configs(selection["engine"], reshard)
        rows += run_checkpoint_rows(configs, timeout=args.timeout, console=console)
    total = time.monotonic() - started
    print_results(console, rows, total)
    meta = {
        "world_size": args.world_size,
        "world_sizes": worlds,
        "steps": args.steps,
        "time_s": round(total, 3),
    }
    if args.json:
        write_json(args.json, rows, meta)
    if args.junit_xml:
        write_junit(args.junit_xml, rows, total)
    if rows and all(r.status == UNAVAILABLE for r in rows):
        print("fsdp-testing check: no configuration could run", file=sys.stderr)
        return 1
    return 1 if any(r.failed for r in rows) else 0


def _validate_user_models(models: tuple[str, ...], args: argparse.Namespace) -> set[str]:
    """The user's models among ``--model`` values (``package.module:callable``), checked in
    this process (importable, an ``nn.Module``, inputs given or its own ``get_input``), so a
    mistake is an option error rather than a failed row.

    Raises:
        ValueError: the message names the option, the value and the fix.
    """
    import torch.nn as nn

    from fsdp_testing.models.user import load_factory

    from ._matrix import MODELS
    from ._plan_args import parse_input_shape, parse_model

    inputs = [parse_input_shape(text) for text in args.input_shape or ()]
    user = {m for m in models if m not in MODELS}
    if not user and (args.input_shape or args.wrap):
        given = "--input-shape" if args.input_shape else "--wrap"
        raise ValueError(
            f"{given} is for --model package.module:callable; reference models make their own "
            "units and inputs"
        )
    for text in sorted(user):
        spec = parse_model(text)
        factory = load_factory(spec.module or "", spec.attribute or "", option=f"--model {text}")
        try:
            module = factory(**dict(spec.kwargs))
        except TypeError as error:
            raise ValueError(
                f"--model {text}: calling {spec.attribute}() failed ({error}); give a callable "
                "that builds the model from size arguments only (package.module:callable:k=v)"
            ) from None
        if not isinstance(module, nn.Module):
            raise ValueError(
                f"--model {text}: {spec.attribute}() returned {type(module).__name__}, not an "
                "nn.Module"
            )
        has_workload = all(
            callable(getattr(module, m, None)) for m in ("get_input", "get_loss", "run_backward")
        )
        if not has_workload and not inputs:
            raise ValueError(
                f"--model {text}: the model has no get_input(device); give its inputs with "
                "--input-shape (once per positional input), e.g. --input-shape 8,1024 or "
                "8,512:int64"
            )
    return user


def run_matrix(
    configs: list[Config],
    *,
    world_size: int,
    steps: int,
    timeout: float,
    strict_comm: bool = True,
    console: Console | None = None,
) -> list[RowResult]:
    """Run each configuration as one distributed task on the warm pool, with progress.

    Args:
        configs: the rows.
        world_size: gloo ranks (hybrid rows: always the 2 x 2 grid, [Note: hybrid rows]).
        steps: training steps per row.
        timeout: seconds per row.
        strict_comm: communication that differs from the theory makes the row a mismatch
            (default True); otherwise it is reported as a note.
        console: where progress goes (default: stdout; a live bar on a terminal, one plain
            line per row elsewhere).
    """
    from fsdp_testing._launch.spec import DistSpec, Mode
    from fsdp_testing._protocol import Task
    from fsdp_testing.launcher import LaunchSettings, run_distributed

    from ._rankwork import CheckCase

    rows = []
    with ProgressDisplay(len(configs), console) as progress:
        for config in configs:
            world = row_world_size(config, world_size)
            spec = DistSpec(world, backend="gloo", mode=Mode.PROCESS, timeout=timeout)
            progress.start(config.label)
            out_dir = tempfile.mkdtemp(prefix="fsdp-testing-check-")
            begin = time.monotonic()
            try:
                task = Task(CheckCase(config, steps, out_dir), {}, test_id=config.label)
                verdict = run_distributed(task, spec, LaunchSettings(timeout=timeout))
                ranks = _read_ranks(out_dir, world)
            finally:
                shutil.rmtree(out_dir, ignore_errors=True)
            row = _merge(config, verdict.outcome, verdict.message, ranks, strict_comm)
            row.time_s = time.monotonic() - begin
            note = row.problems[0][:100] if row.problems and row.status != OK else ""
            progress.finish(config.label, row.status, row.time_s, note)
            rows.append(row)
    return rows


def _read_ranks(out_dir: str, world_size: int) -> dict[int, dict[str, Any]]:
    found = {}
    for rank in range(world_size):
        path = os.path.join(out_dir, f"rank{rank}.json")
        if os.path.exists(path):
            with open(path) as f:
                found[rank] = json.load(f)
    return found


def _merge(
    config: Config,
    outcome: str,
    message: str,
    ranks: dict[int, dict[str, Any]],
    strict_comm: bool,
) -> RowResult:
    row = RowResult(config, OK)
    row.peak_rss = [ranks[r]["peak_rss"] for r in sorted(ranks)]
    row.rss_start = [ranks[r]["rss_start"] for r in sorted(ranks)]
    if outcome != "passed" or not ranks:
        row.status = ERROR
        row.problems = (message or f"the ranks' outcome: {outcome}").splitlines()[:40]
        return row
    if any(data["status"] == UNAVAILABLE for data in ranks.values()):
        row.status = UNAVAILABLE
        row.problems = sorted({d["message"] for d in ranks.values() if "message" in d})
        return row
    first = ranks[min(ranks)]
    row.loss_diff = max(d["loss_diff"] for d in ranks.values())
    diffs = [d["param_diff"] for d in ranks.values() if d["param_diff"] is not None]
    row.param_diff = max(diffs) if diffs else None
    row.step_s = max(d["step_s"] for d in ranks.values() if d["step_s"] is not None)
    row.comm = {k: (v[0], v[1]) for k, v in first["comm"].items()}
    row.layout = first["layout"]
    if first["theory"] is not None:
        row.theory = {k: (v[0], v[1]) for k, v in first["theory"].items()}
    row.comm_groups = {
        k: {g: (v[0], v[1]) for g, v in d.items()} for k, d in first["comm_groups"].items()
    }
    # The same list on every rank (Lockstep.explain agrees on it).
    row.causes = next((d["likely_causes"] for d in ranks.values() if d["likely_causes"]), [])
    for rank, data in sorted(ranks.items()):
        row.problems += [f"[rank {rank}] parity: {p}" for p in data["parity_failures"]]
        if data["comm"] != first["comm"] or data["theory"] != first["theory"]:
            row.problems.append(
                f"[rank {rank}] communication differs from rank {min(ranks)}: {data['comm']} "
                f"against {first['comm']}"
            )
        if not data["comm_consistent"]:
            row.problems.append(f"[rank {rank}] collectives differ between steps 2..N")
        # Per group, each rank against its own groups ([Note: hybrid rows]); the totals were
        # compared above, so this adds only what they cannot see.
        found = group_problems(data["comm_groups"], data["theory_groups"])
        if found and not comm_problems(row.comm, row.theory):
            (row.problems if strict_comm else row.notes).extend(
                f"[rank {rank}] {problem}" for problem in found
            )
    if strict_comm:
        row.problems += comm_problems(row.comm, row.theory)
    else:
        row.notes += comm_problems(row.comm, row.theory)
    if row.problems:
        row.status = MISMATCH
    return row
