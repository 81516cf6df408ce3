"""Order tags: every unit collective carries a code for (unit, op, iteration) in its payload.

[Note: order check]
All ranks of a unit's group must issue the same unit collectives in the same order. If they
diverge (control flow on rank-local data), units of the *same* size would all-gather each
other's shards and training would go on with wrong numbers, so from the first iteration on every
tagged collective carries a code in its own payload, compared after the collective: no extra
collective, in any iteration. Units of *different* sizes make the collective itself fail inside
the backend (gloo aborts the process on a size mismatch, NCCL may hang); under
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` the first iteration also compares each unit's index before
the collective (see [Note: order validation] in ``_exec_order``).

- The code: a 16-bit integer ``iteration mod 4 (2 bits) | op (2 bits) | unit index mod 4096
  (12 bits)``, the index being the instance's position under the root (as in the
  first-iteration check) and the iteration the number of root forwards so far. It travels as
  two base-256 digits, each an integer in [0, 255]: exact in fp32, fp16 and bf16 (bf16 has 8
  significant bits, so every integer up to 256 is exact). Collectives in a dtype with fewer
  mantissa bits (fp8) go untagged.
- All-gather: each rank's block (its flat shard) is followed by its two digits, so the output
  holds every rank's code, the same bytes on every rank.
- Reduction (reduce-scatter, then all-reduce across replicas; see [Note: unit groups] in
  ``_groups``): the payload is summed, so a
  per-rank code cannot share one element (codes 1 and 3 sum like 2 and 2, and comparing the sum
  with ``world * code`` is not the same test on every rank). Instead each row of the input (the
  part summed into one rank's output) is followed by ``2 * world`` elements, one pair per rank
  of the group; rank ``s`` writes its digits into pair ``s`` of every row, after the gradient
  pre-division, and the rest are zero. Each received element is then one rank's digit plus
  zeros, exact in every dtype and summation order: every rank reads every rank's code.
- Hybrid sharding reduces twice: the reduce-scatter's row carries one pair per rank of the
  shard group; after it is checked, those columns of the output are zeroed and replaced by one
  pair per rank of the replicate group, which the all-reduce then sums and every replica
  checks. Summing the shard group's pairs across replicas instead would add codes up, so each
  collective gets its own columns.
- So every rank of the group sees the same codes and decides the same way: on a mismatch all
  of them raise at the same collective, with the same message naming each rank's unit, op and
  iteration, and none goes on into a next collective that could hang.
- On the CPU over gloo a unit's forward all-gather is issued ahead, by the unit before it in the
  recorded forward order (see [Note: overlap on the CPU] in ``_overlap``). A rank whose
  forward runs units out of that order so issues some of its all-gathers in the recorded order
  all the same: the check fires at the first collective that pairs different units, which can
  come after the first unit run out of order (two swapped units still gather their own shards
  in forward; their backward collectives are what pair wrongly).
- Results are unchanged: the tags sit after the data, are written into free slots (the unit's
  shard buffer has two spare elements, so an uncast, non-offloaded all-gather still sends the
  shard without a copy) and are sliced off before the copy-out and before the gradients are
  stored; offload copies move the data only.
- Cost per collective: 2 elements per rank in an all-gather, ``2 * world`` per row in a
  reduce-scatter (``2 * world**2`` in its input, ``2 * world`` received by each rank) and
  ``2 * world`` in an all-reduce, plus two scalar writes and one small read. The theoretical
  volume in ``fsdp_testing/cli/_measure.py`` counts these elements.
- CUDA: reading the tags on the host right after each collective would synchronize every
  collective with the host, so they are copied (non-blocking, on the collective's stream) into
  pinned memory and compared when the iteration ends (the root's final backward callback, or
  the end of a forward without grad): the error comes at the end of the iteration, at the cost
  of one host synchronization there. Until then the ranks go on, so a divergence that pairs
  units of different sizes later in that iteration is left to the backend. The CPU compares
  right after each collective.
- Not compared: collectives over torch's fake backend (a process playing one rank of a large
  world, as fsdp_testing's fake mode does): they move no data, so the received tags are
  whatever the buffer held.
- Not tagged: ``summon_full_params`` and full state dict gathers (between iterations, every rank
  over the same units in the same order), and collectives over a group of one rank (none).
  Units are told apart modulo 4096 and iterations modulo 4.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import _collectives

__all__ = [
    "GATHER_TAG_NUMEL",
    "OrderChecker",
    "TagOp",
    "UnitTags",
    "carries_tags",
    "codes_from_digits",
    "decode",
    "encode",
    "gathered_tags",
    "reduce_tag_numel",
    "write_gather_tag",
    "write_reduce_tag",
]

_BASE = 256  # digits in [0, 256): exact in bf16. See [Note: order check].
_DIGITS = 2
_UNIT_BITS = 12
_OP_BITS = 2
_ITERATION_BITS = 2

# Elements after each rank's block of an all-gather.
GATHER_TAG_NUMEL = _DIGITS


class TagOp(enum.IntEnum):
    """Which collective of a unit a tag belongs to (2 bits of the code)."""

    FORWARD_GATHER = 0
    """The all-gather for forward (or a forward prefetch)."""
    BACKWARD_GATHER = 1
    """The all-gather for backward (or a backward prefetch)."""
    EXPLICIT_GATHER = 2
    """An all-gather asked for outside forward and backward."""
    REDUCE = 3
    """The gradient reduction (reduce-scatter, or all-reduce when replicated)."""


_DESCRIPTIONS = {
    TagOp.FORWARD_GATHER: "all-gathered {unit} for forward",
    TagOp.BACKWARD_GATHER: "all-gathered {unit} for backward",
    TagOp.EXPLICIT_GATHER: "all-gathered {unit} explicitly",
    TagOp.REDUCE: "reduced the gradients of {unit}",
}


def reduce_tag_numel(group_size: int) -> int:
    """Elements after each row of a reduction's input: one digit pair per rank of the group."""
    return _DIGITS * group_size


def carries_tags(dtype: torch.dtype) -> bool:
    """Whether every digit (an integer below 256) is exact in ``dtype``."""
    # eps = 2**-(mantissa bits): every integer up to 2**(bits + 1) is exact, 256 for bf16.
    return dtype.is_floating_point and torch.finfo(dtype).eps <= 2.0**-7


def encode(unit_index: int, op: TagOp, iteration: int) -> int:
    """The 16-bit code of one collective. See [Note: order check]."""
    iteration_field = iteration % (1 << _ITERATION_BITS)
    unit_field = unit_index % (1 << _UNIT_BITS)
    return (iteration_field << (_OP_BITS + _UNIT_BITS)) | (int(op) << _UNIT_BITS) | unit_field


def decode(code: int) -> tuple[int, TagOp, int]:
    """``(unit index mod 4096, op, iteration mod 4)`` of a code made by :func:`encode`."""
    unit_field = code & ((1 << _UNIT_BITS) - 1)
    op = TagOp((code >> _UNIT_BITS) & ((1 << _OP_BITS) - 1))
    return unit_field, op, code >> (_OP_BITS + _UNIT_BITS)


def digits(code: int) -> tuple[int, int]:
    """The two base-256 digits of a 16-bit code, high first."""
    return code // _BASE, code % _BASE


def codes_from_digits(values: Sequence[float]) -> list[int | None]:
    """Per rank, the code its digit pair spells, or ``None`` if the pair is not one."""
    codes: list[int | None] = []
    for high, low in zip(values[0::2], values[1::2], strict=True):
        valid = all(float(d).is_integer() and 0 <= d < _BASE for d in (high, low))
        codes.append(int(high) * _BASE + int(low) if valid else None)
    return codes


def write_gather_tag(send: torch.Tensor, code: int) -> None:
    """Put ``code`` into the last :data:`GATHER_TAG_NUMEL` elements of ``send`` (1D)."""
    # Scalar fills, not a copy from cached digit-pair tensors: small tensors kept alive from
    # the middle of a step pin glibc's heap and raised peak RSS by tens of MiB.
    high, low = digits(code)
    send[-2].fill_(high)
    send[-1].fill_(low)


def gathered_tags(gathered: torch.Tensor, world: int, numel: int) -> torch.Tensor:
    """The ``(world, 2)`` digit pairs of an all-gather's output (1D, ``world`` blocks of
    ``numel`` elements and a pair each), as one strided view."""
    row = gathered.numel() // world
    return gathered.as_strided((world, _DIGITS), (row, 1), gathered.storage_offset() + numel)


def write_reduce_tag(rows: torch.Tensor, code: int, group_rank: int, group_size: int) -> None:
    """Put ``code`` into this rank's digit pair after every row of ``rows`` (2D).

    The other ranks' pairs are left as they are (zero).
    """
    high, low = digits(code)
    first = rows.shape[1] - reduce_tag_numel(group_size) + _DIGITS * group_rank
    rows[:, first].fill_(high)
    rows[:, first + 1].fill_(low)


@dataclass
class _Pending:
    """Tags copied to the host on a CUDA stream, to compare when the iteration ends."""

    group: dist.ProcessGroup
    code: int
    iteration: int
    host: torch.Tensor  # 1D, pinned: the digit pairs of every rank of the group
    copied: torch.cuda.Event


class OrderChecker:
    """Codes of the unit collectives under one root, and their comparison across ranks.

    Args:
        names: the FQN of every FSDP instance under the root, by unit index.
    """

    def __init__(self, names: Sequence[str]) -> None:
        self.names = list(names)
        self.iteration = 0  # root forwards so far; the first forward is iteration 1
        self._pending: list[_Pending] = []
        self._moves_data: dict[int, bool] = {}  # by id(group): ``_collectives.moves_data``

    def begin_iteration(self) -> None:
        """The root's forward starts. Tags of an iteration that never ended are compared first."""
        self.flush()
        self.iteration += 1

    def for_unit(self, unit_index: int) -> UnitTags:
        return UnitTags(self, unit_index)

    def code(self, unit_index: int, op: TagOp) -> int:
        return encode(unit_index, op, self.iteration)

    def check(self, group: dist.ProcessGroup, code: int, received: torch.Tensor) -> None:
        """Compare ``received`` (a digit pair per rank of ``group``: 1D, or ``(ranks, 2)``)
        with ``code``; raise on a mismatch.

        On CUDA the comparison waits for :meth:`flush`. See [Note: order check]. Over a fake
        backend nothing was received (``_collectives.moves_data``): nothing is compared.
        """
        moves = self._moves_data.get(id(group))
        if moves is None:  # the groups live as long as the units that hold them
            moves = self._moves_data[id(group)] = _collectives.moves_data(group)
        if not moves:
            return
        if received.device.type != "cuda":
            self._compare(group, code, self.iteration, received.tolist())
            return
        host = torch.empty(received.shape, dtype=received.dtype, pin_memory=True)
        host.copy_(received, non_blocking=True)
        copied = torch.cuda.current_stream(received.device).record_event()
        self._pending.append(_Pending(group, code, self.iteration, host, copied))

    def flush(self) -> None:
        """Compare the tags whose comparison was deferred (CUDA); raise at the first mismatch."""
        pending, self._pending = self._pending, []
        for p in pending:
            p.copied.synchronize()
            self._compare(p.group, p.code, p.iteration, p.host.tolist())

    def _compare(self, group: dist.ProcessGroup, code: int, iteration: int, values: list) -> None:
        if values and isinstance(values[0], list):  # ``(ranks, 2)``
            values = [digit for pair in values for digit in pair]
        if values == list(digits(code)) * (len(values) // _DIGITS):
            return  # every rank sent ``code``; otherwise decode what each one sent
        codes = codes_from_digits(values)
        by_code: dict[int | None, list[int]] = {}
        for group_rank, c in enumerate(codes):
            by_code.setdefault(c, []).append(dist.get_global_rank(group, group_rank))
        parts = [
            f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} "
            f"{self._describe(c, iteration)}"
            for c, ranks in by_code.items()
        ]
        raise RuntimeError(
            f"[rank {dist.get_rank()}] FSDP ranks ran units in different orders in iteration "
            f"{iteration}: at the same collective, {'; '.join(parts)}. All ranks must run the "
            "same FSDP instances in the same order in forward and backward; look for control "
            "flow that depends on the rank or on rank-local data."
        )

    def _describe(self, code: int | None, iteration: int) -> str:
        if code is None:
            return "sent no readable order tag (a collective of another kind or size)"
        unit_index, op, iteration_field = decode(code)
        unit = self._unit_name(unit_index)
        text = _DESCRIPTIONS[op].format(unit=unit)
        if iteration_field != iteration % (1 << _ITERATION_BITS):
            text += f" in another iteration (number {iteration_field} modulo 4)"
        return text

    def _unit_name(self, unit_index: int) -> str:
        matches = [name for i, name in enumerate(self.names) if i % (1 << _UNIT_BITS) == unit_index]
        if not matches:
            return f"unit #{unit_index}"
        quoted = " or ".join(repr(m) if m else "'' (the root)" for m in matches)
        return quoted


class UnitTags:
    """The order tags of one unit's collectives; given to the unit by the root at lazy init.

    See [Note: order check].
    """

    def __init__(self, checker: OrderChecker, unit_index: int) -> None:
        self.checker = checker
        self.unit_index = unit_index
        # By (op, iteration modulo 4): what the code depends on.
        self._codes: dict[tuple[TagOp, int], int] = {}

    def code(self, op: TagOp) -> int:
        """The code this rank sends with the unit's next ``op`` collective."""
        key = (op, self.checker.iteration % (1 << _ITERATION_BITS))
        code = self._codes.get(key)
        if code is None:
            code = self._codes[key] = self.checker.code(self.unit_index, op)
        return code

    def check(self, code: int, received: torch.Tensor, group: dist.ProcessGroup) -> None:
        """Compare the digit pairs ``received`` (1D, one per rank of ``group``, the group of
        the collective) with the ``code`` sent."""
        self.checker.check(group, code, received)
