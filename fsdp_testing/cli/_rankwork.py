"""What the CLI runs on every rank: one matrix row of ``check``, or the steps of ``trace``.

The tasks are picklable objects with ``run_on_rank(ctx)`` (see ``fsdp_testing/_protocol.py``);
each rank writes what it measured as JSON into a directory the parent reads afterwards.

[Note: lockstep rows]
A row is the library's lockstep trainer (:class:`fsdp_testing.parity.Lockstep`: the models,
reference, training loop and [Note: parity rule] of ``check_fsdp_parity``, with
[Note: mixed precision parity] for the ``--mp`` rows) with the command line's measurements
around the sharded model's step. Collectives are counted only while the sharded model runs one
step, and only from the second step on: the first iteration also records the order that
prefetching follows. The resident memory high-water mark covers the whole row. At the first
step that diverges on any rank (the ranks agree on it after every step, outside the counted
step), every rank reads the likely causes from the lockstep (``Lockstep.explain``, the
library's [Note: likely causes]) and reports them with its numbers. A row of a user's own
parallelization trains on ``check_parity``'s lockstep instead, measured the same way ([Note:
model-parallel rows] in ``_parallel.py``); :func:`make_setup` picks the trainer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import statistics
import time
from collections.abc import Iterator
from typing import Any

from ._hybrid import MeshEngine, expected_groups, hybrid_mesh
from ._matrix import MODELS, Config
from ._measure import (
    CollectiveLog,
    current_rss_bytes,
    peak_rss_bytes,
    reset_peak_rss,
    theoretical_volume,
)

__all__ = ["CheckCase", "TrainingSetup", "fsdp_options", "make_setup"]


def fsdp_options(config: Config) -> dict[str, Any]:
    """The engine options (FSDP1 types; every engine translates them) of one row."""
    import torch
    from torch.distributed.fsdp import (
        BackwardPrefetch,
        CPUOffload,
        MixedPrecision,
        ShardingStrategy,
    )

    options: dict[str, Any] = {
        "sharding_strategy": ShardingStrategy[config.strategy],
        "backward_prefetch": (
            None if config.prefetch == "none" else BackwardPrefetch[config.prefetch]
        ),
    }
    if config.offload == "on":
        options["cpu_offload"] = CPUOffload(offload_params=True)
    if config.mp != "off":
        # "bf16": compute and reduce in bf16; "bf16/fp32": compute in bf16, reduce in fp32.
        dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
        param, _, reduce = config.mp.partition("/")
        options["mixed_precision"] = MixedPrecision(
            param_dtype=dtypes[param], reduce_dtype=dtypes[reduce] if reduce else None
        )
    return options


def _model_class(config: Config) -> tuple[Any, str]:
    """The row's model class and its reference kind (see ``_matrix.MODELS``): a reference
    model, or a user's ``package.module:callable`` as a ``UserModel`` (DDP reference)."""
    from fsdp_testing import models
    from fsdp_testing.models.user import UserModel, load_factory

    from ._plan_args import parse_input_shape, parse_model

    if config.model in MODELS:
        class_name, reference = MODELS[config.model]
        return getattr(models, class_name), reference
    spec = parse_model(config.model)
    option = f"--model {config.model}"
    factory = load_factory(spec.module or "", spec.attribute or "", option=option)
    inputs = [parse_input_shape(text) for text in config.inputs]
    model_class = UserModel.for_factory(
        factory,
        name=config.model,
        kwargs=dict(spec.kwargs),
        inputs=[(i.shape, i.dtype) for i in inputs],
        units=config.units,
    )
    return model_class, "ddp"


def make_setup(config: Config, ctx: Any) -> Any:
    """The trainer of one row on this rank: a :class:`TrainingSetup` for an engine's row, a
    ``ParallelSetup`` for a user's own parallelization ([Note: model-parallel rows]). Both have
    ``lockstep``, ``sharded``, ``engine``, ``mesh``, ``optim``, ``device``, ``forward(step)``,
    ``backward(loss)`` and ``details(report)``."""
    from ._parallel import ParallelConfig, ParallelSetup

    if isinstance(config, ParallelConfig):
        return ParallelSetup(config, ctx)
    return TrainingSetup(config, ctx)


class TrainingSetup:
    """The lockstep trainer of one engine row (its sharded model, reference and optimizers);
    ``trace`` drives the sharded model alone.

    Args:
        config: the row.
        ctx: the rank's context (``process_group``, ``device``).
    """

    def __init__(self, config: Config, ctx: Any) -> None:
        import torch

        from fsdp_testing import models
        from fsdp_testing.engines import resolve_engine
        from fsdp_testing.parity import Lockstep

        model_class, reference = _model_class(config)
        self.device = ctx.device
        self.engine: Any = resolve_engine(config.engine)
        self.mesh: Any = None
        if config.hybrid:  # see [Note: hybrid rows]
            self.mesh = hybrid_mesh(torch.device(ctx.device).type)
            self.engine = MeshEngine(self.engine, self.mesh)
        self.lockstep = Lockstep.build(
            model_class,
            process_group=ctx.process_group,
            engine=self.engine,
            fsdp_kwargs=fsdp_options(config),
            device=ctx.device,
            init_kwargs={"device": ctx.device},
            ref_init_fn=models.DummyDDP if reference == "self" else None,
        )
        sharded = self.lockstep.sharded
        self.sharded = sharded.model
        self.test_model = sharded.test_model
        self.optim = sharded.optim

    def forward(self, step: int) -> Any:
        """The sharded model's loss on its next input (``trace``; the reference models' inputs
        do not depend on ``step``)."""
        test_model = self.test_model
        assert test_model is not None  # for mypy: the reference models are workloads
        inputs = test_model.get_input(self.device)
        return test_model.get_loss(inputs, self.sharded(*inputs))

    def backward(self, loss: Any) -> None:
        assert self.test_model is not None  # for mypy: as in forward
        self.test_model.run_backward(loss)

    def details(self, report: Any) -> list[str]:
        """Nothing beyond the divergences: the engine's units have no mesh coordinates."""
        return []


@dataclasses.dataclass
class CheckCase:
    """One matrix row, run on every rank. See [Note: lockstep rows].

    Args:
        config: the row.
        steps: training steps (collectives are counted from step 2 on).
        out_dir: where each rank writes ``rank{N}.json``.
    """

    config: Config
    steps: int
    out_dir: str

    def run_on_rank(self, ctx: Any) -> None:
        reset_peak_rss()
        result: dict[str, Any] = {"rank": ctx.rank, "rss_start": current_rss_bytes()}
        start = time.perf_counter()
        try:
            result.update(self._train(ctx))
            result["status"] = "ok"
        except NotImplementedError as missing:
            result["status"] = "unavailable"
            result["message"] = f"{type(missing).__name__}: {missing}"
        result["peak_rss"] = peak_rss_bytes()
        result["wall_s"] = time.perf_counter() - start
        _write(self.out_dir, ctx.rank, result)

    def _train(self, ctx: Any) -> dict[str, Any]:
        setup = make_setup(self.config, ctx)
        log = CollectiveLog()
        loss_diff = 0.0
        param_diff: float | None = None
        failures: list[str] = []
        causes: list[str] | None = None  # read at the first step that diverged anywhere
        details: list[str] = []  # the mesh coordinates that differ, as check_parity says
        step_times: list[float] = []
        comm: list[dict[str, tuple[int, int]]] = []
        by_group: dict[str, dict[str, tuple[int, int]]] = {}

        @contextlib.contextmanager
        def measured() -> Iterator[None]:
            log.clear()
            with log.watching():
                begin = time.perf_counter()
                yield
                step_times.append(time.perf_counter() - begin)

        for step in range(1, self.steps + 1):
            report = setup.lockstep.step(around_sharded=measured)
            if step == 1 and self.steps > 1:
                step_times.clear()  # see [Note: lockstep rows]
            else:
                comm.append(log.totals())
                by_group = log.by_group()
            loss_diff = max(loss_diff, report.loss_diff)
            if report.param_diff is not None:
                param_diff = max(param_diff or 0.0, report.param_diff)
            if report.divergences and not failures:
                failures.extend(f"step {step}: {d}" for d in report.divergences[:5])
            if causes is None and _anyone_diverged(bool(report.divergences), ctx.process_group):
                causes = _likely_causes(setup.lockstep, report, ctx.process_group)
                details = [f"step {step}: {line}" for line in setup.details(report)]
        theory = (
            None  # a user's own parallelization has none: [Note: model-parallel rows]
            if not isinstance(setup, TrainingSetup)
            else theoretical_volume(
                setup.sharded,
                engine=setup.engine,
                full_shard=self.config.strategy in ("FULL_SHARD", "HYBRID_SHARD"),
            )
        )
        totals = theory.totals() if theory else None
        return {
            "comm_groups": {k: {g: list(v) for g, v in d.items()} for k, d in by_group.items()},
            "theory_groups": (
                {
                    kind: {g: list(v) for g, v in groups.items()}
                    for kind, groups in expected_groups(totals, self.config, setup.mesh).items()
                }
                if totals is not None
                else None
            ),
            "loss_diff": loss_diff,
            "param_diff": param_diff,
            "parity_failures": failures,
            "likely_causes": causes or [],
            "mesh_details": details,
            "comm": {k: list(v) for k, v in comm[-1].items()} if comm else {},
            "comm_consistent": all(c == comm[-1] for c in comm),
            "theory": {k: list(v) for k, v in totals.items()} if totals is not None else None,
            "layout": theory.layout if theory else None,
            "step_s": statistics.median(step_times) if step_times else None,
        }


def _anyone_diverged(diverged: bool, group: Any) -> bool:
    """Whether any rank of ``group`` diverged at this step (a collective)."""
    import torch.distributed as dist

    verdicts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(verdicts, diverged, group=group)
    return any(verdicts)


def _likely_causes(lockstep: Any, report: Any, group: Any) -> list[str]:
    """The likely causes of ``report``'s divergence, one line each (a collective)."""
    try:
        return [str(cause) for cause in lockstep.explain(report, group=group)]
    except Exception as error:  # never in place of the divergence itself
        return [f"the analysis failed ({type(error).__name__}: {error})"]


def _write(out_dir: str, rank: int, data: dict[str, Any]) -> None:
    path = os.path.join(out_dir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)
