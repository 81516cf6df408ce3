"""``fsdp-testing check``: the parity and communication matrix of a sharding engine on CPU ranks.

Every row trains a reference model sharded by the engine next to a data parallel reference on
gloo ranks of the warm pool, then reports loss and parameter parity, the collectives and bytes
of one step against the theoretical volume, peak resident memory per rank and time. The exit
status is 1 if any row mismatches or errors, so CI can run it as is.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import TYPE_CHECKING, Any

from ._checkpoint_row import checkpoint_configs, parse_reshard, run_checkpoint_rows
from ._matrix import DEFAULTS, HYBRID_GRID, Config, row_world_size
from ._options import OptionError, RowOptions, add_row_options, parse_rows, validate_output_path
from ._parallel import ParallelConfig
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


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "check",
        help="run the parity and communication matrix on CPU ranks",
        description=__doc__.splitlines()[0],
    )
    add_row_options(parser, one_value=False, defaults=DEFAULTS)
    parser.add_argument(
        "--comm",
        choices=("strict", "report"),
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
    try:  # see [Note: options before rows]
        rows_asked, reshard = _parse(args)
    except OptionError as error:
        print(f"fsdp-testing check: {error}", file=sys.stderr)
        return 2
    configs = rows_asked.configs
    world_size = rows_asked.world_size
    console = make_console()
    worlds = sorted({row_world_size(c, world_size) for c in configs})
    hybrid = [c for c in configs if c.hybrid]
    where = f"{world_size} gloo ranks"
    if rows_asked.mesh:
        where += f" (mesh {' x '.join(f'{name}={size}' for name, size in rows_asked.mesh)})"
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
        world_size=world_size,
        steps=args.steps,
        timeout=args.timeout,
        strict_comm=args.comm != "report",
        console=console,
    )
    if reshard is not None:  # see [Note: checkpoint rows]
        configs = checkpoint_configs(rows_asked.selection["engine"], reshard)
        rows += run_checkpoint_rows(configs, timeout=args.timeout, console=console)
    total = time.monotonic() - started
    print_results(console, rows, total)
    meta = {
        "world_size": world_size,
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


def _parse(args: argparse.Namespace) -> tuple[RowOptions, tuple[int, int] | None]:
    """The rows and the checkpoint rows' world sizes, every option validated.

    Raises:
        OptionError: the message names the option, the value and the fix.
    """
    rows = parse_rows(args, defaults=DEFAULTS, one_value=False)
    parallel = any(isinstance(c, ParallelConfig) for c in rows.configs)
    if parallel and args.comm is not None:
        raise OptionError(
            f"--comm {args.comm} with --parallelize {args.parallelize}: there is no theoretical "
            "volume of your own parallelization to compare with (its collectives are shown, "
            "not judged); leave --comm out"
        )
    reshard = None
    if args.checkpoint is not None:
        if parallel:
            raise OptionError(
                f"--checkpoint {args.checkpoint} with --parallelize {args.parallelize}: "
                "checkpoint rows resume an engine's DCP checkpoint; run them without "
                "--parallelize"
            )
        try:
            reshard = parse_reshard(args.checkpoint)
        except ValueError as error:
            raise OptionError(str(error)) from None
    for option, path in (("--json", args.json), ("--junit-xml", args.junit_xml)):
        if path:
            validate_output_path(option, path)
    return rows, reshard


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
    # The mesh coordinates whose shards differ: the same lines on every rank (a collective of
    # UserLockstep.details), shown after the first rank's divergences.
    details: list[str] = next((d["mesh_details"] for d in ranks.values() if d["mesh_details"]), [])
    for rank, data in sorted(ranks.items()):
        row.problems += [f"[rank {rank}] parity: {p}" for p in data["parity_failures"]]
        if data["parity_failures"]:
            row.problems += details
            details = []
    row.problems += details
    if isinstance(config, ParallelConfig):
        # Shown, not judged: a user's parallelization has no theory, and its ranks and steps
        # may differ by design (expert routing). See [Note: model-parallel rows].
        row.status = MISMATCH if row.problems else OK
        return row
    for rank, data in sorted(ranks.items()):
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
