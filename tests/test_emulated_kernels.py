"""CI without a GPU: our CUDA kernels run on the CPU emulator (tests/support/cuda_emu).

* The emulator itself: warp collectives, barriers, dynamic and static shared memory, cp.async groups and
  mma.sync (checked against NumPy with the PTX fragment layout), and the errors it must raise (deadlock,
  mismatched argument types, a misaligned access, an index past a fixed array), and EMU_ORDER=reverse.
* A representative subset of the GPU test files, run in a subprocess with CUPYLLM_EMULATE=1 (the fake
  NumPy-backed `cupy` must be imported before anything else imports CuPy): KV encode/decode (TCQ: the
  Viterbi encoder at its formats' size and at the smaller trellises bench/kv_encode.py times), the
  flash-attention chunk readers of every format (f32 and f16 readers), the dequantizing-pass benchmark kernel,
  FA-VEC, MMA and MMA's decode layout at head dim 128 for every K and V format once, split-KV, argument
  errors, prompt caching with the cache in device memory; the same for the fused Dual Chunk Attention kernels
  (tests/ops/test_attention_dca_gpu.py). Each subset runs twice: blocks and threads in order, then in reverse (EMU_ORDER).
  The full matrix: `CUPYLLM_EMULATE=1 python -m pytest -m gpu tests/` (and again with EMU_ORDER=reverse).

Skipped when g++ (or $CUPYLLM_EMU_CXX) cannot compile C++20. Builds are cached under
$CUPYLLM_EMU_CACHE (default ~/.cache/cupyllm/cuda_emu); a cold run builds 7 libraries (~1.5 min on 2 cores).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "support" / "cuda_emu"))

import emulator  # noqa: E402

_CXX_OK, _CXX_WHY = emulator.cxx20_support()
pytestmark = pytest.mark.skipif(not _CXX_OK, reason=f"the CUDA emulator needs a C++20 compiler: {_CXX_WHY}")

SELF_TEST_SOURCE = r"""
#include <cuda_fp16.h>
#include "common/mma.cuh"
using cupyllm::u32;

// out[t] for t < 32 * warps: xor/down/up/idx shuffles with widths, a ballot and a block count
__global__ void collectives(int* out, int n) {
    const int t = threadIdx.x, lane = t % 32;
    int v = t * 10;
    out[0 * n + t] = __shfl_xor_sync(0xffffffffu, v, 5);
    out[1 * n + t] = __shfl_down_sync(0xffffffffu, v, 3, 8);
    out[2 * n + t] = __shfl_up_sync(0xffffffffu, v, 2);
    out[3 * n + t] = __shfl_sync(0xffffffffu, v, 7, 16);
    out[4 * n + t] = static_cast<int>(__ballot_sync(0xffffffffu, lane % 3 == 0));
    out[5 * n + t] = __syncthreads_count(t % 4 == 1);
    extern __shared__ __align__(16) int dyn[];
    dyn[n - 1 - t] = t;
    __syncthreads();
    out[6 * n + t] = dyn[t];
    if (t == 0) atomicAdd(&out[7 * n], 1);
    atomicAdd(&out[7 * n + 1], blockIdx.x + blockIdx.y * 10 + blockIdx.z * 100);
}

// D = A B + C for one warp, fragments loaded exactly as the PTX ISA lays them out
__global__ void mma_tile(const __half* a, const __half* b, const float* c, float* d) {
    const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
    auto pair = [](const __half* p) { return *reinterpret_cast<const u32*>(p); };
    const u32 af[4] = {pair(a + g * 16 + 2 * t), pair(a + (g + 8) * 16 + 2 * t), pair(a + g * 16 + 2 * t + 8),
                       pair(a + (g + 8) * 16 + 2 * t + 8)};
    alignas(4) __half bt[4] = {b[(2 * t) * 8 + g], b[(2 * t + 1) * 8 + g], b[(2 * t + 8) * 8 + g], b[(2 * t + 9) * 8 + g]};
    const u32 bf[2] = {pair(bt), pair(bt + 2)};
    const float cf[4] = {c[g * 8 + 2 * t], c[g * 8 + 2 * t + 1], c[(g + 8) * 8 + 2 * t], c[(g + 8) * 8 + 2 * t + 1]};
    float df[4];
    cupyllm::mma_m16n8k16_f16_f32(df, af, bf, cf);
    d[g * 8 + 2 * t] = df[0]; d[g * 8 + 2 * t + 1] = df[1];
    d[(g + 8) * 8 + 2 * t] = df[2]; d[(g + 8) * 8 + 2 * t + 1] = df[3];
}

// ldmatrix: out[4 l + k] = r[k] of lane l, lane l giving row l of src [32][16] halves (the first 8 halves of
// each 32-byte row) staged in shared memory
__global__ void ldmatrix_rows(const __half* src, u32* out, int trans) {
    extern __shared__ __align__(16) __half tile[];
    const int l = threadIdx.x;
    for (int i = 0; i < 16; ++i) tile[l * 16 + i] = src[l * 16 + i];
    __syncwarp();
    u32 r[4];
    if (trans) cupyllm::ldmatrix_x4<true>(r, tile + l * 16);
    else cupyllm::ldmatrix_x4<false>(r, tile + l * 16);
    for (int k = 0; k < 4; ++k) out[4 * l + k] = r[k];
}

// D = A K^T (kv = 0) or A V (kv = 1) with every fragment loaded by ldmatrix as fa_mma loads them: A [16][16]
// row-major; K [8][16] (keys x dims) row-major; V [16][8] (keys x dims) row-major, read transposed
__global__ void ldmatrix_mma(const __half* a, const __half* kv, float* d, int use_v) {
    __shared__ __align__(16) __half a_s[16 * 24], kv_s[16 * 24];  // rows padded to 24 halves (48 bytes)
    const int l = threadIdx.x, g = l / 4, t = l % 4;
    for (int i = l; i < 256; i += 32) a_s[(i / 16) * 24 + i % 16] = a[i];
    for (int i = l; i < 128; i += 32) {
        if (use_v) kv_s[(i / 8) * 24 + i % 8] = kv[i];
        else kv_s[(i / 16) * 24 + i % 16] = kv[i];
    }
    __syncwarp();
    u32 af[4], r[4];
    const int m = l / 8, row = l % 8;
    cupyllm::ldmatrix_x4<false>(af, a_s + ((m & 1) * 8 + row) * 24 + (m >> 1) * 8);
    if (use_v) cupyllm::ldmatrix_x4<true>(r, kv_s + ((m & 1) * 8 + row) * 24);   // keys 0-7, 8-15 (twice)
    else cupyllm::ldmatrix_x4<false>(r, kv_s + row * 24 + (m & 1) * 8);         // dims 0-7, 8-15 (twice)
    const u32 bf[2] = {r[0], r[1]};
    const float zero[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    float df[4];
    cupyllm::mma_m16n8k16_f16_f32(df, af, bf, zero);
    d[g * 8 + 2 * t] = df[0]; d[g * 8 + 2 * t + 1] = df[1];
    d[(g + 8) * 8 + 2 * t] = df[2]; d[(g + 8) * 8 + 2 * t + 1] = df[3];
}

// cp.async lands at the wait: out[0] is read before it (still the NaN fill), out[1] after
__global__ void async_copy(const float* src, float* out) {
    extern __shared__ __align__(16) float buf[];
    cupyllm::cp_async<16>(buf, src, true);
    cupyllm::cp_async_commit();
    out[0] = buf[0];
    cupyllm::cp_async_wait<0>();
    out[1] = buf[0];
}

__global__ void divergent_barrier(int* out) {  // half a warp at __syncthreads, half at __syncwarp
    if (threadIdx.x < 16) __syncthreads();
    else __syncwarp();
    out[threadIdx.x] = 1;
}

__global__ void takes_int(int* out, int value) { out[threadIdx.x] = value; }

// one uint4 (16 bytes) from byte `offset` of src: a misaligned-address fault on a GPU unless offset % 16 == 0
__global__ void vector_load(const unsigned char* src, unsigned* out, int offset) {
    const uint4 v = *reinterpret_cast<const uint4*>(src + offset);
    out[0] = v.x ^ v.y ^ v.z ^ v.w;
}

// element `index` of a register array and of a shared array of 8
__global__ void fixed_arrays(int* out, int index) {
    __shared__ int shared_values[8];
    int values[8];
    for (int i = 0; i < 8; ++i) values[i] = shared_values[i] = 10 * i + out[i];
    out[0] = values[index] + shared_values[index % 8];
}

// static shared memory: what each block reads before writing it, then after
__global__ void static_shared_first_read(int* out) {
    __shared__ int word[2];
    if (threadIdx.x == 0) {
        out[2 * blockIdx.x] = word[1];
        word[1] = 7 + blockIdx.x;
    }
    __syncthreads();
    if (threadIdx.x == 1) out[2 * blockIdx.x + 1] = word[1];
}

__global__ void __launch_bounds__(64) bounded(int* out) { out[threadIdx.x] = 1; }

// the order blocks run in: out[1 + b] = how many blocks ran before block b
__global__ void block_arrival(int* out) {
    if (threadIdx.x == 0) out[1 + blockIdx.x] = atomicAdd(&out[0], 1);
}

// a missing barrier: thread t reads the word thread t + 1 writes (dynamic shared memory, filled with 0xFF)
__global__ void racy_neighbour(int* out, int barrier) {
    extern __shared__ int words[];
    const int t = threadIdx.x, n = blockDim.x;
    words[t] = t + 1;
    if (barrier) __syncthreads();
    out[t] = words[(t + 1) % n];
}
"""

NAMES = ("collectives", "mma_tile", "ldmatrix_rows", "ldmatrix_mma", "async_copy", "divergent_barrier", "takes_int",
         "vector_load", "fixed_arrays", "racy_neighbour",
         "static_shared_first_read", "block_arrival", "bounded")


@pytest.fixture(scope="module")
def lib():
    options = [f"-I{REPO / 'kernels_cu'}"]
    return emulator.build(SELF_TEST_SOURCE, NAMES, options)


def test_warp_collectives_barriers_and_dynamic_shared_memory(lib):
    n = 64
    out = np.zeros(8 * n, np.int32)
    lib.function("collectives")((2, 1, 3), (n,), (out, np.int32(n)), shared_mem=n * 4)
    out = out.reshape(8, n)
    t = np.arange(n)
    lane, base8, base16 = t % 32, t - t % 8, t - t % 16
    np.testing.assert_array_equal(out[0], (t ^ 5) * 10)
    down = np.where(t + 3 < base8 + 8, t + 3, t)
    np.testing.assert_array_equal(out[1], down * 10)
    up = np.where(lane >= 2, t - 2, t)
    np.testing.assert_array_equal(out[2], up * 10)
    np.testing.assert_array_equal(out[3], (base16 + 7) * 10)
    ballot = sum(1 << i for i in range(32) if i % 3 == 0)
    np.testing.assert_array_equal(out[4], np.int32(np.uint32(ballot).view(np.int32)))
    np.testing.assert_array_equal(out[5], n // 4)
    np.testing.assert_array_equal(out[6], n - 1 - t)
    assert out[7, 0] == 6  # one per block: grid (2, 1, 3)
    assert out[7, 1] == n * sum(x + 100 * z for x in range(2) for z in range(3))


def test_mma_matches_numpy_with_the_ptx_fragment_layout(lib):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((16, 16)).astype(np.float16)
    b = rng.standard_normal((16, 8)).astype(np.float16)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    d = np.zeros((16, 8), np.float32)
    lib.function("mma_tile")((1,), (32,), (a, b, c, d))
    ref = a.astype(np.float64) @ b.astype(np.float64) + c
    np.testing.assert_allclose(d, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("trans", (0, 1))
def test_ldmatrix_gives_each_lane_its_words(lib, trans):
    """PTX ldmatrix .x4: lane 8m + r gives row r of matrix m; lane l receives, of each matrix, the halves
    (row l / 4, columns 2(l % 4), +1), or transposed (rows 2(l % 4), +1, column l / 4)."""
    src = np.arange(32 * 16, dtype=np.uint16).view(np.float16).reshape(32, 16)  # distinct bit patterns
    out = np.zeros(32 * 4, np.uint32)
    lib.function("ldmatrix_rows")((1,), (32,), (src, out, np.int32(trans)), shared_mem=32 * 16 * 2)
    bits = src.view(np.uint16).astype(np.uint32)
    want = np.zeros((32, 4), np.uint32)
    for lane in range(32):
        for k in range(4):
            mat = bits[8 * k:8 * k + 8, :8]
            r, c = lane // 4, 2 * (lane % 4)
            lo, hi = (mat[c, r], mat[c + 1, r]) if trans else (mat[r, c], mat[r, c + 1])
            want[lane, k] = lo | hi << 16
    np.testing.assert_array_equal(out.reshape(32, 4), want)


@pytest.mark.parametrize("use_v", (0, 1))
def test_ldmatrix_fragments_feed_mma(lib, use_v):
    """ldmatrix as fa_mma uses it gives mma.sync its A (row-major Q), B (row-major K) and, transposed,
    B (row-major V) fragments: the products equal NumPy's."""
    rng = np.random.default_rng(1)
    a = rng.standard_normal((16, 16)).astype(np.float16)
    kv = rng.standard_normal((16, 8) if use_v else (8, 16)).astype(np.float16)
    d = np.zeros((16, 8), np.float32)
    lib.function("ldmatrix_mma")((1,), (32,), (a, kv, d, np.int32(use_v)))
    b = kv.astype(np.float64) if use_v else kv.astype(np.float64).T
    np.testing.assert_allclose(d, a.astype(np.float64) @ b, rtol=1e-6, atol=1e-6)


def test_cp_async_data_lands_at_the_wait(lib):
    src = np.arange(4, dtype=np.float32) + 1
    out = np.zeros(2, np.float32)
    lib.function("async_copy")((1,), (1,), (src, out), shared_mem=16)
    assert np.isnan(out[0]) and out[1] == 1.0


def test_divergent_barrier_is_reported(lib):
    with pytest.raises(emulator.EmuLaunchError, match="deadlock"):
        lib.function("divergent_barrier")((1,), (32,), (np.zeros(32, np.int32),))


def test_arguments_are_checked_against_the_kernel_signature(lib):
    out = np.zeros(4, np.int32)
    with pytest.raises(emulator.EmuLaunchError, match="int64"):
        lib.function("takes_int")((1,), (4,), (out, 7))  # CuPy would pass a Python int as 8 bytes
    with pytest.raises(emulator.EmuLaunchError, match="dtype"):
        lib.function("takes_int")((1,), (4,), (out.astype(np.float32), np.int32(7)))
    lib.function("takes_int")((1,), (4,), (out, np.int32(7)))
    assert (out == 7).all()


def test_misaligned_vector_access_is_reported(lib):
    """What a GPU reports as a misaligned address (x86 would read it) fails the launch with the source line."""
    src = np.arange(64, dtype=np.uint8)
    out = np.zeros(1, np.uint32)
    lib.function("vector_load")((1,), (1,), (src, out, np.int32(16)))
    assert out[0] == np.bitwise_xor.reduce(src[16:32].view(np.uint32))
    with pytest.raises(emulator.EmuLaunchError, match=r"misaligned access at main.cu:\d+: .* 16-byte alignment"):
        lib.function("vector_load")((1,), (1,), (src, out, np.int32(4)))


def test_index_past_a_fixed_array_is_reported(lib):
    out = np.zeros(8, np.int32)
    lib.function("fixed_arrays")((1,), (1,), (out, np.int32(7)))
    assert out[0] == 140
    with pytest.raises(emulator.EmuLaunchError, match="index 8 out of bounds"):
        lib.function("fixed_arrays")((1,), (1,), (np.zeros(8, np.int32), np.int32(8)))


def test_a_block_past_the_launch_bounds_is_refused(lib):
    out = np.zeros(128, np.int32)
    lib.function("bounded")((1,), (64,), (out,))
    assert out[:64].all() and not out[64:].any()
    with pytest.raises(emulator.EmuLaunchError, match=r"128 threads exceeds the kernel's __launch_bounds__\(64\)"):
        lib.function("bounded")((1,), (128,), (out,))


def test_static_shared_memory_is_the_blocks_own_and_unset(lib):
    """Each block gets its own static shared memory, 0xFF-filled (a GPU's is garbage, not the last block's)."""
    out = np.zeros(6, np.int32)
    lib.function("static_shared_first_read")((3,), (2,), (out,))
    np.testing.assert_array_equal(out, [-1, 7, -1, 8, -1, 9])


def test_thread_order_exposes_a_missing_barrier(lib, monkeypatch):
    """EMU_ORDER=reverse runs blocks and threads last to first between collectives: a read of another thread's
    unsynchronised write sees it in one order and not the other; with the barrier both orders agree."""
    n = 8
    results = {}
    for order in ("forward", "reverse"):
        monkeypatch.setenv("EMU_ORDER", order)
        for barrier in (0, 1):
            out = np.zeros(n, np.int32)
            lib.function("racy_neighbour")((1,), (n,), (out, np.int32(barrier)), shared_mem=4 * n)
            results[order, barrier] = out
        arrival = np.zeros(4, np.int32)
        lib.function("block_arrival")((3,), (32,), (arrival,))
        results[order, "blocks"] = arrival[1:]
    want = (np.arange(n) + 1) % n + 1
    np.testing.assert_array_equal(results["forward", 1], want)
    np.testing.assert_array_equal(results["reverse", 1], want)
    np.testing.assert_array_equal(results["forward", 0], np.r_[np.full(n - 1, -1), 1])  # the writes come later
    np.testing.assert_array_equal(results["reverse", 0], np.r_[want[:-1], -1])
    np.testing.assert_array_equal(results["forward", "blocks"], [0, 1, 2])
    np.testing.assert_array_equal(results["reverse", "blocks"], [2, 1, 0])


# ---- a subset of the GPU test files, under the fake cupy ---------------------------------------------------

GPU_SUBSET = (
    "(test_kv_formats_gpu and (test_decode_within_one_f16_ulp and [q4_0-128] or test_encode_is_bit_exact and "
    "([q4_0-128-float32] or [turbo3_tcq-128-float32]) or test_other_trellis_sizes)) "
    "or (test_attention_gpu and (test_chunk_reader_is_bit_exact and 128] or test_vec_matches_reference and [128- "
    "or test_mma_matches_reference and [128- or test_mma_decode_matches_reference and [128- "
    "or test_split_count or test_bad_arguments or test_dequant_bench_kernel)) or test_prompt_cache_on_the_device "
    "or test_deltanet_gpu"
)


def _run_emulated(files: list[str], subset: str, min_passed: int, order: str) -> None:
    """pytest -m gpu on `files` (-k `subset`) under the emulator, blocks and threads run in `order` (EMU_ORDER: a
    race between threads or blocks passes in at most one of the two orders)."""
    env = dict(os.environ, CUPYLLM_EMULATE="1", EMU_ORDER=order)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", *files, "-k", subset]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, f"EMU_ORDER={order} {' '.join(cmd)}\n{result.stdout[-6000:]}\n{result.stderr[-3000:]}"
    assert " passed" in summary and "skipped" not in summary, summary
    assert int(summary.split(" passed")[0].split()[-1]) >= min_passed, summary  # the subset did not silently shrink


@pytest.mark.parametrize("order", ("forward", "reverse"))
def test_gpu_tests_pass_on_the_emulator(order):
    _run_emulated(["tests/ops/test_kv_formats_gpu.py", "tests/ops/test_attention_gpu.py", "tests/ops/test_deltanet_gpu.py",
                   "tests/test_gpu_backend.py"], GPU_SUBSET, 78, order)


# Fused Dual Chunk Attention (tests/ops/test_attention_dca_gpu.py): FA-VEC, MMA decode and MMA prefill at head dim 128 for
# every K and V format once, against NumPy and the three-call LSE path; splits, empty rows, the fallback.
# About 45 s cold, 25 s warm on 2 cores (each order).
DCA_SUBSET = ("(test_vec_decode or test_mma_decode or test_mma_prefill) and [128- or test_split_count "
              "or test_rows_without_keys or test_bad_arguments or test_decoding_fallback")


@pytest.mark.parametrize("order", ("forward", "reverse"))
def test_gpu_dca_tests_pass_on_the_emulator(order):
    _run_emulated(["tests/ops/test_attention_dca_gpu.py"], DCA_SUBSET, 47, order)
