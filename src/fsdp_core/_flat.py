"""Where each parameter's shard sits in a unit's flat shard.

[Note: mixed dtypes in one unit]
A unit keeps its parameters' shards in one flat buffer, so that one all-gather unshards them
all. When every parameter has one dtype the buffer has it too and offsets count elements.
FSDP2 also accepts frozen parameters of other dtypes next to the ones that train (a float8
weight that does not train next to float32 ones): then the buffer is bytes (``uint8``), each
shard starts at a multiple of ``ALIGN`` bytes and is a ``.view(dtype)`` of its bytes, and the
all-gather moves bytes, which every backend supports whatever the dtypes. Casting to a
mixed-precision ``param_dtype`` then happens at the copy-out instead of before the all-gather
(the same values; more bytes on the wire), and such an all-gather carries no order tag (a byte
cannot hold a tag's digit pairs exactly; see [Note: order check]: the unit's reductions still
carry theirs, since gradients have one dtype).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["ALIGN", "FlatLayout"]

ALIGN = 16  # bytes; the largest itemsize (complex128), so every view's offset divides


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class FlatLayout:
    """The offsets of shards of ``numels`` elements of ``dtypes`` in one flat buffer.

    See [Note: mixed dtypes in one unit].
    """

    def __init__(self, dtypes: Sequence[torch.dtype], numels: Sequence[int]) -> None:
        if len(dtypes) != len(numels):
            raise AssertionError(f"{len(dtypes)} dtypes for {len(numels)} shards")
        self.dtypes = tuple(dtypes)
        self.numels = tuple(numels)
        self.mixed = len(set(self.dtypes)) > 1
        # The buffer's dtype: the parameters' own, or bytes.
        self.dtype = torch.uint8 if self.mixed or not self.dtypes else self.dtypes[0]
        self.offsets: list[int] = []  # in the buffer's elements
        end = 0
        for dtype, numel in zip(self.dtypes, self.numels, strict=True):
            if self.mixed:
                end = _round_up(end, ALIGN)
            self.offsets.append(end)
            end += numel * dtype.itemsize if self.mixed else numel
        self.numel = _round_up(end, ALIGN) if self.mixed else end

    def segment(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        """Shard ``index`` of the 1D buffer ``flat``: 1D, in its own dtype."""
        return self.columns(flat.view(1, -1), index).view(-1)

    def columns(self, blocks: torch.Tensor, index: int) -> torch.Tensor:
        """Shard ``index`` of every row of ``blocks`` (``(rows, numel)`` in the buffer's dtype,
        an all-gather's output by rank): ``(rows, numel of the shard)`` in its own dtype."""
        start, numel, dtype = self.offsets[index], self.numels[index], self.dtypes[index]
        if not self.mixed:
            return blocks[:, start : start + numel]
        return blocks[:, start : start + numel * dtype.itemsize].view(dtype)
