"""CUDA plumbing: kernel sources, their compilation (CuPy RawModule / NVRTC) and device discovery.

Nothing here imports CuPy at import time, so the CPU engine runs without it.
"""
from .registry import (KernelRegistry, KernelSet, all_kernel_sets, device_name, gpu_count, kernel_source_dir,
                       require_cupy)

__all__ = ["KernelRegistry", "KernelSet", "all_kernel_sets", "device_name", "gpu_count", "kernel_source_dir",
           "require_cupy"]
