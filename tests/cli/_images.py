"""Checks on the PNG files the command line and the benchmarks write."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def read_png(path: Path) -> Any:
    """The image as an array of RGB(A) floats in [0, 1], height x width x channels."""
    from matplotlib.image import imread

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return imread(str(path))


def assert_drawn_png(path: Path, *, width: int, height: int | None = None) -> Any:
    """``path`` is a PNG of the given size with a drawing on it: many colours, and a good share
    of pixels that are not background white. Returns the pixels."""
    import numpy as np

    pixels = read_png(path)
    assert pixels.shape[1] == width, pixels.shape
    if height is not None:
        assert pixels.shape[0] == height, pixels.shape
    rgb = (pixels[..., :3] * 255).round().astype(np.uint8).reshape(-1, 3)
    colours = np.unique(rgb, axis=0)
    assert len(colours) > 20, f"{path}: only {len(colours)} colours"
    not_white = (rgb < 250).any(axis=1).mean()
    assert not_white > 0.05, f"{path}: {not_white:.1%} of the pixels are drawn on"
    return pixels
