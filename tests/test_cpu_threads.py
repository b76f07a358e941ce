"""The CPU backend's row threads: blocks cover the rows once, results equal the single-threaded computation,
and BLAS's own thread count is back where it was afterwards."""
from __future__ import annotations

import numpy as np
from threadpoolctl import threadpool_info

from cupyllm.attention.reference import attend, causal_mask
from cupyllm.backend.cpu import silu
from cupyllm.backend.cpu_threads import RowThreads


def test_blocks_cover_every_row_once():
    threads = RowThreads(threads=2)
    for n_rows in (1, 15, 16, 33, 100, 4097):
        blocks = threads.blocks(n_rows)
        assert blocks[0][0] == 0 and blocks[-1][1] == n_rows
        assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
        assert len(blocks) <= 4 and (n_rows < 32 or len(blocks) > 1)


def test_rows_on_threads_equal_one_call():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((100, 4, 32)).astype(np.float32)
    k = rng.standard_normal((100, 2, 32)).astype(np.float32)
    v = rng.standard_normal((100, 2, 16)).astype(np.float32)
    pos = np.arange(100)
    want, _ = attend(q, k, v, causal_mask(pos, pos), scale=0.2)
    threads = RowThreads(threads=2)
    before = [lib["num_threads"] for lib in threadpool_info()]
    parts = threads.map_rows(lambda a, b: attend(q[a:b], k, v, causal_mask(pos[a:b], pos), scale=0.2)[0], 100)
    assert len(parts) == 4 and [lib["num_threads"] for lib in threadpool_info()] == before
    np.testing.assert_allclose(np.concatenate(parts), want, rtol=1e-5, atol=1e-6)
    x = rng.standard_normal((70, 300)).astype(np.float32)
    np.testing.assert_array_equal(threads.rows(silu, x), silu(x))
