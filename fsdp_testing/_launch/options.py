"""The plugin's command-line options and ini keys, and the session settings read from them
(``fsdp_testing/plugin.py`` registers them; docs/pytest-api.md lists them)."""

from __future__ import annotations

from typing import Any

import pytest

from fsdp_testing._launch.spec import DEFAULT_TIMEOUT_S

__all__ = ["add_options", "configure_cpu_world_size", "settings_from"]


def add_options(parser: pytest.Parser) -> None:
    """``pytest_addoption``: the options and their ini defaults."""
    group = parser.getgroup("fsdp_testing", "distributed tests (fsdp_testing)")
    group.addoption(
        "--dist-timeout",
        dest="dist_timeout",
        default=None,
        metavar="SECONDS",
        help=f"seconds before a distributed test counts as hung (default {DEFAULT_TIMEOUT_S:g}).",
    )
    group.addoption(
        "--dist-backend",
        dest="dist_backend",
        default=None,
        metavar="NAME",
        help="backend for process-mode tests whose marker names none (gloo or nccl; default: "
        "nccl when CUDA has enough devices, else gloo).",
    )
    group.addoption(
        "--no-dist-pool",
        dest="dist_pool",
        action="store_false",
        default=None,
        help="start fresh rank processes for every test instead of keeping them warm.",
    )
    group.addoption(
        "--fsdp-engine",
        dest="fsdp_engine",
        default=None,
        metavar="NAME",
        help="engine the reference models and parity checks shard with: fsdp_core (default), "
        "torch_fsdp1 or torch_fsdp2.",
    )
    group.addoption(
        "--cpu-world-size",
        dest="cpu_world_size",
        default=None,
        metavar="N",
        help="ranks for torch-style test classes whose world_size comes out as 0 on a machine "
        "without GPUs (default 2; never fewer than their skip_if_lt_x_gpu(n)).",
    )
    parser.addini("cpu_world_size", "default --cpu-world-size", default=None)
    parser.addini("dist_timeout", "default --dist-timeout", default=None)
    parser.addini("fsdp_engine", "default --fsdp-engine", default=None)
    parser.addini("dist_backend", "default --dist-backend", default=None)
    parser.addini("dist_pool", "keep rank processes warm between tests", type="bool", default=True)


def settings_from(config: pytest.Config) -> Any:
    """The session's :class:`~fsdp_testing.launcher.LaunchSettings`; a bad value is a usage
    error naming it."""
    from fsdp_testing.launcher import LaunchSettings

    raw_timeout = config.getoption("dist_timeout") or config.getini("dist_timeout")
    timeout = DEFAULT_TIMEOUT_S
    if raw_timeout not in (None, ""):
        try:
            timeout = float(raw_timeout)
        except (TypeError, ValueError):
            timeout = -1.0
        if not timeout > 0:
            raise pytest.UsageError(
                f"--dist-timeout / dist_timeout must be a positive number of seconds, got "
                f"{raw_timeout!r}"
            )
    backend = config.getoption("dist_backend") or config.getini("dist_backend") or None
    if backend is not None and backend not in ("gloo", "nccl"):
        raise pytest.UsageError(
            f"--dist-backend / dist_backend must be gloo or nccl, got {backend!r} "
            "(thread, local and fake modes are chosen on the marker: mode='thread', "
            "mode='local' or mode='fake')"
        )
    pool = config.getoption("dist_pool")
    if pool is None:
        pool = bool(config.getini("dist_pool"))
    tbstyle = str(config.getoption("tbstyle", "auto"))
    return LaunchSettings(timeout=timeout, backend=backend, pool=pool, tbstyle=tbstyle)


def configure_cpu_world_size(config: pytest.Config) -> None:
    """``--cpu-world-size`` / ``cpu_world_size``: the world size of torch-style test classes
    whose own comes out as 0 without GPUs."""
    from fsdp_testing._unittest.world import set_cpu_world_size

    raw = config.getoption("cpu_world_size") or config.getini("cpu_world_size")
    if raw in (None, ""):
        return
    try:
        set_cpu_world_size(int(str(raw).strip()))
    except ValueError:
        raise pytest.UsageError(
            f"--cpu-world-size / cpu_world_size must be a positive number of ranks, got {raw!r}"
        ) from None
