"""Model-parallel rows of ``fsdp-testing check`` and ``trace``: a user's model and their own
parallelization (``--parallelize package.module:callable``) trained against the reference that
fits it (``--reference``, ``--mesh``, ``--dp-dims``), the full state assembled from DTensor
parameters or ``--layout``. Parsing here imports no torch; what runs on the ranks
(:class:`ParallelSetup`) imports it when built.

[Note: model-parallel rows]
An engine row trains data parallel code: every rank its own batch, against DDP. Tensor, sequence
and expert parallel code splits one replica's work across ranks that must see the same batch,
so under that reference a correct model mismatches by design. A model-parallel row is
:func:`fsdp_testing.parity.check_parity`'s trainer (``UserLockstep``, see [Note: model-parallel
parity] in ``fsdp_testing/parity/_mesh.py``) with the row's measurements around the step of the
code under test:

- The code under test is ``parallelize(model, mesh)`` with ``--mesh`` (a ``DeviceMesh`` of its
  dims, row-major over the ranks) and ``parallelize(model, process_group)`` (the world)
  without: check_parity's ``wrap``.
- ``--reference data-parallel`` (the default): the batch follows the data-parallel coordinate
  (every rank without ``--mesh``, the dims of ``--dp-dims`` with it), the reference is DDP over
  the data-parallel ranks. ``same-batch``: every rank trains on one batch, the reference is one
  replica on it (check_parity's ``"local"``). With ``--mesh`` and no ``--dp-dims`` the row is
  ``same-batch``.
- The full state: DTensor parameters by ``full_tensor()``; ``--layout NAME=DIM`` a plain shard
  cut on DIM across the model-parallel ranks (the dims of ``--mesh`` outside ``--dp-dims``;
  without ``--mesh``, every rank), ``NAME=DIM:MESH_DIM`` across one mesh dim's ranks; anything
  else replicated. Without ``--mesh``, a ``same-batch`` row, and a ``data-parallel`` row with a
  layout, run on a one-dim mesh named ``rank`` over the world (data-parallel: ``dp_dims`` is
  that dim and each layout is split across it).
- The workload: the model's own ``get_input(device)`` and ``get_loss(input, output)`` when it
  has ``get_input``, ``get_loss`` and ``run_backward`` (``get_input`` runs under torch's global
  generator seeded from the step and the data-parallel rank, so the ranks of one replica draw
  one batch), else one random tensor per ``--input-shape`` seeded likewise and the sum of the
  outputs as the loss (as in engine rows). Both sides backpropagate with ``loss.backward()``.
- There is no theoretical volume of a user's parallelization: the collectives of one step are
  counted and shown, not judged; the row fails on parity only.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from ._matrix import Config

__all__ = [
    "REFERENCES",
    "ROW_MESH_DIM",
    "ParallelConfig",
    "ParallelSetup",
    "parse_dp_dims",
    "parse_layout",
    "parse_mesh",
    "validate_layout",
]

#: ``--reference`` values. See [Note: model-parallel rows].
REFERENCES = ("data-parallel", "same-batch")

#: The one mesh dim of a row without ``--mesh`` that needs a mesh (over the world).
ROW_MESH_DIM = "rank"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelConfig(Config):
    """A model-parallel row: a user's model (``model``) under their ``parallelize`` callable.
    The engine axes (strategy, prefetch, offload, mp) are ``"-"``; ``engine`` is
    ``parallelize``. See [Note: model-parallel rows].

    Args:
        parallelize: ``package.module:callable``, ``(model, mesh or process group) -> model``.
        reference: one of :data:`REFERENCES`.
        mesh: ``--mesh`` as ``(dim name, size)`` pairs; empty: none (the world's group).
        dp_dims: ``--dp-dims``, the mesh dims that split the batch.
        layout: ``--layout`` as ``(parameter, dim, mesh dim or "")``.
    """

    parallelize: str
    reference: str = "data-parallel"
    mesh: tuple[tuple[str, int], ...] = ()
    dp_dims: tuple[str, ...] = ()
    layout: tuple[tuple[str, int, str], ...] = ()

    @property
    def placement(self) -> str:
        """Where the batch comes from: ``data-parallel``, ``same-batch``, or the mesh and its
        data-parallel dims (``mesh dp=2,tp=2 dp-dims=dp``)."""
        if not self.mesh:
            return self.reference
        dims = ",".join(f"{name}={size}" for name, size in self.mesh)
        batch = f"dp-dims={','.join(self.dp_dims)}" if self.dp_dims else "same-batch"
        return f"mesh {dims} {batch}"

    @property
    def label(self) -> str:
        return f"{self.model} parallelize={self.parallelize} {self.placement}"

    @property
    def engine_name(self) -> str:
        return f"parallelize={self.parallelize.rpartition(':')[2]}"

    @property
    def engine_title(self) -> str:
        return f"parallelize: {self.parallelize}"

    @property
    def cell(self) -> str | None:
        return self.placement


def _mesh_text(mesh: tuple[tuple[str, int], ...]) -> str:
    return ",".join(f"{name}={size}" for name, size in mesh)


def parse_mesh(text: str) -> tuple[tuple[str, int], ...]:
    """``--mesh NAME=SIZE,...`` (``dp=2,tp=2``): the dims of the device mesh, outermost first.

    Raises:
        ValueError: the message names the option, the value and the fix.
    """
    if re.fullmatch(r"\s*\d+\s*[xX]\s*\d+\s*", text):
        raise ValueError(
            f"--mesh {text!r}: check and trace name each dim of a model-parallel mesh, e.g. "
            "--mesh dp=2,tp=2 (RxS is plan's hybrid grid; check's hybrid rows come from "
            "--strategy HYBRID_SHARD and always run 2 x 2)"
        )
    dims: list[tuple[str, int]] = []
    for piece in (p.strip() for p in text.split(",")):
        name, sep, size = piece.partition("=")
        name, size = name.strip(), size.strip()
        if not sep or not name.isidentifier() or not size.isdigit() or int(size) < 1:
            raise ValueError(
                f"--mesh {text!r}: {piece!r} is not NAME=SIZE; give each dim's name and size, "
                "outermost first, e.g. --mesh dp=2,tp=2"
            )
        if name in (d for d, _ in dims):
            raise ValueError(f"--mesh {text!r}: dim {name!r} is given twice; name each dim once")
        dims.append((name, int(size)))
    return tuple(dims)


def parse_dp_dims(text: str, mesh: tuple[tuple[str, int], ...]) -> tuple[str, ...]:
    """``--dp-dims NAME,...``: the dims of ``--mesh`` that split the batch.

    Raises:
        ValueError: a name that is not a dim of the mesh, or every dim (nothing model
            parallel is left).
    """
    names = [name for name, _ in mesh]
    dims = tuple(dict.fromkeys(d.strip() for d in text.split(",") if d.strip()))
    unknown = [d for d in dims if d not in names]
    if not dims or unknown:
        raise ValueError(
            f"--dp-dims {text!r}: {', '.join(map(repr, unknown)) or 'no dim'} is not a dim of "
            f"--mesh {_mesh_text(mesh)}; name the dims that split the batch, from "
            f"{', '.join(names)}"
        )
    return tuple(d for d in names if d in dims)  # in mesh order: the row-major dp rank


def parse_layout(text: str, mesh: tuple[tuple[str, int], ...]) -> tuple[tuple[str, int, str], ...]:
    """``--layout NAME=DIM[:MESH_DIM],...``: plain parameters split across ranks.

    Raises:
        ValueError: the message names the entry and the form.
    """
    names = [name for name, _ in mesh]
    entries: list[tuple[str, int, str]] = []
    for piece in (p.strip() for p in text.split(",")):
        name, sep, where = piece.partition("=")
        dim, _, over = where.partition(":")
        name, dim, over = name.strip(), dim.strip(), over.strip()
        if not sep or not name or not dim.isdigit():
            raise ValueError(
                f"--layout {text!r}: {piece!r} is not NAME=DIM[:MESH_DIM]; give each plain "
                "parameter's name in the model and the dim it is cut on, e.g. --layout "
                "0.weight=0,0.bias=0,2.weight=1"
            )
        if over and over not in names:
            fix = (
                f"name a dim of --mesh ({', '.join(names)})"
                if names
                else f"give --mesh NAME=SIZE,... with a dim {over}"
            )
            raise ValueError(
                f"--layout {piece}: {over!r} is not a mesh dim; {fix}, or leave :MESH_DIM out "
                "to split across the model-parallel ranks"
            )
        if name in (n for n, _, _ in entries):
            raise ValueError(f"--layout {text!r}: {name!r} is given twice; give each once")
        entries.append((name, int(dim), over))
    return tuple(entries)


def split_ranks(config: ParallelConfig, world_size: int, mesh_dim: str) -> int:
    """How many ranks a ``--layout`` entry across ``mesh_dim`` (``""``: the model-parallel
    dims) is split over."""
    if not config.mesh:
        return world_size
    sizes = dict(config.mesh)
    if mesh_dim:
        return sizes[mesh_dim]
    return math.prod(size for name, size in config.mesh if name not in config.dp_dims)


def validate_layout(module: Any, config: ParallelConfig, world_size: int) -> None:
    """Every ``--layout`` entry names a parameter of ``module`` (the unwrapped model), a dim it
    has, and a split that cuts that dim into equal chunks (``torch.chunk``'s, which the
    all-gather that assembles it needs).

    Raises:
        ValueError: the message names the entry and the fix.
    """
    params = dict(module.named_parameters())
    for name, dim, over in config.layout:
        param = params.get(name)
        if param is None:
            known = ", ".join(list(params)[:12]) + (", ..." if len(params) > 12 else "")
            raise ValueError(
                f"--layout {name}={dim}: the model has no parameter {name!r}; name parameters "
                f"as the unwrapped model does ({known})"
            )
        if dim >= param.dim():
            raise ValueError(
                f"--layout {name}={dim}: {name} has {param.dim()} dims (shape "
                f"{tuple(param.shape)}); give a dim below {param.dim()}"
            )
        ranks = split_ranks(config, world_size, over)
        if ranks == 1:
            raise ValueError(
                f"--layout {name}={dim}: no model-parallel dim to split it across (every dim "
                f"of --mesh {_mesh_text(config.mesh)} is in --dp-dims); name the mesh dim it "
                f"is split across ({name}={dim}:MESH_DIM) or leave it out"
            )
        if param.shape[dim] % ranks:
            raise ValueError(
                f"--layout {name}={dim}: dim {dim} of {name} has {param.shape[dim]} rows, which "
                f"{ranks} ranks cannot cut into equal chunks; a layout is even chunks "
                "(torch.chunk), so give a size that divides, or another dim"
            )


#: The batch seed of forward ``i`` on data-parallel rank ``r``.
def _batch_seed(i: int, dp_rank: int) -> int:
    return 1 + dp_rank + 1000 * i


class ParallelSetup:
    """A model-parallel row's trainer on one rank (see [Note: model-parallel rows]): the same
    attributes as ``_rankwork.TrainingSetup``, which ``check`` and ``trace`` use.

    Args:
        config: the row.
        ctx: the rank's context (``process_group``, ``device``, ``world_size``).
    """

    def __init__(self, config: ParallelConfig, ctx: Any) -> None:
        import torch
        import torch.nn as nn

        from fsdp_testing.engines import engine_for
        from fsdp_testing.models.user import load_factory, random_inputs, sum_of_outputs
        from fsdp_testing.parity._user import UserLockstep

        from ._plan_args import parse_input_shape, parse_model

        spec = parse_model(config.model)
        factory = load_factory(spec.module or "", spec.attribute or "", option="--model")
        kwargs = dict(spec.kwargs)
        module_name, _, attribute = config.parallelize.partition(":")
        parallelize = load_factory(module_name, attribute, option="--parallelize")
        self.device = torch.device(ctx.device)
        self.mesh, dp_dims, layout = _placement(config, ctx.world_size, self.device.type)
        target = self.mesh if config.mesh else ctx.process_group
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            probe: Any = factory(**kwargs)  # the workload's methods; never trained
        own = all(callable(getattr(probe, m, None)) for m in _WORKLOAD)
        shapes = [(s.shape, s.dtype) for s in map(parse_input_shape, config.inputs)]

        def get_batch(i: int, dp_rank: int) -> tuple[Any, ...]:
            if not own:
                return random_inputs(shapes, seed=_batch_seed(i, dp_rank))
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(_batch_seed(i, dp_rank))
                return tuple(probe.get_input(self.device))

        def loss_fn(model: Any, batch: tuple[Any, ...]) -> torch.Tensor:
            output = model(*batch)
            if own:
                return probe.get_loss(batch, output)
            return sum_of_outputs(output, what=f"--model {config.model}")

        self.run = UserLockstep.build(
            lambda: factory(**kwargs),
            lambda model, _: parallelize(model, target),
            get_batch,
            process_group=ctx.process_group,
            loss_fn=loss_fn,
            device=self.device,
            mesh=self.mesh,
            dp_dims=dp_dims,
            layout=layout,
        )
        self.lockstep = self.run.lockstep
        self._loop = self.lockstep.sharded
        self.sharded = self._loop.model
        self.optim = self._loop.optim
        self.engine = engine_for(self.sharded) if isinstance(self.sharded, nn.Module) else None

    def forward(self, step: int) -> Any:
        """The loss of the code under test on its batch of ``step`` (0-based), for ``trace``."""
        loop = self._loop
        assert loop.batches is not None  # for mypy: check_parity's loops take batches
        return loop.loss_fn(loop.model, loop.batches(step))

    def backward(self, loss: Any) -> None:
        loss.backward()

    def details(self, report: Any) -> list[str]:
        """The mesh coordinates whose shards differ (a collective; see ``UserLockstep``)."""
        return self.run.details(report)


_WORKLOAD = ("get_input", "get_loss", "run_backward")


def _placement(
    config: ParallelConfig, world_size: int, device_type: str
) -> tuple[Any, list[str] | None, dict[str, Any] | None]:
    """check_parity's ``mesh``, ``dp_dims`` and ``layout`` for the row (see [Note:
    model-parallel rows])."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    def make(dims: tuple[tuple[str, int], ...]) -> Any:
        sizes = [size for _, size in dims]
        ranks = torch.arange(math.prod(sizes)).view(*sizes)
        return DeviceMesh(device_type, ranks, mesh_dim_names=tuple(name for name, _ in dims))

    layout: dict[str, Any] = {}
    if config.mesh:
        for name, dim, over in config.layout:
            layout[name] = (dim, over) if over else dim
        return make(config.mesh), list(config.dp_dims) or None, layout or None
    world = ((ROW_MESH_DIM, world_size),)
    if config.reference == "same-batch":
        layout = {name: dim for name, dim, _ in config.layout}
        return make(world), None, layout or None
    if config.layout:
        layout = {name: (dim, ROW_MESH_DIM) for name, dim, _ in config.layout}
        return make(world), [ROW_MESH_DIM], layout
    return None, None, None
