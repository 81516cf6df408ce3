"""``fsdp-testing plan``: what a configuration costs each rank, without running it.

The model is built and sharded on fake tensors as one rank of a fake world of ``--world-size``
ranks (no data, no allocation; [Note: a fake world] in ``_plan_build.py``), steps once to warm
up and once counted (``_plan_memory.py``), and every rank's parameters, gradients, optimizer
state, padding, empty units, peak and communication per step follow from that rank's units
(``_plan_cost.py``). Communication is the engine's theoretical volume (what ``check`` compares
the wire with, order tags included). Prints a table with one row per class of identical ranks;
``--json PATH`` writes every rank. Exit status 2 for a bad option, with what to change.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import TYPE_CHECKING, Any

from ._matrix import AXES, add_user_model_options
from ._plan_args import BACKENDS, ENGINES, OPTIMIZERS, PlanError, PlanRequest, parse_request

if TYPE_CHECKING:
    from ._plan_cost import Measured, RankCost

__all__ = ["Plan", "add_parser", "make_plan", "plan_comm", "run"]


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="what a configuration costs per rank, planned on fake tensors without running it",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument(
        "--model",
        required=True,
        metavar="NAME[:k=v,...]",
        help="a reference model with optional size arguments (transformer:d_model=2048,nhead=16,"
        "num_encoder_layers=10,...), or package.module:callable[:k=v,...] returning an nn.Module",
    )
    parser.add_argument(
        "--world-size", type=int, metavar="N", help="ranks (default: R x S of --mesh, else 2)"
    )
    parser.add_argument("--mesh", metavar="RxS", help="hybrid: R replicas of shard groups of S")
    parser.add_argument(
        "--strategy",
        metavar="NAME",
        help=f"{', '.join(AXES['strategy'])} (default FULL_SHARD; HYBRID_SHARD with --mesh)",
    )
    for option, default in (("prefetch", "BACKWARD_PRE"), ("mp", "off"), ("offload", "off")):
        parser.add_argument(
            f"--{option}",
            default=default,
            help=f"{', '.join(AXES[option])} (default {default})",
        )
    parser.add_argument(
        "--engine", default="fsdp_core", help=f"{', '.join(ENGINES)} (default fsdp_core)"
    )
    parser.add_argument(
        "--optim",
        default="adam",
        help=f"the optimizer whose state optim_bytes counts: {', '.join(OPTIMIZERS)} "
        "(default adam)",
    )
    parser.add_argument(
        "--backend",
        default="gloo",
        help=f"{', '.join(BACKENDS)}: whose collective buffers the peak counts (default gloo)",
    )
    add_user_model_options(parser)
    parser.add_argument("--json", metavar="PATH", help="write every rank's numbers as JSON")
    parser.set_defaults(run=run)


@dataclasses.dataclass(frozen=True)
class Plan:
    """A planned configuration. See ``_plan_cost.py`` for how each number is made.

    Args:
        request: the configuration.
        units: units of the sharded model.
        numel: parameters (elements), and ``trainable`` of them.
        trainable: trainable parameters (elements).
        comm_calls: collectives per step per family (every rank alike).
        comm_groups: per family, the sizes of the groups it runs in.
        measured: what the played rank held in its counted step.
        ranks: every rank's numbers, by rank.
        notes: what the plan could not square (the fake step's collectives against the
            theory).
        seconds: how long planning took.
    """

    request: PlanRequest
    units: int
    numel: int
    trainable: int
    comm_calls: dict[str, int]
    comm_groups: dict[str, tuple[int, ...]]
    measured: Measured
    ranks: tuple[RankCost, ...]
    notes: tuple[str, ...]
    seconds: float

    def as_json(self) -> dict[str, Any]:
        """``{"world_size": N, "ranks": {"R": {...}}}`` as the SPEC gives it."""
        return {
            "world_size": self.request.world_size,
            "ranks": {str(rank): cost.as_json() for rank, cost in enumerate(self.ranks)},
        }


def _resident(built: Any) -> list[Any]:
    """Every tensor a rank holds between steps: parameters, gradients, optimizer state,
    buffers."""
    params = list(built.model.parameters())
    state = [v for s in built.optim.state.values() for v in s.values() if hasattr(v, "shape")]
    grads = [p.grad for p in params if p.grad is not None]
    return params + grads + state + list(built.model.buffers())


def _bytes(tensors: Any) -> int:
    from ._plan_memory import storage_of

    seen = {id(s): s.nbytes() for s in (storage_of(t) for t in tensors)}
    return sum(seen.values())


def _theory(built: Any, request: PlanRequest) -> dict[str, tuple[int, int]]:
    """The engine's theoretical volume per step, ``family -> (calls, bytes)``: what ``check``
    compares the wire with (``engine.theoretical_volume``, from the units' views)."""
    full_shard = request.strategy in ("FULL_SHARD", "HYBRID_SHARD")
    volume = built.engine.theoretical_volume(built.model, full_shard=full_shard)
    return volume.totals() if volume is not None else {}


def plan_comm(request: PlanRequest) -> dict[str, tuple[int, int]]:
    """The communication :func:`make_plan` gives, ``family -> (calls, bytes)`` per step,
    without its steps: the model is sharded in the same fake world and runs one forward
    without gradients (which decides the root, as the first forward of training does).

    Raises:
        PlanError: as :func:`make_plan`.
    """
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ._plan_build import build, fake_world

    with fake_world(request.world_size, request.rank):
        built = build(request, FakeTensorMode())
        with built.stepping(), torch.no_grad():
            built.model(*built.workload.get_input(built.device))
        return _theory(built, request)


def make_plan(request: PlanRequest) -> Plan:
    """Plan ``request``: build, shard and step its model on fake tensors as rank
    ``request.rank`` of a fake world, and compute every rank's costs.

    Raises:
        PlanError: the request cannot be planned (the message says what to change).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fsdp_core import events, unit_views

    from ._measure import CollectiveLog
    from ._plan_build import build, fake_world, train_step
    from ._plan_cost import COMM_FAMILIES, Measured, rank_costs
    from ._plan_memory import StorageCounter

    begin = time.perf_counter()
    mode = FakeTensorMode()
    with fake_world(request.world_size, request.rank):
        built = build(request, mode)
        with built.stepping():
            train_step(built)  # lazy init, the units' order, the optimizer state
            counter, log = StorageCounter(backend=request.backend), CollectiveLog()
            counter.hold(_resident(built))
            with events.subscribe(counter.on_event), log.watching(), counter:
                train_step(built, counter)
        params = list(built.model.parameters())
        measured = Measured(
            param_bytes=_bytes(params),
            grad_bytes=_bytes(p.grad for p in params if p.grad is not None),
            optim_bytes=_bytes(
                v for s in built.optim.state.values() for v in s.values() if hasattr(v, "shape")
            ),
            buffer_bytes=_bytes(built.model.buffers()),
            peak_bytes=counter.peak,
            end_bytes=counter.alive,
            peak_at=counter.peak_at,
            max_units_unsharded=counter.max_units_unsharded,
        )
        views = unit_views(built.model)
        theory = _theory(built, request)
        sent = log.totals()
    notes = [
        f"the fake step sent {family} {sent.get(family, (0, 0))} (calls, bytes) where the "
        f"theory says {theory.get(family, (0, 0))}"
        for family in COMM_FAMILIES
        if sent.get(family, (0, 0)) != theory.get(family, (0, 0))
    ]
    groups = {
        "all_gather": tuple(sorted({v.shard_size for v in views if v.shard_size > 1})),
        "reduce_scatter": tuple(sorted({v.shard_size for v in views if v.shard_size > 1})),
        "all_reduce": tuple(sorted({v.replicate_size for v in views if v.replicate_size > 1})),
    }
    ranks = rank_costs(
        views,
        world_size=request.world_size,
        played=request.rank,
        measured=measured,
        optim=request.optim,
        comm={family: size for family, (_, size) in theory.items()},
    )
    return Plan(
        request=request,
        units=len(views),
        numel=sum(p.numel for v in views for p in v.params),
        trainable=sum(p.numel for v in views for p in v.params if p.requires_grad),
        comm_calls={family: calls for family, (calls, _) in theory.items()},
        comm_groups=groups,
        measured=measured,
        ranks=tuple(ranks),
        notes=tuple(notes),
        seconds=time.perf_counter() - begin,
    )


def run(args: argparse.Namespace) -> int:
    try:
        request = parse_request(args)
        plan = make_plan(request)
    except PlanError as error:
        print(f"fsdp-testing plan: {error}", file=sys.stderr)
        return 2
    from ._plan_render import print_plan
    from ._render import make_console

    print_plan(make_console(), plan)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(plan.as_json(), f, indent=1)
    return 0
