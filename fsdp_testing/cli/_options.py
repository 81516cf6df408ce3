"""The options ``fsdp-testing check`` and ``trace`` share: the configuration axes, a user's model
and engine, a user's own parallelization and where its batch comes from, the world. Both
commands add them with :func:`add_row_options` and turn them into rows with
:func:`parse_rows`.

[Note: options before rows]
Every option is checked in this process before any row runs (before the warm pool starts): the
axes' values; each ``--engine module:attribute`` resolved to an engine (importable, an object or
class with ``wrap``); each ``--model package.module:callable`` imported, built and given inputs;
``--wrap`` classes found in it; ``--parallelize`` importable and callable as ``(model, mesh)``;
``--mesh``, ``--dp-dims`` and ``--layout`` parsed and checked against each other, the model and
the world size; numbers in range; options that do not apply refused. A mistake is exit status 2
and one line naming the option, the value and the fix, as argparse reports what it checks
itself; nothing has run. Only what needs the ranks (an engine or a parallelization that raises
there) is a row's ``ERROR``.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import math
import os
from collections.abc import Mapping
from typing import Any

from ._matrix import AXES, MODELS, Config, add_user_model_options, parse_axis
from ._parallel import (
    REFERENCES,
    ParallelConfig,
    parse_dp_dims,
    parse_layout,
    parse_mesh,
    validate_layout,
)

__all__ = [
    "ENGINE_AXES",
    "OptionError",
    "RowOptions",
    "add_row_options",
    "parse_rows",
    "validate_output_path",
]

#: The axes that configure an engine; a ``--parallelize`` row has none of them.
ENGINE_AXES = ("strategy", "prefetch", "offload", "mp", "engine")

_NAMED_HELP = {
    "engine": "; or module:attribute naming an engine",
    "model": "; or package.module:callable[:k=v,...] returning an nn.Module",
}


class OptionError(ValueError):
    """A command-line mistake: the message names the option, the value and the fix."""


def add_row_options(parser: argparse.ArgumentParser, *, one_value: bool, defaults: Any) -> None:
    """The shared options (see the module's docstring).

    Args:
        parser: the subcommand's parser.
        one_value: each axis takes one value (``trace``), not a list (``check``).
        defaults: each axis's default values (shown in the help; applied by
            :func:`parse_rows`).
    """
    for axis, values in AXES.items():
        default = ",".join(defaults[axis])
        listed = ", ".join(values) + ("" if one_value else ", all")
        parser.add_argument(
            f"--{axis}",
            default=None,
            metavar="VALUE" if one_value else "A,B",
            help=f"{'one of' if one_value else 'values:'} {listed} (default: {default})"
            + _NAMED_HELP.get(axis, ""),
        )
    add_user_model_options(parser)
    parser.add_argument(
        "--parallelize",
        metavar="PKG.MOD:CALLABLE",
        help="your own parallelization of a package.module:callable model, called as "
        "callable(model, mesh) with --mesh, callable(model, process_group) without; replaces "
        "the engine axes",
    )
    parser.add_argument(
        "--reference",
        metavar="KIND",
        help="with --parallelize: data-parallel (default: each rank, or each --dp-dims "
        "coordinate, its own batch; DDP reference) or same-batch (every rank one batch; one "
        "replica as the reference)",
    )
    parser.add_argument(
        "--mesh",
        metavar="NAME=SIZE,...",
        help="with --parallelize: the device mesh your callable gets, e.g. dp=2,tp=2 "
        "(sets the world size)",
    )
    parser.add_argument(
        "--dp-dims",
        metavar="NAME,...",
        help="the dims of --mesh that split the batch (default none: every rank one batch)",
    )
    parser.add_argument(
        "--layout",
        metavar="NAME=DIM[:MESH_DIM],...",
        help="with --parallelize: plain (not DTensor) parameters split across ranks: the dim "
        "each is cut on, across the model-parallel ranks or one mesh dim's",
    )
    parser.add_argument(
        "--world-size", type=int, help="gloo ranks (default: 2, or the ranks of --mesh)"
    )
    parser.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="seconds per row before it counts as hung"
    )


@dataclasses.dataclass(frozen=True)
class RowOptions:
    """The rows a command line asks for, validated (see [Note: options before rows]).

    Args:
        configs: the rows, in order.
        selection: each axis's values (``--parallelize``: the defaults, unused).
        world_size: the ranks of a non-hybrid row.
        mesh: ``--mesh`` as ``(dim, size)`` pairs (empty: none).
    """

    configs: list[Config]
    selection: dict[str, tuple[str, ...]]
    world_size: int
    mesh: tuple[tuple[str, int], ...] = ()


def parse_rows(
    args: argparse.Namespace, *, defaults: Mapping[str, tuple[str, ...]], one_value: bool
) -> RowOptions:
    """The rows of parsed ``check`` or ``trace`` arguments. See [Note: options before rows].

    Args:
        args: the parsed arguments (those of :func:`add_row_options`).
        defaults: each axis's values when the option is not given.
        one_value: each axis must have exactly one value (``trace``).

    Raises:
        OptionError: the message names the option, the value and the fix.
    """
    _validate_numbers(args)
    given = {axis for axis in AXES if getattr(args, axis) is not None}
    selection: dict[str, tuple[str, ...]] = {}
    for axis in AXES:
        try:
            value = _value(args, axis)
            selection[axis] = parse_axis(axis, value) if axis in given else tuple(defaults[axis])
        except ValueError as error:
            raise OptionError(str(error)) from None
        if one_value and len(selection[axis]) != 1:
            raise OptionError(
                f"--{axis} {_value(args, axis)}: trace runs one configuration; give one "
                f"value of --{axis}"
            )
    if args.parallelize is not None:
        return _parallel_rows(args, selection, given)
    for option in ("mesh", "dp_dims", "layout"):
        if getattr(args, option) is not None:
            flag = "--" + option.replace("_", "-")
            raise OptionError(
                f"{flag} {getattr(args, option)}: describes where your own parallelization "
                "runs; give that code with --parallelize package.module:callable (engine rows "
                "shard data parallel over the world)"
            )
    if args.reference not in (None, "data-parallel"):
        raise OptionError(
            f"--reference {args.reference}: engine rows are data parallel (each rank its own "
            "batch, against DDP); a same-batch reference is for your own model-parallel code: "
            "give it with --parallelize package.module:callable"
        )
    _validate_engines(selection["engine"])
    world = args.world_size if args.world_size is not None else 2
    user = _validate_user_models(selection["model"], args)
    units = tuple(w.strip() for w in (args.wrap or "").split(",") if w.strip())
    configs = [
        Config(
            engine=engine,
            model=model,
            strategy=strategy,
            prefetch=prefetch,
            offload=offload,
            mp=mp,
            inputs=tuple(args.input_shape or ()) if model in user else (),
            units=units if model in user else (),
        )
        for engine in selection["engine"]
        for model in selection["model"]
        for strategy in selection["strategy"]
        for prefetch in selection["prefetch"]
        for offload in selection["offload"]
        for mp in selection["mp"]
    ]
    return RowOptions(configs, selection, world)


def _value(args: argparse.Namespace, axis: str) -> str:
    return str(getattr(args, axis))


def validate_output_path(option: str, path: str) -> None:
    """A file the command writes: its directory exists and it is not a directory.

    Raises:
        OptionError: naming the option, the path and the fix.
    """
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise OptionError(f"{option} {path}: is a directory; give a file path")
    if not os.path.isdir(folder):
        raise OptionError(
            f"{option} {path}: the directory {folder} does not exist; create it or give a path "
            "in an existing directory"
        )


def _validate_numbers(args: argparse.Namespace) -> None:
    if args.world_size is not None and args.world_size < 1:
        raise OptionError(f"--world-size {args.world_size}: give at least 1 rank")
    if args.steps < 1:
        raise OptionError(f"--steps {args.steps}: give at least 1 training step")
    if not args.timeout > 0:
        raise OptionError(f"--timeout {args.timeout:g}: give a positive number of seconds")


def _validate_engines(engines: tuple[str, ...]) -> None:
    """Each ``module:attribute`` engine imports and is an engine (registered names were
    checked by ``parse_axis``)."""
    from fsdp_testing.engines import resolve_engine

    for engine in engines:
        if ":" not in engine:
            continue
        try:
            resolve_engine(engine)
        except (ValueError, TypeError) as error:
            raise OptionError(
                f"--engine {engine}: {str(error).removeprefix('resolve_engine: ')}"
            ) from None


def _validate_user_models(models: tuple[str, ...], args: argparse.Namespace) -> dict[str, Any]:
    """The user's models among ``--model`` values (``package.module:callable``), each built
    once in this process: importable, an ``nn.Module``, inputs given or its own
    ``get_input``, ``--wrap`` classes in it.

    Returns:
        each user's model by its ``--model`` value, as built.
    """
    import torch.nn as nn

    from fsdp_testing.models.user import load_factory

    from ._plan_args import parse_input_shape, parse_model

    try:
        inputs = [parse_input_shape(text) for text in args.input_shape or ()]
    except ValueError as error:
        raise OptionError(str(error)) from None
    user = [m for m in models if m not in MODELS]
    if not user and (args.input_shape or args.wrap):
        given = "--input-shape" if args.input_shape else "--wrap"
        raise OptionError(
            f"{given} is for --model package.module:callable; reference models make their own "
            "units and inputs"
        )
    built: dict[str, Any] = {}
    own_inputs = []
    for text in user:
        try:
            spec = parse_model(text)
            factory = load_factory(
                spec.module or "", spec.attribute or "", option=f"--model {text}"
            )
        except ValueError as error:
            raise OptionError(str(error)) from None
        try:
            module = factory(**dict(spec.kwargs))
        except TypeError as error:
            raise OptionError(
                f"--model {text}: calling {spec.attribute}() failed ({error}); give a callable "
                "that builds the model from size arguments only (package.module:callable:k=v)"
            ) from None
        if not isinstance(module, nn.Module):
            raise OptionError(
                f"--model {text}: {spec.attribute}() returned {type(module).__name__}, not an "
                "nn.Module"
            )
        has_workload = all(
            callable(getattr(module, m, None)) for m in ("get_input", "get_loss", "run_backward")
        )
        own_inputs.append(has_workload)
        if not has_workload and not inputs:
            raise OptionError(
                f"--model {text}: the model has no get_input(device); give its inputs with "
                "--input-shape (once per positional input), e.g. --input-shape 8,1024 or "
                "8,512:int64"
            )
        classes = {type(m).__name__ for m in module.modules()}
        unknown = [w.strip() for w in (args.wrap or "").split(",") if w.strip() not in classes]
        if args.wrap and unknown:
            raise OptionError(
                f"--wrap {','.join(unknown)}: no such module class in --model {text}; its "
                f"classes: {', '.join(sorted(classes))}"
            )
        built[text] = module
    if inputs and own_inputs and all(own_inputs):
        raise OptionError(
            f"--input-shape {args.input_shape[0]}: every --model given has its own "
            "get_input(device), which is used; leave --input-shape out"
        )
    return built


def _parallel_rows(
    args: argparse.Namespace, selection: dict[str, tuple[str, ...]], given: set[str]
) -> RowOptions:
    """The rows of ``--parallelize`` (see [Note: model-parallel rows] in ``_parallel.py``)."""
    text = args.parallelize
    for axis in ENGINE_AXES:
        if axis in given:
            raise OptionError(
                f"--{axis} {_value(args, axis)} with --parallelize {text}: your callable "
                f"parallelizes the model, so there is no engine to configure; leave --{axis} "
                "out (or drop --parallelize to run an engine's rows)"
            )
    if args.wrap is not None:
        raise OptionError(
            f"--wrap {args.wrap} with --parallelize {text}: --wrap picks an engine's units; "
            "your callable parallelizes the model itself; leave --wrap out"
        )
    if "model" not in given:
        raise OptionError(
            f"--parallelize {text} needs --model package.module:callable: the unwrapped model "
            "your callable parallelizes"
        )
    references = [m for m in selection["model"] if m in MODELS]
    if references:
        raise OptionError(
            f"--model {references[0]} with --parallelize {text}: reference models are sharded "
            "by an engine; give package.module:callable returning your unwrapped model, or "
            "drop --parallelize"
        )
    mesh, dp_dims, layout, reference = _placement_options(args)
    mesh_world = math.prod(size for _, size in mesh) if mesh else None
    if mesh_world is not None and args.world_size not in (None, mesh_world):
        raise OptionError(
            f"--world-size {args.world_size} does not fit --mesh {args.mesh}: its dims hold "
            f"{mesh_world} ranks; give --world-size {mesh_world} or leave it out (the mesh sets "
            "the world size)"
        )
    world = mesh_world or args.world_size or 2
    _validate_parallelize(text)
    built = _validate_user_models(selection["model"], args)
    configs: list[Config] = []
    for model in selection["model"]:
        config = ParallelConfig(
            model=model,
            strategy="-",
            prefetch="-",
            offload="-",
            mp="-",
            engine=text,
            inputs=tuple(args.input_shape or ()),
            parallelize=text,
            reference=reference,
            mesh=mesh,
            dp_dims=dp_dims,
            layout=layout,
        )
        try:
            validate_layout(built[model], config, world)
        except ValueError as error:
            raise OptionError(f"{error} (--model {model})") from None
        configs.append(config)
    return RowOptions(configs, selection, world, mesh)


def _placement_options(
    args: argparse.Namespace,
) -> tuple[tuple[tuple[str, int], ...], tuple[str, ...], tuple[tuple[str, int, str], ...], str]:
    """``--mesh``, ``--dp-dims``, ``--layout`` and ``--reference``, checked together."""
    try:
        mesh = parse_mesh(args.mesh) if args.mesh is not None else ()
        if args.dp_dims is not None and not mesh:
            raise OptionError(
                f"--dp-dims {args.dp_dims} names dims of a mesh; give --mesh NAME=SIZE,... as "
                "well (without --mesh, --reference data-parallel gives each rank its own batch "
                "and same-batch gives every rank one)"
            )
        dp_dims = parse_dp_dims(args.dp_dims, mesh) if args.dp_dims is not None else ()
        layout = parse_layout(args.layout, mesh) if args.layout is not None else ()
    except OptionError:
        raise
    except ValueError as error:
        raise OptionError(str(error)) from None
    reference = args.reference
    if reference is not None and reference not in REFERENCES:
        raise OptionError(
            f"--reference {reference}: unknown reference; give {' or '.join(REFERENCES)}"
        )
    if not mesh:
        return mesh, dp_dims, layout, reference or "data-parallel"
    if reference == "same-batch" and dp_dims:
        raise OptionError(
            f"--reference same-batch with --dp-dims {args.dp_dims}: the dp dims split the "
            "batch, same-batch gives every rank one; leave one of them out"
        )
    if reference == "data-parallel" and not dp_dims:
        raise OptionError(
            f"--reference data-parallel with --mesh {args.mesh} needs --dp-dims: name the mesh "
            "dims that split the batch (or give --reference same-batch)"
        )
    return mesh, dp_dims, layout, "data-parallel" if dp_dims else "same-batch"


def _validate_parallelize(text: str) -> None:
    """``--parallelize``: ``package.module:callable``, importable, callable with two
    positional arguments."""
    from fsdp_testing.models.user import load_factory

    module, sep, attribute = text.partition(":")
    if (
        not sep
        or not all(p.isidentifier() for p in module.split("."))
        or not attribute.isidentifier()
    ):
        raise OptionError(
            f"--parallelize {text!r}: not package.module:callable; name an importable module "
            "and a function in it, e.g. --parallelize my_tp:parallelize"
        )
    try:
        found = load_factory(module, attribute, option=f"--parallelize {text}")
    except ValueError as error:
        raise OptionError(str(error)) from None
    try:
        signature = inspect.signature(found)
    except (TypeError, ValueError):
        return  # a builtin without a signature: it is called as it is
    try:
        signature.bind(object(), object())
    except TypeError as error:
        raise OptionError(
            f"--parallelize {text}: {attribute}{signature} cannot be called as {attribute}(model, "
            f"mesh_or_group) ({error}); give a function of the model and the mesh (with --mesh) "
            "or process group that returns the model to train"
        ) from None
