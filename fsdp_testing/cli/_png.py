"""A tiny RGB canvas with rectangles and a 3x5 pixel font, written as PNG with zlib and struct.

Enough to draw a timeline without a plotting dependency.
"""

from __future__ import annotations

import struct
import zlib

__all__ = ["Canvas"]

Color = tuple[int, int, int]

# 3x5 glyphs, rows top to bottom; lower case is drawn as upper case.
_FONT: dict[str, str] = {
    "A": "010101111101101", "B": "110101110101110", "C": "011100100100011",
    "D": "110101101101110", "E": "111100110100111", "F": "111100110100100",
    "G": "011100101101011", "H": "101101111101101", "I": "111010010010111",
    "J": "001001001101010", "K": "101101110101101", "L": "100100100100111",
    "M": "101111111101101", "N": "110101101101101", "O": "010101101101010",
    "P": "110101110100100", "Q": "010101101110011", "R": "110101110101101",
    "S": "011100010001110", "T": "111010010010010", "U": "101101101101111",
    "V": "101101101101010", "W": "101101111111101", "X": "101101010101101",
    "Y": "101101010010010", "Z": "111001010100111", "0": "111101101101111",
    "1": "010110010010111", "2": "110001010100111", "3": "110001010001110",
    "4": "101101111001001", "5": "111100110001110", "6": "011100111101111",
    "7": "111001010010010", "8": "111101111101111", "9": "111101111001110",
    " ": "000000000000000", "-": "000000111000000", "_": "000000000000111",
    ".": "000000000000010", ":": "000010000010000", "/": "001001010100100",
    "(": "010100100100010", ")": "010001001001010", "=": "000111000111000",
    "+": "000010111010000", ",": "000000000010100",
}  # fmt: skip


class Canvas:
    """An RGB image of ``width`` x ``height`` pixels filled with ``background``."""

    def __init__(self, width: int, height: int, background: Color = (255, 255, 255)) -> None:
        if width < 1 or height < 1:
            raise ValueError(f"Canvas needs a positive size, got {width}x{height}")
        self.width = width
        self.height = height
        self._rows = [bytearray(bytes(background) * width) for _ in range(height)]

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        """Fill the pixels with ``x0 <= x < x1`` and ``y0 <= y < y1`` (clipped)."""
        x0, x1 = max(0, x0), min(self.width, x1)
        y0, y1 = max(0, y0), min(self.height, y1)
        if x0 >= x1 or y0 >= y1:
            return
        span = bytes(color) * (x1 - x0)
        for y in range(y0, y1):
            self._rows[y][3 * x0 : 3 * x1] = span

    def text(self, x: int, y: int, text: str, color: Color = (0, 0, 0), scale: int = 2) -> int:
        """Draw ``text`` with its top-left corner at (x, y); returns the x after it."""
        for char in text.upper():
            glyph = _FONT.get(char, _FONT["-"])
            for i, bit in enumerate(glyph):
                if bit == "1":
                    gx, gy = x + (i % 3) * scale, y + (i // 3) * scale
                    self.rect(gx, gy, gx + scale, gy + scale, color)
            x += 4 * scale
        return x

    def png(self) -> bytes:
        """The image as PNG bytes (8-bit RGB, no interlacing)."""
        raw = b"".join(b"\x00" + bytes(row) for row in self._rows)

        def chunk(kind: bytes, data: bytes) -> bytes:
            body = kind + data
            return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return (
            b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(raw, 9))
            + chunk(b"IEND", b"")
        )
