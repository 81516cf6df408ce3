"""The planner's options, parsed and checked before torch is imported: one frozen
:class:`PlanRequest` per command line, or a :class:`PlanError` naming the option and the fix.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from ._matrix import AXES, MODELS

__all__ = [
    "BACKENDS",
    "ENGINES",
    "OPTIMIZERS",
    "InputSpec",
    "ModelSpec",
    "PlanError",
    "PlanRequest",
    "parse_input_shape",
    "parse_mesh",
    "parse_model",
    "parse_request",
]

#: The engines the planner reads (both read through ``fsdp_core.unit_views``).
ENGINES = ("fsdp_core", "fsdp_core_fully_shard")

#: Optimizers ``optim_bytes`` is counted for (``_plan_build.make_optimizer``).
OPTIMIZERS = ("adam", "sgd", "sgd-momentum")

#: Backends whose collective buffers the peak counts (``_plan_memory.StorageCounter``).
BACKENDS = ("gloo", "nccl")

#: Why the other engines are refused: the planner reads fsdp_core's views of its units.
_REFUSED = {
    "torch_fsdp1": "torch's FSDP1 keeps one flat parameter per unit and has no public view",
    "torch_fsdp2": "torch's FSDP2 has no public view of its units",
    "fsdp_core_graph": "graph mode traces the step itself (plan its eager twin, "
    "fsdp_core_fully_shard)",
}

_HYBRID = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
_DTYPES = ("float32", "bfloat16", "float16", "int64")
_DTYPE_ALIASES = {"float": "float32", "fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_DTYPE_ALIASES["long"] = "int64"


class PlanError(ValueError):
    """A command-line mistake: the message names the option, the value and the fix."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """What ``--model`` names.

    Args:
        text: the option as given.
        reference: a key of ``_matrix.MODELS`` (a reference model), or ``None``.
        module: the module of a user's callable (``package.module``), or ``None``.
        attribute: the callable's name in it, or ``None``.
        kwargs: size arguments (``k=v``), passed to the reference model's ``init`` or to the
            callable.
    """

    text: str
    reference: str | None = None
    module: str | None = None
    attribute: str | None = None
    kwargs: tuple[tuple[str, Any], ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class InputSpec:
    """One positional input of a user's model (``--input-shape 8,512[:int64]``)."""

    shape: tuple[int, ...]
    dtype: str = "float32"


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """One configuration to plan.

    Args:
        model: the model.
        world_size: ranks in the world.
        mesh: ``(replicas, shard size)`` of a hybrid run, or ``None``.
        strategy: a ``ShardingStrategy`` member name.
        prefetch: a ``BackwardPrefetch`` member name or ``"none"``.
        mp: ``"off"`` or a ``check --mp`` value (``"bf16"``, ``"bf16/fp32"``, ...).
        offload: parameters offloaded to the CPU.
        engine: one of :data:`ENGINES`.
        optim: one of :data:`OPTIMIZERS`.
        backend: one of :data:`BACKENDS` (what the collectives hold while they run).
        wrap: class names of the submodules of a user's model that become units.
        inputs: the inputs of a user's model without ``get_input``.
        rank: the rank the fake world plays (0; tests play others to check the arithmetic).
    """

    model: ModelSpec
    world_size: int
    mesh: tuple[int, int] | None = None
    strategy: str = "FULL_SHARD"
    prefetch: str = "BACKWARD_PRE"
    mp: str = "off"
    offload: bool = False
    engine: str = "fsdp_core"
    optim: str = "adam"
    backend: str = "gloo"
    wrap: tuple[str, ...] = ()
    inputs: tuple[InputSpec, ...] = ()
    rank: int = 0

    @property
    def hybrid(self) -> bool:
        return self.strategy in _HYBRID


def _value(text: str) -> Any:
    """``k=v`` values: ints, floats, ``true``/``false``, else the text."""
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _kwargs(text: str, option: str) -> tuple[tuple[str, Any], ...]:
    pairs = []
    for item in (part.strip() for part in text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key.strip().isidentifier() or not value.strip():
            raise PlanError(
                f"{option}: {item!r} is not k=v; give size arguments as name=value pairs "
                "separated by commas, e.g. transformer:d_model=2048,nhead=16"
            )
        pairs.append((key.strip(), _value(value.strip())))
    keys = [k for k, _ in pairs]
    repeated = sorted({k for k in keys if keys.count(k) > 1})
    if repeated:
        raise PlanError(f"{option}: {', '.join(repeated)} given twice; give each size once")
    return tuple(pairs)


def parse_model(text: str) -> ModelSpec:
    """``NAME[:k=v,...]`` (a reference model) or ``package.module:callable[:k=v,...]``."""
    parts = text.split(":")
    if parts[0] in MODELS and len(parts) <= 2:
        sizes = _kwargs(parts[1], f"--model {text}") if len(parts) == 2 and parts[1] else ()
        return ModelSpec(text=text, reference=parts[0], kwargs=sizes)
    names = ", ".join(MODELS)
    if len(parts) < 2 or len(parts) > 3 or not all(parts[:2]):
        raise PlanError(
            f"--model {text!r}: unknown model; give a reference model ({names}) with optional "
            "size arguments (transformer:d_model=64), or package.module:callable returning an "
            "nn.Module"
        )
    module, attribute = parts[0], parts[1]
    if not all(p.isidentifier() for p in module.split(".")) or not attribute.isidentifier():
        raise PlanError(
            f"--model {text!r}: {module}:{attribute} is not package.module:callable; give a "
            f"reference model ({names}) or an importable module and a callable's name"
        )
    sizes = _kwargs(parts[2], f"--model {text}") if len(parts) == 3 and parts[2] else ()
    return ModelSpec(text=text, module=module, attribute=attribute, kwargs=sizes)


def parse_mesh(text: str) -> tuple[int, int]:
    """``RxS``: R replicas of shard groups of S ranks."""
    match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if match is None or 0 in (int(match[1]), int(match[2])):
        raise PlanError(
            f"--mesh {text!r}: give R x S as two positive integers, e.g. 8x128 (8 replicas of "
            "shard groups of 128 ranks)"
        )
    return int(match[1]), int(match[2])


def parse_input_shape(text: str) -> InputSpec:
    """``SHAPE[:DTYPE]`` (``--input-shape``): one positional input of a user's model."""
    shape_text, _, dtype = text.partition(":")
    dtype = _DTYPE_ALIASES.get(dtype.strip(), dtype.strip()) or "float32"
    try:
        shape = tuple(int(s) for s in shape_text.split(","))
    except ValueError:
        shape = ()
    if not shape or any(s < 1 for s in shape) or dtype not in _DTYPES:
        raise PlanError(
            f"--input-shape {text!r}: give positive sizes separated by commas and optionally a "
            f"dtype ({', '.join(_DTYPES)}), e.g. 8,512:int64 for token ids"
        )
    return InputSpec(shape=shape, dtype=dtype)


def _choice(option: str, value: str, valid: tuple[str, ...]) -> str:
    if value not in valid:
        raise PlanError(f"--{option} {value!r}: unknown value; valid: {', '.join(valid)}")
    return value


def parse_request(args: Any) -> PlanRequest:
    """The :class:`PlanRequest` of parsed ``fsdp-testing plan`` arguments.

    Raises:
        PlanError: an option's value is invalid or options contradict each other.
    """
    model = parse_model(args.model)
    engine = args.engine
    if engine in _REFUSED:
        raise PlanError(
            f"--engine {engine}: not supported by the planner ({_REFUSED[engine]}); plan with "
            f"{' or '.join(ENGINES)}"
        )
    _choice("engine", engine, ENGINES)
    mesh = parse_mesh(args.mesh) if args.mesh else None
    strategy = args.strategy or ("HYBRID_SHARD" if mesh else "FULL_SHARD")
    _choice("strategy", strategy, AXES["strategy"])
    world = args.world_size if args.world_size is not None else (mesh[0] * mesh[1] if mesh else 2)
    if world < 1:
        raise PlanError(f"--world-size {world}: give at least 1 rank")
    if mesh is not None and mesh[0] * mesh[1] != world:
        raise PlanError(
            f"--mesh {args.mesh}: {mesh[0]} x {mesh[1]} = {mesh[0] * mesh[1]} ranks, but "
            f"--world-size is {world}; give R x S with R * S = {world} (S must divide it)"
        )
    if mesh is not None and strategy not in _HYBRID:
        raise PlanError(
            f"--mesh {args.mesh} with --strategy {strategy}: a mesh shards inside groups of S "
            "ranks and replicates across R; use --strategy HYBRID_SHARD or _HYBRID_SHARD_ZERO2"
        )
    if mesh is None and strategy in _HYBRID:
        raise PlanError(
            f"--strategy {strategy} needs --mesh RxS (R replicas of shard groups of S ranks), "
            f"e.g. --mesh 2x{max(world // 2, 1)}"
        )
    if model.reference is not None and (args.wrap or args.input_shape):
        given = "--wrap" if args.wrap else "--input-shape"
        raise PlanError(
            f"{given} is for --model package.module:callable; reference models make their "
            f"own units and inputs ({model.reference} has both)"
        )
    wrap = tuple(w.strip() for w in (args.wrap or "").split(",") if w.strip())
    return PlanRequest(
        model=model,
        world_size=world,
        mesh=mesh,
        strategy=strategy,
        prefetch=_choice("prefetch", args.prefetch, AXES["prefetch"]),
        mp=_choice("mp", args.mp, AXES["mp"]),
        offload=_choice("offload", args.offload, AXES["offload"]) == "on",
        engine=engine,
        optim=_choice("optim", args.optim, OPTIMIZERS),
        backend=_choice("backend", args.backend, BACKENDS),
        wrap=wrap,
        inputs=tuple(parse_input_shape(text) for text in args.input_shape or ()),
    )
