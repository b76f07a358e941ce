"""The CPU backend's row threads: blocks cover the rows once, results equal the single-threaded computation,
and BLAS's own thread count is back where it was afterwards; and its allocator setting (freed memory kept)."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import numpy as np
import pytest
from threadpoolctl import threadpool_info

from cupyllm.ops.attention.reference import attend, causal_mask
from cupyllm.ops.elementwise.reference import silu
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


def test_threads_option_limits_the_forward_pass_and_changes_no_value(tiny_model):
    """load(threads=) / -t: numba's parallel regions and BLAS run on that many threads inside each forward pass
    (restored after); the logits agree up to BLAS's summation order (the attention rows go to BLAS whole
    instead of in blocks), which the random tiny model carries to 1.3e-5 of its logit scale (3.5e-5 through
    the 16-bit activation codes)."""
    import numba

    import cupyllm
    from test_generate import run_cli
    path = tiny_model("qwen2")[0]
    ids = list(range(4, 60))
    default = cupyllm.load(path, device="cpu", ctx=64, progress=False)
    one = cupyllm.load(path, device="cpu", ctx=64, threads=1, progress=False)
    seen = []
    forward = one.transformer.forward

    def spy(*args, **kwargs):
        seen.append(numba.get_num_threads())
        return forward(*args, **kwargs)

    one.transformer.forward = spy
    before = numba.get_num_threads()
    want = default.logits(ids)
    np.testing.assert_allclose(one.logits(ids), want, rtol=0, atol=1e-4 * np.abs(want).max())
    assert seen and set(seen) == {1} and numba.get_num_threads() == before
    out = run_cli("generate", "hi", "-m", str(path), "-n", "2", "-t", "1", "--device", "cpu", "-c", "64")
    assert out.returncode == 0, out.stderr
    bad = run_cli("generate", "hi", "-m", str(path), "-n", "2", "-t", "0", "--device", "cpu", "-c", "64")
    assert bad.returncode == 1 and "threads=0: choose 1 .." in bad.stderr and "Traceback" not in bad.stderr


# --- freed memory kept for reuse (backend/cpu_memory.py) ---------------------------------------------------
CHURN = """
import resource, sys
import numpy as np
{setup}
def churn():  # a prefill's pattern: many arrays of megabytes alive at once, then freed
    for _ in range(10):
        held = [np.ones(600_000, np.float32) for _ in range(16)]
        del held
churn()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
churn()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(setup: str, env: dict | None = None) -> int:
    out = subprocess.run([sys.executable, "-c", CHURN.format(setup=setup)], capture_output=True, text=True,
                         timeout=120, env={**os.environ, **(env or {})}, check=True)
    return int(out.stdout.split()[-1])


def test_the_cpu_backend_keeps_freed_memory_for_reuse():
    """Arrays freed and allocated again fault no new pages in once the CPU backend is made (glibc's default
    returns the heap top to the OS and faults every page in again: ~90,000 faults for this churn); a user's own
    malloc setting stands (nothing changed, the faults as without us)."""
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("the allocator setting is glibc's")
    make_backend = "from cupyllm.backend.cpu import CPUBackend\nCPUBackend()"
    without = _faults("")
    assert without > 10_000  # (the churn does fault by default: else this test could not fail)
    assert _faults(make_backend) < 100
    user_set = {"MALLOC_TOP_PAD_": "1"}
    assert _faults(make_backend + "\nfrom cupyllm.backend.cpu_memory import keep_freed_memory\n"
                   "assert not keep_freed_memory()", user_set) > 10_000


def _resident_bytes(address: int) -> int:
    """The resident bytes (smaps' Rss) of this process's mapping that holds `address`."""
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start <= address < end
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError("no mapping holds the address")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads the mapping's resident size from /proc")
def test_released_pages_of_a_mapped_file_leave_memory_and_read_back_unchanged(tmp_path):
    """release_mapped_pages drops the whole pages of a read-only mapped tensor from the process's resident
    memory (the rows copied elsewhere); reading them again gives the file's bytes. Arrays of memory and
    copy-on-write mappings are left alone (their pages may hold what the file does not)."""
    import mmap
    from cupyllm.backend.cpu_memory import release_mapped_pages
    path = tmp_path / "tensor.bin"
    data = np.random.default_rng(0).integers(0, 256, 8 << 20, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    with open(path, "rb") as fh:
        mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    tensor = np.frombuffer(mapped, np.uint8, count=6 << 20, offset=1000).reshape(-1, 1024)  # (not page-aligned)
    assert int(tensor.sum(dtype=np.int64)) == int(data[1000:1000 + (6 << 20)].sum(dtype=np.int64))  # all in
    address = tensor.ctypes.data
    before = _resident_bytes(address)
    assert before >= 6 << 20
    released = release_mapped_pages(tensor)
    assert released == ((1000 + (6 << 20)) // 4096 - (1000 + 4095) // 4096) * 4096
    assert _resident_bytes(address) <= before - released
    np.testing.assert_array_equal(tensor.reshape(-1), data[1000:1000 + (6 << 20)])
    assert release_mapped_pages(data) == 0
    with open(path, "r+b") as fh:
        private = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
    written = np.frombuffer(private, np.uint8)
    written[:4096] = 7
    assert release_mapped_pages(written) == 0 and (written[:4096] == 7).all()
    del tensor, written
