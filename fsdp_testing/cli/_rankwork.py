"""What the CLI runs on every rank: one matrix row of ``check``, or the steps of ``trace``.

The tasks are picklable objects with ``run_on_rank(ctx)`` (see ``fsdp_testing/_task.py``); each
rank writes what it measured as JSON into a directory the parent reads afterwards.

[Note: lockstep rows]
A row trains the sharded model and its data parallel reference side by side with SGD and
momentum, comparing the loss and every full parameter after every step. Collectives are counted
only while the sharded model runs one step, and only from the second step on: the first
iteration also validates the units' order across ranks (one small all-reduce per unit
collective) and records the order that prefetching follows.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import statistics
import time
from typing import Any

from ._matrix import MODELS, Config
from ._measure import (
    CollectiveLog,
    current_rss_bytes,
    peak_rss_bytes,
    reset_peak_rss,
    theoretical_volume,
)

__all__ = ["CheckCase", "TrainingSetup", "resolve_engine"]

_LR = 0.01

# [Note: mixed precision rows]
# The reference runs under autocast in the low dtype, the sharded model under its mixed
# precision policy (as torch's _test_fsdp_parity); parameters are not compared. Autocast keeps
# some ops in float32 (softmax, layer norm, losses) and float32 parameters in compute, the
# policy computes everything in the low dtype, so the two are different computations. At step 1
# both start from the same parameters and the losses agree to the low dtype's resolution
# (torch.testing's default tolerance for it). From step 2 on the models also carry updates made
# from gradients computed in different precisions, and the losses drift apart by more than a
# few ulps: the transformer by up to 2.5% (bf16) and 1.1% (fp16) at 3 steps, the same to the
# bit with fsdp_core, FSDP1 and FSDP2, so it is precision, not sharding. Later steps allow the
# relative drift below (those maxima with margin); a gradient that is not averaged moves the
# loss by far more (tests/cli), and the mp=off rows check exact parity.
_LOW_PRECISION_DRIFT = {"torch.bfloat16": 5e-2, "torch.float16": 2.5e-2}


def resolve_engine(name: str) -> Any:
    """A registered engine, or the object (instantiated if a class) that ``module:attr``
    names."""
    if ":" in name:
        module_name, _, attribute = name.partition(":")
        found = getattr(importlib.import_module(module_name), attribute)
        return found() if isinstance(found, type) else found
    from fsdp_testing.engines import get_engine

    return get_engine(name)


def _options(config: Config) -> dict[str, Any]:
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


class TrainingSetup:
    """The sharded model, its reference and their optimizers for one row."""

    def __init__(self, config: Config, ctx: Any) -> None:
        import torch
        from torch.nn.parallel import DistributedDataParallel

        from fsdp_testing import models
        from fsdp_testing.engines import use_engine
        from fsdp_testing.parity import _test_model

        class_name, reference = MODELS[config.model]
        model_class = getattr(models, class_name)
        group, device = ctx.process_group, ctx.device
        self.device = device
        self.engine = resolve_engine(config.engine)
        plain = model_class.init(
            group,
            models.FSDPInitMode.NO_FSDP,
            models.DEVICEInitMode.DEVICE_BEFORE,
            deterministic=True,
            device=device,
        )
        self.reference = (
            models.DummyDDP(plain)
            if reference == "self"
            else DistributedDataParallel(plain, process_group=group)
        )
        options = _options(config)
        with use_engine(self.engine):
            sharded = model_class.init(
                group,
                models.FSDPInitMode.RECURSIVE,
                models.DEVICEInitMode.DEVICE_BEFORE,
                options,
                deterministic=True,
                device=device,
            )
            if not self.engine.is_wrapped(sharded):
                # The reference is data parallel over the whole model: shard the root too.
                sharded = self.engine.wrap(sharded, group, **options)
        self.sharded = sharded
        policy = options.get("mixed_precision")
        self.mp_dtype = policy.param_dtype if policy is not None else None
        self.test_model = _test_model(sharded)
        self.ref_test_model = _test_model(self.reference)
        self.optim = torch.optim.SGD(sharded.parameters(), lr=_LR, momentum=0.9)
        self.ref_optim = torch.optim.SGD(self.reference.parameters(), lr=_LR, momentum=0.9)

    def step(self, sharded: bool) -> Any:
        import torch

        model = self.sharded if sharded else self.reference
        test_model = self.test_model if sharded else self.ref_test_model
        optim = self.optim if sharded else self.ref_optim
        # The reference computes in the low precision under autocast; the sharded model casts
        # itself (its mixed precision policy).
        autocast = self.mp_dtype is not None and not sharded
        optim.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, dtype=self.mp_dtype, enabled=autocast):
            inputs = test_model.get_input(self.device)
            loss = test_model.get_loss(inputs, model(*inputs))
        test_model.run_backward(loss)
        optim.step()
        return loss.detach().float()

    def full_params(self) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
        from fsdp_testing.engines import clean_param_name
        from fsdp_testing.parity import _reference_body

        ref = [
            (clean_param_name(n), p.detach().clone())
            for n, p in _reference_body(self.reference).named_parameters()
        ]
        try:
            mine = self.engine.named_full_params(self.sharded)
        except NotImplementedError:
            mine = _core_full_params(self.sharded)
            if mine is None:
                raise
        return ref, mine


def _core_full_params(model: Any) -> list[tuple[str, Any]] | None:
    """fsdp_core parameters gathered from the local shards the optimizer steps, for as long as
    the core has no ``summon_full_params``; None for other layouts."""
    import torch
    import torch.distributed as dist

    try:
        from fsdp_core import FullyShardedDataParallel as CoreFSDP
    except ImportError:
        return None
    instances = CoreFSDP.fsdp_modules(model)
    if not instances:
        return None
    names = {id(p): n for n, p in model.named_parameters()}
    found: dict[str, Any] = {}
    for instance in instances:
        unit = instance._unit
        if unit is None:
            continue
        for sp in unit.params:
            name = names[id(sp.sharded)]
            if unit.replicate:
                found[name] = sp.sharded.detach().clone()
                continue
            shards = [torch.empty_like(sp.padded_shard) for _ in range(unit.group_size)]
            dist.all_gather(shards, sp.padded_shard.detach().contiguous(), group=unit.group)
            found[name] = torch.cat(shards)[: sp.rows].clone()
    return [(n, found[n]) for n, _ in model.named_parameters() if n in found]


def _low_precision_loss_divergence(ref_loss: Any, loss: Any, dtype: Any, step: int) -> Any:
    """A divergence of the sharded loss from the autocast reference's, or None.

    See [Note: mixed precision rows].
    """
    import torch

    from fsdp_testing._compare import Divergence, tensor_divergence

    expected = ref_loss.to(dtype)
    if step == 1:
        return tensor_divergence("loss", expected, loss)
    rtol = _LOW_PRECISION_DRIFT[str(dtype)]
    if torch.isclose(loss.double(), expected.double(), rtol=rtol, atol=0.0).all():
        return None
    worst = float((loss.double() - expected.double()).abs().max())
    return Divergence("loss", worst, f"more than {rtol:.1%} relative from step 2 on")


def _max_abs_diff(pairs: list[tuple[str, Any, Any]]) -> float:
    import torch

    worst = 0.0
    for _, ref, mine in pairs:
        if ref is None or mine is None or ref.shape != mine.shape:
            return float("inf")
        if ref.numel():
            diff = (mine.detach().cpu().double() - ref.detach().cpu().double()).abs().max()
            worst = max(worst, float(diff)) if not torch.isnan(diff) else float("nan")
    return worst


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
        from fsdp_testing._compare import align_named, compare_named

        models = TrainingSetup(self.config, ctx)
        low_precision = models.mp_dtype is not None
        log = CollectiveLog()
        loss_diff = param_diff = 0.0
        failures: list[str] = []
        step_times: list[float] = []
        comm: list[dict[str, tuple[int, int]]] = []
        for step in range(1, self.steps + 1):
            ref_loss = models.step(sharded=False)
            log.clear()
            counted = step > 1 or self.steps == 1
            with log.watching():
                begin = time.perf_counter()
                loss = models.step(sharded=True)
                elapsed = time.perf_counter() - begin
            if counted:
                step_times.append(elapsed)
                comm.append(log.totals())
            loss_diff = max(loss_diff, abs(float(loss) - float(ref_loss)))
            if low_precision:
                # See [Note: mixed precision rows].
                bad = _low_precision_loss_divergence(ref_loss, loss, models.mp_dtype, step)
                if bad is not None and not failures:
                    failures.append(f"step {step}: {bad}")
                continue
            ref_params, params = models.full_params()
            param_diff = max(param_diff, _max_abs_diff(align_named(ref_params, params)))
            found = compare_named([("loss", ref_loss)], [("loss", loss)])
            found += compare_named(ref_params, params)
            if found and not failures:
                failures.extend(f"step {step}: {d}" for d in found[:5])
        theory = theoretical_volume(models.sharded, full_shard=self.config.strategy == "FULL_SHARD")
        return {
            "loss_diff": loss_diff,
            "param_diff": None if low_precision else param_diff,
            "parity_failures": failures,
            "comm": {k: list(v) for k, v in comm[-1].items()} if comm else {},
            "comm_consistent": all(c == comm[-1] for c in comm),
            "theory": {k: list(v) for k, v in theory.totals().items()} if theory else None,
            "layout": theory.layout if theory else None,
            "step_s": statistics.median(step_times) if step_times else None,
        }


def _write(out_dir: str, rank: int, data: dict[str, Any]) -> None:
    path = os.path.join(out_dir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)
