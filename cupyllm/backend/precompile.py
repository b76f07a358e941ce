"""Compile every CPU kernel the engine can reach, once per machine, into numba's on-disk cache.

numba compiles a kernel on its first call for each new set of argument types, which would put minutes of
compiling into a first `cupyllm generate` (and more into the first run with a longer prompt or another KV type).
Instead the CPU backend checks a stamp beside numba's cache when it starts (`ensure_compiled`): if the kernels of
these sources, this numba and this CPU are not there yet, it compiles them all first, in one process per core
with a progress bar, by calling each kernel's Python wrapper on tiny inputs (so each compiles for exactly the
argument types the engine passes it). The kernels are written to take one set of types each, whatever the prompt
length, chunk size, KV type, weight format or thread count (the kinds of weight and KV row are data, not types),
so after this no run compiles. `cupyllm compile` and `python tools/compile_kernels.py --cpu` run it by hand.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

_OPS = Path(__file__).resolve().parents[1] / "ops"
# the sources whose code numba compiles into the kernels (a change to any of them needs a new compile)
SOURCES = [_OPS / "simd.py", _OPS / "matmul" / "cpu_gemv.py", _OPS / "matmul" / "cpu_interleaved.py",
           _OPS / "matmul" / "cpu_gemm.py",
           _OPS / "matmul" / "activation_codes.py", _OPS / "matmul" / "reference.py", _OPS / "attention" / "cpu.py",
           _OPS / "kv_formats" / "cpu.py", _OPS / "kv_formats" / "tcq.py", _OPS / "elementwise" / "cpu.py",
           _OPS / "deltanet" / "cpu.py", Path(__file__)]


# --- the jobs: each calls kernels through the wrappers the engine uses, on inputs of a few values ---------------
# (the weight and KV row formats are data to the kernels, so one format stands for all of them)

def zero_weight(rows: int, n_in: int):
    """(blocks, format) of a Q4_K weight [rows, n_in] of zero blocks (zero scales: valid rows): what the jobs
    multiply, and what the server's thread warm-up multiplies to run a cached kernel."""
    from gguf import GGMLQuantizationType as T

    from ..ops.matmul.reference import WEIGHT_FORMATS
    fmt = WEIGHT_FORMATS[T.Q4_K]
    data = np.zeros((rows, n_in // fmt.block_values * fmt.block_bytes), np.uint8)  # zero scales: a valid row
    return data, fmt


def _gemv() -> None:
    from ..ops.matmul.cpu import matmul_many
    data, fmt = zero_weight(4, 256)
    matmul_many(np.ones((1, 256), np.float32), [(data, fmt)], 256)
    from ..ops.matmul.cpu import matmul_each
    matmul_each(np.ones((2, 256), np.float32), [(data, fmt)] * 2, np.arange(2), 256)  # a decode's chosen experts


def _gemm() -> None:
    from ..ops.matmul.cpu import TOKENS_PER_GEMV, matmul_many
    data, fmt = zero_weight(4, 256)  # (the GEMM on interleaved rows is a branch of the same kernel, same types)
    matmul_many(np.ones((TOKENS_PER_GEMV + 1, 256), np.float32), [(data, fmt)], 256)


def _weight_rows() -> None:
    from gguf import GGMLQuantizationType as T

    from ..ops.matmul import cpu as matmul_cpu
    from ..ops.matmul.cpu_gemv import dequantize_ids
    from ..ops.matmul.reference import WEIGHT_FORMATS
    from ..ops.matmul.cpu_interleaved import LAYOUTS, ROWS, interleave_rows
    data, fmt = zero_weight(4, 256)
    dequantize_ids(data, fmt, 256, np.array([1, 2]))  # embedding rows
    layout = LAYOUTS["Q8_0"]
    interleave_rows(np.zeros((ROWS, layout.block_bytes), np.uint8), layout)  # rows interleaved for the GEMV
    f16 = WEIGHT_FORMATS[T.F16]  # the f32 tiles of the BLAS path
    matmul_cpu.matmul(np.ones((TOKENS_PER_TILE, 16), np.float32), np.zeros((4, 32), np.uint8), f16, 16)


TOKENS_PER_TILE = 9  # (any prompt longer than the GEMV's: the tiles path is one type for every length)


def _attention() -> None:
    from ..ops.attention.cpu import attend_floats
    q = np.ones((1, 2, 16), np.float32)
    k = np.ones((3, 1, 16), np.float32)
    attend_floats(q, k, k, np.array([2]), np.arange(3), scale=0.25)  # the encoded rows' kernel, f32 rows


def _kv_rows() -> None:
    from ..ops.kv_formats.cpu import decode_rows
    from ..ops.kv_formats.formats import get_format
    for name in ("f16", "turbo3"):  # a scalar and a rotated format (the same types: one compile)
        fmt = get_format(name, 128)
        decode_rows(fmt, fmt.encode(np.ones((2, 128), np.float32)), 128)


def _tcq_encode() -> None:
    from ..ops.kv_formats.formats import get_format
    get_format("turbo3_tcq", 128).encode(np.ones((1, 128), np.float32))


def _elementwise() -> None:
    from ..ops.elementwise.cpu import rms_norm_rows, rope_rows
    x = np.ones((2, 8), np.float32)
    for writable in (True, False):  # norm weights: computed (Gemma's 1 + w) or read-only in the mapped GGUF
        w = np.ones(8, np.float32)
        w.flags.writeable = writable
        rms_norm_rows(x, w, np.float32(1e-6), np.empty_like(x))
    x3 = np.ones((2, 1, 8), np.float32)
    table = np.ones((2, 4), np.float32)
    rope_rows(x3, table, table, True, np.empty_like(x3))


def _deltanet() -> None:
    # (the kernels as backend/cpu.py's causal_conv1d_silu, gated_delta_rule and gated_rms_norm call them)
    from ..ops.deltanet.cpu import conv1d_silu_rows, gated_delta_tokens, gated_rms_norm_rows
    n, channels, width = 3, 48, 4
    x = np.ones((n, channels), np.float32)
    conv1d_silu_rows(x, np.ones((channels, width), np.float32), np.zeros((width - 1, channels), np.float32),
                     np.empty_like(x))
    q, v, g = np.ones((n, 2, 16), np.float32), np.ones((n, 2, 16), np.float32), np.ones((n, 2), np.float32)
    gated_delta_tokens(q, q, v, g, g, np.zeros((2, 16, 16), np.float32), np.empty_like(v))
    rows = v.reshape(-1, 16)
    gated_rms_norm_rows(rows, rows, np.ones(16, np.float32), np.float32(1e-6), np.empty_like(rows))


# longest first (each job's compile time alone: docs/benchmarks.md#cpu-first-run), so that the processes end
# close together; the KV rows after the attention and the prefill matmul: the attention's process is the first
# free, takes the GEMM, then the KV rows, whose scalar row decoder it has compiled already
JOBS = {"decode matmul": _gemv, "attention": _attention, "prefill matmul": _gemm, "KV rows": _kv_rows,
        "Gated DeltaNet": _deltanet, "weight rows": _weight_rows, "TCQ encoder": _tcq_encode,
        "norms and rope": _elementwise}


def _run_job(name: str) -> tuple[str, float]:
    start = time.perf_counter()
    JOBS[name]()
    return name, time.perf_counter() - start


def _serve_jobs() -> None:
    """A worker process: runs the jobs named on its standard input, one a line, and answers each on stdout."""
    for line in sys.stdin:
        name, seconds = _run_job(line.strip())
        print(f"done\t{name}\t{seconds:.1f}", flush=True)


def _worker(jobs: queue.Queue, done: queue.Queue) -> None:
    """Feeds jobs to one worker process until none is left; each answer (or the failure) goes to `done`.
    (A plain `python -c` process, not multiprocessing's: spawn would import the caller's __main__ again, which
    may itself load a model.)"""
    env = dict(os.environ)  # (cupyllm importable there as here, installed or not)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                      env.get("PYTHONPATH")]))
    errors = tempfile.TemporaryFile("w+")  # (a file, not a pipe: warnings cannot fill it and stall the worker)
    process = subprocess.Popen([sys.executable, "-c", "from cupyllm.backend.precompile import _serve_jobs; "
                                "_serve_jobs()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors,
                               text=True, env=env)
    try:
        while True:
            try:
                name = jobs.get_nowait()
            except queue.Empty:
                break
            process.stdin.write(name + "\n")
            process.stdin.flush()
            answer = process.stdout.readline()
            if not answer.startswith("done"):
                process.kill()
                process.wait()
                errors.seek(0)
                raise RuntimeError(f"compiling the {name} kernels failed: {errors.read()[-2000:]}")
            done.put(f"{name} {answer.split()[-1]} s")
        process.stdin.close()
        process.wait()
    except BaseException as exc:  # noqa: BLE001 - handed to compile_all, which raises it
        done.put(exc)
    finally:
        if process.poll() is None:
            process.kill()
        errors.close()
    done.put(None)


# --- the stamp: whether this machine's cache holds the kernels of these sources ----------------------------------

def cache_key() -> str:
    """A digest of what numba's cached code depends on: the kernels' sources, numba's version, the CPU."""
    import numba
    from numba.core.registry import cpu_target
    digest = hashlib.sha256(numba.__version__.encode())
    digest.update(repr(cpu_target.target_context.codegen().magic_tuple()).encode())  # (triple, CPU, features)
    for path in SOURCES:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:20]


def cache_dir() -> Path:
    """The folder where numba caches the GEMV (NUMBA_CACHE_DIR, or __pycache__ beside the source when writable,
    or the user's cache): the stamp lies beside it, so that emptying that cache empties the stamp too."""
    from ..ops.matmul.cpu_gemv import gemv_blocks
    return Path(gemv_blocks._cache._cache_path)


def stamp_path() -> Path:
    return cache_dir() / f"cupyllm-kernels-{cache_key()}.stamp"


def is_compiled() -> bool:
    """Whether the kernels were compiled into the cache for this machine (a file check, milliseconds)."""
    return stamp_path().exists()


@contextlib.contextmanager
def _exclusive(folder: Path):
    """One compiling process at a time per cache (others wait, then find the stamp)."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "cupyllm-kernels.lock", "w") as lock:
        try:
            import fcntl
            fcntl.flock(lock, fcntl.LOCK_EX)
        except ImportError:  # (no fcntl: Windows; two first runs at once compile twice)
            pass
        yield


def _cached_kernel_files() -> list[Path]:
    """numba's cache files (.nbi index, .nbc code) of the cached kernels of SOURCES' modules."""
    import importlib
    package_root = Path(__file__).resolve().parents[2]
    files = []
    for path in SOURCES:
        module = importlib.import_module(".".join(path.relative_to(package_root).with_suffix("").parts))
        folders = {Path(value._cache._cache_path) for value in vars(module).values()
                   if type(getattr(value, "_cache", None)).__name__ == "FunctionCache"}
        files += [f for folder in folders for pattern in (f"{path.stem}.*.nbi", f"{path.stem}.*.nbc")
                  for f in folder.glob(pattern)]
    return files


def compile_all(processes: int | None = None, stream=None) -> float:
    """Compile every job into numba's cache in `processes` processes (default: one per core), a progress bar on
    `stream` (default stderr); then write the stamp. Returns the seconds it took."""
    from tqdm import tqdm

    start = time.perf_counter()
    # numba keys a cached kernel by its own file alone: one compiled before a change to a helper it inlines from
    # another file (ops/simd.py, cpu_interleaved.py) would load as it was. The sources changed (no stamp): drop
    # them all, so that every kernel compiles from these sources.
    for old in _cached_kernel_files():
        old.unlink(missing_ok=True)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    processes = max(1, min(processes or cores or 1, len(JOBS)))
    jobs, done = queue.Queue(), queue.Queue()
    for name in JOBS:
        jobs.put(name)
    threads = [threading.Thread(target=_worker, args=(jobs, done), daemon=True) for _ in range(processes)]
    for thread in threads:
        thread.start()
    failure, running = None, processes
    with tqdm(total=len(JOBS), desc=f"cupyllm: compiling the CPU kernels, once per machine ({processes} processes)",
              file=stream or sys.stderr, bar_format="{desc}: {n}/{total} [{elapsed}] {postfix}") as bar:
        while running:
            item = done.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                failure = failure or item
            else:
                bar.set_postfix_str(item)
                bar.update()
    if failure is not None:
        raise failure
    stamp = stamp_path()
    for old in stamp.parent.glob("cupyllm-kernels-*.stamp"):  # (other sources' stamps: their kernels are gone)
        old.unlink(missing_ok=True)
    stamp.write_text("compiled by cupyllm.backend.precompile\n")
    return time.perf_counter() - start


def ensure_compiled(stream=None) -> bool:
    """Compile the kernels unless this machine's cache has them; True if it compiled. If compiling them ahead
    fails (no processes to be had, say), each kernel compiles on its first call instead, as numba does: one line
    says so."""
    if is_compiled():
        return False
    try:
        with _exclusive(cache_dir()):
            if is_compiled():  # another process compiled them meanwhile
                return False
            compile_all(stream=stream)
    except Exception as exc:  # noqa: BLE001 - the kernels still compile when called; the run goes on
        print(f"cupyllm: could not compile the CPU kernels ahead ({type(exc).__name__}: {exc}); they compile on "
              "their first use instead", file=stream or sys.stderr, flush=True)
        return False
    return True
