"""Compile every CUDA kernel with NVRTC, no GPU or driver needed.

`RawModule.compile()` asks the driver for the device architecture and loads the result, so it fails
on a machine without a GPU. NVRTC itself is a plain C library: we call it through
ctypes (no CuPy needed) for a named architecture and only keep the cubin's size.
This is what CI runs (tests/test_cuda_compile.py) and what `python -m cupyllm.cuda.nvrtc_check`
prints as a table.
"""
from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import DeviceError
from .registry import (KernelSet, all_kernel_sets, compile_options, cuda_include_dirs, kernel_source_dir,
                       read_kernel_source)

# sm_80 (A100, the oldest we support: bf16 and cp.async) and sm_90 (H100/H200).
DEFAULT_ARCHS = (80, 90)


class NVRTCLibrary:
    """The few NVRTC calls the check makes, through ctypes: NVRTC is a plain C library, so the check needs neither
    CuPy nor a driver. Methods raise RuntimeError with NVRTC's message on a failed call."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p

    def _check(self, status: int, call: str) -> None:
        if status != 0:
            raise RuntimeError(f"{call}: {self.lib.nvrtcGetErrorString(status).decode()}")

    def getVersion(self) -> tuple[int, int]:
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        return major.value, minor.value

    def createProgram(self, source: str, name: str, headers=(), include_names=()) -> ctypes.c_void_p:
        program = ctypes.c_void_p()
        self._check(self.lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), name.encode(), 0, None, None),
                    "nvrtcCreateProgram")
        return program

    def addNameExpression(self, program, name: str) -> None:
        self._check(self.lib.nvrtcAddNameExpression(program, name.encode()), "nvrtcAddNameExpression")

    def compileProgram(self, program, options) -> None:
        encoded = [o.encode() for o in options]
        argv = (ctypes.c_char_p * len(encoded))(*encoded)
        self._check(self.lib.nvrtcCompileProgram(program, len(encoded), argv), "nvrtcCompileProgram")

    def _bytes(self, program, size_call: str, get_call: str) -> bytes:
        size = ctypes.c_size_t()
        self._check(getattr(self.lib, size_call)(program, ctypes.byref(size)), size_call)
        buf = ctypes.create_string_buffer(size.value)
        self._check(getattr(self.lib, get_call)(program, buf), get_call)
        return buf.raw

    def getProgramLog(self, program) -> str:
        return self._bytes(program, "nvrtcGetProgramLogSize", "nvrtcGetProgramLog").rstrip(b"\0").decode(
            errors="replace")

    def getCUBIN(self, program) -> bytes:
        return self._bytes(program, "nvrtcGetCUBINSize", "nvrtcGetCUBIN")

    def getLoweredName(self, program, name: str) -> str:
        lowered = ctypes.c_char_p()
        self._check(self.lib.nvrtcGetLoweredName(program, name.encode(), ctypes.byref(lowered)), "nvrtcGetLoweredName")
        return lowered.value.decode()

    def destroyProgram(self, program) -> None:
        self._check(self.lib.nvrtcDestroyProgram(ctypes.byref(program)), "nvrtcDestroyProgram")


def load_nvrtc() -> NVRTCLibrary:
    """libnvrtc from the pip package nvidia-cuda-nvrtc-cu12 (what the dev extra installs), else a CUDA toolkit's;
    DeviceError saying what to install when there is none."""
    for path in _nvrtc_library_candidates():
        try:
            library = NVRTCLibrary(ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL))
            library.getVersion()
            return library
        except (OSError, AttributeError, RuntimeError):
            continue
    raise DeviceError(
        "libnvrtc could not be loaded: pip install nvidia-cuda-nvrtc-cu12 (or install a CUDA toolkit)")


def _nvrtc_library_candidates() -> list[Path | str]:
    candidates: list[Path | str] = list(_pip_nvrtc_libraries())
    for root in (os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root:
            candidates += sorted(Path(root, "lib64").glob("libnvrtc.so*"), reverse=True)
    found = ctypes.util.find_library("nvrtc")
    if found:
        candidates.append(found)
    return [c for c in candidates if "builtins" not in str(c) and ".alt." not in str(c)]


def _pip_nvrtc_libraries() -> list[Path]:
    try:
        import nvidia.cuda_nvrtc as package
    except ImportError:
        return []
    libs = []
    for root in package.__path__:
        libs += sorted(Path(root, "lib").glob("libnvrtc.so*"))
    return libs


@dataclass
class CompileResult:
    """Outcome of compiling one kernel set (or one header) for one architecture."""
    unit: str
    arch: int
    ok: bool
    seconds: float
    n_kernels: int = 0
    cubin_bytes: int = 0
    lowered: dict[str, str] = field(default_factory=dict)
    log: str = ""


def compile_source(nvrtc, source: str, unit_name: str, options: tuple[str, ...], arch: int,
                   name_expressions: tuple[str, ...] = ()) -> CompileResult:
    """Compile `source` to a cubin for sm_`arch`, mirroring the options CuPy's RawModule uses."""
    start = time.perf_counter()
    # CuPy appends -ftz=true to every NVRTC compile; do the same so we check the same code.
    all_options = [f"-arch=sm_{arch}", *options, "-ftz=true"]
    program = nvrtc.createProgram(source, unit_name, [], [])
    try:
        for name in name_expressions:
            nvrtc.addNameExpression(program, name)
        try:
            nvrtc.compileProgram(program, all_options)
        except Exception:
            return CompileResult(unit_name, arch, False, time.perf_counter() - start,
                                 log=_as_text(nvrtc.getProgramLog(program)))
        lowered = {name: _as_text(nvrtc.getLoweredName(program, name)) for name in name_expressions}
        cubin = nvrtc.getCUBIN(program)
        return CompileResult(unit_name, arch, True, time.perf_counter() - start,
                             n_kernels=len(name_expressions), cubin_bytes=len(cubin),
                             lowered=lowered, log=_as_text(nvrtc.getProgramLog(program)))
    finally:
        nvrtc.destroyProgram(program)


def _as_text(value) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def compile_kernel_set(nvrtc, kernel_set: KernelSet, arch: int, source_dir: Path,
                       include_dirs: list[str]) -> CompileResult:
    source = read_kernel_source(kernel_set.filename, source_dir)
    result = compile_source(nvrtc, source, kernel_set.filename,
                            compile_options(kernel_set, source_dir, include_dirs), arch,
                            kernel_set.name_expressions)
    result.unit = kernel_set.description
    return result


def compile_header(nvrtc, header: str, arch: int, source_dir: Path,
                   include_dirs: list[str]) -> CompileResult:
    """A header must compile on its own (it includes what it uses)."""
    source = f'#include "{header}"\n'
    options = compile_options(KernelSet("header.cu", ()), source_dir, include_dirs)
    result = compile_source(nvrtc, source, f"{header}.cu", options, arch)
    result.unit = header
    return result


def units_to_check(source_dir: Path, sets: list[KernelSet]) -> list[KernelSet]:
    """Every declared kernel set, plus every .cu file nobody declared (compiled without templates)."""
    declared = {s.filename for s in sets}
    extra = [KernelSet(name, (), label="no declared kernels")
             for name in sorted(p.relative_to(source_dir).as_posix() for p in source_dir.rglob("*.cu"))
             if name not in declared]
    return list(sets) + extra


def check_all(archs=DEFAULT_ARCHS, progress=None) -> list[CompileResult]:
    nvrtc = load_nvrtc()
    source_dir = kernel_source_dir()
    include_dirs = cuda_include_dirs()
    if not include_dirs:
        raise DeviceError("cuda_fp16.h not found: pip install nvidia-cuda-runtime-cu12")
    units = units_to_check(source_dir, all_kernel_sets())
    headers = sorted(p.relative_to(source_dir).as_posix() for p in source_dir.rglob("*.cuh"))
    results = []
    for arch in archs:
        for header in headers:
            results.append(compile_header(nvrtc, header, arch, source_dir, include_dirs))
            if progress:
                progress(results[-1])
        for unit in units:
            results.append(compile_kernel_set(nvrtc, unit, arch, source_dir, include_dirs))
            if progress:
                progress(results[-1])
    return results


def _print_row(result: CompileResult) -> None:
    status = "ok" if result.ok else "FAILED"
    print(f"{result.unit:<44} sm_{result.arch:<4} {status:<7} {result.n_kernels:>4} "
          f"{result.cubin_bytes:>10,} {result.seconds:>7.1f}s", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, action="append",
                        help="compute capability as e.g. 80 or 90 (repeatable; default 80 and 90)")
    args = parser.parse_args(argv)
    archs = tuple(args.arch) if args.arch else DEFAULT_ARCHS
    print(f"{'unit':<44} {'arch':<7} {'status':<7} {'kern':>4} {'cubin bytes':>10} {'time':>8}")
    results = check_all(archs, progress=_print_row)
    failed = [r for r in results if not r.ok]
    for r in failed:
        print(f"\n--- {r.unit} sm_{r.arch} ---\n{r.log}", file=sys.stderr)
    print(f"{len(results) - len(failed)}/{len(results)} compiled")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
