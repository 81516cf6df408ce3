"""Local mode's numbers equal a real run's: the same collectives on random data (every op,
dtype and size class, segments of gloo's ring included) and fsdp_core's training (both doors,
hybrid on a 2x2 mesh, SGD with momentum, 3 steps), run on 4 gloo rank processes and in local
mode, compared bit for bit on every rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .._scenario import Run, run_scenario

SCENARIOS = Path(__file__).parent / "scenarios"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, Path]:
    work = tmp_path_factory.mktemp("exact")
    out = work / "out"
    result = run_scenario(
        work, "test_exact.py", env={"EXACT_OUT": str(out)}, scenarios=SCENARIOS, timeout=900
    )
    return result, out


def _load(out: Path, mode: str, name: str, rank: int) -> object:
    return torch.load(out / mode / name / f"rank{rank}.pt")


def _assert_bitwise(gloo: object, local: object, where: str) -> None:
    if isinstance(gloo, torch.Tensor):
        assert isinstance(local, torch.Tensor), where
        assert gloo.dtype == local.dtype and gloo.shape == local.shape, where
        same = torch.equal(gloo.reshape(-1).view(torch.uint8), local.reshape(-1).view(torch.uint8))
        assert same, f"{where}: max difference {(gloo.double() - local.double()).abs().max()}"
    elif isinstance(gloo, dict):
        assert isinstance(local, dict) and gloo.keys() == local.keys(), where
        for key in gloo:
            _assert_bitwise(gloo[key], local[key], f"{where} / {key}")
    else:
        assert isinstance(gloo, list) and isinstance(local, list), where
        assert len(gloo) == len(local), where
        for i, (a, b) in enumerate(zip(gloo, local, strict=True)):
            _assert_bitwise(a, b, f"{where}[{i}]")


@pytest.mark.parametrize(
    "name",
    ["collectives", "train_composable", "train_wrapper", "train_hybrid", "train_hybrid_wrapper"],
)
def test_local_mode_equals_gloo_bit_for_bit(run: tuple[Run, Path], name: str) -> None:
    result, out = run
    suffix = name.removeprefix("train_")
    for mode in ("gloo", "local"):
        case = f"test_{name.split('_')[0]}_{mode}" + (f"[{suffix}]" if name != suffix else "")
        assert result.cases[case].outcome == "passed", result.cases[case].text
    for rank in range(4):
        gloo = _load(out, "process", name, rank)
        local = _load(out, "local", name, rank)
        _assert_bitwise(gloo, local, f"{name} rank {rank}")
