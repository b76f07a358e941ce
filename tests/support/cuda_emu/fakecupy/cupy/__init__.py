"""A NumPy-backed stand-in for the parts of CuPy that cupyllm's GPU code and GPU tests use.

Device arrays are NumPy arrays of a subclass (`cupy.ndarray`) whose memory is mapped with a guard page
right after it (an overrun of more than the 256-byte rounding faults instead of reading garbage);
RawModule kernels run on the CPU emulator (tests/support/cuda_emu). For checking GPU code without a GPU only:
it is never on sys.path unless asked for (CUPYLLM_EMULATE=1 in tests/conftest.py, or an explicit
sys.path insertion), and `cupy.__cupyllm_emulated__` is True.

Closer to CuPy than plain NumPy where it catches bugs: kernel arguments are checked against the
kernel's parameter types (dtype of each pointer, exact scalar types, C-contiguity, device arrays only),
ufuncs refuse to mix device arrays with host NumPy arrays, dynamic shared memory above 48 KB needs
`kernel.max_dynamic_shared_size_bytes` raised first, as on a GPU.

`launches` counts what would be a device launch on CuPy (tools/count_decode_launches.py reads it): each
RawModule kernel by name, each ufunc call as `cupy_<ufunc>` (CuPy runs one elementwise or reduction kernel
per call), and the copies and fills CuPy runs as kernels (`cupy_copy`: astype, copy, a copying
ascontiguousarray, concatenate, stack, device-to-device asarray; `cupy_fill`; `cupy_gather` / `cupy_scatter`:
fancy indexing). Host-device transfers are not launches and are not counted.
"""
from __future__ import annotations

import collections
import ctypes
import os
import sys
import types
import weakref
from pathlib import Path

import numpy as np
from numpy import (bool_, float16, float32, float64, int8, int16, int32, int64, uint8, uint16, uint32,  # noqa: F401
                   uint64, dtype, newaxis)

__version__ = "14.0.0+cupyllm.emulator"
__cupyllm_emulated__ = True

_TOOLS = Path(__file__).resolve().parents[2]  # tests/support/cuda_emu
if str(_TOOLS) not in sys.path:
    sys.path.insert(0, str(_TOOLS))
import emulator as _emulator  # noqa: E402

# The device the emulator pretends to be: CUPYLLM_EMULATE_ARCH=80 gives an A100's limits.
_ARCH = int(os.environ.get("CUPYLLM_EMULATE_ARCH", "90"))
_SMEM_OPTIN = {80: 166912, 86: 101376, 89: 101376, 90: 232448}.get(_ARCH, 232448)
_SMEM_DEFAULT = 49152
_SM_COUNT = {80: 108, 90: 132}.get(_ARCH, 132)


launches: collections.Counter = collections.Counter()


def _fancy(key) -> bool:
    """Whether an index is advanced (arrays or lists: a gather / scatter kernel on CuPy)."""
    keys = key if isinstance(key, tuple) else (key,)
    return any(isinstance(k, (np.ndarray, list)) for k in keys)


# ---- device memory -----------------------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_PAGE = os.sysconf("SC_PAGE_SIZE")
_PROT_NONE, _PROT_RW, _MAP_PRIVATE_ANON = 0, 3, 0x02 | 0x20


def _device_buffer(nbytes: int):
    """A writable buffer of nbytes, 256-byte aligned, ending within 255 bytes of a PROT_NONE page."""
    span = max(256, -(-nbytes // 256) * 256)
    pages = -(-span // _PAGE)
    total = (pages + 1) * _PAGE
    base = _libc.mmap(None, total, _PROT_RW, _MAP_PRIVATE_ANON, -1, 0)
    if base in (None, ctypes.c_void_p(-1).value):
        raise MemoryError(f"out of (emulated) device memory allocating {nbytes} bytes")
    _libc.mprotect(base + pages * _PAGE, _PAGE, _PROT_NONE)
    start = base + pages * _PAGE - span
    buffer = (ctypes.c_char * span).from_address(start)
    weakref.finalize(buffer, _libc.munmap, base, total)
    return buffer


class ndarray(np.ndarray):
    """A device array: a NumPy array that kernels accept and host NumPy arrays do not mix with."""

    def __new__(cls, shape, dtype=float, memptr=None, strides=None, order="C"):
        dt = np.dtype(dtype)
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        return np.ndarray.__new__(cls, shape, dt, buffer=_device_buffer(nbytes), order=order)

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.ctypes.data)

    @property
    def device(self):
        return cuda.Device()

    def get(self, stream=None, order="C", out=None):
        host = np.array(self.view(np.ndarray), order=order)
        if out is not None:
            out[...] = host
            return out
        return host

    def set(self, arr, stream=None):
        if isinstance(arr, ndarray):
            raise TypeError("ndarray.set takes a host NumPy array")
        self.view(np.ndarray)[...] = arr

    def astype(self, dtype, order="K", casting="unsafe", subok=True, copy=True):
        if copy or np.dtype(dtype) != self.dtype:
            launches["cupy_copy"] += 1
        return np.ndarray.astype(self, dtype, order=order, casting=casting, subok=subok, copy=copy)

    def copy(self, order="C"):
        launches["cupy_copy"] += 1
        return np.ndarray.copy(self, order=order)

    def fill(self, value):
        launches["cupy_fill"] += 1
        np.ndarray.fill(self, value)

    def __getitem__(self, key):
        if _fancy(key):
            launches["cupy_gather"] += 1
        return np.ndarray.__getitem__(self, key)

    def __setitem__(self, key, value):
        launches["cupy_scatter" if _fancy(key) else "cupy_copy"] += 1
        np.ndarray.__setitem__(self, key, value)

    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kwargs):
        for x in inputs + (out or ()):
            if isinstance(x, np.ndarray) and not isinstance(x, ndarray) and x.ndim > 0:
                raise TypeError(f"Unsupported type {type(x)}: a host NumPy array mixed with a device array "
                                "(use cupy.asarray / cupy.asnumpy)")
        launches[f"cupy_{ufunc.__name__}"] += 1
        base_inputs = tuple(x.view(np.ndarray) if isinstance(x, ndarray) else x for x in inputs)
        if out is not None:
            kwargs["out"] = tuple(x.view(np.ndarray) if isinstance(x, ndarray) else x for x in out)
        result = getattr(ufunc, method)(*base_inputs, **kwargs)
        if out is not None:
            return out[0] if len(out) == 1 else out
        return _wrap(result)

    def __array_function__(self, func, types_, args, kwargs):
        return _wrap(func(*_unwrap(args), **_unwrap(kwargs)))

    def __repr__(self):
        return "device:" + repr(self.view(np.ndarray))


def _unwrap(obj):
    if isinstance(obj, ndarray):
        return obj.view(np.ndarray)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_unwrap(x) for x in obj)
    if isinstance(obj, dict):
        return {k: _unwrap(v) for k, v in obj.items()}
    return obj


def _wrap(obj):
    if isinstance(obj, np.ndarray) and not isinstance(obj, ndarray):
        return obj.view(ndarray)
    if isinstance(obj, tuple):
        return tuple(_wrap(x) for x in obj)
    if isinstance(obj, list):
        return [_wrap(x) for x in obj]
    return obj


def _device_copy(host: np.ndarray) -> ndarray:
    host = np.ascontiguousarray(host)
    out = ndarray(host.shape, host.dtype)
    out.view(np.ndarray)[...] = host
    return out


def _copy_on_device(a) -> None:
    if isinstance(a, ndarray) or isinstance(a, (list, tuple)) and any(isinstance(x, ndarray) for x in a):
        launches["cupy_copy"] += 1


def asarray(a, dtype=None, order=None):
    if isinstance(a, ndarray) and (dtype is None or np.dtype(dtype) == a.dtype):
        return a
    _copy_on_device(a)
    return _device_copy(np.asarray(_unwrap(a), dtype=dtype))


def array(a, dtype=None, copy=True, order="K"):
    _copy_on_device(a)
    return _device_copy(np.array(_unwrap(a), dtype=dtype))


def ascontiguousarray(a, dtype=None):
    if isinstance(a, ndarray) and a.flags.c_contiguous and (dtype is None or np.dtype(dtype) == a.dtype):
        return a
    _copy_on_device(a)
    return _device_copy(np.ascontiguousarray(_unwrap(a), dtype=dtype))


def asnumpy(a, stream=None, order="C", out=None):
    host = np.array(_unwrap(a), order=order) if isinstance(a, ndarray) else np.asarray(a, order=order)
    if out is not None:
        out[...] = host
        return out
    return host


def empty(shape, dtype=float, order="C"):
    return ndarray(shape, dtype)


def zeros(shape, dtype=float, order="C"):
    launches["cupy_fill"] += 1
    out = ndarray(shape, dtype)
    out.view(np.ndarray).fill(0)
    return out


def ones(shape, dtype=float, order="C"):
    return full(shape, 1, dtype)


def full(shape, fill_value, dtype=None, order="C"):
    dt = np.dtype(dtype) if dtype is not None else np.asarray(fill_value).dtype
    launches["cupy_fill"] += 1
    out = ndarray(shape, dt)
    out.view(np.ndarray).fill(fill_value)
    return out


def empty_like(a, dtype=None):
    return empty(a.shape, dtype or a.dtype)


def zeros_like(a, dtype=None):
    return zeros(a.shape, dtype or a.dtype)


def full_like(a, fill_value, dtype=None):
    return full(a.shape, fill_value, dtype or a.dtype)


def arange(*args, dtype=None):
    return _device_copy(np.arange(*args, dtype=dtype))


def concatenate(arrays, axis=0, out=None, dtype=None):
    _copy_on_device(list(arrays))
    return _device_copy(np.concatenate(_unwrap(list(arrays)), axis=axis, dtype=dtype))


def stack(arrays, axis=0):
    _copy_on_device(list(arrays))
    return _device_copy(np.stack(_unwrap(list(arrays)), axis=axis))


class _Random:
    """cupy.random: NumPy's global generator, results as device arrays, with CuPy's dtype= keyword."""

    def standard_normal(self, size=None, dtype=float):
        return _device_copy(np.asarray(np.random.standard_normal(size), dtype=dtype))

    def __getattr__(self, name):
        func = getattr(np.random, name)
        return (lambda *a, **k: _wrap(func(*_unwrap(a), **_unwrap(k)))) if callable(func) else func


random = _Random()


def __getattr__(name):  # other NumPy functions act on device arrays and return device arrays
    func = getattr(np, name)
    if callable(func) and not isinstance(func, type):
        return lambda *a, **k: _wrap(func(*_unwrap(a), **_unwrap(k)))
    return func


# ---- kernels -------------------------------------------------------------------------------------------

class RawKernel:
    """A kernel of a RawModule; `kernel(grid, block, args, shared_mem=0)` runs it on the emulator."""

    def __init__(self, function, name: str = "kernel"):
        self._function = function
        self._name = name
        self.max_dynamic_shared_size_bytes = 0

    def __setattr__(self, name, value):
        if name == "max_dynamic_shared_size_bytes" and value > _SMEM_OPTIN:
            raise cuda.driver.CUDADriverError(
                f"CUDA_ERROR_INVALID_VALUE: max_dynamic_shared_size_bytes {value} exceeds the device's "
                f"{_SMEM_OPTIN} (sm_{_ARCH})")
        object.__setattr__(self, name, value)

    @property
    def attributes(self):
        return {"max_dynamic_shared_size_bytes": self.max_dynamic_shared_size_bytes}

    def __call__(self, grid, block, args, *, shared_mem=0, stream=None, enable_cooperative_groups=False):
        limit = max(_SMEM_DEFAULT, self.max_dynamic_shared_size_bytes)
        if shared_mem > limit:
            raise cuda.driver.CUDADriverError(
                f"CUDA_ERROR_INVALID_VALUE: {shared_mem} bytes of dynamic shared memory, but the kernel "
                f"allows {limit} (set kernel.max_dynamic_shared_size_bytes first; sm_{_ARCH} max {_SMEM_OPTIN})")
        launches[self._name] += 1
        try:
            self._function(grid, block, tuple(args), shared_mem,
                           is_device_array=lambda a: isinstance(a, ndarray))
        except _emulator.EmuLaunchError as exc:
            raise cuda.driver.CUDADriverError(str(exc)) from None


class RawModule:
    """Compiles `code` for the emulator (and with NVRTC first when CUPYLLM_EMULATE_NVRTC=1)."""

    def __init__(self, code=None, path=None, options=(), backend="nvrtc", translate_cucomplex=False,
                 enable_cooperative_groups=False, name_expressions=None, jitify=False):
        if code is None:
            code = Path(path).read_text()
        self.code, self.options = code, tuple(options)
        self.name_expressions = list(name_expressions or ())
        self._library = None

    def compile(self, log_stream=None):
        if self._library is None:
            if os.environ.get("CUPYLLM_EMULATE_NVRTC") == "1":
                _nvrtc_check(self.code, self.options, self.name_expressions)
            try:
                self._library = _emulator.build(self.code, self.name_expressions, self.options)
            except _emulator.EmuBuildError as exc:
                raise cuda.compiler.CompileException(str(exc), self.code, "emulated", self.options, "emu") from None
        return self

    def get_function(self, name):
        self.compile()
        return RawKernel(self._library.function(name), name)


def _nvrtc_check(code, options, names):
    from cupyllm.cuda import nvrtc_check
    result = nvrtc_check.compile_source(nvrtc_check.load_nvrtc(), code, "emulated.cu", tuple(options), _ARCH,
                                        tuple(names))
    if not result.ok:
        raise cuda.compiler.CompileException(result.log, code, "emulated.cu", options, "nvrtc")


# ---- cupy.cuda ------------------------------------------------------------------------------------------

class _CUDADriverError(RuntimeError):
    pass


class _CompileException(Exception):
    def __init__(self, msg, source, name, options, backend="nvrtc"):
        super().__init__(msg)
        self._msg = msg

    def get_message(self):
        return self._msg


class _Device:
    def __init__(self, device=0):
        self.id = int(device)

    compute_capability = str(_ARCH)

    @property
    def attributes(self):
        return {"MultiProcessorCount": _SM_COUNT, "MaxSharedMemoryPerBlockOptin": _SMEM_OPTIN}

    @property
    def mem_info(self):
        """(free, total) bytes: the emulated device's memory is the host's (MemAvailable, MemTotal)."""
        fields = {}
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                name, value = line.split(":", 1)
                fields[name] = int(value.split()[0]) * 1024
        return fields.get("MemAvailable", 0), fields.get("MemTotal", 0)

    def synchronize(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Runtime:
    @staticmethod
    def getDeviceCount():
        return 1

    @staticmethod
    def deviceSynchronize():
        pass

    @staticmethod
    def getDeviceProperties(device=0):
        return {"name": f"CPU emulator (sm_{_ARCH})".encode(), "multiProcessorCount": _SM_COUNT,
                "sharedMemPerBlockOptin": _SMEM_OPTIN, "totalGlobalMem": 8 << 30,
                "major": _ARCH // 10, "minor": _ARCH % 10}

    @staticmethod
    def runtimeGetVersion():
        return 12090

    @staticmethod
    def memGetInfo():
        return 8 << 30, 8 << 30


class _Stream:
    """Everything is synchronous in the emulator; stream capture is not supported (begin_capture raises)."""

    def __init__(self, non_blocking=False):
        pass

    def synchronize(self):
        pass

    def begin_capture(self, mode=None):
        raise RuntimeError("CUDA graph capture is not emulated")

    def end_capture(self):
        return None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Event:
    def __init__(self, *args, **kwargs):
        import time
        self._time = time.perf_counter
        self.t = None

    def record(self, stream=None):
        self.t = self._time()

    def elapsed_time(self, other):
        return (other.t - self.t) * 1000.0

    def synchronize(self):
        pass


def _get_elapsed_time(start, end):
    return (end.t - start.t) * 1000.0


_Stream.null = _Stream()
cuda = types.SimpleNamespace(
    Device=_Device, runtime=_Runtime, Stream=_Stream, Event=_Event, get_elapsed_time=_get_elapsed_time,
    get_current_stream=lambda: _Stream.null, driver=types.SimpleNamespace(CUDADriverError=_CUDADriverError),
    compiler=types.SimpleNamespace(CompileException=_CompileException), is_available=lambda: True)


class _MemoryPool:
    def used_bytes(self):
        return 0

    def free_bytes(self):
        return 0

    def total_bytes(self):
        return 0

    def free_all_blocks(self):
        pass


_pool = _MemoryPool()


def get_default_memory_pool():
    return _pool


def is_available():
    return True
