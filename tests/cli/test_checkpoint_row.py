"""``fsdp-testing check --checkpoint FROM:TO``: a DCP checkpoint row per engine, which passes
for fsdp_core and fails, naming why, for an engine whose model ignores what it loads."""

from __future__ import annotations

import json
from typing import Any

import pytest

from fsdp_testing.cli import main
from fsdp_testing.cli._checkpoint_row import parse_reshard
from fsdp_testing.engines.fsdp_core import FSDPCoreEngine


class SkipsLoadingEngine(FSDPCoreEngine):
    """fsdp_core, but the wrapped model's ``state_dict`` hands out copies (so ``dcp.load``
    cannot write into the shards) and its ``load_state_dict`` loads nothing."""

    name = "skips_loading"

    def wrap(self, module: Any, process_group: Any = None, **fsdp_kwargs: Any) -> Any:
        from torch.nn.modules.module import _IncompatibleKeys

        wrapped = super().wrap(module, process_group, **fsdp_kwargs)
        state_dict = wrapped.state_dict
        wrapped.state_dict = lambda *args, **kwargs: {
            k: v.clone() for k, v in state_dict(*args, **kwargs).items()
        }
        wrapped.load_state_dict = lambda *args, **kwargs: _IncompatibleKeys([], [])
        return wrapped


def test_checkpoint_rows_pass_for_fsdp_core_and_catch_a_load_that_does_nothing(tmp_path, capsys):
    report = tmp_path / "check.json"
    code = main(
        [
            "check",
            *("--model", "nested", "--strategy", "FULL_SHARD", "--prefetch", "none"),
            *("--offload", "off", "--mp", "off"),
            *("--engine", "fsdp_core,tests.cli.test_checkpoint_row:SkipsLoadingEngine"),
            *("--checkpoint", "3:2", "--json", str(report)),
        ]
    )
    out = capsys.readouterr().out
    assert code == 1
    assert "MISMATCH: checkpoint 3->2 SkipsLoadingEngine" in out
    assert "does not hold the saved state" in out
    statuses = {r["label"]: r for r in json.loads(report.read_text())["rows"]}
    good = statuses["checkpoint 3->2 fsdp_core"]
    assert good["status"] == "ok" and 0 <= good["loss_max_abs_diff"] < 1e-5
    assert statuses["checkpoint 3->2 SkipsLoadingEngine"]["status"] == "MISMATCH"


@pytest.mark.parametrize("text", ["4", "4:0", "a:2", "4:2:1"])
def test_checkpoint_option_rejects_malformed_world_sizes(text, capsys):
    assert parse_reshard("4:2") == (4, 2)
    assert main(["check", "--model", "nested", "--checkpoint", text]) == 2
    assert "--checkpoint takes FROM:TO" in capsys.readouterr().err
