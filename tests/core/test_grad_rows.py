"""``write_grad_rows``: a gradient laid out as reduce-scatter rows, each element written once.

The reference is the layout spelled out: pad the gradient along the shard dim, split it into
``world`` chunks, flatten each into its rank's row, then divide. The buffer starts full of NaNs
so that an element the function does not write shows.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from fsdp_core._param import chunk_shape
from fsdp_core._unit_grads import write_grad_rows


def _param(shape: tuple[int, ...], dim: int, world: int) -> SimpleNamespace:
    chunk = chunk_shape(torch.Size(shape), dim, world)
    return SimpleNamespace(
        shard_world=world,
        chunk_shape=chunk,
        shard_dim=dim,
        chunk_rows=chunk[dim],
        rows=shape[dim],
        shard_numel=math.prod(chunk),
    )


def _reference(grad: torch.Tensor, p: SimpleNamespace, div: float, dtype: torch.dtype):
    pad = list(grad.shape)
    pad[p.shard_dim] = p.chunk_rows * p.shard_world - p.rows
    padded = torch.cat([grad, grad.new_zeros(pad)], dim=p.shard_dim).to(dtype)
    rows = [c.reshape(-1) for c in padded.chunk(p.shard_world, dim=p.shard_dim)]
    out = torch.stack(rows) if p.chunk_rows else padded.new_zeros(p.shard_world, 0)
    return out / div if div != 1 else out


@pytest.mark.parametrize(
    "shape,dim,world",
    [
        ((8, 3), 0, 2),  # even
        ((7, 3), 0, 2),  # one padded row
        ((5, 4), 0, 4),  # the last rank's chunk all padding
        ((2, 3), 0, 4),  # two ranks hold nothing
        ((3, 10, 2), 1, 3),  # another shard dim, padded
        ((6,), 0, 3),
        ((0, 4), 0, 2),  # an empty parameter
    ],
)
@pytest.mark.parametrize("div", [1, 2, 3.0])
def test_rows_equal_the_padded_chunks_divided(shape, dim, world, div) -> None:
    p = _param(shape, dim, world)
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    buffer = torch.full((world, p.shard_numel + 5), float("nan"))
    write_grad_rows(p, grad, buffer[:, 2 : 2 + p.shard_numel], div)
    expected = _reference(grad, p, div, torch.float32)
    assert torch.equal(buffer[:, 2 : 2 + p.shard_numel], expected)
    assert buffer[:, :2].isnan().all() and buffer[:, 2 + p.shard_numel :].isnan().all()


def test_a_missing_gradient_writes_zeros() -> None:
    p = _param((7, 3), 0, 4)
    buffer = torch.full((4, p.shard_numel), float("nan"))
    write_grad_rows(p, None, buffer, 4)
    assert torch.equal(buffer, torch.zeros_like(buffer))


def test_a_cast_divides_in_the_buffers_dtype() -> None:
    p = _param((9, 5), 0, 3)
    grad = torch.randn(9, 5, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    buffer = torch.full((3, p.shard_numel), float("nan"))
    write_grad_rows(p, grad, buffer, 3)
    assert torch.equal(buffer, _reference(grad, p, 3, torch.float32))


def test_the_rows_equal_a_copy_then_an_in_place_division_bit_for_bit() -> None:
    p = _param((1000, 33), 0, 3)
    grad = torch.randn(1000, 33, generator=torch.Generator().manual_seed(2))
    buffer = torch.empty(3, p.shard_numel)
    write_grad_rows(p, grad, buffer, 3)
    copied = _reference(grad, p, 1, torch.float32)
    copied.div_(3)
    assert torch.equal(buffer, copied)
