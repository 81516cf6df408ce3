"""One original parameter moving between its local dim-0 shard and its unsharded form.

[Note: sharded and unsharded parameters]
Each original parameter ``p`` (shape ``(rows, *rest)``) is replaced by two ``nn.Parameter``s:

- ``sharded``: this rank's dim-0 chunk, rows ``[rank * chunk_rows, (rank + 1) * chunk_rows)``
  clipped to ``rows`` (it may have zero rows). It is a view into the unit's flat shard buffer, so
  the all-gather input needs no copy, and the padding rows behind it stay zero. This is the
  parameter the module exposes between passes and the one the optimizer steps.
- ``unsharded``: the full tensor used for compute. Its storage (padded to ``chunk_rows *
  world`` rows) is allocated on unshard and freed on reshard by resizing the storage in place, so
  views that autograd saved in forward see the re-gathered values in backward. Writes go
  through ``.data`` so they do not bump the version counter autograd checks.

With replication (``NO_SHARD``) the chunk is the whole tensor. If the unsharded form also has
the shard's dtype and device (no mixed precision, no CPU offload), ``unsharded`` aliases
``sharded``: nothing is gathered or freed, but gradients still land on ``unsharded`` first so
that the all-reduce and the accumulation into ``sharded.grad`` stay separate. Otherwise the
unsharded storage is a separate, freeable buffer in the compute dtype on the compute device,
filled from the (cast, copied) shard on unshard like a gather from a group of one.

With CPU offload ``sharded`` (and its gradient) lives on the CPU while ``unsharded`` lives on
the compute device; see [Note: CPU offload] in ``_offload``.

Swapping which of the two a module sees is a plain ``module._parameters[name] = ...`` on every
(module, attribute) slot that referred to the original, which also covers tied parameters.

``sharded.requires_grad`` is the source of truth for whether the parameter trains: it is what
users see (and freeze) between passes, and ``unsharded`` copies it on every switch to the
unsharded form. See [Note: requires_grad changes after wrapping] in ``_unit``.

[Note: sharding on another dim]
``fully_shard(shard_placement_fn=...)`` may shard a parameter on a dim ``d > 0`` (a
``ParamSpec``'s ``shard_dim``); then it must split evenly (``shape[d]`` divisible by the world
size, as in FSDP2), so nothing is padded. The counts of [Note: sharded and unsharded
parameters] (``rows``, ``chunk_rows``, ``start_row``, ``valid_rows``) are taken along dim
``d``: the local shard is ``full.narrow(d, start_row, valid_rows)``, stored contiguously in its
own shape (``chunk_shape``) in the flat buffer, so the all-gather still sends one flat block
per rank. Block ``r`` of the gathered output is rank ``r``'s chunk; viewing the unsharded tensor as
``(*shape[:d], world, chunk_rows, *shape[d + 1:])`` and moving the ``world`` dim to the front
gives a ``(world, *chunk_shape)`` view of it (``_blocks``), so the copy-out and the
reduce-scatter input are one strided copy each. For ``d == 0`` that view is the plain
reshape the dim-0 layout always used. The sharded ``DTensor``'s placement is ``Shard(d)``.

[Note: unreduced gradients]
Autograd accumulates each backward's gradient into ``unsharded.grad``, in the compute dtype.
The unit takes it from there when it reduces (:meth:`ShardedParam.take_unreduced_grad`). A
backward that does not reduce (``no_sync``, ``set_requires_gradient_sync(False)``) leaves it for
the next one; with mixed precision the two doors differ, as torch's do: the wrapper (FSDP1) keeps
accumulating in the compute dtype, ``fully_shard`` (FSDP2) moves the gradient into
``unreduced_grad`` in ``reduce_dtype`` (:meth:`ShardedParam.keep_unreduced_grad`) and adds each
later backward's gradient there, so a bf16 model with an fp32 ``reduce_dtype`` sums its
micro-batches in fp32.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ._dtensor_layout import DTensorLayout
from ._grad_dtype import GradDtypePolicy
from ._tensor_parallel import local_grad, sharded_layout, tp_spec_of, unsharded_param

__all__ = [
    "DTensorLayout",  # ShardedParam's layout, defined in _dtensor_layout
    "ParamSpec",
    "ShardedParam",
    "ShardedState",
    "chunk_shape",
    "is_sharded_param",
    "local_tensor",
]


class ShardedState(enum.Enum):
    """Which form of a parameter the module sees, and whether the unsharded storage exists."""

    SHARDED = enum.auto()
    """The module sees the local shard; the unsharded storage is freed (or aliases the shard)."""
    UNSHARDED = enum.auto()
    """The module sees the unsharded parameter; its storage is allocated."""


@dataclass(frozen=True)
class ParamSpec:
    """An original parameter and every (module, attribute name) slot that refers to it."""

    fqn: str
    param: nn.Parameter
    slots: tuple[tuple[nn.Module, str], ...]
    shard_dim: int = 0  # see [Note: sharding on another dim]


def chunk_shape(shape: torch.Size, dim: int, world: int) -> tuple[int, ...]:
    """The shape of one rank's padded chunk of a ``shape`` tensor sharded on ``dim``."""
    return (*shape[:dim], math.ceil(shape[dim] / world), *shape[dim + 1 :])


class ShardedParam:
    """See [Note: sharded and unsharded parameters]."""

    def __init__(
        self,
        spec: ParamSpec,
        flat_segment: torch.Tensor,
        *,
        shard_world: int,
        shard_rank: int,
        compute_dtype: torch.dtype,
        compute_device: torch.device,
        alias: bool,
        layout: DTensorLayout | None = None,
    ) -> None:
        orig = spec.param
        self.layout = layout
        self.fqn = spec.fqn
        self.slots = spec.slots
        # A DTensor parameter: its local tensor is sharded. See [Note: tensor-parallel
        # parameters] in ``_tensor_parallel``.
        self._spmd = layout.spmd if layout is not None else None  # see [Note: SPMD meshes]
        self._tp_spec = tp_spec_of(orig, layout.mesh if layout is not None else None, self._spmd)
        orig_local = local_tensor(orig)
        self.full_shape = orig_local.shape  # what the unit shards: the local tensor
        self.global_shape = orig.shape  # what the sharded DTensor shows
        dim = self.shard_dim = spec.shard_dim
        self._mesh: Any = None
        self._placements: tuple[Any, ...] = ()
        if self._spmd is not None:
            self._mesh, self._placements = self._spmd.sharded_layout(self._tp_spec.placements, dim)
        elif layout is not None:
            self._mesh, self._placements = sharded_layout(
                layout.mesh, layout.placements, dim, self._tp_spec
            )
        # Counted along the shard dim: see [Note: sharding on another dim].
        self.rows = self.full_shape[dim]
        self.rest = tuple(self.full_shape[1:])  # the other dims, when sharded on dim 0
        self.chunk_rows = math.ceil(self.rows / shard_world)
        self.chunk_shape = chunk_shape(self.full_shape, dim, shard_world)
        self.shard_numel = math.prod(self.chunk_shape)
        self.shard_world = shard_world
        start = shard_rank * self.chunk_rows
        self.start_row = start
        self.valid_rows = max(0, min(self.chunk_rows, self.rows - start))

        self.padded_shard = flat_segment.view(self.chunk_shape)  # zero padded
        with torch.no_grad():
            self.padded_shard.zero_()
            self._valid(self.padded_shard).copy_(self._my_rows(orig_local))
        # See [Note: per-parameter gradient dtypes] in ``_grad_dtype``.
        self.grad_policy = GradDtypePolicy()
        self.grad_policy.capture(orig)
        self.sharded = self._as_parameter(self._valid(self.padded_shard), orig.requires_grad)
        if alias and shard_world != 1:
            raise AssertionError(f"{self.fqn}: only a replicated parameter can alias its shard")
        self._aliased = alias
        self.state = ShardedState.SHARDED
        # ``param_dtype_override_fn`` kept it in its dtype; see [Note: parameters kept in their
        # dtype] in ``_unit``.
        self.keeps_dtype = False
        # ``set_keep_unsharded_storage(True)``: a reshard keeps the unsharded storage, so its
        # data pointer survives reshard and unshard (CUDA graph capture).
        self.keep_unsharded_storage = False
        # See [Note: unreduced gradients].
        self.unreduced_grad: torch.Tensor | None = None  # full shape, in ``reduce_dtype``
        # The full shape with ``chunk_rows * world`` rows along the shard dim.
        self._unsharded_padded: torch.Tensor | None
        if alias:
            self._unsharded_padded = None
            local = self._valid(self.padded_shard)
        else:
            padded = list(self.full_shape)
            padded[dim] = self.chunk_rows * shard_world
            self._unsharded_padded = torch.empty(padded, dtype=compute_dtype, device=compute_device)
            local = self._unsharded_padded.narrow(dim, 0, self.rows)
        self.unsharded = unsharded_param(local, self._tp_spec, orig.requires_grad)
        if self._unsharded_padded is not None:
            self._padded_nbytes = self._unsharded_padded.untyped_storage().nbytes()
            self.free_unsharded()

    def _valid(self, padded: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a padded chunk (``chunk_shape``)."""
        return padded.narrow(self.shard_dim, 0, self.valid_rows)

    def _my_rows(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full tensor (``full_shape``)."""
        return full.narrow(self.shard_dim, min(self.start_row, self.rows), self.valid_rows)

    def _blocks(self, padded_full: torch.Tensor) -> torch.Tensor:
        """``(world, *chunk_shape)`` view of a full tensor padded along the shard dim (see
        [Note: sharding on another dim])."""
        d, shape = self.shard_dim, padded_full.shape
        split = padded_full.view(*shape[:d], self.shard_world, self.chunk_rows, *shape[d + 1 :])
        return split.movedim(d, 0)

    def _as_parameter(self, local: torch.Tensor, requires_grad: bool) -> nn.Parameter:
        """``local`` (this rank's rows) as the parameter the module shows between passes."""
        tensor = self._as_sharded_tensor(local)
        if self.layout is None:
            param = nn.Parameter(tensor, requires_grad=requires_grad)
        else:
            # A DTensor parameter built directly (``nn.Parameter(dtensor)`` would detach it
            # through DTensor's dispatch, whose output-spec cache compares meshes by layout:
            # a mesh rebuilt with new groups after an equal one's groups were destroyed would
            # get the old mesh back). ``_is_param`` is what makes it an ``nn.Parameter``.
            from torch.distributed.tensor import DTensor

            spec = tensor._spec  # type: ignore[attr-defined]
            param = DTensor(local, spec, requires_grad=requires_grad)  # type: ignore[assignment]
            param._is_param = True
        param._fsdp_sharded = True  # type: ignore[attr-defined]  # see is_sharded_param
        self.grad_policy.restore_on(param)
        return param

    def _as_sharded_tensor(self, local: torch.Tensor) -> torch.Tensor:
        if self.layout is None:
            return local
        from torch.distributed.tensor import DTensor

        with torch.no_grad():
            return DTensor.from_local(
                local,
                self._mesh,
                self._placements,
                run_check=False,
                shape=self.global_shape,
                stride=_contiguous_stride(self.global_shape),
            )

    def _as_sharded_grad(self, local: torch.Tensor) -> torch.Tensor:
        """``local`` (this rank's gradient rows, the parameter's dtype) in the sharded
        parameter's form: a ``DTensor`` sharing the parameter's spec, built directly (about a
        tenth of ``DTensor.from_local``'s cost, once per parameter and step)."""
        if self.layout is None:
            return local
        from torch.distributed.tensor import DTensor

        spec = self.sharded._spec  # type: ignore[attr-defined]
        return DTensor(local, spec, requires_grad=False)

    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of ``full`` (``global_shape``) in the sharded parameter's form."""
        if self._tp_spec is not None:
            from torch.distributed.tensor import distribute_tensor

            return distribute_tensor(full.detach(), self._mesh, self._placements)
        rows = self._my_rows(full.detach()).to(self.padded_shard.device)
        return self._as_sharded_tensor(rows.contiguous())

    def rebind(self, flat_segment: torch.Tensor, current: torch.Tensor) -> None:
        """Move the shard into ``flat_segment`` with the values of ``current``, what the module
        shows now (see [Note: replaced parameters] in ``_replaced``), and show it again."""
        local = local_tensor(current)
        rows = self._valid(self.padded_shard)
        if local.shape != rows.shape and current.shape == self.full_shape == self.global_shape:
            local = self._my_rows(local)  # a full tensor
        if local.shape != rows.shape:
            raise ValueError(
                f"fully_shard: parameter {self.fqn!r} was replaced by a tensor of shape "
                f"{tuple(current.shape)} (local {tuple(local.shape)}); give it the full shape "
                f"{tuple(self.full_shape)}, as a DTensor of the parameter's layout or a full "
                "tensor."
            )
        self.padded_shard = flat_segment.view(self.chunk_shape)
        with torch.no_grad():
            self.padded_shard.zero_()
            self._valid(self.padded_shard).copy_(local)
        self.grad_policy.capture(self.sharded)  # set on it since, or on its replacement
        self.grad_policy.capture(current)
        if self._adoptable(current):
            # Keep the object the user holds (an optimizer may be built on it), as FSDP2 does.
            current._local_tensor = self._valid(self.padded_shard)  # type: ignore[attr-defined]
            current._fsdp_sharded = True  # type: ignore[attr-defined]
            self.sharded = current  # type: ignore[assignment]
            self.grad_policy.restore_on(current)
        else:
            self.sharded = self._as_parameter(self._valid(self.padded_shard), current.requires_grad)
        if self._aliased:
            # The same Parameter object: autograd hooks are registered on it.
            self.unsharded.data = self._valid(self.padded_shard)
        self.expose_sharded()

    def _adoptable(self, current: torch.Tensor) -> bool:
        """Whether ``current`` is a ``DTensor`` parameter with this parameter's layout."""
        if self.layout is None or not isinstance(current, nn.Parameter):
            return False
        spec = getattr(current, "_spec", None)
        return (
            spec is not None
            and tuple(spec.placements) == tuple(self._placements)
            and spec.mesh == self._mesh
        )

    def current(self) -> torch.Tensor:
        """What the module shows for this parameter now: a slot's tensor other than the
        sharded parameter, if one was assigned, else the sharded parameter."""
        for module, name in self.slots:
            value = module._parameters.get(name)
            if value is not None and value is not self.sharded and value is not self.unsharded:
                return value
        return self.sharded

    def set_compute_dtype(self, dtype: torch.dtype) -> None:
        """Compute in ``dtype`` from now on (the unit's dtype changed); unsharded storage freed."""
        if self._unsharded_padded is None or self._unsharded_padded.dtype == dtype:
            return
        if self._tp_spec is not None:
            raise NotImplementedError(
                f"fully_shard: the dtype of tensor-parallel parameter {self.fqn!r} changed after "
                "sharding; cast the module with .to(dtype) before fully_shard."
            )
        self._unsharded_padded = torch.empty_like(self._unsharded_padded, dtype=dtype)
        # ``.data``: the same Parameter object, which autograd hooks are registered on.
        self.unsharded.data = self._unsharded_padded.narrow(self.shard_dim, 0, self.rows)
        self._padded_nbytes = self._unsharded_padded.untyped_storage().nbytes()
        self.free_unsharded()

    @property
    def may_reduce_grad_outside_dp(self) -> bool:
        """Whether taking the gradient's local tensor may reduce it over a mesh dim outside
        data parallelism (a ``Partial`` gradient of a parameter replicated there), in the
        gradient's dtype: FSDP2's test for keeping autograd's upcast."""
        if self._tp_spec is None:
            return False
        from torch.distributed.tensor import Replicate

        dp = self._spmd.dp_dims if self._spmd is not None else frozenset()
        placements = self._tp_spec.placements
        return any(isinstance(pl, Replicate) for i, pl in enumerate(placements) if i not in dp)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype forward and backward see this parameter in."""
        if self._unsharded_padded is None:
            return self.padded_shard.dtype
        return self._unsharded_padded.dtype

    def alloc_unsharded(self) -> None:
        if self._unsharded_padded is not None:
            storage = self._unsharded_padded.untyped_storage()
            if storage.nbytes() != self._padded_nbytes:
                storage.resize_(self._padded_nbytes)

    def free_unsharded(self) -> None:
        if self._unsharded_padded is not None:
            self._unsharded_padded.untyped_storage().resize_(0)

    def copy_from_gathered(self, gathered: torch.Tensor) -> None:
        """Fill the unsharded storage from this parameter's ``(world, shard)`` gathered block."""
        if self._unsharded_padded is None:
            raise AssertionError(f"{self.fqn}: a parameter aliasing its shard is never gathered")
        # ``.data``: see [Note: sharded and unsharded parameters].
        blocks = self._blocks(self._unsharded_padded.data)
        blocks.copy_(gathered.view(self.shard_world, *self.chunk_shape))

    def _pad(self, tensor: torch.Tensor, rows: int) -> torch.Tensor:
        """``tensor`` with ``rows`` zero rows appended along the shard dim."""
        if not rows:
            return tensor
        shape = list(tensor.shape)
        shape[self.shard_dim] = rows
        return torch.cat([tensor, tensor.new_zeros(shape)], dim=self.shard_dim)

    def full_from_gathered(self, gathered: torch.Tensor) -> torch.Tensor:
        """A new full tensor (``full_shape``) from this parameter's ``(world, shard)`` block."""
        padded = list(self.full_shape)
        padded[self.shard_dim] = self.chunk_rows * self.shard_world
        full = gathered.new_empty(padded)
        self._blocks(full).copy_(gathered.reshape(self.shard_world, *self.chunk_shape))
        return full.narrow(self.shard_dim, 0, self.rows).clone()

    def write_local_rows(self, full: torch.Tensor) -> None:
        """Copy this rank's rows of ``full`` (``full_shape``) into the shard."""
        with torch.no_grad():
            self._valid(self.padded_shard).copy_(self._my_rows(full))

    def accumulate_sharded_grad(self, shard_flat: torch.Tensor) -> None:
        """Add this rank's reduced gradient (1D, ``shard_numel``, padded) to ``sharded.grad``."""
        grad = self._valid(shard_flat.view(self.chunk_shape))
        current = self.sharded.grad
        if current is not None:
            local_tensor(current).add_(grad)  # no DTensor dispatch on the hot path
        elif grad.dtype == self.sharded.dtype or self._takes_grad_of(grad.dtype):
            self.sharded.grad = self._as_sharded_grad(grad)
        else:
            # keep_low_precision_grads: ``.grad`` must match the parameter's dtype when set, so
            # set a placeholder of the right dtype and swap its data for the low-precision one.
            self.sharded.grad = torch.empty_like(self.sharded)
            self.sharded.grad.data = self._as_sharded_tensor(grad)

    def _takes_grad_of(self, dtype: torch.dtype) -> bool:
        """Whether the sharded parameter's explicit ``grad_dtype`` admits a ``.grad`` of
        ``dtype`` (see [Note: per-parameter gradient dtypes] in ``_grad_dtype``)."""
        policy = self.grad_policy
        return policy.explicit and policy.dtype in (None, dtype)

    def sharded_grad_rows(self) -> torch.Tensor | None:
        """``sharded.grad`` zero padded to ``chunk_shape``, or ``None``."""
        if self.sharded.grad is None:
            return None
        return self._pad(local_tensor(self.sharded.grad), self.chunk_rows - self.valid_rows)

    def take_unreduced_grad(self) -> torch.Tensor | None:
        """The gradient not reduced yet (full shape), and forget it. See [Note: unreduced
        gradients]."""
        grad, kept = local_grad(self.unsharded.grad, self._tp_spec, self._spmd), self.unreduced_grad
        self.unsharded.grad = self.unreduced_grad = None
        if kept is None:
            return grad
        if grad is not None:
            kept.add_(grad)
        return kept

    def keep_unreduced_grad(self, dtype: torch.dtype) -> None:
        """After a backward that did not reduce: keep the gradient so far in ``dtype``."""
        grad = self.unsharded.grad
        if grad is None or (self.unreduced_grad is None and grad.dtype == dtype):
            return  # nothing new, or autograd accumulates in ``dtype`` already
        self.unreduced_grad = self.take_unreduced_grad().to(dtype)  # type: ignore[union-attr]

    def has_unreduced_grad(self) -> bool:
        return self.unsharded.grad is not None or self.unreduced_grad is not None

    @property
    def requires_grad(self) -> bool:
        """Whether the parameter trains now (the sharded parameter's flag)."""
        return self.sharded.requires_grad

    def sync_requires_grad(self) -> None:
        """Give ``unsharded`` the sharded parameter's ``requires_grad``."""
        if self.unsharded.requires_grad != self.sharded.requires_grad:
            self.unsharded.requires_grad_(self.sharded.requires_grad)

    # ------------------------------------------------------------------ transitions
    def to_unsharded(self, *, alloc: bool = True) -> None:
        """SHARDED -> UNSHARDED: allocate the unsharded storage (unless not ``alloc``: then the
        copy-out does) and show it to the module. :meth:`copy_from_gathered` fills it."""
        self._assert_state(ShardedState.SHARDED)
        if alloc:
            self.alloc_unsharded()
        self.sync_requires_grad()
        for module, name in self.slots:
            module._parameters[name] = self.unsharded
        self.state = ShardedState.UNSHARDED

    def to_sharded(self) -> None:
        """UNSHARDED -> SHARDED: show the local shard to the module and free the storage
        (unless ``keep_unsharded_storage``)."""
        self._assert_state(ShardedState.UNSHARDED)
        self.expose_sharded()
        if not self.keep_unsharded_storage:
            self.free_unsharded()
        self.state = ShardedState.SHARDED

    def expose_sharded(self) -> None:
        """Put the local shard back into every slot (after something else was shown there)."""
        for module, name in self.slots:
            module._parameters[name] = self.sharded

    def _assert_state(self, expected: ShardedState) -> None:
        if self.state is not expected:
            raise AssertionError(
                f"[rank {dist.get_rank() if dist.is_initialized() else 0}] parameter "
                f"{self.fqn!r} is {self.state.name}, expected {expected.name}"
            )

    @property
    def device(self) -> torch.device:
        return self.sharded.device


def is_sharded_param(param: torch.Tensor) -> bool:
    """Whether ``param`` is a unit's sharded parameter (so a unit already owns it)."""
    return getattr(param, "_fsdp_sharded", False) is True


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s local part: itself, or a ``DTensor``'s local shard (sharing storage, outside
    autograd)."""
    local: torch.Tensor | None = getattr(tensor, "_local_tensor", None)
    return tensor if local is None else local


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride = []
    running = 1
    for size in reversed(shape):
        stride.append(running)
        running *= size
    return tuple(reversed(stride))
