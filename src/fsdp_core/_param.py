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
the compute device; see [Note: CPU offload] in ``_unit``.

Swapping which of the two a module sees is a plain ``module._parameters[name] = ...`` on every
(module, attribute) slot that referred to the original, which also covers tied parameters.

``sharded.requires_grad`` is the source of truth for whether the parameter trains: it is what
users see (and freeze) between passes, and ``unsharded`` copies it on every switch to the
unsharded form. See [Note: requires_grad changes after wrapping] in ``_unit``.

[Note: the wrapper's DTensor parameters]
Both doors show ``sharded`` as a ``DTensor`` (a :class:`DTensorLayout`): the composable door on
the mesh it is given, the wrapper on a mesh built from its groups (``Shard(0)`` over the shard
group; ``Replicate()`` over the group of ``NO_SHARD``; ``(Replicate(), Shard(0))`` on the 2-D
``("replicate", "shard")`` mesh of the hybrid strategies). Its local tensor is the view into
the flat shard, so the optimizer's state is ``DTensor``s laid out the same way, which is what
DCP's state dict functions and ``dcp.save`` need to save, gather and reshard each rank's rows
(see [Note: DCP's state dict functions and the wrapper] in ``_state_dict_types``). Gradients
are ``DTensor``s of the same layout, built from the parameter's spec (no ``from_local``);
accumulation and everything else the unit does on shards goes through :func:`local_tensor`,
never through DTensor dispatch. For code written against torch's FSDP1 this means
``p.shape``/``p.numel()`` of a parameter between passes are the full (global) sizes, as for
FSDP2, where FSDP1 shows 1-D local pieces; ``p.to_local()`` is this rank's rows.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ._groups import UnitGroups

__all__ = [
    "DTensorLayout",
    "ParamSpec",
    "ShardedParam",
    "ShardedState",
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
class DTensorLayout:
    """How both doors show a sharded parameter: a ``DTensor`` on ``mesh``.

    The local tensor is still the view into the unit's flat shard, so the optimizer's in-place
    updates land there (see [Note: sharded and unsharded parameters]). The composable door
    takes the mesh it is given; the wrapper builds one from its groups (:meth:`of_groups`).
    """

    mesh: Any  # torch.distributed.device_mesh.DeviceMesh
    placements: tuple[Any, ...]  # (Shard(0),), (Replicate(),), or (Replicate(), Shard(0)) for HSDP

    @classmethod
    def of_groups(cls, groups: UnitGroups, device_type: str) -> DTensorLayout:
        """The layout of a unit over ``groups`` (see [Note: unit groups] in ``_groups``):
        ``Shard(0)`` on a 1-D mesh of the shard group, ``Replicate()`` on one of the replicate
        group, or both on a 2-D mesh ``("replicate", "shard")`` of the hybrid grid. A mesh made
        from existing groups costs well under a millisecond, so each wrapper instance makes its
        own (kept by its parameters, none kept beyond them)."""
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        if device_type == "meta":
            # A unit on the meta device (``device_id="meta"``, planning): DTensor has no
            # device handle for meta, so its mesh is a CPU one (its shards stay on meta).
            device_type = "cpu"
        # A mesh holds its ranks in a real tensor, also when the module is wrapped under a
        # ``FakeTensorMode`` (one rank of a fake world, planning): made outside it.
        with unset_fake_temporarily():
            return cls._of_groups(groups, device_type)

    @classmethod
    def _of_groups(cls, groups: UnitGroups, device_type: str) -> DTensorLayout:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import Replicate, Shard

        if groups.shard is not None and groups.replicate is not None:
            mesh = DeviceMesh.from_group(
                [groups.replicate, groups.shard],
                device_type,
                mesh=torch.tensor(groups.grid, device="cpu"),  # not a default device's
                mesh_dim_names=("replicate", "shard"),
            )
            return cls(mesh, (Replicate(), Shard(0)))
        if groups.shard is not None:
            return cls(DeviceMesh.from_group(groups.shard, device_type), (Shard(0),))
        if groups.replicate is not None:
            return cls(DeviceMesh.from_group(groups.replicate, device_type), (Replicate(),))
        raise AssertionError(f"[rank {dist.get_rank()}] a unit needs a shard or a replicate group")


@dataclass(frozen=True)
class ParamSpec:
    """An original parameter and every (module, attribute name) slot that refers to it."""

    fqn: str
    param: nn.Parameter
    slots: tuple[tuple[nn.Module, str], ...]


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
        self.full_shape = orig.shape
        self.rows = orig.shape[0]
        self.rest = tuple(orig.shape[1:])
        self.chunk_rows = math.ceil(self.rows / shard_world)
        self.shard_numel = self.chunk_rows * math.prod(self.rest)
        self.shard_world = shard_world
        start = shard_rank * self.chunk_rows
        self.start_row = start
        self.valid_rows = max(0, min(self.chunk_rows, self.rows - start))

        self.padded_shard = flat_segment.view(self.chunk_rows, *self.rest)  # zero padded
        with torch.no_grad():
            self.padded_shard.zero_()
            self.padded_shard[: self.valid_rows].copy_(orig[start : start + self.valid_rows])
        self.sharded = self._as_parameter(self.padded_shard[: self.valid_rows], orig.requires_grad)
        if alias and shard_world != 1:
            raise AssertionError(f"{self.fqn}: only a replicated parameter can alias its shard")
        self._aliased = alias
        self.state = ShardedState.SHARDED
        self._unsharded_padded: torch.Tensor | None  # (chunk_rows * world, *rest)
        if alias:
            self._unsharded_padded = None
            self.unsharded = nn.Parameter(
                self.padded_shard[: self.valid_rows], requires_grad=orig.requires_grad
            )
        else:
            self._unsharded_padded = torch.empty(
                (self.chunk_rows * shard_world, *self.rest),
                dtype=compute_dtype,
                device=compute_device,
            )
            self.unsharded = nn.Parameter(
                self._unsharded_padded[: self.rows], requires_grad=orig.requires_grad
            )
            self._padded_nbytes = self._unsharded_padded.untyped_storage().nbytes()
            self.free_unsharded()

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
        return param

    def _as_sharded_tensor(self, local: torch.Tensor) -> torch.Tensor:
        if self.layout is None:
            return local
        from torch.distributed.tensor import DTensor

        with torch.no_grad():
            return DTensor.from_local(
                local,
                self.layout.mesh,
                self.layout.placements,
                run_check=False,
                shape=self.full_shape,
                stride=_contiguous_stride(self.full_shape),
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
        """This rank's rows of ``full`` (``full_shape``) in the sharded parameter's form."""
        rows = full.detach()[self.start_row : self.start_row + self.valid_rows]
        return self._as_sharded_tensor(rows.to(self.padded_shard.device))

    def rebind(self, flat_segment: torch.Tensor, local: torch.Tensor) -> None:
        """Move the shard into ``flat_segment`` with the values of ``local`` (this rank's
        rows, e.g. after ``module.to_empty``) and show the new sharded parameter."""
        self.padded_shard = flat_segment.view(self.chunk_rows, *self.rest)
        with torch.no_grad():
            self.padded_shard.zero_()
            self.padded_shard[: self.valid_rows].copy_(local)
        self.sharded = self._as_parameter(
            self.padded_shard[: self.valid_rows], self.sharded.requires_grad
        )
        if self._aliased:
            self.unsharded = nn.Parameter(
                self.padded_shard[: self.valid_rows], requires_grad=self.sharded.requires_grad
            )
        self.expose_sharded()

    def current_local(self) -> torch.Tensor:
        """The local rows of the parameter the module's first slot holds now."""
        module, name = self.slots[0]
        current = module._parameters[name]
        if current is None:
            raise AssertionError(f"{self.fqn}: the module's slot {name!r} is empty")
        return local_tensor(current)

    def alloc_unsharded(self) -> None:
        if not self._aliased:
            storage = self.unsharded.untyped_storage()
            if storage.nbytes() != self._padded_nbytes:
                storage.resize_(self._padded_nbytes)

    def free_unsharded(self) -> None:
        if not self._aliased:
            self.unsharded.untyped_storage().resize_(0)

    def copy_from_gathered(self, gathered: torch.Tensor) -> None:
        """Fill the unsharded storage from this parameter's ``(world, shard)`` gathered block."""
        if self._unsharded_padded is None:
            raise AssertionError(f"{self.fqn}: a parameter aliasing its shard is never gathered")
        # ``.data``: see [Note: sharded and unsharded parameters].
        self._unsharded_padded.data.view(self.shard_world, self.shard_numel).copy_(gathered)

    def padded_grad_rows(self, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` (full shape) as a ``(world, shard_numel)`` block, zero padded in dim 0."""
        pad_rows = self.chunk_rows * self.shard_world - self.rows
        if pad_rows:
            grad = torch.cat([grad, grad.new_zeros((pad_rows, *self.rest))])
        return grad.reshape(self.shard_world, self.shard_numel)

    def full_from_gathered(self, gathered: torch.Tensor) -> torch.Tensor:
        """A new full tensor (``full_shape``) from this parameter's ``(world, shard)`` block."""
        padded = gathered.reshape(self.chunk_rows * self.shard_world, *self.rest)
        return padded[: self.rows].clone()

    def write_local_rows(self, full: torch.Tensor) -> None:
        """Copy this rank's rows of ``full`` (``full_shape``) into the shard."""
        with torch.no_grad():
            self.padded_shard[: self.valid_rows].copy_(
                full[self.start_row : self.start_row + self.valid_rows]
            )

    def accumulate_sharded_grad(self, shard_flat: torch.Tensor) -> None:
        """Add this rank's reduced gradient (1D, ``shard_numel``, padded) to ``sharded.grad``."""
        grad = shard_flat.view(self.chunk_rows, *self.rest)[: self.valid_rows]
        current = self.sharded.grad
        if current is not None:
            local_tensor(current).add_(grad)  # no DTensor dispatch on the hot path
        elif grad.dtype == self.sharded.dtype:
            self.sharded.grad = self._as_sharded_grad(grad)
        else:
            # keep_low_precision_grads: ``.grad`` must match the parameter's dtype when set, so
            # set a placeholder of the right dtype and swap its data for the low-precision one.
            self.sharded.grad = torch.empty_like(self.sharded)
            self.sharded.grad.data = self._as_sharded_tensor(grad)

    def sharded_grad_rows(self) -> torch.Tensor | None:
        """``sharded.grad`` zero padded to ``(chunk_rows, *rest)`` rows, or ``None``."""
        if self.sharded.grad is None:
            return None
        grad = local_tensor(self.sharded.grad)
        pad_rows = self.chunk_rows - self.valid_rows
        if pad_rows:
            grad = torch.cat([grad, grad.new_zeros((pad_rows, *self.rest))])
        return grad

    @property
    def requires_grad(self) -> bool:
        """Whether the parameter trains now (the sharded parameter's flag)."""
        return self.sharded.requires_grad

    def sync_requires_grad(self) -> None:
        """Give ``unsharded`` the sharded parameter's ``requires_grad``."""
        if self.unsharded.requires_grad != self.sharded.requires_grad:
            self.unsharded.requires_grad_(self.sharded.requires_grad)

    # ------------------------------------------------------------------ transitions
    def to_unsharded(self) -> None:
        """SHARDED -> UNSHARDED: allocate the unsharded storage and show it to the module.

        The storage is filled by :meth:`copy_from_gathered` (on CUDA, after this returns).
        """
        self._assert_state(ShardedState.SHARDED)
        self.alloc_unsharded()
        self.sync_requires_grad()
        for module, name in self.slots:
            module._parameters[name] = self.unsharded
        self.state = ShardedState.UNSHARDED

    def to_sharded(self) -> None:
        """UNSHARDED -> SHARDED: show the local shard to the module and free the storage."""
        self._assert_state(ShardedState.UNSHARDED)
        self.expose_sharded()
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
