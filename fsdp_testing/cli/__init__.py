"""The ``fsdp-testing`` command line (also ``python -m fsdp_testing``).

Subcommands, one module each, imported only when the command line runs (the pytest plugin never
imports this package):

- ``check`` (``check.py``): the parity and communication matrix of a sharding engine.
- ``trace`` (``trace.py``): a Perfetto/Chrome trace and a PNG timeline of a few steps.
- ``plan`` (``plan.py``): what a configuration costs per rank, planned on fake tensors in a
  fake world without running it (``_plan_*.py``).

``check`` and ``trace`` share their options (``_options.py``: parsed and validated before any
row runs), the rows' matrix (``_matrix.py``), what runs on the ranks (``_rankwork.py``) and a
user's own model-parallel rows (``_parallel.py``: ``--parallelize`` on check_parity's trainer).

Shared by them (and the benchmarks): ``_render.py`` writes to the terminal (rich tables, a live
progress bar and colour on a terminal, plain lines elsewhere), ``_table.py`` lays out the
check's results, ``_report.py`` writes its JSON and JUnit reports, and ``_plot.py`` draws the
pictures with matplotlib (the ``plot`` extra).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    from . import check, plan, trace

    parser = argparse.ArgumentParser(
        prog="fsdp-testing",
        description="Check and trace sharded training on CPU ranks (gloo).",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    check.add_parser(subparsers)
    trace.add_parser(subparsers)
    plan.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).
    """
    args = _parser().parse_args(argv)
    # As ``python -m``: a user's module:attribute (--engine, --model) may live in the current
    # directory; ranks inherit this path.
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return int(args.run(args))
    finally:
        from fsdp_testing.launcher import shutdown

        shutdown()
