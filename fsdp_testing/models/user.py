"""A user's own model as a reference model: ``fsdp-testing check --model package.module:callable``
(and ``fsdp-testing plan``) build it from the user's factory and drive it through the
:class:`FSDPTestModel` interface, so the same matrix, table and reports cover it."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from ..engines import current_engine, has_nested_units
from ._base import (
    DEVICEInitMode,
    FSDPInitMode,
    FSDPTestModel,
    as_device_init_mode,
    as_fsdp_init_mode,
    finish_placement,
    group_rank_and_size,
    resolve_device,
)

__all__ = ["UserModel", "load_factory", "random_inputs", "sum_of_outputs"]

_WORKLOAD = ("get_input", "get_loss", "run_backward")


def load_factory(module: str, attribute: str, *, option: str) -> Callable[..., nn.Module]:
    """The callable ``attribute`` of the importable ``module``.

    Raises:
        ValueError: it cannot be imported (or importing it raises) or is not callable (the
            message names ``option``).
    """
    try:
        found = getattr(importlib.import_module(module), attribute, None)
    except ImportError as error:
        raise ValueError(
            f"{option}: cannot import {module!r} ({error}); run from the directory that holds it "
            "or put it on PYTHONPATH"
        ) from None
    except Exception as error:  # the module itself raised: say so rather than a traceback
        raise ValueError(
            f"{option}: importing {module!r} raised {type(error).__name__}: {error}; fix the "
            "module so that it imports"
        ) from None
    if not callable(found):
        raise ValueError(f"{option}: {module} has no callable {attribute!r}")
    return found


def sum_of_outputs(output: Any, *, what: str) -> torch.Tensor:
    """The loss of a model without ``get_loss``: the sum of every floating point tensor in its
    output, in float32.

    Raises:
        ValueError: the output holds no floating point tensor (``what`` names the model).
    """
    values = tree_flatten(output)[0]
    floats = [t for t in values if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not floats:
        raise ValueError(
            f"{what}: the model's output has no floating-point tensor to take a loss from; "
            "give the model a get_loss(input, output) method"
        )
    return torch.stack([t.sum().float() for t in floats]).sum()


def random_inputs(
    inputs: Iterable[tuple[tuple[int, ...], str]], *, seed: int
) -> tuple[torch.Tensor, ...]:
    """One random CPU tensor per ``(shape, dtype name)`` of ``--input-shape``, drawn from a
    generator seeded with ``seed``: floats uniform in [0, 1), integers 0 or 1 (valid indices of
    any embedding)."""
    generator = torch.Generator().manual_seed(seed)
    made = []
    for shape, dtype_name in inputs:
        dtype = getattr(torch, dtype_name)
        if dtype.is_floating_point:
            made.append(torch.rand(shape, generator=generator).to(dtype))
        else:
            made.append(torch.randint(0, 2, shape, generator=generator, dtype=dtype))
    return tuple(made)


class UserModel(FSDPTestModel):
    """A user's module (``self.module``) with the :class:`FSDPTestModel` interface. Make a class
    per factory with :meth:`for_factory`; its ``init`` builds and shards like the reference
    models do.

    The workload: the module's own ``get_input``, ``get_loss`` and ``run_backward`` when it has
    all three; otherwise one random tensor per ``inputs`` entry (floats uniform in [0, 1),
    integers 0 or 1, valid indices of any embedding), different per rank and the same on every
    call (:func:`random_inputs`), the loss :func:`sum_of_outputs` and a plain backward.

    Args:
        module: the user's module.
        group: the process group (its rank seeds the inputs).
    """

    factory: ClassVar[Callable[..., nn.Module]]
    factory_kwargs: ClassVar[Mapping[str, Any]] = {}
    inputs: ClassVar[tuple[tuple[tuple[int, ...], str], ...]] = ()
    units: ClassVar[tuple[str, ...]] = ()

    def __init__(self, module: nn.Module, group: Any) -> None:
        super().__init__()
        self.module = module
        self.rank, _ = group_rank_and_size(group)
        self._own = all(callable(getattr(module, name, None)) for name in _WORKLOAD)

    @classmethod
    def for_factory(
        cls,
        factory: Callable[..., nn.Module],
        *,
        name: str,
        kwargs: Mapping[str, Any] | None = None,
        inputs: Iterable[tuple[tuple[int, ...], str]] = (),
        units: Iterable[str] = (),
    ) -> type[UserModel]:
        """A :class:`UserModel` class whose ``init`` builds ``factory(**kwargs)``.

        Args:
            factory: returns the unsharded module.
            name: the class's name (shown in reports).
            kwargs: the factory's keyword arguments.
            inputs: ``(shape, dtype name)`` of each positional input, for a module without
                ``get_input``.
            units: class names of the submodules that become units under ``RECURSIVE``.
        """
        return type(
            name,
            (cls,),
            {
                "factory": staticmethod(factory),
                "factory_kwargs": dict(kwargs or {}),
                "inputs": tuple(inputs),
                "units": tuple(units),
            },
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def get_input(self, device: torch.device) -> tuple[Any, ...]:
        if self._own:
            return tuple(self.module.get_input(device))  # type: ignore[operator]
        if not self.inputs:
            raise ValueError(
                f"--model {type(self).__name__}: the model has no get_input(device); give its "
                "inputs with --input-shape (once per positional input), e.g. --input-shape "
                "8,1024 or 8,512:int64"
            )
        return tuple(t.to(device) for t in random_inputs(self.inputs, seed=1 + self.rank))

    def get_loss(self, input: Any, output: Any) -> torch.Tensor:
        if self._own:
            return self.module.get_loss(input, output)  # type: ignore[operator]
        return sum_of_outputs(output, what=f"--model {type(self).__name__}")

    def run_backward(self, loss: torch.Tensor) -> None:
        if self._own:
            self.module.run_backward(loss)  # type: ignore[operator]
        else:
            loss.backward()

    @classmethod
    def init(
        cls,
        group: dist.ProcessGroup,
        fsdp_init_mode: FSDPInitMode,
        device_init_mode: DEVICEInitMode,
        fsdp_kwargs: Mapping[str, Any] | None = None,
        deterministic: bool = False,
        *,
        device: torch.device | str | None = None,
    ) -> nn.Module:
        """Builds the user's module (seeded with 0 when ``deterministic``); ``RECURSIVE`` makes
        the submodules of the classes in ``units`` units and shards the root with them (a model
        without ``units`` is left plain: the trainer wraps the root).

        Raises:
            NotImplementedError: ``units`` with a root-only engine (see [Note: root-only
                engines] in ``engines/_root_only.py``).
        """
        target = resolve_device(device)
        placement = as_device_init_mode(device_init_mode)
        with torch.random.fork_rng(devices=[]):
            if deterministic:
                torch.manual_seed(0)
            module = cls.factory(**cls.factory_kwargs)
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"--model {cls.__name__}: the factory returned {type(module).__name__}, not an "
                "nn.Module"
            )
        if placement is DEVICEInitMode.DEVICE_BEFORE:
            module = module.to(target)
        model = cls(module, group)
        if as_fsdp_init_mode(fsdp_init_mode) is FSDPInitMode.NO_FSDP or not cls.units:
            return model
        engine = current_engine()
        if not has_nested_units(engine):
            raise NotImplementedError(
                f"engine {getattr(engine, 'name', engine)!r} wraps the root only; --wrap "
                f"{','.join(cls.units)} asks for units inside the model"
            )
        classes = {type(m).__name__: type(m) for m in module.modules()}
        unknown = [name for name in cls.units if name not in classes]
        if unknown:
            raise ValueError(
                f"--wrap {','.join(unknown)}: no such module class in the model; its classes: "
                f"{', '.join(sorted(classes))}"
            )
        policy = engine.module_wrap_policy([classes[name] for name in cls.units])
        sharded = engine.wrap(model, group, **{**(fsdp_kwargs or {}), "auto_wrap_policy": policy})
        return finish_placement(sharded, placement, target, True)
