"""``common_fsdp``'s test classes and helpers on fsdp_testing's launcher.

[Note: the mirror's engine]
A file moved off ``torch.testing._internal`` by its imports alone has a body written against
torch's FSDP (``isinstance(m, FullyShardedDataParallel)``, ``fully_shard``, FSDP1 internals).
So the torch-compatible classes build the reference models and run ``_test_fsdp_parity`` with
torch's FSDP1 (engine ``torch_fsdp1``), and the unit patches (``patch_unshard``, ...) reach
torch's FSDP2, as torch's helpers do (the body's own ``fully_shard`` is torch's; pass
``engine=`` to patch another engine's units). fsdp_core is chosen explicitly for the models and
parity: ``--fsdp-engine fsdp_core`` (or the ini key), or ``fsdp_engine = "fsdp_core"`` on the
class. The native API (``@pytest.mark.distributed``, ``fsdp_testing.parity``, the CLI) defaults
to fsdp_core.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_testing import patching as _patching
from fsdp_testing._protocol import ENGINE_ENV
from fsdp_testing._report.text import add_note
from fsdp_testing._unittest.world import cpu_world_size
from fsdp_testing.engines import engine_for, use_engine
from fsdp_testing.parity import FSDPParityMixin
from fsdp_testing.parity import check_sharded_parity as _native_check_sharded_parity
from fsdp_testing.testcase import MultiProcessTestCase, MultiThreadedTestCase, run_subtests

from .classes import MultiProcContinuousTest
from .env import DEVICE_TYPE, DISTRIBUTED_BACKEND, accelerator_count, set_rng_seed

__all__ = [
    "DummyProcessGroup",
    "FSDPTest",
    "FSDPTestContinuous",
    "FSDPTestMixin",
    "FSDPTestMultiThread",
    "check_sharded_parity",
    "compiled_fsdp_test",
    "get_devtype",
    "mirror_engine",
    "patch_all_gather",
    "patch_all_reduce",
    "patch_foreach_all_gather",
    "patch_foreach_reduce",
    "patch_post_backward",
    "patch_reduce_scatter",
    "patch_register_post_backward_hook_backward",
    "patch_reshard",
    "patch_unshard",
    "subtest_name",
]

_F = TypeVar("_F", bound=Callable[..., Any])
MIRROR_ENGINE = "torch_fsdp1"


def _explicit_engine() -> str | None:
    """The engine chosen with ``--fsdp-engine``/ini (travels to ranks in the environment)."""
    return os.environ.get(ENGINE_ENV) or None


def mirror_engine(test_case: object = None) -> str:
    """The engine a torch-compatible test shards its models with (see [Note: the mirror's
    engine]): the class's ``fsdp_engine``, else the session's ``--fsdp-engine``, else
    ``torch_fsdp1``."""
    chosen = getattr(test_case, "fsdp_engine", None)
    return cast(str, chosen or _explicit_engine() or MIRROR_ENGINE)


def _unit_engine(engine: object) -> Any:
    # torch's unit patches target FSDP2's FSDPParamGroup, which is what a torch-style body's
    # fully_shard uses whatever --fsdp-engine says; engine= reaches another engine's units.
    return engine if engine is not None else "torch_fsdp2"


def get_devtype() -> torch.device:
    """``torch.device`` of the device type tests run on (cuda, xpu, hpu or cpu)."""
    return torch.device(DEVICE_TYPE)


def subtest_name(test_name_mapping: dict[str, str], *args: Any) -> str:
    """A test-name suffix: each argument's ``str`` looked up in ``test_name_mapping``, ``none``
    for None, joined by underscores."""
    return "_".join(test_name_mapping[str(a)] if a is not None else "none" for a in args)


# -- patching, with torch's signatures ----------------------------------------------------------


def patch_all_gather(
    new_all_gather_into_tensor: Callable[..., Any],
) -> contextlib.AbstractContextManager[Callable[..., Any]]:
    """torch's ``patch_all_gather``: see :func:`fsdp_testing.patching.patch_all_gather` (both
    collective spellings, thread-rank safe)."""
    return _patching.patch_all_gather(new_all_gather_into_tensor)


def patch_reduce_scatter(
    new_reduce_scatter_tensor: Callable[..., Any],
) -> contextlib.AbstractContextManager[Callable[..., Any]]:
    """torch's ``patch_reduce_scatter``: see :func:`fsdp_testing.patching.patch_reduce_scatter`."""
    return _patching.patch_reduce_scatter(new_reduce_scatter_tensor)


def patch_all_reduce(
    new_all_reduce: Callable[..., Any],
) -> contextlib.AbstractContextManager[Callable[..., Any]]:
    """torch's ``patch_all_reduce``: see :func:`fsdp_testing.patching.patch_all_reduce`."""
    return _patching.patch_all_reduce(new_all_reduce)


def patch_unshard(
    new_unshard: Callable[..., Any], *, engine: Any = None
) -> contextlib.AbstractContextManager[Callable[..., Any]]:
    """torch's ``patch_unshard`` (FSDP2's ``FSDPParamGroup.unshard``; see [Note: the mirror's
    engine]); ``engine=`` picks another engine's unshard."""
    return _patching.patch_unshard(new_unshard, engine=_unit_engine(engine))


def patch_reshard(
    new_reshard: Callable[..., Any], *, engine: Any = None
) -> contextlib.AbstractContextManager[Callable[..., Any]]:
    """torch's ``patch_reshard`` (FSDP2's ``FSDPParamGroup.reshard``)."""
    return _patching.patch_reshard(new_reshard, engine=_unit_engine(engine))


def patch_post_backward(
    new_post_backward: Callable[..., Any], *, engine: Any = None
) -> contextlib.AbstractContextManager[Callable[..., Any]]:
    """torch's ``patch_post_backward`` (FSDP2's ``FSDPParamGroup.post_backward``)."""
    return _patching.patch_post_backward(new_post_backward, engine=_unit_engine(engine))


def patch_register_post_backward_hook_backward(
    new_backward: Callable[..., Any], *, engine: Any = None
) -> contextlib.AbstractContextManager[Callable[..., Any]]:
    """torch's ``patch_register_post_backward_hook_backward`` (FSDP2's
    ``RegisterPostBackwardFunction.backward``)."""
    return _patching.patch_register_post_backward_hook_backward(
        new_backward, engine=_unit_engine(engine)
    )


def _foreach_target(name: str) -> Any:
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    from fsdp_testing.engines import PatchTarget

    if not hasattr(_fsdp_param_group, name):
        raise NotImplementedError(
            f"patch_{name}: torch {torch.__version__}'s FSDP2 has no "
            f"_fsdp_param_group.{name} to patch"
        )
    return PatchTarget(_fsdp_param_group, name)


def patch_foreach_all_gather(
    new_foreach_all_gather: Callable[..., Any],
) -> contextlib.AbstractContextManager[Callable[..., Any]]:
    """Replace FSDP2's ``foreach_all_gather`` (the one all-gather of a parameter group) for the
    calling rank; thread-rank safe and chainable like the other patches. Yields the next
    implementation down."""
    return _patching.patched(_foreach_target("foreach_all_gather"), new_foreach_all_gather)


def patch_foreach_reduce(
    new_foreach_reduce: Callable[..., Any],
) -> contextlib.AbstractContextManager[Callable[..., Any]]:
    """Replace FSDP2's ``foreach_reduce`` (a group's gradient reduce-scatter/all-reduce) for the
    calling rank. Yields the next implementation down."""
    return _patching.patched(_foreach_target("foreach_reduce"), new_foreach_reduce)


# -- parity -------------------------------------------------------------------------------------


def check_sharded_parity(
    cls: Any,
    replicated_module: nn.Module,
    sharded_module: nn.Module,
    prefixes_to_ignore: tuple[str, ...] = (),
) -> None:
    """torch's signature: compare each ``DTensor`` parameter (and gradient) of
    ``sharded_module`` with the same shard of ``replicated_module``'s; ``cls`` is the running
    test case (kept for torch's signature). Names must match once ``prefixes_to_ignore`` are
    removed from the sharded names.

    Args:
        cls: the test case.
        replicated_module: the reference, identical on every rank.
        sharded_module: the sharded module.
        prefixes_to_ignore: substrings removed from sharded parameter names.
    """
    del cls
    _native_check_sharded_parity(replicated_module, sharded_module, tuple(prefixes_to_ignore))


class DummyProcessGroup:
    """A stand-in process group of ``size`` ranks seen from ``rank``: ``allreduce`` returns a
    completed work whose future holds 1 (for code that only needs a group object)."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def allreduce(self, *args: Any, **kwargs: Any) -> _CompletedWork:
        return _CompletedWork()


class _CompletedWork:
    def get_future(self) -> torch.futures.Future[Any]:
        future: torch.futures.Future[Any] = torch.futures.Future()
        future.set_result(1)
        return future

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


# -- compiled_fsdp_test -------------------------------------------------------------------------


class _FullyShardMode(enum.Enum):
    EAGER = "eager"
    COMPILED_COMPUTE = "compiled compute"


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def compiled_fsdp_test(compile_compute_on_module: type | None = None) -> Callable[[_F], _F]:
    """Run an FSDP2 test twice: eagerly, then with each module passed to ``fully_shard``
    (or only instances of ``compile_compute_on_module``) compiled with ``torch.compile``,
    on CPU too (inductor's C++ backend; torch needs Triton and skips the compiled pass on CPU).

    The test module's global ``fully_shard`` (torch's when the module has none) is what both
    runs shard with; for the compiled run it is wrapped, and afterwards the module's global is
    exactly what it was before, so later tests in the same (warm) rank shard with it too.
    Barriers around the swap keep thread ranks in step.

    Args:
        compile_compute_on_module: compile only modules of this type (default: every one).
    """

    def decorator(func: _F) -> _F:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> None:
            from torch.distributed.fsdp import fully_shard as torch_fully_shard

            name = torch_fully_shard.__name__
            module_globals = func.__globals__
            missing = object()
            previous = module_globals.get(name, missing)
            original = torch_fully_shard if previous is missing else previous

            def fully_shard_and_compile(*shard_args: Any, **shard_kwargs: Any) -> Any:
                result = original(*shard_args, **shard_kwargs)
                module = shard_args[0] if shard_args else shard_kwargs["module"]
                if compile_compute_on_module is None or isinstance(
                    module, compile_compute_on_module
                ):
                    module.compile()
                return result

            for mode in _FullyShardMode:
                import torch._inductor.config as inductor_config

                saved_threads = inductor_config.compile_threads
                _barrier()
                if mode is _FullyShardMode.COMPILED_COMPUTE:
                    inductor_config.compile_threads = 1
                module_globals[name] = (
                    original if mode is _FullyShardMode.EAGER else fully_shard_and_compile
                )
                try:
                    func(*args, **kwargs)
                except BaseException as error:
                    add_note(error, f"compiled_fsdp_test: in the {mode.value} run")
                    raise
                finally:
                    _barrier()
                    if previous is missing:
                        module_globals.pop(name, None)
                    else:
                        module_globals[name] = previous
                    inductor_config.compile_threads = saved_threads

        return wrapper  # type: ignore[return-value]

    return decorator


# -- private helpers torch's FSDP tests import ---------------------------------------------------


def _zero_model(model: nn.Module, zero_buffers: bool = False, summon_full: bool = True) -> None:
    """Zero ``model``'s parameters (and buffers), unsharded first when ``summon_full``."""
    engine = engine_for(model) if summon_full else None
    full = (
        engine.full_params(model, writeback=True)
        if engine is not None
        else contextlib.nullcontext()
    )
    with full, torch.no_grad():
        for param in model.parameters():
            param.zero_()
        if zero_buffers:
            for buffer in model.buffers():
                buffer.zero_()


def _get_state_dict(model: nn.Module, cpu_offload: bool = False, half: bool = False) -> Any:
    if not cpu_offload:
        model = model.to(DEVICE_TYPE)
    if half:
        model.half()
    return model.state_dict()


def _broadcast_state_dict(rank: int, state_dict: dict[str, torch.Tensor]) -> Any:
    """Rank 0's ``state_dict`` on every rank, on ``DEVICE_TYPE``."""
    payload = [{k: v.cpu() for k, v in state_dict.items()} if rank == 0 else None]
    dist.broadcast_object_list(payload)
    received = cast(dict[str, torch.Tensor], payload[0])
    return {k: v.to(DEVICE_TYPE) for k, v in received.items()}


def _move_to_device(model: nn.Module, move_to_device: bool) -> nn.Module:
    return model.to(DEVICE_TYPE) if move_to_device else model


def _maybe_wrap_fsdp(model: nn.Module, wrap_fsdp: bool, *args: Any, **kwargs: Any) -> nn.Module:
    """``model`` sharded by the current engine (torch's FSDP1 in the mirror) when ``wrap_fsdp``."""
    if not wrap_fsdp:
        return model
    from fsdp_testing.engines import current_engine

    return current_engine().wrap(model, *args, **kwargs)


def _assert_module_states(
    model: nn.Module, process_group: dist.ProcessGroup, assert_fn: Callable[[Any, Any], Any]
) -> None:
    """Call ``assert_fn(rank 0's state, this rank's state)`` for every parameter and buffer."""
    states = [(n, t.detach().cpu()) for n, t in [*model.named_parameters(), *model.named_buffers()]]
    gathered: list[Any] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(gathered, states, group=process_group)
    for other in gathered[1:]:
        for (_, first), (_, mine) in zip(gathered[0], other, strict=True):
            assert_fn(first, mine)


# -- test classes -------------------------------------------------------------------------------


def _reset_dynamo() -> None:
    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].reset()


def _keyword_alias(new: Any, old: Any, new_name: str, old_name: str, api: str) -> Any:
    if new is not None and old is not None:
        raise TypeError(f"{api}: pass {new_name} or its old name {old_name}, not both")
    if new is None and old is None:
        raise TypeError(f"{api}: missing the {new_name} argument (old name: {old_name})")
    return new if new is not None else old


class FSDPTestMixin(FSDPParityMixin):
    """torch's ``FSDPTestMixin``: ``run_subtests``, the ``_check_*`` helpers,
    ``_train_for_several_steps`` and ``_test_fsdp_parity`` (both with their current and older
    keyword names), models built with the mirror's engine (see [Note: the mirror's engine]),
    each rank seeded with 1234 and dynamo reset around each test."""

    fsdp_engine: str | None = None
    """Engine for models and parity (None: see [Note: the mirror's engine])."""

    @contextlib.contextmanager
    def _rank_method_context(self) -> Iterator[None]:
        with use_engine(mirror_engine(self)):
            _reset_dynamo()
            set_rng_seed()
            try:
                yield
            finally:
                _reset_dynamo()

    def run_subtests(self, *args: Any, **kwargs: Any) -> None:
        run_subtests(cast(Any, self), *args, **kwargs)

    def _check_cpu_offload(self, fsdp_model: Any, cpu_offload: Any) -> None:
        cast(Any, self).assertEqual(cpu_offload, fsdp_model.cpu_offload)

    def _check_backward_prefetch(self, fsdp_model: Any, backward_prefetch: Any) -> None:
        cast(Any, self).assertEqual(backward_prefetch, fsdp_model.backward_prefetch)

    def _check_forward_prefetch(self, fsdp_model: Any, forward_prefetch: Any) -> None:
        cast(Any, self).assertEqual(forward_prefetch, fsdp_model.forward_prefetch)

    def _train_for_several_steps(
        self, model: nn.Module, num_steps: int, autocast: bool, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        """torch's ``_train_for_several_steps(model, num_steps, autocast, lr=0.01,
        fsdp_cpu_offload=None, save_model=False, mixed_precision=None,
        enable_sharded_grad_scaler=False, use_pure_fp16=False, sharded_grad_scaler_kwargs=None)``.
        torch 1.x's ``norm_type``/``clip_norm`` (gradient clipping) are accepted when None."""
        for old in ("norm_type", "clip_norm"):
            if kwargs.pop(old, None) is not None:
                raise NotImplementedError(
                    f"_train_for_several_steps: {old}= (gradient clipping, torch 1.x) is not "
                    "supported; clip gradients in the test body instead"
                )
        return super()._train_for_several_steps(model, num_steps, autocast, *args, **kwargs)

    def _test_fsdp_parity(
        self,
        model_class: Any,
        fsdp_init_mode: Any,
        device_init_mode: Any = None,
        *args: Any,
        cuda_init_mode: Any = None,
        **kwargs: Any,
    ) -> None:
        """torch's ``_test_fsdp_parity``; ``device_init_mode`` may be passed under its old name
        ``cuda_init_mode`` (``CUDAInitMode`` members are accepted)."""
        mode = _keyword_alias(
            device_init_mode,
            cuda_init_mode,
            "device_init_mode",
            "cuda_init_mode",
            "_test_fsdp_parity",
        )
        if kwargs.pop("norm_type", None) is not None:
            raise NotImplementedError(
                "_test_fsdp_parity: norm_type= (gradient clipping, torch 1.x) is not supported"
            )
        super()._test_fsdp_parity(model_class, fsdp_init_mode, mode, *args, **kwargs)


def _default_world() -> int:
    return accelerator_count() or cpu_world_size()


class FSDPTest(FSDPTestMixin, MultiProcessTestCase):
    """torch's ``FSDPTest``: each ``test_*`` method runs on ``world_size`` rank processes (gloo
    on CPU) in the warm pool. Default ``world_size``: the accelerators, else the CPU world size
    (torch: ``DEVICE_COUNT``, which skips everything on CPU)."""

    @property
    def world_size(self) -> int:
        return _default_world()

    @property
    def destroy_pg_upon_exit(self) -> bool:
        return False


class FSDPTestMultiThread(FSDPTestMixin, MultiThreadedTestCase):
    """torch's ``FSDPTestMultiThread``: ranks are threads over torch's threaded process group;
    ``perThreadSetUp``/``perThreadTearDown`` reset dynamo."""

    @property
    def world_size(self) -> int:
        return _default_world()

    def perThreadSetUp(self) -> None:
        _reset_dynamo()

    def perThreadTearDown(self) -> None:
        _reset_dynamo()


class FSDPTestContinuous(FSDPTestMixin, MultiProcContinuousTest):
    """torch's ``FSDPTestContinuous``: the class's tests share ranks (the warm pool does that
    for every class here); a failing test does not skip the rest of the class."""

    world_size: int = -2

    @classmethod
    def backend_str(cls) -> str:
        return DISTRIBUTED_BACKEND

    @classmethod
    def device_type(cls) -> str:
        return DEVICE_TYPE
