"""What every family's GPU launcher shares: CuPy, the registry its kernels compile through, stand-ins for pointer
arguments a kernel does not read, and the grid of a grid-stride kernel."""
from __future__ import annotations

from .registry import KernelRegistry, require_cupy

MAX_GRID = 65535 * 32  # grid-stride kernels: enough CTAs to fill any GPU


def grid_stride_blocks(n: int, threads: int) -> int:
    """CTAs of `threads` threads for a grid-stride loop over n items: one item a thread, at most MAX_GRID."""
    return max(1, min(MAX_GRID, (n + threads - 1) // threads))


class KernelLauncher:
    """Base of the launcher classes (ops/<family>/gpu.py); CuPy is imported when one is built."""

    def __init__(self, registry: KernelRegistry | None = None):
        self.cp = require_cupy()
        self.registry = registry if registry is not None else KernelRegistry()
        # stands in for pointer arguments a kernel does not read (the emulator takes only arrays for pointers)
        self._unused_f32 = self.cp.zeros(1, dtype=self.cp.float32)

    def _fn(self, name: str):
        return self.registry.function(name)
