"""The ``requires_*`` and ``skip_if_*`` decorators of ``common_distributed``.

[Note: requirements decided in the parent]
A requirement this machine cannot meet (a backend torch was built without, an accelerator it
lacks, a package not installed) is known when the test module is imported, so it becomes
``unittest.skip`` with the real reason: the parent skips the test before any rank is involved
and the report says why. Requirements on the running world (``skip_if_odd_worldsize``) are
checked on the rank, against the world the test actually got. ROCm and sandcastle checks
(torch's own CI) never apply here and let the test run. ``skip_if_lt_x_gpu`` lives in
``testcase.py``: it also sets the minimum number of ranks (see [Note: CPU world size]).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
import unittest
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from fsdp_testing._rank.skips import TEST_SKIPS, multi_device_message
from fsdp_testing._unittest.world import running_world_size

from .env import TEST_CUDA, TEST_HPU, TEST_WITH_ROCM, TORCH_RELEASE, accelerator_count
from .parametrize import skip_but_pass_in_sandcastle_if

__all__ = [
    "ACCELERATOR_DIST_BACKENDS",
    "DDP_RANK_DEVICES",
    "at_least_x_gpu",
    "current_world_size",
    "get_required_world_size",
    "import_transformers_or_skip",
    "nccl_skip_if_lt_x_gpu",
    "require_n_gpus_for_nccl_backend",
    "requires_accelerator_dist_backend",
    "requires_ddp_rank",
    "requires_gloo",
    "requires_mpi",
    "requires_multicast_support",
    "requires_nccl",
    "requires_nccl_shrink",
    "requires_nccl_version",
    "requires_ucc",
    "requires_world_size",
    "requires_xccl",
    "skip_if_no_gpu",
    "skip_if_odd_worldsize",
    "skip_if_rocm_arch_multiprocess",
    "skip_if_rocm_multiprocess",
    "skip_if_rocm_ver_atleast_multiprocess",
    "skip_if_rocm_ver_lessthan_multiprocess",
    "skip_if_small_worldsize",
    "skip_if_win32",
    "sm_is_or_higher_than",
]

_F = TypeVar("_F", bound=Callable[..., Any])
ACCELERATOR_DIST_BACKENDS = ["nccl", "xccl", "hccl"]
DDP_RANK_DEVICES = ["cuda", "xpu"]


def current_world_size() -> int | None:
    """The world size of the test running on this rank (``world.running_world_size``), else
    ``$WORLD_SIZE``, else None."""
    value = running_world_size()
    if value is not None:
        return value
    raw = os.environ.get("WORLD_SIZE")
    return int(raw) if raw and raw.isdigit() else None


def _skip_unless(ok: bool, reason: str) -> Callable[[_F], _F]:
    # See [Note: requirements decided in the parent]
    return (lambda fn: fn) if ok else unittest.skip(reason)


def requires_ddp_rank(device: str) -> bool:
    """Whether DDP gives each rank its own ``device`` (CUDA, XPU)."""
    return device in DDP_RANK_DEVICES


def at_least_x_gpu(x: int) -> bool:
    """Whether this machine has at least ``x`` accelerators."""
    return accelerator_count() >= x


def skip_if_no_gpu(func: _F) -> _F:
    """Skip a test that gives each rank its own accelerator, on a machine without one (torch
    2.15's reason "accelerator is not available.", earlier ones' "CUDA is not available.")."""
    reason = TEST_SKIPS["no_accelerator" if TORCH_RELEASE >= (2, 15) else "no_cuda"].message
    return _skip_unless(accelerator_count() > 0, reason)(func)


def _world_check(code: str, fails: Callable[[int], bool]) -> Callable[[_F], _F]:
    def decorator(func: _F) -> _F:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            world = current_world_size()
            if world is not None and os.environ.get("BACKEND") != "mpi" and fails(world):
                raise unittest.SkipTest(f"{TEST_SKIPS[code].message} (world size {world})")
            return func(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorator


def skip_if_small_worldsize(func: _F) -> _F:
    """Skip on a world of fewer than 8 ranks (checked on the rank)."""
    return _world_check("small_worldsize", lambda world: world < 8)(func)


def skip_if_odd_worldsize(func: _F) -> _F:
    """Skip on an odd world size (checked on the rank)."""
    return _world_check("odd_worldsize", lambda world: world % 2 == 1)(func)


def require_n_gpus_for_nccl_backend(n: int, backend: str) -> Callable[[_F], _F]:
    """Skip when ``backend`` is nccl and fewer than ``n`` CUDA devices exist. For nccl the
    test carries ``_min_gpus_required = n``, as torch 2.15's decorators set it (torch's
    test/conftest.py reads it at collection to place the test on a machine with enough GPUs)."""
    enough = backend != "nccl" or (TEST_CUDA and torch.cuda.device_count() >= n)
    skip = _skip_unless(enough, multi_device_message(n))

    def decorator(func: _F) -> _F:
        decorated = skip(func)
        if backend == "nccl":
            decorated._min_gpus_required = n  # type: ignore[attr-defined]
        return decorated

    return decorator


def nccl_skip_if_lt_x_gpu(backend: str, x: int) -> Callable[[_F], _F]:
    """torch's spelling of :func:`require_n_gpus_for_nccl_backend` with swapped arguments."""
    return require_n_gpus_for_nccl_backend(x, backend)


def import_transformers_or_skip() -> Callable[[_F], _F]:
    """Skip unless the ``transformers`` package is installed."""
    found = importlib.util.find_spec("transformers") is not None
    return _skip_unless(found, f"{TEST_SKIPS['importerror'].message}: transformers")


def requires_world_size(n: int) -> Callable[[_F], _F]:
    """Ask for a world of ``n`` ranks. On CPU the test gets ``n`` CPU ranks; a machine with
    accelerators but fewer than ``n`` skips it (torch skips whenever fewer than ``n`` GPUs)."""

    def decorator(func: _F) -> _F:
        func._required_world_size = n  # type: ignore[attr-defined]
        available = accelerator_count()
        return _skip_unless(
            available == 0 or available >= n, f"requires {n} GPUs, found {available}"
        )(func)

    return decorator


def get_required_world_size(obj: Any, default: int) -> int:
    """The ``requires_world_size(n)`` of the test method ``obj`` is running, else ``default``."""
    name = getattr(obj, "_testMethodName", None)
    method = getattr(type(obj), name, None) if isinstance(name, str) else None
    value = getattr(method, "_required_world_size", None)
    return int(value) if value is not None else default


def _backend_requirement(available: bool, name: str) -> Callable[[_F], _F]:
    return skip_but_pass_in_sandcastle_if(
        not available, f"c10d was not compiled with the {name} backend"
    )


def requires_gloo() -> Callable[[_F], _F]:
    """Skip unless torch has the gloo backend."""
    return _backend_requirement(dist.is_gloo_available(), "Gloo")


def requires_nccl() -> Callable[[_F], _F]:
    """Skip unless torch has the NCCL backend."""
    return _backend_requirement(dist.is_nccl_available(), "NCCL")


def requires_ucc() -> Callable[[_F], _F]:
    """Skip unless torch has the UCC backend."""
    return _backend_requirement(dist.is_ucc_available(), "UCC")


def requires_xccl() -> Callable[[_F], _F]:
    """Skip unless torch has the XCCL backend (Intel GPUs)."""
    available = getattr(dist, "is_xccl_available", lambda: False)()
    return _backend_requirement(bool(available), "XCCL")


def requires_mpi() -> Callable[[_F], _F]:
    """Skip unless torch has the MPI backend."""
    return _backend_requirement(dist.is_mpi_available(), "MPI")


def requires_nccl_version(version: tuple[int, ...], msg: str) -> Callable[[_F], _F]:
    """Skip unless NCCL is at least ``version``; a machine without CUDA lets the test run, as
    torch does (its body decides what it needs)."""
    if not TEST_CUDA:
        return lambda fn: fn
    if not dist.is_nccl_available():
        return _backend_requirement(False, "NCCL")
    found = torch.cuda.nccl.version()
    return skip_but_pass_in_sandcastle_if(
        found < version,
        f"Requires NCCL version greater than or equal to: {version}, found: {found}, reason: {msg}",
    )


def requires_nccl_shrink() -> Callable[[_F], _F]:
    """Skip unless NCCL 2.27 or newer is available (for ``shrink_group``)."""
    return requires_nccl_version((2, 27), "Need NCCL 2.27+ for shrink_group")


def requires_accelerator_dist_backend(
    backends: Iterable[str] | None = None,
) -> Callable[[_F], _F]:
    """Skip unless one of ``backends`` (default nccl, xccl, hccl) is available."""
    wanted = list(backends) if backends is not None else ACCELERATOR_DIST_BACKENDS
    checks = {
        "nccl": dist.is_nccl_available,
        "xccl": getattr(dist, "is_xccl_available", lambda: False),
        "hccl": lambda: TEST_HPU,
    }
    available = any(checks.get(name, lambda: False)() for name in wanted)
    return skip_but_pass_in_sandcastle_if(
        not available, f"No accelerator communication backend available among {wanted}"
    )


def requires_multicast_support() -> Callable[[_F], _F]:
    """Skip unless CUDA symmetric memory supports multicast on device 0."""
    supported = False
    if TEST_CUDA:
        from torch._C._autograd import DeviceType
        from torch._C._distributed_c10d import _SymmetricMemory

        supported = bool(_SymmetricMemory.has_multicast_support(DeviceType.CUDA, 0))
    return skip_but_pass_in_sandcastle_if(not supported, "multicast support is not available")


def _rocm_only(reason: str) -> Callable[[_F], _F]:
    # ROCm checks concern torch's ROCm CI only: elsewhere the test runs unchanged.
    return unittest.skip(reason) if TEST_WITH_ROCM else (lambda fn: fn)


def skip_if_rocm_multiprocess(func: _F) -> _F:
    """Skip on ROCm builds; runs everywhere else."""
    return _rocm_only(TEST_SKIPS["skipIfRocm"].message)(func)


def skip_if_rocm_arch_multiprocess(arch: tuple[str, ...]) -> Callable[[_F], _F]:
    """Skip on the ROCm GPU architectures ``arch``; runs everywhere else."""
    if not TEST_WITH_ROCM:
        return lambda fn: fn
    found = torch.cuda.get_device_properties(0).gcnArchName.split(":")[0]
    return _skip_unless(
        found not in arch, f"skip_if_rocm_arch_multiprocess: test skipped on {arch}"
    )


def _rocm_release() -> tuple[int, ...]:
    # The ROCm release: torch.version.rocm where the build records it, else the HIP runtime's
    # version (which tracks it on released ROCm), without its git suffix.
    version = getattr(torch.version, "rocm", None) or torch.version.hip
    return tuple(int(part) for part in str(version).split("-", 1)[0].split("."))


def skip_if_rocm_ver_lessthan_multiprocess(
    version: tuple[int, ...] | None = None,
) -> Callable[[_F], _F]:
    """Skip on ROCm older than ``version``; runs everywhere else."""
    if not TEST_WITH_ROCM:
        return lambda fn: fn
    found = _rocm_release()
    return _skip_unless(
        version is not None and found >= tuple(version),
        f"skip_if_rocm_ver_lessthan_multiprocess: ROCm {found} is available but {version} required",
    )


def skip_if_rocm_ver_atleast_multiprocess(
    version: tuple[int, ...] | None = None,
) -> Callable[[_F], _F]:
    """Skip on ROCm ``version`` or newer (a known failure there); runs everywhere else."""
    if not TEST_WITH_ROCM or version is None:
        return lambda fn: fn
    found = _rocm_release()
    return _skip_unless(
        found < tuple(version),
        f"skip_if_rocm_ver_atleast_multiprocess: known failure on ROCm {found} (>= {version})",
    )


def skip_if_win32() -> Callable[[_F], _F]:
    """Skip on Windows."""
    return skip_but_pass_in_sandcastle_if(
        sys.platform == "win32", "This unit test case is not supported on Windows platform"
    )


def sm_is_or_higher_than(device: torch.device, major: int, minor: int) -> bool:
    """Whether a CUDA ``device``'s compute capability is at least ``(major, minor)``; True for
    non-CUDA devices, False on ROCm (whose capability numbers mean something else)."""
    if device.type != "cuda":
        return True
    if torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device) >= (major, minor)
