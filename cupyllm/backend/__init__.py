"""Backends run the same operations on different devices: `cpu` (NumPy + numba) and `gpu` (CuPy + our kernels)."""
from __future__ import annotations

from ..errors import DeviceError

DEVICES = ("auto", "cpu", "gpu")


def gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, no device: all mean "no GPU here"
        return False


def select_backend(device: str = "auto", threads: int | None = None):
    """The backend for `device`; `threads`: CPU threads of the CPU backend's parallel work (None: every core)."""
    if device not in DEVICES:
        raise DeviceError(f"unknown device '{device}'; choose one of {', '.join(DEVICES)}")
    if device == "gpu" or (device == "auto" and gpu_available()):
        if not gpu_available():
            raise DeviceError("device 'gpu' asked for, but no CUDA GPU is usable here (CuPy missing or no device); "
                              "install cupyllm[gpu] (CUDA 12) or cupyllm[gpu13] (CUDA 13), or use --device cpu")
        from .gpu import GPUBackend

        return GPUBackend()
    from .cpu import CPUBackend

    return CPUBackend(threads=threads)
