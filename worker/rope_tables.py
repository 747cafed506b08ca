"""Per-position RoPE tables of one stage, kept across steps.

The compressor kernels read (cos, sin) [P, R/2] tables by position, and the per-token (cos, sin)
are rows of the same tables, so a step computes no trigonometry and uploads nothing. Tables grow
(to a power of two) when a position passes their length; a CUDA graph captures the tables it was
given, so `ensure` is called with the graphs' longest context before any capture, and tables
that an eager step outgrows stay allocated (a captured graph still reads them).
"""

from __future__ import annotations

import torch

from dsv4ray.config import RopeSpec
from dsv4ray.model.layers.rope import rope_tables


class RopeTables:
    def __init__(self, specs, device) -> None:
        self.specs = tuple(dict.fromkeys(specs))
        self.device = torch.device(device)
        self.length = 0
        self.tables: dict[RopeSpec, tuple[torch.Tensor, torch.Tensor]] = {}
        self._outgrown: list[dict] = []  # earlier tables, kept for the graphs that read them

    def ensure(self, length: int) -> int:
        """Tables cover [0, length) afterwards; returns their length."""
        if length > self.length:
            self.length = 1 << max(length - 1, 1).bit_length()
            if self.tables:
                self._outgrown.append(self.tables)
            self.tables = {s: rope_tables(s, self.length, self.device) for s in self.specs}
        return self.length

    def get(self, spec: RopeSpec) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tables[spec]
