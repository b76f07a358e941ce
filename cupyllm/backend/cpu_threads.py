"""NumPy work on row blocks, spread over a few Python threads (the CPU backend's prefill attention and
activations).

Why threads and not BLAS's own: the prefill matmuls run in numba's thread pool, and OpenBLAS's workers, once
woken, spin for a long while after every call (about 0.1 s), so numba's threads and BLAS's fight for the cores
(measured: a 128-token Qwen2.5-0.5B prefill took 2.4x as long). Here BLAS is held to one thread (threadpoolctl,
only while the work runs) and the rows are split instead: NumPy releases the GIL inside matmul and the ufuncs,
so the blocks run in parallel, elementwise work included, and idle Python threads sleep.
"""
from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
from threadpoolctl import ThreadpoolController

MIN_ROWS_PER_BLOCK = 16  # fewer rows than this per thread run on the calling thread alone


class RowThreads:
    def __init__(self, threads: int | None = None):
        self.threads = threads or numba.get_num_threads()
        self._pool = None
        self._blas = None

    @contextlib.contextmanager
    def limited(self, threads: int | None):
        """numba's parallel regions and BLAS on at most `threads` threads inside (None: unchanged)."""
        if threads is None:
            yield
            return
        before = numba.get_num_threads()
        numba.set_num_threads(threads)
        try:
            with self._controller().limit(limits=threads, user_api="blas"):
                yield
        finally:
            numba.set_num_threads(before)

    def _controller(self) -> ThreadpoolController:
        if self._blas is None:  # (finding the loaded BLAS libraries takes milliseconds: once)
            self._blas = ThreadpoolController()
        return self._blas

    def blocks(self, n_rows: int) -> list[tuple[int, int]]:
        """Row ranges [start, stop), two per thread (rows late in a causal prefill see more keys)."""
        parts = max(1, min(2 * self.threads, n_rows // MIN_ROWS_PER_BLOCK))
        bounds = np.linspace(0, n_rows, parts + 1).astype(int)
        return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]

    def map_rows(self, fn, n_rows: int) -> list:
        """[fn(start, stop) for each row block], the blocks run on the threads with BLAS single-threaded."""
        if n_rows < 2 * MIN_ROWS_PER_BLOCK or self.threads == 1:  # (decode: no block planning per call)
            return [fn(0, n_rows)]
        blocks = self.blocks(n_rows)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="cupyllm-rows")
        with self._controller().limit(limits=1, user_api="blas"):
            return list(self._pool.map(lambda block: fn(*block), blocks))

    def rows(self, fn, *arrays: np.ndarray) -> np.ndarray:
        """fn(*arrays) for an elementwise fn of arrays with the same rows, computed block by block on the
        threads."""
        parts = self.map_rows(lambda a, b: fn(*(x[a:b] for x in arrays)), arrays[0].shape[0])
        return parts[0] if len(parts) == 1 else np.concatenate(parts)
