"""The values of the rank fixtures on one rank."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["RankContext"]


@dataclasses.dataclass
class RankContext:
    """The values of the rank fixtures on one rank."""

    rank: int
    world_size: int
    process_group: Any
    device: Any
    dist_backend: str

    def value(self, name: str) -> Any:
        return getattr(self, name)
