"""The gradient side of a unit: which parameters train, and their reduction in backward.

``FSDPUnit`` (``_unit``) mixes this in; its ``post_backward`` takes the unreduced gradients
and hands them here: :meth:`UnitGrads._reduce_input` lays them out as the reduce-scatter's
rows in ``reduce_dtype``, pre-divided; ``_reduce`` runs the unit's reduction collectives (see
``_reduce``), or ``_reduce_later`` issues the reduce-scatter and leaves the rest to the root's
``CpuOverlap`` (see [Note: overlap on the CPU] in ``_overlap``); ``_store_grads`` adds the
reduced shard to each sharded ``.grad``.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from . import _collectives, _offload, _order_check
from ._collectives import ReduceScatterComm
from ._grad_dtype import promoted, set_grad_dtype
from ._groups import UnitGroups
from ._order_check import UnitTags
from ._overlap import CpuOverlap, overlaps
from ._param import ShardedParam
from ._precision import UnitPrecision
from ._reduce import AllReduceHook, input_tag_slots, reduce_gradients, start_reduce_scatter
from ._staging import StagingBuffers
from ._streams import CudaStreams

__all__ = ["UnitGrads", "write_grad_rows"]


def write_grad_rows(
    p: ShardedParam, grad: torch.Tensor | None, out: torch.Tensor, div: float
) -> None:
    """Lay ``grad`` (``p``'s full shape; None: zeros) out in ``out``, ``p``'s ``(world,
    shard_numel)`` columns of a reduce buffer, zero padded along the shard dim and divided by
    ``div``. Each element is written once: the buffer is not zero filled first (that fill,
    faulting in a new buffer's pages, cost about 5% of a CPU step)."""
    blocks, d, c = out.view(p.shard_world, *p.chunk_shape), p.shard_dim, p.chunk_rows
    whole = min(p.rows // c, p.shard_world) if grad is not None and c else 0

    def put(dst: torch.Tensor, src: torch.Tensor) -> None:
        if div != 1 and src.dtype == dst.dtype:
            torch.div(src, div, out=dst)  # the numbers of a copy, then ``div_``
            return
        dst.copy_(src)  # a cast first: the division in ``dst``'s dtype, as before
        if div != 1:
            dst.div_(div)

    if grad is not None and whole:
        src = grad.narrow(d, 0, whole * c)
        rows = (*src.shape[:d], whole, c, *src.shape[d + 1 :])
        put(blocks[:whole], src.reshape(rows).movedim(d, 0))
    if whole < p.shard_world:
        rest = p.rows - whole * c if grad is not None else 0
        if rest:
            put(blocks[whole].narrow(d, 0, rest), grad.narrow(d, whole * c, rest))  # type: ignore[union-attr]
        blocks[whole].narrow(d, rest, c - rest).zero_()
        blocks[whole + 1 :].zero_()


class UnitGrads:
    """The gradient state and reduction of ``FSDPUnit``, which sets the attributes below."""

    name: str
    groups: UnitGroups
    params: list[ShardedParam]
    shard_world: int
    precision: UnitPrecision
    device: torch.device
    offload_params: bool
    streams: CudaStreams | None
    cpu_overlap: CpuOverlap | None
    staging: StagingBuffers | None
    order_tags: UnitTags | None
    reduce_scatter_comm: ReduceScatterComm | None
    _sharded: bool
    _pin: bool

    def _init_grads(self) -> None:
        """The gradient side's state; called by ``FSDPUnit.__init__`` once ``params`` exist."""
        # The trainable parameters and their offsets in the reduce buffer; see
        # [Note: requires_grad changes after wrapping].
        self._grad_params: list[ShardedParam] = []
        self._grad_offsets: list[int] = []
        self._grad_numel = 0
        self._grads_ready: set[ShardedParam] = set()
        self.update_grad_params()
        # Set by the composable door: gradients kept unreduced accumulate in ``reduce_dtype``
        # (FSDP2), not in the compute dtype (FSDP1). See [Note: unreduced gradients].
        self.upcast_unreduced_grads = False
        # Also the composable door's: a parameter that got no gradient keeps its ``.grad`` (FSDP2
        # leaves it None), instead of adding the zeros of its rows (FSDP1's flat gradient).
        self.skip_params_without_grads = False
        # ``set_requires_all_reduce(False)`` (HSDP): reduce-scatter only, summing the shards in
        # ``_partial_reduced`` (1D) until a backward that all-reduces; see ``_reduce``.
        self.all_reduce_grads = True
        self._partial_reduced: torch.Tensor | None = None
        self.all_reduce_hook: AllReduceHook | None = None  # ``set_all_reduce_hook``
        self.gradient_divide_factor: float | None = None  # ``set_gradient_divide_factor``
        self.reduce_scatter_max_input_buffers = 1  # ``set_reduce_scatter_max_input_buffers``
        # ``set_reduce_scatter_unused_params(True)``: a parameter without a gradient takes part
        # with zeros, and the unit reduces in the final callback on every rank alike.
        self.reduce_unused_params = False
        # ``set_separate_reduce_scatter_group``: the reduce-scatter's own group over the shard
        # ranks (None: the shard group, shared with the all-gather).
        self.reduce_scatter_group: dist.ProcessGroup | None = None
        # Set by the composable door where torch follows ``param.grad_dtype`` (2.15 on): see
        # [Note: per-parameter gradient dtypes] in ``_grad_dtype``.
        self.grad_dtype_policies = False

    @property
    def reduce_groups(self) -> UnitGroups:
        """The groups the gradient reduction runs over: ``groups``, with the reduce-scatter's
        own group in place of the shard group when one is set."""
        if self.reduce_scatter_group is None:
            return self.groups
        return dataclasses.replace(self.groups, shard=self.reduce_scatter_group)

    def has_partial_reduction(self) -> bool:
        """Whether reduce-scattered shards wait for their all-reduce (HSDP without it)."""
        return self._partial_reduced is not None

    def _reduce_tags(self, dtype: torch.dtype) -> UnitTags | None:
        """The order tags a reduction in ``dtype`` carries now, if any. See [Note: order
        check]."""
        if self.groups.world == 1 or not _order_check.carries_tags(dtype):
            return None
        return self.order_tags

    def _unsharded_grad_dtype(self, p: ShardedParam) -> torch.dtype | None:
        """The dtype ``p``'s unreduced gradients accumulate in (``None``: as they come); see
        [Note: per-parameter gradient dtypes] in ``_grad_dtype``."""
        precision = self.precision
        named = precision.reduce_dtype if precision.policy_sets_reduce else None
        return p.grad_policy.unsharded(named, precision.orig_dtype)

    def sync_unsharded_grad_dtypes(self) -> None:
        """Give each trainable unsharded parameter the ``grad_dtype`` its unreduced gradients
        accumulate in (casting a pending gradient). No-op unless ``grad_dtype_policies``."""
        if not self.grad_dtype_policies:
            return
        for p in self._grad_params:
            dtype, unsharded = self._unsharded_grad_dtype(p), p.unsharded
            # Explicit even where it is the parameter's dtype, as torch's unsharded parameters.
            explicit = getattr(unsharded, "_has_grad_dtype_override", False)
            if unsharded.grad_dtype != dtype or not explicit:
                set_grad_dtype(unsharded, dtype)

    def defer_grad_upcast(self, reduces: bool) -> None:
        """Before this unit's backward: a parameter whose accumulation dtype is wider than its
        compute dtype (fp32 gradients of bf16 compute) takes autograd's gradients in the
        compute dtype (``grad_dtype=None``) when this backward reduces, or when it holds a
        pending gradient (already wide: autograd adds into it in place). The reduce input's
        copy upcasts them, and a parameter used twice sums its contributions in the compute
        dtype, as torch 2.15 does; :meth:`sync_unsharded_grad_dtypes` (after the backward)
        puts the accumulation dtype back."""
        if not self.grad_dtype_policies:
            return
        for p in self._grad_params:
            dtype, compute = self._unsharded_grad_dtype(p), p.compute_dtype
            if dtype is None or p.may_reduce_grad_outside_dp:
                continue
            floats = dtype.is_floating_point and compute.is_floating_point
            if floats and dtype.itemsize > compute.itemsize:
                if reduces or p.unsharded.grad is not None:
                    p.unsharded.grad_dtype = None

    def check_unused_grad_dtypes(self) -> None:
        """Raise if zeros for unused parameters would have no dtype every rank agrees on: a
        trainable parameter with ``grad_dtype=None`` and no ``reduce_dtype``. The check reads
        the configuration, not this rank's gradients, so every rank raises alike."""
        if not (self.grad_dtype_policies and self.reduce_unused_params):
            return
        for p in self.params:
            if p.requires_grad and self._unsharded_grad_dtype(p) is None:
                raise ValueError(
                    "set_reduce_scatter_unused_params: reducing unused parameters with "
                    f"grad_dtype=None requires an explicit MixedPrecisionPolicy.reduce_dtype so "
                    f"every rank builds zero gradients of the same dtype: parameter {p.fqn!r} of "
                    f"unit {self.name!r}. Set reduce_dtype to the dtype its gradients have, or "
                    "give the parameter a grad_dtype before fully_shard."
                )

    def keep_unreduced_grads(self) -> None:
        """After a backward that does not reduce: keep its gradients for the next one, in the
        dtype they accumulate in (see [Note: unreduced gradients] in ``_param``): on the
        unsharded ``.grad`` with per-parameter gradient dtypes, else moved into
        ``unreduced_grad`` in ``reduce_dtype`` when ``upcast_unreduced_grads``."""
        if self.grad_dtype_policies:
            self.sync_unsharded_grad_dtypes()
        elif self.upcast_unreduced_grads:
            for p in self._grad_params:
                p.keep_unreduced_grad(self.precision.reduce_dtype)

    def take_grads_to_reduce(self) -> list[torch.Tensor | None]:
        """The unreduced gradient of each parameter in ``grad_params`` (None: it got none),
        forgotten by the parameters."""
        self.check_unused_grad_dtypes()
        grads = [p.take_unreduced_grad() for p in self._grad_params]
        self.sync_unsharded_grad_dtypes()  # back from ``defer_grad_upcast``
        return grads

    def _reduce_dtype_for(self, grads: list[torch.Tensor | None]) -> torch.dtype:
        """The dtype this backward reduces in: ``reduce_dtype`` as resolved, or with
        per-parameter gradient dtypes and no ``reduce_dtype`` in the policy, the promotion of
        each gradient's accumulation dtype (its own dtype under ``grad_dtype=None``) and of a
        pending partial reduction's."""
        precision = self.precision
        if not self.grad_dtype_policies or precision.policy_sets_reduce:
            return precision.reduce_dtype
        dtypes = []
        for p, grad in zip(self._grad_params, grads, strict=True):
            dtype = self._unsharded_grad_dtype(p)
            if dtype is None and grad is not None:
                dtype = grad.dtype
            if dtype is not None and (grad is not None or self.reduce_unused_params):
                dtypes.append(dtype)
        if self._partial_reduced is not None:
            dtypes.append(self._partial_reduced.dtype)
        return promoted(dtypes) or precision.reduce_dtype

    def _reduce_input(self, grads: list[torch.Tensor | None]) -> torch.Tensor:
        """``(shard_world, grad numel [+ tag])`` in the reduction's dtype
        (:meth:`_reduce_dtype_for`), zero padded, pre-divided.

        With order tags each row ends with one digit pair per rank of the first reduction
        (the reduce-scatter, or the all-reduce of an unsharded unit), all zero until
        :meth:`_reduce` writes this rank's; see [Note: order check].
        """
        dtype = self._reduce_dtype_for(grads)
        slots = input_tag_slots(self.groups) if self._reduce_tags(dtype) is not None else 0
        shape = (self.shard_world, self._grad_numel + slots)
        full = _collectives.new_buffer(
            self.reduce_scatter_comm,
            math.prod(shape),
            dtype,
            self.device,
            self.staging,  # see [Note: staging buffers on the CPU]
        ).view(shape)
        factor = self.gradient_divide_factor
        div = self.groups.world if factor is None else 1  # See [Note: gradient averaging].
        for p, offset, grad in zip(self._grad_params, self._grad_offsets, grads, strict=True):
            write_grad_rows(p, grad, full[:, offset : offset + p.shard_numel], div)
        full[:, self._grad_numel :].zero_()
        if factor is not None and factor != 1:  # sum / factor: one division out of place, as
            divided = full / factor  # FSDP2 (torch's tests count the ``aten.div.Tensor`` calls)
            self._give_reduce_input(full)
            return divided
        return full

    def _give_reduce_input(self, reduce_input: torch.Tensor) -> None:
        """Hand a reduce input that the engine no longer reads back to the root's staging
        buffers, unless the reduced gradient is a view of it (a shard group of one). See
        [Note: staging buffers on the CPU]."""
        sharded = self._sharded and self.groups.shard_size > 1
        if self.staging is not None and sharded and self.reduce_scatter_comm is None:
            self.staging.give(reduce_input)

    def _overlap_for_reduce(self) -> CpuOverlap | None:
        """``cpu_overlap`` where the reduction is one reduce-scatter over gloo (no replicate
        group, no custom reduce-scatter), else None. See [Note: overlap on the CPU]."""
        overlap, groups = self.cpu_overlap, self.reduce_groups
        if overlap is None or not self._sharded or groups.replicate_size > 1:
            return None
        if self._partial_reduced is not None or not self.all_reduce_grads:
            return None  # a shard that waits for its all-reduce (a replicate group of one)
        if self.reduce_scatter_comm is not None or not overlaps(groups.shard):
            return None
        return overlap

    def _reduce_later(
        self, overlap: CpuOverlap, reduce_input: torch.Tensor, got: list[bool]
    ) -> None:
        """Issue the reduce-scatter and leave the rest to ``overlap``."""
        numel = self._grad_numel
        tags = self._reduce_tags(reduce_input.dtype) if reduce_input.shape[1] > numel else None
        scatter = start_reduce_scatter(
            reduce_input,
            numel,
            groups=self.reduce_groups,
            tags=tags,
            unit=self.name,
            async_op=True,
        )
        overlap.defer(scatter, lambda reduced: self._reduced(reduced, got))

    def _reduced(self, reduced: torch.Tensor, got: list[bool]) -> None:
        """The all-reduce hook, then the gradients' add; for a reduction finished late."""
        if self.all_reduce_hook is not None:
            self.all_reduce_hook.run(reduced, self.device)
        self._store_grads(reduced, got)

    def _reduce(self, reduce_input: torch.Tensor) -> torch.Tensor | None:
        """This rank's summed gradient shard (1D, grad numel) from the pre-divided input, or
        ``None`` while it waits for its all-reduce; see ``_reduce.reduce_gradients``."""
        numel = self._grad_numel
        # The input has tag columns iff ``_reduce_input`` saw order tags.
        tags = self._reduce_tags(reduce_input.dtype) if reduce_input.shape[1] > numel else None
        # Without its all-reduce the shard waits, also over a replicate group of one (FSDP2).
        all_reduce = self.all_reduce_grads or self.groups.replicate is None
        reduced = reduce_gradients(
            reduce_input, numel, self.reduce_groups, tags, unit=self.name,
            all_reduce=all_reduce, partial=self._partial_reduced, comm=self.reduce_scatter_comm,
        )  # fmt: skip
        self._partial_reduced = None if all_reduce else reduced
        if all_reduce and self.all_reduce_hook is not None:
            self.all_reduce_hook.run(reduced, self.device)
        return reduced if all_reduce else None

    def _store_grads(self, reduced: torch.Tensor | None, got: list[bool]) -> None:
        """Add ``reduced`` to the ``.grad`` of each parameter in ``grad_params`` whose entry
        in ``got`` is true."""
        if reduced is None:
            return
        default = self.precision.grad_dtype
        if self.grad_dtype_policies:  # see [Note: per-parameter gradient dtypes]
            dtypes = [p.grad_policy.sharded(default) or reduced.dtype for p in self._grad_params]
        else:
            dtypes = [default] * len(self._grad_params)
        cast = {dtype: reduced.to(dtype) for dtype in dict.fromkeys(dtypes)}  # one per dtype
        if self.offload_params:
            cast = {
                dtype: _offload.copy_to_host(
                    grad, self.device, self.streams, unit=self.name, pin=self._pin
                )
                for dtype, grad in cast.items()
            }
        rows = zip(self._grad_params, self._grad_offsets, got, dtypes, strict=True)
        for p, offset, store, dtype in rows:
            if store:
                p.accumulate_sharded_grad(cast[dtype][offset : offset + p.shard_numel])

    @property
    def grad_params(self) -> list[ShardedParam]:
        """Parameters that required gradients at the last forward, in registration order."""
        return self._grad_params

    def update_grad_params(self) -> None:
        """Follow ``requires_grad`` changes made since the last forward.

        See [Note: requires_grad changes after wrapping] in ``_param``.
        """
        for p in self.params:
            p.sync_requires_grad()
        trainable = [p for p in self.params if p.requires_grad]
        if trainable == self._grad_params:
            return
        for p in self.params:
            if not p.requires_grad:
                p.take_unreduced_grad()  # frozen while holding a no_sync gradient: dropped
        self._grad_params = trainable
        self._grad_offsets = []
        offset = 0
        for p in trainable:
            self._grad_offsets.append(offset)
            offset += p.shard_numel
        self._grad_numel = offset

    def mark_grad_ready(self, param: ShardedParam) -> bool:
        """Note that ``param`` got its gradient; True once every one in ``grad_params`` has."""
        self._grads_ready.add(param)
        return self._grads_ready.issuperset(self._grad_params)

    def has_pending_grads(self) -> bool:
        """Whether some gradient of this backward has not been reduced yet."""
        return any(p.has_unreduced_grad() for p in self._grad_params)

    def drop_unreduced_grads(self) -> None:
        """Forget every gradient not reduced into the sharded ``.grad``s yet."""
        for p in self.params:
            p.take_unreduced_grad()
        self._partial_reduced = None

    def reset_backward(self) -> None:
        self._grads_ready.clear()
