"""The unit: the parameters one fully sharded module owns, with one unshard/reshard pair.

A unit knows nothing about hooks, roots or execution order (``_runtime`` drives it), so both
front doors (the ``FullyShardedDataParallel`` wrapper and ``fully_shard``/``replicate``) share
it.
Test helpers patch :meth:`FSDPUnit.unshard`, :meth:`FSDPUnit.reshard` and
:meth:`FSDPUnit.post_backward` by name on the class; the runtime always calls them through the
instance so such patches see every call.

Communication per unit: ``unshard`` issues one all-gather of the flat shard buffer (the
concatenation of every parameter's padded shard) inside the shard group,
``post_backward`` one reduce-scatter of all of the unit's gradients inside the shard group and
one all-reduce of the reduced shard across the replicate group, each skipped over a group of
one (see [Note: unit groups] in ``_groups``).

The data path of an unshard is: flat shard -> [copy to the compute device, with CPU offload] ->
[cast to ``param_dtype``, with mixed precision] -> all-gather (skipped when unsharded) -> copy
out into each unsharded parameter. A reduction goes: unsharded gradients -> reduce buffer in
``reduce_dtype``, pre-divided -> reduce-scatter -> all-reduce -> [cast to the gradient dtype]
-> [copy to the host, with CPU offload] -> accumulate into ``sharded.grad``. Every collective
carries an order tag after the data once the root has given the unit its ``order_tags``; see
[Note: order check] in ``_order_check``.

[Note: parameters kept in their dtype]
``MixedPrecisionPolicy.param_dtype_override_fn`` may keep some parameters of a unit in their
original dtype while the others compute in ``param_dtype`` (FSDP2's per-parameter override,
e.g. a router weight in fp32). Such a unit all-gathers its flat shard in the original dtype
and casts each parameter to its own compute dtype in the copy-out: the values are those of a
cast before the all-gather (a cast is elementwise), at the cost of moving the wider dtype.
Gradients arrive in each parameter's compute dtype and are copied into the one reduce buffer
in ``reduce_dtype``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from . import _collectives, _offload, _order_check, _replaced, events
from ._collectives import AllGatherComm, ReduceScatterComm
from ._extensions import GatherExtensions
from ._flat import FlatLayout
from ._groups import UnitGroups
from ._init import trained_dtype
from ._order_check import TagOp, UnitTags
from ._overlap import CpuOverlap, PendingGather, overlaps
from ._param import DTensorLayout, ParamSpec, ShardedParam, chunk_shape, local_tensor
from ._post_forward import PostForwardShards
from ._precision import UnitPrecision
from ._staging import StagingBuffers
from ._streams import CudaStreams
from ._unit_grads import UnitGrads

__all__ = ["FSDPUnit"]

# Unshards whose all-gather may run while the rank computes: see [Note: overlap on the CPU].
_PREFETCHES = ("forward_prefetch", "backward_prefetch")
# The tag an unshard's all-gather carries, by the reason of the unshard.
_GATHER_OPS: dict[events.UnshardReason, TagOp] = {
    "forward": TagOp.FORWARD_GATHER,
    "forward_prefetch": TagOp.FORWARD_GATHER,
    "backward": TagOp.BACKWARD_GATHER,
    "backward_prefetch": TagOp.BACKWARD_GATHER,
    "explicit": TagOp.EXPLICIT_GATHER,
}


class FSDPUnit(UnitGrads):
    """The parameter group of one fully sharded module.

    Args:
        module: the fully sharded module (for the wrapper: the wrapped module).
        specs: the parameters this unit owns, each with the slots that refer to it.
        groups: the group the parameters are sharded over and the group each shard is
            replicated across; see [Note: unit groups] in ``_groups``.
        precision: the resolved dtypes (default: none of the parameters' dtype changes).
        offload_params: keep shards and sharded gradients on the CPU (default ``False``).
            See [Note: CPU offload] in ``_offload``.
        compute_device: where forward/backward run (default: the parameters' device).
        layout: show the sharded parameters as ``DTensor``s (the composable door; default
            ``None``: plain tensors).
        pin_memory: pin offloaded shards when an accelerator exists (default ``True``).
        keep_dtype: indices into ``specs`` of parameters that compute in their own dtype,
            not ``param_dtype`` (``MixedPrecisionPolicy.param_dtype_override_fn``; default:
            none). See [Note: parameters kept in their dtype].
    """

    def __init__(
        self,
        module: nn.Module,
        specs: Sequence[ParamSpec],
        groups: UnitGroups,
        *,
        precision: UnitPrecision | None = None,
        offload_params: bool = False,
        compute_device: torch.device | None = None,
        layout: DTensorLayout | None = None,
        pin_memory: bool = True,
        keep_dtype: frozenset[int] = frozenset(),
    ) -> None:
        if not specs:
            raise AssertionError(f"[rank {dist.get_rank()}] FSDPUnit needs at least one parameter")
        self.module = module
        self.groups = groups
        self.name = type(module).__name__  # the FQN once the root is known
        self.is_unsharded = False
        self.shard_world = groups.shard_size  # ranks the parameters are sharded over (1: not)
        self.shard_rank = groups.shard_rank  # this rank's index in the shard group
        self._replicas = groups.replicate_size
        self._sharded = self.shard_world > 1

        first = specs[0].param
        # Of the sharded parameters that train; frozen ones may have others (the composable
        # doors; see [Note: mixed dtypes in one unit] in ``_flat``).
        self.dtype = trained_dtype(specs)
        if any(s.param.device != first.device for s in specs):
            # Each door checks it first, naming itself (``_init.validate_uniform``).
            raise AssertionError(f"[rank {dist.get_rank()}] a unit needs one device")
        self.device = compute_device if compute_device is not None else first.device
        self.precision = precision or UnitPrecision.resolve(None, self.dtype)
        if self.precision.orig_dtype != self.dtype:
            raise AssertionError(
                f"[rank {dist.get_rank()}] unit precision resolved for {self.precision.orig_dtype}"
                f" but the parameters are {self.dtype}"
            )
        self.offload_params = offload_params
        self.layout = layout  # the composable door's: its parameters may be replaced
        shard_device = torch.device("cpu") if offload_params else self.device
        if first.is_meta:
            shard_device = first.device  # meta-device init: see ``reset_sharded_params``
        # Pinned host memory only pays off (and only exists) with an accelerator.
        self._pin = (
            pin_memory
            and offload_params
            and torch.cuda.is_available()
            and self.device.type == "cuda"
        )
        self.streams: CudaStreams | None = None  # set by the root at lazy init on CUDA
        self.cpu_overlap: CpuOverlap | None = None  # set by the root at lazy init on the CPU
        self._pending_gather: PendingGather | None = None  # see [Note: overlap on the CPU]
        self._deferred_op: TagOp | None = None  # a backward prefetch's gather, not yet issued
        # Set by the root at lazy init; None: collectives go untagged. See [Note: order check].
        self.order_tags: UnitTags | None = None
        # The root's on the CPU, set at lazy init: see [Note: staging buffers on the CPU].
        self.staging: StagingBuffers | None = None
        alias = (
            not self._sharded
            and not offload_params
            and not self.precision.casts_params
            and not keep_dtype
        )

        numels = [
            math.prod(chunk_shape(local_tensor(s.param).shape, s.shard_dim, self.shard_world))
            for s in specs
        ]
        self.flat_layout = FlatLayout([s.param.dtype for s in specs], numels)
        # The flat shard and two spare elements for the all-gather's order tag, so that an
        # all-gather in the shard's dtype and device sends this buffer without a copy.
        self._flat_send = torch.empty(  # 1D: flat shard, then GATHER_TAG_NUMEL elements
            self.flat_layout.numel + _order_check.GATHER_TAG_NUMEL,
            dtype=self.flat_layout.dtype,
            device=shard_device,
            pin_memory=self._pin,
        )
        self._flat_send.zero_()  # the tag elements, and a mixed layout's alignment gaps
        # 1D, padded; every sharded parameter is a view into it.
        self._flat_shard = self._flat_send[: self.flat_layout.numel]
        self.params = [
            ShardedParam(
                spec,
                self.flat_layout.segment(self._flat_shard, i),
                shard_world=self.shard_world,
                shard_rank=self.shard_rank,
                compute_dtype=(
                    spec.param.dtype
                    if i in keep_dtype
                    else self.precision.compute_dtype_of(spec.param.dtype)
                ),
                compute_device=self.device,
                alias=alias,
                layout=layout,
            )
            for i, spec in enumerate(specs)
        ]
        for i in keep_dtype:
            self.params[i].keeps_dtype = True
        self._aliased = alias
        # The trainable parameters, reduction settings and state; see ``_unit_grads``.
        self._init_grads()
        # All-gather output waiting for its copy-out (CUDA: until ``wait_for_unshard``).
        self._gathered: torch.Tensor | None = None  # 1D, shard_world * flat shard numel
        self._gathered_event: torch.cuda.Event | None = None
        self._extensions: GatherExtensions | None = None  # see ``_copy_out``
        self.mp_policy: object = None  # the composable door's, for ``fsdp_pre_all_gather``
        self._reason: events.UnshardReason = "explicit"  # of the pending unshard
        # Set by the door for ``reshard_after_forward=N``; see [Note: reshard after forward to
        # a smaller world] in ``_post_forward``.
        self.post_forward: PostForwardShards | None = None
        # ``set_custom_all_gather``/``_reduce_scatter``; see [Note: custom collectives].
        self.all_gather_comm: AllGatherComm | None = None
        self.reduce_scatter_comm: ReduceScatterComm | None = None
        for p in self.params:
            p.expose_sharded()

    # ------------------------------------------------------------------ transitions
    def unshard(self, reason: events.UnshardReason = "explicit", *, async_op: bool = False) -> None:
        """Make the module see full parameters; one all-gather unless unsharded.

        On CUDA the gather is only issued here; :meth:`wait_for_unshard` finishes it before
        compute uses the parameters. See [Note: streams and events]. On the CPU too, over gloo,
        for a prefetch or with ``async_op``; see [Note: overlap on the CPU] in ``_overlap``.
        """
        if self.is_unsharded:
            return
        if not self._aliased:
            streams = self.streams
            op = _GATHER_OPS[reason]
            self._reason = reason
            if streams is None:
                overlap = self._overlaps(async_op or reason in _PREFETCHES)
                cpu = self.cpu_overlap
                if self._gathered is not None:  # issued ahead: see ``gather_ahead``
                    pass
                elif overlap and reason == "backward_prefetch" and cpu is not None and cpu.reducing:
                    self._deferred_op = op  # issued later: see [Note: overlap on the CPU]
                    cpu.defer_gather(self._issue_deferred_gather)
                else:
                    self._gathered = self._gather_for_unshard(op, wait=not overlap)
                    if self._pending_gather is None:
                        self._copy_out()
            else:
                streams.before_all_gather()
                with torch.cuda.stream(streams.all_gather):
                    self._gathered = self._gather_for_unshard(op)
                    self._gathered_event = streams.all_gather.record_event()
        pending = self._pending_gather is not None or self._deferred_op is not None
        for p in self.params:  # a pending all-gather's copy-out allocates
            p.to_unsharded(alloc=not pending)
        self.is_unsharded = True
        if events.has_subscribers():
            events.publish(
                events.Unshard(
                    unit=self.name,
                    reason=reason,
                    devices=tuple(str(p.unsharded.device) for p in self.params),
                    rank=dist.get_rank(),
                )
            )

    def wait_for_unshard(self) -> None:
        """Finish a pending unshard on the current stream (on the CPU: a pending all-gather)."""
        streams = self.streams
        self._issue_deferred_gather()
        if self._gathered is None:
            return
        if streams is None:
            if self._pending_gather is not None:
                self._pending_gather.finish()
                self._pending_gather = None
            self._copy_out()
            return
        if self._gathered_event is not None:
            torch.cuda.current_stream(self.device).wait_event(self._gathered_event)
        self._copy_out()
        streams.record_copy_out()

    def gather_ahead(self) -> bool:
        """Issue this unit's forward all-gather now, before its pre-forward asks for it; its
        ``unshard`` takes it over (or ``drop_gather_ahead`` finishes it). Whether it was
        issued. See [Note: overlap on the CPU] in ``_overlap``."""
        if self.is_unsharded or self._gathered is not None or self._aliased:
            return False
        if not self._overlaps(True) or self.streams is not None:
            return False
        if self.post_forward is not None and self.post_forward.blocks is not None:
            return False
        self._gathered = self._gather(self.gather_dtype, _GATHER_OPS["forward"], wait=False)
        return True

    def drop_gather_ahead(self) -> None:
        """Finish and forget an all-gather issued ahead that no unshard took over."""
        if not self.is_unsharded and self._pending_gather is not None:
            self._pending_gather.finish()
            self._pending_gather = self._gathered = None

    def _issue_deferred_gather(self) -> None:
        """Issue the all-gather of a deferred backward prefetch, if one is waiting."""
        op, self._deferred_op = self._deferred_op, None
        if op is not None:
            self._gathered = self._gather_for_unshard(op, wait=False)

    def _gather_for_unshard(self, op: TagOp, *, wait: bool = True) -> torch.Tensor:
        """The all-gather output to copy out: from the blocks kept after forward, if any."""
        post_forward = self.post_forward
        if post_forward is not None and post_forward.blocks is not None:
            return post_forward.regather(unit=self.name)
        return self._gather(self.gather_dtype, op, wait=wait)

    @property
    def gather_dtype(self) -> torch.dtype:
        """The dtype the all-gather moves: ``param_dtype``, or the original dtype when a
        parameter computes in another dtype (see [Note: parameters kept in their dtype])."""
        param_dtype = self.precision.param_dtype
        if any(p.keeps_dtype and p.compute_dtype != param_dtype for p in self.params):
            return self.precision.orig_dtype
        return param_dtype

    def compute_dtype_for(self, p: ShardedParam, dtype: torch.dtype) -> torch.dtype:
        """The compute dtype of ``p`` once its shard is of ``dtype``."""
        return dtype if p.keeps_dtype else self.precision.compute_dtype_of(dtype)

    def _overlaps(self, async_op: bool) -> bool:
        """Whether an all-gather may be left pending on the CPU: not when its copy-out issues
        an all-gather of its own (extensions). See [Note: overlap on the CPU] in ``_overlap``."""
        if not async_op or self.cpu_overlap is None or self.all_gather_comm is not None:
            return False
        extended = self._extensions is not None or (
            self.layout is not None and bool(GatherExtensions.find(self))
        )
        return not extended and self._sharded and overlaps(self.groups.shard)

    def drop_post_forward(self) -> None:
        """Forget the blocks kept after forward (their backward did not run)."""
        if self.post_forward is not None:
            self.post_forward.drop()

    def reshard(self, reason: events.ReshardReason = "explicit") -> None:
        """Free the unsharded parameters; the module sees the local shards again.

        After forward (``reason="forward"``) the blocks of ``post_forward``, if set, stay for
        the backward all-gather inside the smaller group; any other reshard drops them.
        """
        if reason != "forward":
            self.drop_post_forward()
        if not self.is_unsharded:
            return
        # A prefetch that was never waited on: its output was only used on the gather stream
        # (CUDA), or is complete once waited on (CPU).
        self._issue_deferred_gather()  # issued as on every other rank, then finished
        if self._pending_gather is not None:
            self._pending_gather.finish()
            self._pending_gather = None
        self._gathered = self._gathered_event = None
        for p in self.params:
            p.to_sharded()
        if self._extensions is not None:
            self._extensions.reshard()
        self.is_unsharded = False
        if events.has_subscribers():
            events.publish(
                events.Reshard(
                    unit=self.name,
                    reason=reason,
                    devices=tuple(str(p.device) for p in self.params),
                    rank=dist.get_rank(),
                )
            )

    def post_backward(self, *, reduce: bool = True, reshard: bool = True) -> None:
        """Reshard, then reduce this backward's gradients into the sharded ``.grad``s.

        Gradients are averaged over ``groups.world`` ranks (see [Note: gradient averaging]) and
        added to any
        gradient already on the sharded parameter, so several backwards accumulate. With
        ``reduce=False`` (inside ``no_sync``) the unsharded gradients are kept and keep
        accumulating until a backward that reduces (in ``reduce_dtype`` when
        ``upcast_unreduced_grads``; see [Note: unreduced gradients] in ``_param``). With
        ``reshard=False`` the unsharded parameters stay (``set_reshard_after_backward(False)``).
        """
        if reshard and self.is_unsharded:  # see ``FSDPState._final_callback``
            self.reshard("backward")
        if not reduce:
            self.keep_unreduced_grads()
            return
        grads = self.take_grads_to_reduce()
        if all(g is None for g in grads) and not self.reduce_unused_params:
            return
        streams = self.streams
        overlap = self._overlap_for_reduce() if streams is None else None
        if overlap is not None:  # the reduction in flight finishes before this one's buffers
            overlap.make_room()  # are made: at most one unit's extra (see ``_overlap``)
        unused_too = self.reduce_unused_params or not self.skip_params_without_grads
        got = [g is not None or unused_too for g in grads]
        reduce_input = self._reduce_input(grads)
        del grads  # copied in: freed before the collective allocates its own buffers
        if overlap is not None:
            self._reduce_later(overlap, reduce_input, got)
            self._give_reduce_input(reduce_input)
            return
        if streams is None:
            self._store_grads(self._reduce(reduce_input), got)
            self._give_reduce_input(reduce_input)
            return
        side = streams.reduce_scatter
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._store_grads(self._reduce(reduce_input), got)
            done = side.record_event()
        streams.hold_reduce_input(reduce_input, done)

    # ------------------------------------------------------------------ data path
    def _gather(
        self, dtype: torch.dtype, op: TagOp | None = None, *, wait: bool = True
    ) -> torch.Tensor:
        """The flat shard on the compute device in ``dtype``, gathered over the group.

        Returns a 1D tensor of ``shard_world`` blocks; for an unsharded unit, the one block.
        With ``op`` and order tags, each block ends with its rank's tag (see [Note: order
        check]); the parameters' data is at the same offsets either way. Without ``wait`` the
        all-gather is left in ``_pending_gather`` (see [Note: overlap on the CPU]).
        """
        tags = None
        mixed = self.flat_layout.mixed  # a byte all-gather carries no tag
        if op is not None and self._sharded and not mixed and _order_check.carries_tags(dtype):
            tags = self.order_tags
        slots = _order_check.GATHER_TAG_NUMEL if tags is not None else 0
        numel = self._flat_shard.numel()
        if self.flat_layout.mixed:
            dtype = self.flat_layout.dtype  # bytes; the copy-out casts
        if self.offload_params:
            send = _offload.copy_to_device(
                self._flat_shard, self.device, self.streams, unit=self.name, extra=slots
            )
        else:
            send = self._flat_send[: numel + slots]
        if send.dtype != dtype:
            send = send.to(dtype)  # the spare elements too: they are written below
        group = self.groups.shard
        if group is None or not self._sharded:
            return send
        comm = self.all_gather_comm
        gathered = _collectives.new_buffer(
            comm, self.shard_world * send.numel(), dtype, self.device, self.staging
        )
        code = tags.code(op) if tags is not None and op is not None else 0
        if tags is not None:
            _order_check.write_gather_tag(send, code)
        work = _collectives.all_gather_flat(
            gathered, send, group, unit=self.name, comm=comm, async_op=not wait
        )
        pending = PendingGather(work, gathered, tags, code, group, self.shard_world, numel)
        if wait:
            pending.finish()
        else:
            self._pending_gather = pending
        return gathered

    def _copy_out(self) -> None:
        gathered = self._gathered
        if gathered is None:
            raise AssertionError(f"[rank {dist.get_rank()}] {self.name}: nothing gathered")
        post_forward = self.post_forward
        if post_forward is not None and self._reason in ("forward", "forward_prefetch"):
            post_forward.keep(gathered)
        blocks = gathered.view(self.shard_world, -1)
        extended = GatherExtensions.find(self) if self.layout is not None else {}
        for i, p in enumerate(self.params):
            p.alloc_unsharded()
            if i not in extended:
                p.copy_from_gathered(self.flat_layout.columns(blocks, i))
        if extended or self._extensions is not None:  # see [Note: all-gather extensions]
            self._extensions = self._extensions or GatherExtensions()
            self._extensions.unshard(self, extended)
        elif self.staging is not None and self.all_gather_comm is None:
            self.staging.give(gathered)  # copied out: see [Note: staging buffers on the CPU]
        self._gathered = self._gathered_event = None

    # ------------------------------------------------------------------ full parameters
    def gather_full_params(self) -> list[torch.Tensor]:
        """New full tensors of every parameter in the original dtype, on the compute device.

        Used by ``summon_full_params``: one all-gather unless unsharded, synchronous on the
        current stream, independent of the unsharded parameters used for compute.
        """
        blocks = self._gather(self.dtype).view(self.shard_world, -1)
        return [
            p.full_from_gathered(self.flat_layout.columns(blocks, i))
            for i, p in enumerate(self.params)
        ]

    def expose(self, tensors: Sequence[torch.Tensor]) -> None:
        """Make the module see ``tensors`` (one per parameter) in place of the shards."""
        for p, tensor in zip(self.params, tensors, strict=True):
            for module, name in p.slots:
                module._parameters[name] = tensor  # type: ignore[assignment]

    def reset_sharded_params(self) -> None:
        """Adopt sharded parameters that replaced the unit's own on the module (``to_empty``,
        ``.to(...)``, ``load_state_dict(assign=True)``, assignment); see [Note: replaced
        parameters] in ``_replaced``."""
        _replaced.adopt(self)

    def new_flat_shard(self, layout: FlatLayout, device: torch.device) -> torch.Tensor:
        """Make a new zeroed flat shard buffer (with its tag elements) of ``layout`` the
        unit's; return the flat shard (1D, padded) to rebind the parameters into."""
        self._flat_send = torch.zeros(
            layout.numel + _order_check.GATHER_TAG_NUMEL,
            dtype=layout.dtype,
            device=device,
            pin_memory=self._pin and device.type == "cpu",
        )
        self.flat_layout = layout
        self._flat_shard = self._flat_send[: layout.numel]
        return self._flat_shard

    @property
    def flat_shard(self) -> torch.Tensor:  # 1D, padded; every sharded parameter is a view
        return self._flat_shard

    def write_back(self, tensors: Sequence[torch.Tensor]) -> None:
        """Copy this rank's rows of every full tensor in ``tensors`` into the shards."""
        for p, tensor in zip(self.params, tensors, strict=True):
            p.write_local_rows(tensor.detach())
