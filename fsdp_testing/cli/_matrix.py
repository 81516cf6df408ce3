"""The configuration matrix of ``fsdp-testing check``: axes, their values and one row's config.

Nothing here imports torch, so option parsing and ``--help`` stay fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools

__all__ = [
    "AXES",
    "DEFAULTS",
    "HYBRID_GRID",
    "HYBRID_STRATEGIES",
    "MODELS",
    "Config",
    "add_user_model_options",
    "build_matrix",
    "parse_axis",
    "row_world_size",
]

#: Reference models by command-line name: (class in ``fsdp_testing.models``, reference kind).
#: ``"ddp"`` is DistributedDataParallel; ``"self"`` a model that averages its own gradients
#: (per-rank experts must not be synchronized by DDP).
MODELS: dict[str, tuple[str, str]] = {
    "nested": ("NestedWrappedModule", "ddp"),
    "always_wrap": ("AlwaysWrapNestedWrappedModule", "ddp"),
    "transformer": ("TransformerWithSharedParams", "ddp"),
    "nonuniform": ("NonUniformReqGradNWM", "ddp"),
    "moe": ("MixtureOfExperts", "self"),
}


def add_user_model_options(parser: argparse.ArgumentParser) -> None:
    """``--input-shape`` and ``--wrap``: what a ``package.module:callable`` model needs beyond
    itself (``check``, ``trace`` and ``plan`` take them alike)."""
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


#: Every axis with the values it accepts.
AXES: dict[str, tuple[str, ...]] = {
    "model": tuple(MODELS),
    "strategy": ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"),
    "prefetch": ("none", "BACKWARD_PRE", "BACKWARD_POST"),
    "offload": ("off", "on"),
    "mp": ("off", "bf16", "fp16", "bf16/fp32", "fp16/fp32"),
    "engine": (
        "fsdp_core",
        "fsdp_core_fully_shard",
        "fsdp_core_graph",
        "torch_fsdp1",
        "torch_fsdp2",
    ),
}

#: Hybrid sharding (HSDP) strategies: their rows run at world size 4 as a 2 x 2 grid of ranks
#: whatever ``--world-size`` says. See [Note: hybrid rows] in ``_hybrid.py``.
HYBRID_STRATEGIES = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")

#: The hybrid rows' grid: (replicate groups, shard group size); mesh dims (replicate, shard).
HYBRID_GRID = (2, 2)

#: The default matrix (180 rows, about half a minute on two CPU cores): every model, the three
#: single-group strategies, every prefetch mode and offload setting, in full precision and in
#: bf16 with fp32 reduction. Hybrid rows (4 ranks each) are asked for with ``--strategy``.
DEFAULTS: dict[str, tuple[str, ...]] = {
    "model": ("nested", "always_wrap", "transformer", "nonuniform", "moe"),
    "strategy": ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"),
    "prefetch": AXES["prefetch"],
    "offload": ("off", "on"),
    "mp": ("off", "bf16/fp32"),
    "engine": ("fsdp_core",),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """One row of the matrix.

    Args:
        model: a key of :data:`MODELS`, or ``package.module:callable[:k=v,...]`` naming a
            user's model.
        strategy: a ``ShardingStrategy`` member name.
        prefetch: a ``BackwardPrefetch`` member name or ``"none"``.
        offload: ``"on"`` offloads parameters to the CPU (``CPUOffload(offload_params=True)``).
        mp: ``"off"``, or the dtypes of a ``MixedPrecision`` policy: ``"bf16"`` computes and
            reduces in bf16, ``"bf16/fp32"`` computes in bf16 and reduces in fp32.
        engine: a registered engine name, or ``module:attribute`` naming an engine object or
            class (for engines outside the registry, e.g. a deliberately broken one in a test).
        inputs: a user's model: ``--input-shape`` values, one per positional input.
        units: a user's model: ``--wrap`` class names, the submodules that become units.
    """

    model: str
    strategy: str
    prefetch: str
    offload: str
    mp: str
    engine: str
    inputs: tuple[str, ...] = ()
    units: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        """One line naming every axis, as shown in the table and the reports."""
        return (
            f"{self.model} {self.strategy} {self.prefetch} offload={self.offload} mp={self.mp} "
            f"{self.engine_name}"
        )

    @property
    def hybrid(self) -> bool:
        """A hybrid sharding row (4 ranks, 2 x 2)."""
        return self.strategy in HYBRID_STRATEGIES

    @property
    def engine_name(self) -> str:
        return self.engine.rpartition(":")[2] if ":" in self.engine else self.engine

    @property
    def engine_title(self) -> str:
        """What runs the row, as the terminal table's title says it."""
        return f"engine: {self.engine_name}"

    @property
    def cell(self) -> str | None:
        """The terminal table's configuration cell, where it is not the engine axes."""
        return None


def parse_axis(axis: str, text: str) -> tuple[str, ...]:
    """Parse ``--AXIS a,b,c`` (``all`` for every value).

    Raises:
        ValueError: a value is not accepted on this axis; the message lists the valid ones.
    """
    values = _split(text, axis)
    if values == ("all",):
        return AXES[axis]
    if not values:
        raise ValueError(f"--{axis}: give at least one value ({', '.join(AXES[axis])} or all)")
    named = axis in _NAMED  # a user's engine or model by module:attribute
    bad = [v for v in values if v not in AXES[axis] and not (named and ":" in v)]
    if bad:
        raise ValueError(
            f"--{axis}: unknown value(s) {', '.join(bad)}; valid: {', '.join(AXES[axis])}, all"
            + (f" or {_NAMED[axis]}" if named else "")
        )
    return tuple(dict.fromkeys(values))


#: Axes that also take a user's object by ``module:attribute``, and what it names.
_NAMED = {
    "engine": "module:attribute naming an engine",
    "model": "package.module:callable[:k=v,...] returning an nn.Module",
}


def _split(text: str, axis: str) -> tuple[str, ...]:
    """The comma-separated values; on the model axis a ``k=v`` piece after a user's model
    continues its size arguments (``pkg.mod:build:d=8,n=2`` is one value)."""
    values: list[str] = []
    for piece in (v.strip() for v in text.split(",")):
        if not piece:
            continue
        continues = axis == "model" and values and values[-1].count(":") >= 2
        if continues and "=" in piece and ":" not in piece:
            values[-1] += "," + piece
        else:
            values.append(piece)
    return tuple(values)


def build_matrix(selection: dict[str, tuple[str, ...]]) -> list[Config]:
    """Every combination of the selected values, engine-major then model, in axis order."""
    order = ("engine", "model", "strategy", "prefetch", "offload", "mp")
    rows = itertools.product(*(selection[axis] for axis in order))
    return [
        Config(engine=e, model=m, strategy=s, prefetch=p, offload=o, mp=mp)
        for e, m, s, p, o, mp in rows
    ]


def row_world_size(config: Config, world_size: int) -> int:
    """The ranks one row runs on: ``world_size`` (``--world-size``), or the hybrid grid's."""
    if config.hybrid:
        return HYBRID_GRID[0] * HYBRID_GRID[1]
    return world_size
