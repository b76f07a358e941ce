"""Compile every kernel set on this GPU in parallel threads (NVRTC releases the GIL), filling CuPy's kernel
cache for the processes that follow; a set that fails is reported here (and again by the tests using it).
With --cpu: the CPU backend's numba kernels instead, into numba's cache (what the first CPU run does by itself,
cupyllm/backend/precompile.py; kernels the cache holds already just load).

    python tools/compile_kernels.py        # used by tools/gpu_check.sh and tools/gpu_probe.sh
    python tools/compile_kernels.py --cpu  # e.g. NUMBA_CACHE_DIR=/tmp/fresh: time a first run's compile
"""
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def compile_cpu() -> int:
    from cupyllm.backend import precompile
    seconds = precompile.compile_all()
    print(f"{len(precompile.JOBS)} CPU kernel groups in {seconds:.0f} s, cached in {precompile.cache_dir()}")
    return 0


def main() -> int:
    if sys.argv[1:] == ["--cpu"]:
        return compile_cpu()
    from cupyllm.cuda.registry import KernelRegistry
    registry, start = KernelRegistry(), time.perf_counter()

    def compile_set(kernel_set):
        try:
            registry.function(kernel_set.name_expressions[0])  # compiles the whole set
        except Exception as exc:  # noqa: BLE001 - reported, the run goes on
            print(f"FAILED {kernel_set.description}: {str(exc)[:2000]}")

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 8) as pool:
        list(pool.map(compile_set, registry.sets))
    print(f"{len(registry.sets)} kernel sets in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
