"""The checkpoint rows of ``fsdp-testing check --checkpoint FROM:TO``: per engine, a DCP
checkpoint saved at ``FROM`` ranks and resumed at ``TO`` ranks must continue with the losses of
the uninterrupted run.

[Note: checkpoint rows]
A row is :func:`fsdp_testing.parity.check_resume_parity` (see [Note: resuming at another world
size]) on a small MLP of two blocks, each block a unit (the engine's ``module_wrap_policy``),
AdamW, four steps, saved after two. Both world sizes run in one launch of ``max(FROM, TO)``
ranks. The row's loss difference is the largest absolute difference between the resumed and
the uninterrupted losses; a load that does not restore the saved parameters bitwise, or losses
outside ``FP32_TOLERANCE``, make it a mismatch. Communication is not measured here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import time
from typing import TYPE_CHECKING, Any

from ._matrix import Config
from ._report import ERROR, MISMATCH, OK, UNAVAILABLE, RowResult

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["CheckpointCase", "CheckpointConfig", "parse_reshard", "run_checkpoint_rows"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig(Config):
    """A checkpoint row: the engine, and the world sizes it saves at and resumes at."""

    from_world: int
    to_world: int

    @property
    def label(self) -> str:
        return f"checkpoint {self.from_world}->{self.to_world} {self.engine_name}"


def parse_reshard(text: str) -> tuple[int, int]:
    """``"4:2"`` -> ``(4, 2)``; raises ``ValueError`` naming the expected form."""
    parts = text.split(":")
    if len(parts) != 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise ValueError(
            f"--checkpoint takes FROM:TO, two world sizes of at least 1 (e.g. 4:2), got {text!r}"
        )
    return int(parts[0]), int(parts[1])


def checkpoint_configs(engines: tuple[str, ...], reshard: tuple[int, int]) -> list[Config]:
    """One checkpoint row per engine."""
    return [
        CheckpointConfig(
            model="checkpoint",
            strategy="FULL_SHARD",
            prefetch="BACKWARD_PRE",
            offload="off",
            mp="off",
            engine=engine,
            from_world=reshard[0],
            to_world=reshard[1],
        )
        for engine in engines
    ]


def _build() -> Any:
    import torch
    from torch import nn

    model = nn.Sequential(
        nn.Sequential(nn.Linear(8, 12), nn.ReLU()),
        nn.Sequential(nn.Linear(12, 10), nn.ReLU()),
        nn.Linear(10, 4),
    )
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    return model


def _batch(step: int) -> Any:
    import torch

    return torch.randn(12, 8, generator=torch.Generator().manual_seed(1000 + step))


@dataclasses.dataclass
class CheckpointCase:
    """One checkpoint row, run on every rank. See [Note: checkpoint rows]."""

    config: CheckpointConfig
    out_dir: str

    def run_on_rank(self, ctx: Any) -> None:
        from torch import nn

        from fsdp_testing.engines import resolve_engine
        from fsdp_testing.parity import check_resume_parity

        engine = resolve_engine(self.config.engine)

        def shard(model: nn.Module, group: Any) -> nn.Module:
            policy = engine.module_wrap_policy({nn.Sequential})
            return engine.wrap(model, group, auto_wrap_policy=policy)

        result: dict[str, Any] = {"rank": ctx.rank}
        try:
            report = check_resume_parity(
                _build,
                shard,
                _batch,
                process_group=ctx.process_group,
                checkpoint_dir=os.path.join(self.out_dir, "checkpoint"),
                from_world=self.config.from_world,
                to_world=self.config.to_world,
            )
            expected = report.reference_losses[report.save_after :]
            diffs = [abs(a - b) for a, b in zip(report.resumed_losses, expected, strict=True)]
            result.update(status=OK, loss_diff=max(diffs, default=0.0))
        except AssertionError as mismatch:
            result.update(status=MISMATCH, message=str(mismatch))
        except NotImplementedError as missing:
            result.update(status=UNAVAILABLE, message=f"NotImplementedError: {missing}")
        path = os.path.join(self.out_dir, f"rank{ctx.rank}.json")
        with open(path, "w") as f:
            json.dump(result, f)


def run_checkpoint_rows(
    configs: list[Config], *, timeout: float, console: Console | None = None
) -> list[RowResult]:
    """Run each checkpoint row as one distributed task of ``max(FROM, TO)`` gloo ranks."""
    from fsdp_testing._launch.spec import DistSpec, Mode
    from fsdp_testing._protocol import Task
    from fsdp_testing.launcher import LaunchSettings, run_distributed

    from ._render import ProgressDisplay

    rows = []
    with ProgressDisplay(len(configs), console) as progress:
        for config in configs:
            if not isinstance(config, CheckpointConfig):
                raise TypeError(f"run_checkpoint_rows takes CheckpointConfigs, got {config!r}")
            world = max(config.from_world, config.to_world)
            spec = DistSpec(world, backend="gloo", mode=Mode.PROCESS, timeout=timeout)
            progress.start(config.label)
            out_dir = tempfile.mkdtemp(prefix="fsdp-testing-checkpoint-")
            begin = time.monotonic()
            try:
                task = Task(CheckpointCase(config, out_dir), {}, test_id=config.label)
                verdict = run_distributed(task, spec, LaunchSettings(timeout=timeout))
                ranks = [_read(out_dir, r) for r in range(world)]
            finally:
                shutil.rmtree(out_dir, ignore_errors=True)
            row = _row(config, verdict.outcome, verdict.message, [r for r in ranks if r])
            row.time_s = time.monotonic() - begin
            note = row.problems[0][:100] if row.problems else ""
            progress.finish(config.label, row.status, row.time_s, note)
            rows.append(row)
    return rows


def _read(out_dir: str, rank: int) -> dict[str, Any] | None:
    path = os.path.join(out_dir, f"rank{rank}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        data: dict[str, Any] = json.load(f)
    return data


def _row(config: Config, outcome: str, message: str, ranks: list[dict[str, Any]]) -> RowResult:
    row = RowResult(config, OK)
    statuses = {r["status"] for r in ranks}
    if not ranks or (outcome != "passed" and MISMATCH not in statuses):
        row.status = ERROR
        row.problems = (message or f"the ranks' outcome: {outcome}").splitlines()[:40]
    elif statuses != {OK}:
        row.status = MISMATCH if MISMATCH in statuses else UNAVAILABLE
        row.problems = sorted({r["message"] for r in ranks if "message" in r})
    else:
        row.loss_diff = max(r["loss_diff"] for r in ranks)
    return row
