"""Build CUDA C kernels for the CPU emulator and launch them.

`build(code, name_expressions, options)` compiles the kernel source (the text CuPy's RawModule would get)
with g++ against the host shims in shim/ (emu.h: the execution model; cuda_fp16.h, cuda_bf16.h) and
returns an `EmuLibrary`; `library.function(name)(grid, block, args, shared_mem=0)` runs one kernel.
Nothing is written per kernel: each name expression is registered through a template
(`emu::Registration<&kernel<...>>`) that unpacks the argument array by the kernel's own parameter
types, and the parameter types travel to Python as a signature string, so arguments are checked
(dtype of every pointer, exact scalar types) the way a GPU cannot.

Libraries are cached by a hash of everything that goes into them (sources, headers, shims, flags,
compiler) under $CUPYLLM_EMU_CACHE (default ~/.cache/cupyllm/cuda_emu). The kernels of a set are
compiled in parallel translation units.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

HERE = Path(__file__).resolve().parent
SHIM_DIR = HERE / "shim"
RUNTIME_SOURCE = SHIM_DIR / "emu_runtime.cpp"
CACHE_ENV = "CUPYLLM_EMU_CACHE"
CXX_ENV = "CUPYLLM_EMU_CXX"

# -O1 keeps builds quick; -ffp-contract=off keeps a*b+c two roundings (the __f*_rn intrinsics' meaning).
CXX_FLAGS = ("-std=c++20", "-O1", "-ffp-contract=off", "-fno-strict-aliasing", "-fPIC", "-pthread",
             "-Wno-unknown-pragmas", "-Wno-attributes")
SOURCE_SUFFIXES = (".cu", ".cuh", ".h", ".hpp", ".inl")
# Kernel units only: a misaligned typed access (a uint4 load from an address that is not 16-byte aligned faults
# on a GPU, x86 does not mind) or an index past a fixed-size array fails the launch (emu_runtime.cpp's handlers).
SANITIZE_FLAGS = ("-fsanitize=alignment,bounds",)
KERNELS_PER_UNIT = 6  # name expressions per translation unit (units compile in parallel)

_EXTERN_SHARED = re.compile(r"extern\s+__shared__\s+(?P<type>[^;\[]*?)\s*\b(?P<name>\w+)\s*\[\s*\]\s*;")
_ALIGN = re.compile(r"__align__\s*\(\s*\d+\s*\)")


class EmuBuildError(RuntimeError):
    """g++ rejected the emulator build of a kernel source (the compiler output is in the message)."""


class EmuLaunchError(RuntimeError):
    """A kernel launch was refused (bad arguments/geometry) or failed inside the emulator."""


def compiler() -> str:
    return os.environ.get(CXX_ENV, "g++")


def cxx20_support() -> tuple[bool, str]:
    """(True, version) if the C++ compiler builds the emulator's C++20; else (False, why)."""
    cxx = compiler()
    if shutil.which(cxx) is None:
        return False, f"{cxx} not found (set {CXX_ENV} to a C++20 compiler)"
    probe = "#include <concepts>\ntemplate <auto F> struct S {};\nint main() { return 0; }\n"
    try:
        result = subprocess.run([cxx, "-std=c++20", "-x", "c++", "-fsyntax-only", "-"], input=probe,
                                capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"{cxx} failed to run: {exc}"
    if result.returncode != 0:
        return False, f"{cxx} has no C++20 support: {result.stderr.strip()[:200]}"
    return True, _compiler_version(cxx)


def _compiler_version(cxx: str) -> str:
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout.splitlines()[0]
    except Exception:  # noqa: BLE001 - the version only feeds the cache key
        return cxx


def cache_dir() -> Path:
    path = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "cupyllm" / "cuda_emu")
    path.mkdir(parents=True, exist_ok=True)
    return path


def rewrite_source(text: str) -> str:
    """`extern __shared__ T name[];` -> a pointer to the emulator's dynamic shared memory; `__shared__ T a[..], b;`
    -> references to this block's copies of them (`_rewrite_static_shared`)."""
    def replace(match: re.Match) -> str:
        ctype = _ALIGN.sub("", match["type"]).strip()
        return f"{ctype}* const {match['name']} = reinterpret_cast<{ctype}*>(::emu::dynamic_smem());"
    return _check_launch_bounds(_rewrite_static_shared(_EXTERN_SHARED.sub(replace, text)))


def _balanced(text: str, open_at: int) -> int:
    """The index just past the parenthesis that closes the one at `open_at`."""
    depth = 0
    for i in range(open_at, len(text)):
        depth += text[i] == "("
        depth -= text[i] == ")"
        if depth == 0:
            return i + 1
    raise EmuBuildError(f"unbalanced parentheses from: {text[open_at:open_at + 80]!r}")


def _check_launch_bounds(text: str) -> str:
    """`__global__ void __launch_bounds__(N, ...) name(params) {` -> the same with `::emu::check_launch_bounds(N);`
    first in the body (on the brace's line: line numbers stay), so a launch with more threads a block than the
    kernel was compiled for fails, as on a GPU (the expression is evaluated in the kernel's template context)."""
    out, pos = [], 0
    while (at := text.find("__launch_bounds__", pos)) >= 0:
        open_at = text.find("(", at)
        close = _balanced(text, open_at)
        max_threads = _split_top_level(text[open_at + 1:close - 1])[0].strip()
        params_at = text.find("(", close)
        body_at = text.find("{", _balanced(text, params_at))
        if not max_threads or params_at < 0 or body_at < 0 or text[_balanced(text, params_at):body_at].strip():
            raise EmuBuildError(f"cannot read the kernel after: {text[at:at + 120]!r}")
        out.append(text[pos:body_at + 1] + f" ::emu::check_launch_bounds(static_cast<long>({max_threads}));")
        pos = body_at + 1
    return "".join(out) + text[pos:]


_STATIC_SHARED = re.compile(r"(?<![\w.])__shared__[ \t]+(?P<decl>[^;{}\n]*);")  # (one line: not a comment's word)
_DECLARATOR = re.compile(r"^(?P<type>.*?)\b(?P<name>[A-Za-z_]\w*)\s*(?P<dims>(?:\[[^\]]*\]\s*)*)$", re.S)


def _split_top_level(text: str) -> list[str]:
    """`a[x], b<c, d>[y]` -> its comma-separated parts outside <>, () and []."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch in "<(["
        depth -= ch in ">)]"
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return parts + [text[start:]]


def _rewrite_static_shared(text: str) -> str:
    """Each static `__shared__` declarator -> a reference to the running block's copy, which the runtime places in
    its static shared memory and fills with 0xFF (NaN) at the block's first use (emu.h `static_shared`): a read
    before any write shows, as do blocks that pass values through shared memory. Declarations it cannot parse stay
    block-scope statics (emu.h `#define __shared__ static`)."""
    counter = iter(range(1 << 30))

    def replace(match: re.Match) -> str:
        parts = _split_top_level(_ALIGN.sub("", match["decl"]).strip())
        first = _DECLARATOR.match(parts[0].strip())
        if first is None or not first["type"].strip():
            return match[0]
        base = first["type"].strip()
        out = []
        for i, part in enumerate(parts):
            d = first if i == 0 else _DECLARATOR.match(part.strip())
            if d is None or (i and d["type"].strip()):
                return match[0]
            k = next(counter)
            out.append(f"static ::emu::SharedSlot emu_shared_slot_{k}; using emu_shared_t_{k} = {base}{d['dims']}; "
                       f"emu_shared_t_{k}& {d['name']} = ::emu::static_shared<emu_shared_t_{k}>(emu_shared_slot_{k});")
        return " ".join(out)
    return _STATIC_SHARED.sub(replace, text)


def include_dirs_from_options(options: Iterable[str]) -> list[Path]:
    """The -I directories of NVRTC options, minus real CUDA header directories (the shims replace them)."""
    dirs = []
    for opt in options:
        path = opt[2:] if opt.startswith("-I") else opt.split("=", 1)[1] if opt.startswith("--include-path=") else None
        if path and not (Path(path) / "cuda_fp16.h").is_file():
            dirs.append(Path(path))
    return dirs


# ---- argument checking and packing -------------------------------------------------------------------

_SCALAR_DTYPES = {"f32": np.float32, "f64": np.float64, "i8": np.int8, "u8": np.uint8, "i16": np.int16,
                  "u16": np.uint16, "i32": np.int32, "u32": np.uint32, "i64": np.int64, "u64": np.uint64,
                  "b8": np.bool_}
_POINTER_DTYPES = {"f32": ("float32",), "f64": ("float64",), "f16": ("float16",), "bf16": ("uint16", "int16"),
                   "i8": ("int8", "uint8"), "u8": ("uint8", "int8"), "i16": ("int16",), "u16": ("uint16",),
                   "i32": ("int32",), "u32": ("uint32",), "i64": ("int64",), "u64": ("uint64",), "b8": ("bool",)}


@dataclass(frozen=True)
class Param:
    """One kernel parameter: a pointer to `code` elements, or a value of type `code` and `size` bytes."""
    pointer: bool
    code: str
    size: int = 8

    @classmethod
    def parse(cls, text: str) -> "Param":
        parts = text.split(":")
        if parts[0] == "p":
            return cls(True, parts[1])
        return cls(False, parts[1], int(parts[2]))

    def describe(self) -> str:
        return f"pointer to {self.code}" if self.pointer else f"{self.code} value"


def _pack(param: Param, arg, index: int, kernel: str, is_device_array: Callable[[object], bool]):
    where = f"kernel {kernel!r} argument {index} ({param.describe()})"
    if param.pointer:
        if not isinstance(arg, np.ndarray) or not is_device_array(arg):
            raise EmuLaunchError(f"{where}: got {type(arg).__name__}, expected a device array")
        allowed = _POINTER_DTYPES.get(param.code)
        if allowed is not None and arg.dtype.name not in allowed:
            raise EmuLaunchError(f"{where}: array of dtype {arg.dtype}, the kernel reads {param.code}")
        if not arg.flags.c_contiguous:
            raise EmuLaunchError(f"{where}: array is not C-contiguous (the kernel sees only its data pointer)")
        return ctypes.c_void_p(arg.ctypes.data)
    # CuPy passes Python int as long long, float as double, bool as bool (RawKernel docs)
    if isinstance(arg, bool):
        value = np.bool_(arg)
    elif isinstance(arg, int):
        value = np.int64(arg)
    elif isinstance(arg, float):
        value = np.float64(arg)
    elif isinstance(arg, np.generic):
        value = arg
    elif isinstance(arg, (bytes, bytearray)) and param.code == "raw":
        if len(arg) != param.size:
            raise EmuLaunchError(f"{where}: {len(arg)} bytes for a {param.size}-byte struct")
        return ctypes.create_string_buffer(bytes(arg), param.size)
    else:
        raise EmuLaunchError(f"{where}: unsupported argument type {type(arg).__name__}")
    want = _SCALAR_DTYPES.get(param.code)
    if want is None or value.dtype != np.dtype(want):
        raise EmuLaunchError(f"{where}: got {value.dtype} ({type(arg).__name__}); pass np.{np.dtype(want).name if want else '?'}"
                             "(...) so the bytes match the parameter (CuPy passes Python int as int64)")
    return ctypes.create_string_buffer(value.tobytes(), param.size)


class EmuFunction:
    """One kernel of an emulator library: call as `f(grid, block, args, shared_mem=0)` like cupy.RawKernel."""

    def __init__(self, library: "EmuLibrary", index: int, name: str, signature: str):
        self._library = library
        self._index = index
        self.name = name
        self.params = [Param.parse(p) for p in signature.split(",")] if signature else []

    def __call__(self, grid, block, args, shared_mem: int = 0,
                 is_device_array: Callable[[object], bool] = lambda a: True):
        grid = _dims(grid, "grid")
        block = _dims(block, "block")
        if len(args) != len(self.params):
            raise EmuLaunchError(f"kernel {self.name!r} takes {len(self.params)} arguments, got {len(args)}")
        packed = [_pack(p, a, i, self.name, is_device_array) for i, (p, a) in enumerate(zip(self.params, args))]
        argv = (ctypes.c_void_p * max(1, len(packed)))(*[ctypes.addressof(b) for b in packed])
        self._library.launch(self._index, argv, grid, block, int(shared_mem), self.name)


def _dims(value, what: str) -> tuple[int, int, int]:
    dims = tuple(int(v) for v in (value if isinstance(value, (tuple, list)) else (value,)))
    if not 1 <= len(dims) <= 3 or min(dims) < 1:
        raise EmuLaunchError(f"{what} dimensions must be 1 to 3 positive integers, got {value!r}")
    return dims + (1,) * (3 - len(dims))


class EmuLibrary:
    """A built emulator library: its kernels by name expression."""

    _lock = threading.Lock()  # the emulator runtime is single-threaded

    def __init__(self, path: Path):
        self.path = path
        self._lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_LOCAL)
        lib = self._lib
        lib.emu_kernel_count.restype = ctypes.c_int
        lib.emu_kernel_name.restype = ctypes.c_char_p
        lib.emu_kernel_name.argtypes = [ctypes.c_int]
        lib.emu_kernel_signature.restype = ctypes.c_char_p
        lib.emu_kernel_signature.argtypes = [ctypes.c_int]
        lib.emu_last_error.restype = ctypes.c_char_p
        lib.emu_kernel_launch.restype = ctypes.c_int
        lib.emu_kernel_launch.argtypes = [ctypes.c_int, ctypes.c_void_p] + [ctypes.c_uint] * 6 + [ctypes.c_ulonglong]
        self.functions = {}
        for i in range(lib.emu_kernel_count()):
            name = lib.emu_kernel_name(i).decode()
            self.functions[name] = EmuFunction(self, i, name, lib.emu_kernel_signature(i).decode())

    def function(self, name: str) -> EmuFunction:
        try:
            return self.functions[name]
        except KeyError:
            raise KeyError(f"kernel {name!r} is not in this module; it has {sorted(self.functions)}") from None

    def launch(self, index: int, argv, grid, block, shared_mem: int, name: str) -> None:
        with self._lock:
            rc = self._lib.emu_kernel_launch(index, argv, *grid, *block, shared_mem)
            if rc != 0:
                raise EmuLaunchError(f"kernel {name!r}: {self._lib.emu_last_error().decode()}")


_loaded: dict[str, EmuLibrary] = {}
_build_lock = threading.Lock()


def build(code: str, name_expressions: Sequence[str], options: Sequence[str] = (), *,
          jobs: int | None = None) -> EmuLibrary:
    """Compile `code` (CUDA C, as given to RawModule) with its name expressions for the emulator."""
    if not name_expressions:
        raise EmuBuildError("the emulator needs the kernels' name expressions (RawModule name_expressions=...)")
    stage_files = {"main.cu": rewrite_source(code)}
    include_args = []
    for k, directory in enumerate(include_dirs_from_options(options)):
        include_args.append(f"-Iinc{k}")
        for path in sorted(directory.rglob("*")) if directory.is_dir() else []:  # kernels_cu/<family>/ too
            if path.suffix in SOURCE_SUFFIXES and path.is_file():
                relative = path.relative_to(directory).as_posix()
                stage_files[f"inc{k}/{relative}"] = rewrite_source(path.read_text(encoding="utf-8"))
    n = len(name_expressions)
    n_units = min(n, max(os.cpu_count() or 1, -(-n // KERNELS_PER_UNIT)))
    per_unit = -(-n // n_units)
    units = [name_expressions[i:i + per_unit] for i in range(0, len(name_expressions), per_unit)]
    for u, names in enumerate(units):
        regs = "\n".join(f"emu::Registration<&{n}> emu_registration_{i}(\"{n}\");" for i, n in enumerate(names))
        # The kernel source sits in an unnamed namespace: each unit gets its own copy of non-template
        # functions (no duplicate symbols at link time); the shims are included first, outside it.
        stage_files[f"unit{u}.cpp"] = (f'#include "emu.h"\n#include "cuda_fp16.h"\n#include "cuda_bf16.h"\n'
                                       f'namespace {{\n#include "main.cu"\n}}\nnamespace {{\n{regs}\n}}\n')
    shim_files = {p.name: p.read_text() for p in sorted(SHIM_DIR.iterdir()) if p.is_file()}
    digest = hashlib.sha256()
    for part in (compiler(), _compiler_version(compiler()), " ".join(CXX_FLAGS + SANITIZE_FLAGS),
                 " ".join(include_args)):
        digest.update(part.encode() + b"\0")
    for name, text in sorted({**stage_files, **{f"shim/{k}": v for k, v in shim_files.items()}}.items()):
        digest.update(name.encode() + b"\0" + text.encode() + b"\0")
    key = digest.hexdigest()[:24]
    with _build_lock:
        if key in _loaded:
            return _loaded[key]
        target = cache_dir() / f"emu-{key}.so"
        if not target.is_file():
            _compile(stage_files, include_args, len(units), target, jobs)
        library = EmuLibrary(target)
        missing = set(name_expressions) - set(library.functions)
        if missing:
            raise EmuBuildError(f"built library lacks {sorted(missing)}")
        _loaded[key] = library
        return library


def _compile(stage_files: dict[str, str], include_args: list[str], n_units: int, target: Path,
             jobs: int | None) -> None:
    stage = Path(tempfile.mkdtemp(prefix="emu-build-", dir=target.parent))
    try:
        for rel, text in stage_files.items():
            (stage / rel).parent.mkdir(parents=True, exist_ok=True)
            (stage / rel).write_text(text, encoding="utf-8")
        base = [compiler(), *CXX_FLAGS, f"-I{SHIM_DIR}", "-I.", *include_args, "-c"]
        sources = [RUNTIME_SOURCE] + [stage / f"unit{u}.cpp" for u in range(n_units)]
        objects = [stage / f"obj{i}.o" for i in range(len(sources))]

        def run(i: int):
            flags = base if sources[i] == RUNTIME_SOURCE else base + list(SANITIZE_FLAGS)
            return subprocess.run(flags + [str(sources[i]), "-o", str(objects[i])], cwd=stage,
                                  capture_output=True, text=True)

        with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
            results = list(pool.map(run, range(len(sources))))
        failed = [r for r in results if r.returncode != 0]
        if failed:
            raise EmuBuildError(f"emulator build failed (sources kept in {stage}):\n{failed[0].stderr[-8000:]}")
        link = subprocess.run([compiler(), "-shared", "-pthread", "-Wl,--no-undefined", "-o", str(stage / "lib.so"),
                               *map(str, objects)], capture_output=True, text=True)
        if link.returncode != 0:
            raise EmuBuildError(f"emulator link failed (sources kept in {stage}):\n{link.stderr[-8000:]}")
        os.replace(stage / "lib.so", target)  # atomic: a concurrent build of the same key is harmless
    except EmuBuildError:
        raise  # keep the staged sources for inspection
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    shutil.rmtree(stage, ignore_errors=True)
