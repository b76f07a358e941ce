"""Find, compile and cache our CUDA kernels (`kernels_cu/<family>/*.cu`) through CuPy's RawModule.

Every kernel the engine launches is a template instantiation declared up front in a `KernelSet`
(file + C++ name expressions). The same declarations drive the driverless NVRTC check
(`cupyllm.cuda.nvrtc_check`), so CI compiles exactly what a GPU run would ask for.

CuPy is imported lazily: `import cupyllm.cuda` works on machines without it.
"""
from __future__ import annotations

import hashlib
import importlib
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from ..errors import DeviceError

# Environment override for the kernel source directory (tests, custom builds).
KERNEL_DIR_ENV = "CUPYLLM_KERNEL_DIR"

# Options every kernel is compiled with. No --use_fast_math: the storage formats must reproduce the
# NumPy references bit for bit, and approximate division/sqrt/exp would not. (CuPy itself appends
# -ftz=true after these; our kernels never rely on f32 subnormal arithmetic, see common.cuh.)
BASE_OPTIONS: tuple[str, ...] = ("-std=c++17",)

# Modules that declare kernel sets through a `kernel_sets()` function. Importing them must not import
# CuPy. A new kernel file gets its sets declared in its wrapper module, listed here.
KERNEL_SET_PROVIDERS: tuple[str, ...] = (
    "cupyllm.ops.kv_formats.gpu",
    "cupyllm.ops.elementwise.gpu",
    "cupyllm.ops.matmul.gpu",
    "cupyllm.ops.attention.gpu",
    "cupyllm.ops.deltanet.gpu",
)


@dataclass(frozen=True)
class KernelSet:
    """One compilation unit: a .cu file and the template instantiations compiled from it together.

    `name_expressions` are C++ expressions such as ``"kv_encode<FmtQ8_0, 128, float>"``; CuPy maps
    each to its mangled symbol. `options` are extra NVRTC options for this unit only.
    """
    filename: str
    name_expressions: tuple[str, ...]
    options: tuple[str, ...] = ()
    label: str = ""

    def __post_init__(self):
        if not self.filename.endswith(".cu"):
            raise ValueError(f"kernel file must be a .cu file, got {self.filename!r}")

    @property
    def description(self) -> str:
        return f"{self.filename} [{self.label}]" if self.label else self.filename


def _package_kernel_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "kernels_cu"


def _checkout_kernel_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "kernels_cu"


def kernel_source_dir() -> Path:
    """The directory holding the .cu/.cuh sources.

    Installed wheel: `cupyllm/kernels_cu` (package data). Source checkout: `<repo>/kernels_cu`.
    """
    override = os.environ.get(KERNEL_DIR_ENV)
    candidates = [Path(override)] if override else []
    candidates += [_package_kernel_dir(), _checkout_kernel_dir()]
    for path in candidates:
        if path.is_dir() and any(path.glob("*/*.cu")):
            return path
    raise DeviceError(
        "CUDA kernel sources not found (looked in "
        + ", ".join(str(p) for p in candidates)
        + f"); reinstall cupyllm or set {KERNEL_DIR_ENV} to the kernels_cu directory")


def all_kernel_sets() -> list[KernelSet]:
    """Every kernel set the engine may compile, from each provider module."""
    sets: list[KernelSet] = []
    for module_name in KERNEL_SET_PROVIDERS:
        module = importlib.import_module(module_name)
        sets.extend(module.kernel_sets())
    return sets


def cuda_include_dirs() -> list[str]:
    """The directory holding cuda_fp16.h / cuda_bf16.h for NVRTC (it has no built-in search path).

    Prefers the `nvidia-cuda-runtime` pip package (located by cuda.pathfinder), then CUDA_PATH /
    CUDA_HOME, then /usr/local/cuda.
    """
    found: list[str] = []
    try:
        import cuda.pathfinder as pathfinder  # shipped with CuPy 14
        located = pathfinder.find_nvidia_header_directory("cudart")
        if located:
            found.append(str(located))
    except Exception:  # pathfinder missing or no header package: fall through to CUDA_PATH
        pass
    for env in ("CUDA_PATH", "CUDA_HOME"):
        root = os.environ.get(env)
        if root:
            found.append(str(Path(root) / "include"))
    found.append("/usr/local/cuda/include")
    # One directory only: mixing the headers of two CUDA versions is worse than a clear failure.
    for d in found:
        if (Path(d) / "cuda_fp16.h").is_file():
            return [d]
    return []


def source_fingerprint(source_dir: Path) -> str:
    """Hash of every header in the kernel directory.

    CuPy's on-disk cache keys on the .cu text only, not on what it #includes; we put this hash
    into the compiled source so that editing a .cuh file recompiles its users.
    """
    digest = hashlib.sha256()
    for header in sorted(source_dir.rglob("*.cuh")):
        digest.update(header.relative_to(source_dir).as_posix().encode())
        digest.update(header.read_bytes())
    return digest.hexdigest()[:16]


def read_kernel_source(filename: str, source_dir: Path) -> str:
    path = source_dir / filename
    if not path.is_file():
        raise DeviceError(f"CUDA kernel source {path} is missing; reinstall cupyllm")
    text = path.read_text(encoding="utf-8")
    return f"// cupyllm headers {source_fingerprint(source_dir)}\n{text}"


def compile_options(kernel_set: KernelSet, source_dir: Path,
                    include_dirs: Iterable[str] | None = None) -> tuple[str, ...]:
    include_dirs = cuda_include_dirs() if include_dirs is None else list(include_dirs)
    includes = tuple(f"-I{d}" for d in [str(source_dir), *include_dirs])
    return BASE_OPTIONS + includes + tuple(kernel_set.options)


@dataclass
class KernelRegistry:
    """Compiles each kernel set once per (set, GPU architecture) and hands out its functions.

    The in-process cache lives in the instance (the engine owns one registry); CuPy's own on-disk
    kernel cache makes a second process skip NVRTC entirely.
    """
    sets: list[KernelSet] | None = None
    source_dir: Path | None = None
    # A first run on a machine compiles each kernel set with NVRTC (seconds each, tens of seconds in all) before
    # CuPy's disk cache serves it; the first set slower than this says so on stderr, once per registry.
    slow_compile_seconds: float = 1.0
    _modules: dict[tuple[KernelSet, str], Any] = field(default_factory=dict, repr=False)
    _functions: dict[tuple[str, str], Any] = field(default_factory=dict, repr=False)
    _said_compiling: bool = field(default=False, repr=False)

    def __post_init__(self):
        if self.sets is None:
            self.sets = all_kernel_sets()
        if self.source_dir is None:
            self.source_dir = kernel_source_dir()
        self._set_of_name = {}
        for kernel_set in self.sets:
            for name in kernel_set.name_expressions:
                self._set_of_name.setdefault(name, kernel_set)

    def kernel_set_for(self, name_expression: str) -> KernelSet:
        try:
            return self._set_of_name[name_expression]
        except KeyError:
            raise DeviceError(
                f"kernel {name_expression!r} is not declared in any KernelSet; add it to the "
                "kernel_sets() of its wrapper module") from None

    def function(self, name_expression: str):
        """The cupy.RawKernel for one declared template instantiation, compiling its set if needed."""
        cp = require_cupy()
        arch = _current_arch(cp)
        cached = self._functions.get((name_expression, arch))
        if cached is not None:
            return cached
        kernel_set = self.kernel_set_for(name_expression)
        module = self._module(kernel_set, arch, cp)
        try:
            kernel = module.get_function(name_expression)
        except Exception as exc:  # NVRTC errors surface on first get_function (lazy compile)
            raise _compile_error(kernel_set, arch, exc) from exc
        self._functions[(name_expression, arch)] = kernel
        return kernel

    def _module(self, kernel_set: KernelSet, arch: str, cp):
        key = (kernel_set, arch)
        module = self._modules.get(key)
        if module is None:
            source = read_kernel_source(kernel_set.filename, self.source_dir)
            start = time.perf_counter()
            try:
                module = cp.RawModule(
                    code=source,
                    options=compile_options(kernel_set, self.source_dir),
                    name_expressions=list(kernel_set.name_expressions),
                    backend="nvrtc")
                module.compile()
            except Exception as exc:
                raise _compile_error(kernel_set, arch, exc) from exc
            if not self._said_compiling and time.perf_counter() - start > self.slow_compile_seconds:
                self._said_compiling = True
                print(f"cupyllm: compiling the CUDA kernels for sm_{arch} as they are first used (the first run "
                      "only: CuPy caches them)", file=sys.stderr, flush=True)
            self._modules[key] = module
        return module


def _compile_error(kernel_set: KernelSet, arch: str, exc: Exception) -> DeviceError:
    log = getattr(exc, "get_message", None)
    text = log() if callable(log) else str(exc)
    return DeviceError(
        f"CUDA kernel {kernel_set.description} failed to compile for sm_{arch}; "
        f"run `python -m cupyllm.cuda.nvrtc_check` to reproduce. NVRTC log:\n{text}")


def _current_arch(cp) -> str:
    return str(cp.cuda.Device().compute_capability)


def require_cupy():
    """Import CuPy, or raise DeviceError saying how to get it."""
    try:
        import cupy
    except ImportError as exc:
        raise DeviceError(
            "the GPU path needs CuPy: pip install 'cupyllm[gpu]' (CUDA 12) or 'cupyllm[gpu13]' "
            "(CUDA 13)") from exc
    return cupy


def device_name() -> str:
    """The current CUDA device's name (e.g. "NVIDIA H200"), as the benchmarks record it."""
    cupy = require_cupy()
    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def gpu_count() -> int:
    """Number of visible CUDA devices; 0 without CuPy, without a driver, or without a device."""
    try:
        import cupy
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no CuPy, no driver (cudaErrorInsufficientDriver / NoDevice)
        return 0
