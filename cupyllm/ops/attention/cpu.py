"""Few-query attention on the CPU straight from the encoded cache (decode steps; the default, no float32 mirror).

What the GPU's FA-VEC kernel does, in numba: each K/V row is decoded into a small scratch inside the loop
(ops/kv_formats/cpu.py decode_in_place, 16 values at a time), never the whole cache; every array the loops read is
borrowed (simd.borrow), so that numba counts no references per row. The rotated formats (turbo*, *_tcq) are
read in their rotated domain: Q is rotated once for K (dot products are rotation-invariant) and the output is
unrotated once for V (it is linear in V). K channel normalisation (kv/cache.py key_normalization) folds into
the query: with K stored as (K - offset) / scale, q . K = (q * scale) . K_stored + q . offset.

Work is split over (KV head, block of `BLOCK_KEYS` slots, half that for one KV head), each task decoding its rows
once for every query head of its group (GQA) and returning a partial (sum, max, weighted values); the partials merge
by log-sum-exp (split-K flash decoding). In a block: each key's dot products four query heads at a time (one K load
for four FMAs, the four horizontal sums sharing their shuffles), the scores scaled and their maxima taken 16 at a
time, the softmax weights 16 at a time (`simd.fexp`); then the value rows `VALUE_KEYS` at a time, decoded once,
summed into register tiles of four rows by 64 columns (four weights and four V loads per key feed sixteen FMAs),
never a load and store of the sums per key. The sums are the same float32 operations in the same order as the
one-head-at-a-time kernel before (bit for bit); bench/attention_cpu.py measures it.

The same kernel reads float32 rows in place (`attend_floats`:
the CPU cache's float32 mirror: attend_few, dca_few). Semantics: `reference.attend` over
`LayerKV.decode` (causal and sliding-window masks from slot positions, softcap, (O, LSE)); for DCA the query
rotation of each key's regime, as `dca.attend_dca`. Tested against the reference and the dense DCA reference
(tests/ops/test_attention_cpu.py, tests/ops/test_attention.py, tests/ops/test_attention_dca.py).
"""
from __future__ import annotations

import math

import numpy as np
import numba
from numba import get_thread_id, njit, prange

from ..kv_formats.formats import get_format, is_rotated
from ..kv_formats.cpu import F32, HALF_TABLE, decode_in_place, row_codec
from ..simd import (borrow, fadd, fexp, fma, fmax, fmul, fsub, hmax, hsum, load_f32_16, splat_16, splat_at_16,
                    store_f32, store_hsums_4, zeros_16)

# slots per task (a multiple of 16): enough work per task, and the task's scores stay in L1; with one KV head,
# half as many, so that a short cache still makes a task per core (Gemma 3 270M's decode step over 200 slots: 47
# us a layer with 256, 31 with 128; over 4000 slots 90 / 83 us; at two KV heads and 16k slots 128 was slower).
# A model's blocks start at fixed slots, so a query's values do not depend on how many follow it (a verify run).
BLOCK_KEYS = 256
VALUE_KEYS = 16  # value rows decoded together (16 KiB at dv 256: in L1 beside the scores), then summed in registers


@njit(inline="always")
def _dot(a, ao, b, bo, n):
    """sum_c a[ao + c] * b[bo + c] over c < n (1-D float32 arrays): 16 lanes at a time into four sums (one sum
    would chain every multiply-add on the one before: 4 cycles each), then the tail."""
    s0, s1, s2, s3 = zeros_16(), zeros_16(), zeros_16(), zeros_16()
    c = 0
    while c + 64 <= n:
        s0 = fma(load_f32_16(a, ao + c), load_f32_16(b, bo + c), s0)
        s1 = fma(load_f32_16(a, ao + c + 16), load_f32_16(b, bo + c + 16), s1)
        s2 = fma(load_f32_16(a, ao + c + 32), load_f32_16(b, bo + c + 32), s2)
        s3 = fma(load_f32_16(a, ao + c + 48), load_f32_16(b, bo + c + 48), s3)
        c += 64
    while c + 16 <= n:
        s0 = fma(load_f32_16(a, ao + c), load_f32_16(b, bo + c), s0)
        c += 16
    total = hsum(fadd(fadd(s0, s1), fadd(s2, s3)))
    for t in range(c, n):
        total += a[ao + t] * b[bo + t]
    return total


@njit(inline="always")
def _dots_4(q, qo, k, ko, d, out, oo):
    """out[oo + h] = _dot(q, qo + h * d, k, ko, d) for h < 4, the same sums in the same order, each K load
    shared by the four (d a multiple of 16)."""
    a0, a1, a2, a3 = zeros_16(), zeros_16(), zeros_16(), zeros_16()  # head 0's four partial sums, ...
    b0, b1, b2, b3 = zeros_16(), zeros_16(), zeros_16(), zeros_16()
    c0, c1, c2, c3 = zeros_16(), zeros_16(), zeros_16(), zeros_16()
    e0, e1, e2, e3 = zeros_16(), zeros_16(), zeros_16(), zeros_16()
    qb, qc, qe = qo + d, qo + 2 * d, qo + 3 * d
    c = 0
    while c + 64 <= d:
        k0 = load_f32_16(k, ko + c)
        k1 = load_f32_16(k, ko + c + 16)
        k2 = load_f32_16(k, ko + c + 32)
        k3 = load_f32_16(k, ko + c + 48)
        a0 = fma(load_f32_16(q, qo + c), k0, a0)
        a1 = fma(load_f32_16(q, qo + c + 16), k1, a1)
        a2 = fma(load_f32_16(q, qo + c + 32), k2, a2)
        a3 = fma(load_f32_16(q, qo + c + 48), k3, a3)
        b0 = fma(load_f32_16(q, qb + c), k0, b0)
        b1 = fma(load_f32_16(q, qb + c + 16), k1, b1)
        b2 = fma(load_f32_16(q, qb + c + 32), k2, b2)
        b3 = fma(load_f32_16(q, qb + c + 48), k3, b3)
        c0 = fma(load_f32_16(q, qc + c), k0, c0)
        c1 = fma(load_f32_16(q, qc + c + 16), k1, c1)
        c2 = fma(load_f32_16(q, qc + c + 32), k2, c2)
        c3 = fma(load_f32_16(q, qc + c + 48), k3, c3)
        e0 = fma(load_f32_16(q, qe + c), k0, e0)
        e1 = fma(load_f32_16(q, qe + c + 16), k1, e1)
        e2 = fma(load_f32_16(q, qe + c + 32), k2, e2)
        e3 = fma(load_f32_16(q, qe + c + 48), k3, e3)
        c += 64
    while c + 16 <= d:
        k0 = load_f32_16(k, ko + c)
        a0 = fma(load_f32_16(q, qo + c), k0, a0)
        b0 = fma(load_f32_16(q, qb + c), k0, b0)
        c0 = fma(load_f32_16(q, qc + c), k0, c0)
        e0 = fma(load_f32_16(q, qe + c), k0, e0)
        c += 16
    store_hsums_4(out, oo, fadd(fadd(a0, a1), fadd(a2, a3)), fadd(fadd(b0, b1), fadd(b2, b3)),
                  fadd(fadd(c0, c1), fadd(c2, c3)), fadd(fadd(e0, e1), fadd(e2, e3)))


@njit(inline="always")
def _accumulate_tile(acc, ao, dv, weights, wo, block_keys, v, vc, seen_at, v_at, n_seen):
    """acc[ao + t * dv + c : +16] += sum_n weights[wo + t * block_keys + seen_at[n]] * v[v_at[n] + vc + c : +16]
    for rows t < 4 and columns c = 0, 16, 32, 48, the keys n in order: sixteen sums in registers."""
    a0, a1 = load_f32_16(acc, ao), load_f32_16(acc, ao + 16)
    a2, a3 = load_f32_16(acc, ao + 32), load_f32_16(acc, ao + 48)
    b = ao + dv
    b0, b1, b2, b3 = load_f32_16(acc, b), load_f32_16(acc, b + 16), load_f32_16(acc, b + 32), load_f32_16(acc, b + 48)
    c = ao + 2 * dv
    c0, c1, c2, c3 = load_f32_16(acc, c), load_f32_16(acc, c + 16), load_f32_16(acc, c + 32), load_f32_16(acc, c + 48)
    e = ao + 3 * dv
    e0, e1, e2, e3 = load_f32_16(acc, e), load_f32_16(acc, e + 16), load_f32_16(acc, e + 32), load_f32_16(acc, e + 48)
    for n in range(n_seen):
        o = v_at[n] + vc
        v0, v1, v2, v3 = load_f32_16(v, o), load_f32_16(v, o + 16), load_f32_16(v, o + 32), load_f32_16(v, o + 48)
        w = wo + seen_at[n]
        p = splat_at_16(weights, w)
        a0, a1, a2, a3 = fma(p, v0, a0), fma(p, v1, a1), fma(p, v2, a2), fma(p, v3, a3)
        p = splat_at_16(weights, w + block_keys)
        b0, b1, b2, b3 = fma(p, v0, b0), fma(p, v1, b1), fma(p, v2, b2), fma(p, v3, b3)
        p = splat_at_16(weights, w + 2 * block_keys)
        c0, c1, c2, c3 = fma(p, v0, c0), fma(p, v1, c1), fma(p, v2, c2), fma(p, v3, c3)
        p = splat_at_16(weights, w + 3 * block_keys)
        e0, e1, e2, e3 = fma(p, v0, e0), fma(p, v1, e1), fma(p, v2, e2), fma(p, v3, e3)
    store_f32(acc, ao, a0); store_f32(acc, ao + 16, a1); store_f32(acc, ao + 32, a2); store_f32(acc, ao + 48, a3)
    store_f32(acc, b, b0); store_f32(acc, b + 16, b1); store_f32(acc, b + 32, b2); store_f32(acc, b + 48, b3)
    store_f32(acc, c, c0); store_f32(acc, c + 16, c1); store_f32(acc, c + 32, c2); store_f32(acc, c + 48, c3)
    store_f32(acc, e, e0); store_f32(acc, e + 16, e1); store_f32(acc, e + 32, e2); store_f32(acc, e + 48, e3)


@njit(inline="always")
def _accumulate_rows_4(acc, ao, dv, weights, wo, block_keys, v, vc, seen_at, v_at, n_seen):
    """_accumulate_tile's sums for 16 columns (c = 0 only)."""
    a0, a1 = load_f32_16(acc, ao), load_f32_16(acc, ao + dv)
    a2, a3 = load_f32_16(acc, ao + 2 * dv), load_f32_16(acc, ao + 3 * dv)
    for n in range(n_seen):
        x = load_f32_16(v, v_at[n] + vc)
        w = wo + seen_at[n]
        a0 = fma(splat_at_16(weights, w), x, a0)
        a1 = fma(splat_at_16(weights, w + block_keys), x, a1)
        a2 = fma(splat_at_16(weights, w + 2 * block_keys), x, a2)
        a3 = fma(splat_at_16(weights, w + 3 * block_keys), x, a3)
    store_f32(acc, ao, a0); store_f32(acc, ao + dv, a1)
    store_f32(acc, ao + 2 * dv, a2); store_f32(acc, ao + 3 * dv, a3)


@njit(inline="always")
def _accumulate_columns_64(acc, ao, weights, wo, v, vc, seen_at, v_at, n_seen):
    """_accumulate_tile's sums for one row (t = 0 only)."""
    a0, a1 = load_f32_16(acc, ao), load_f32_16(acc, ao + 16)
    a2, a3 = load_f32_16(acc, ao + 32), load_f32_16(acc, ao + 48)
    for n in range(n_seen):
        p = splat_at_16(weights, wo + seen_at[n])
        o = v_at[n] + vc
        a0, a1 = fma(p, load_f32_16(v, o), a0), fma(p, load_f32_16(v, o + 16), a1)
        a2, a3 = fma(p, load_f32_16(v, o + 32), a2), fma(p, load_f32_16(v, o + 48), a3)
    store_f32(acc, ao, a0); store_f32(acc, ao + 16, a1); store_f32(acc, ao + 32, a2); store_f32(acc, ao + 48, a3)


@njit(inline="always")
def _accumulate_columns_16(acc, ao, weights, wo, v, vc, seen_at, v_at, n_seen):
    """_accumulate_tile's sums for one row and 16 columns."""
    a0 = load_f32_16(acc, ao)
    for n in range(n_seen):
        a0 = fma(splat_at_16(weights, wo + seen_at[n]), load_f32_16(v, v_at[n] + vc), a0)
    store_f32(acc, ao, a0)


@njit(inline="always")
def _take(work, at, n):
    """(work[at:at + n], at + n): the next n words of a scratch."""
    return work[at:at + n], at + n


def _scratch_words(rows: int, block_keys: int, d: int, dv: int, k_row_bytes: int, v_row_bytes: int) -> int:
    """float32 words of one thread's scratch in _attend_encoded: scores and weights [rows, block_keys], the rows'
    maxima and sums, their value sums [rows, dv], a decoded K row, a key's dot products (rows + 4 >= group + 4),
    VALUE_KEYS decoded V rows, the row decoder's uint32 scratch."""
    bits_words = max(d, dv, (max(k_row_bytes, v_row_bytes) + 7) // 4)
    return 2 * rows * block_keys + 2 * rows + rows * dv + d + rows + 4 + VALUE_KEYS * dv + bits_words


@njit(nogil=True)  # no fastmath: the inlined row decode stays exact
def _attend_task(task, q_flat, q_offset, q_pos, k_pos, k_bytes, v_bytes, k_all, v_all, k_codec, k_table, v_codec,
                 v_table, half_table, n_q, n_head, n_k, d, k_row_bytes, v_row_bytes, window, chunk_len, scale,
                 softcap, block_keys, scratch, index_scratch, part_acc, part_max, part_sum):  # pragma: no cover
    """One task of _attend_encoded: KV head task // n_blocks over the block (task % n_blocks) of block_keys slots,
    into its partial (sum, max, weighted values). Compiled on its own, not inlined into the parallel loop:
    numba's parallel passes copy and analyse the loop body's IR, which took most of the kernel's compile time."""
    n_kv, n_blocks = part_max.shape[0], part_max.shape[1]
    dv = part_acc.shape[-1]
    group = n_head // n_kv
    rows = n_q * group  # row i * group + g: query i, head kh * group + g
    kh = task // n_blocks
    first = (task % n_blocks) * block_keys
    stop = min(first + block_keys, n_k)
    work = borrow(scratch[get_thread_id()])  # (one task at a time per thread)
    # row r's scores at scores[r * block_keys + j - first] (-inf: not seen), so that its softmax weights
    # are one vector loop; block_keys is a multiple of 16, the slots past `stop` stay -inf
    scores, at = _take(work, 0, rows * block_keys)
    weights, at = _take(work, at, rows * block_keys)
    row_max, at = _take(work, at, rows)
    total, at = _take(work, at, rows)
    acc, at = _take(work, at, rows * dv)
    k_row, at = _take(work, at, d)
    dots, at = _take(work, at, group + 4)
    v_rows, at = _take(work, at, VALUE_KEYS * dv)
    bits_f = work[at:]  # the row decoder's scratch
    bits = bits_f.view(np.uint32)
    scores[:] = -np.inf
    row_max[:] = -np.inf
    total[:] = 0.0
    acc[:] = 0.0
    k_floats = k_all if k_codec[0] == F32 else k_row  # where key j's values are, from k_at
    # pass 1: decode each visible key once, dot it with every query head of the group (four at a time)
    for j in range(first, stop):
        kp = k_pos[j]
        if kp < 0:
            continue
        decoded = False
        for i in range(n_q):
            if kp > q_pos[i] or (window > 0 and q_pos[i] - kp >= window) or \
                    (window < 0 and q_pos[i] - kp < -window):  # (the complement: a mixed cache's tail)
                continue
            if not decoded and k_codec[0] != F32:
                decode_in_place(k_bytes, (j * n_kv + kh) * k_row_bytes, k_codec, k_table, half_table, bits,
                                bits_f, k_row)
                decoded = True
            k_at = (j * n_kv + kh) * d if k_codec[0] == F32 else 0
            regime = 0 if chunk_len == 0 else min(q_pos[i] // chunk_len - kp // chunk_len, 2)
            q_at = ((regime * n_q + i) * n_head + kh * group) * d
            g = 0
            if d % 16 == 0:
                while g + 4 <= group:
                    _dots_4(q_flat, q_at + g * d, k_floats, k_at, d, dots, g)
                    g += 4
            for g in range(g, group):
                dots[g] = _dot(q_flat, q_at + g * d, k_floats, k_at, d)
            for g in range(group):
                scores[(i * group + g) * block_keys + j - first] = q_offset[regime, i, kh * group + g] + dots[g]
    # the scores scaled (and soft-capped) a row at a time, 16 at a time; their maxima
    for r in range(rows):
        o = r * block_keys
        best = splat_16(-np.inf)
        for c in range(o, o + block_keys, 16):
            s = fmul(load_f32_16(scores, c), splat_16(scale))
            store_f32(scores, c, s)
            best = fmax(best, s)
        if softcap > 0.0:
            for c in range(o, o + block_keys):
                if scores[c] != -np.inf:
                    scores[c] = softcap * np.float32(math.tanh(scores[c] / softcap))
            row_max[r] = scores[o:o + block_keys].max()
        else:
            row_max[r] = hmax(best)
    # pass 2: each row's softmax weights exp(s - max), 16 at a time (fexp of -inf: 0), and their sum
    for r in range(rows):
        if row_max[r] == -np.inf:  # no key of the block seen: no weights (pass 3 reads rows four at a time)
            weights[r * block_keys:(r + 1) * block_keys] = 0.0
            continue
        m = splat_16(row_max[r])
        sums = zeros_16()
        for o in range(r * block_keys, (r + 1) * block_keys, 16):
            e = fexp(fsub(load_f32_16(scores, o), m))
            store_f32(weights, o, e)
            sums = fadd(sums, e)
        total[r] = hsum(sums)
    # pass 3: the value rows some query sees, VALUE_KEYS at a time: decoded once (or found in place), then
    # each 16-lane column of four rows' value sums kept in registers over them (one V load, four FMAs)
    seen_at = borrow(index_scratch[get_thread_id()])
    v_at = seen_at[VALUE_KEYS:]
    v_src = v_all if v_codec[0] == F32 else v_rows
    whole = dv - dv % 16
    for sub in range(first, stop, VALUE_KEYS):
        n_seen = 0
        for j in range(sub, min(sub + VALUE_KEYS, stop)):
            seen = False
            for r in range(rows):
                if scores[r * block_keys + j - first] != -np.inf:
                    seen = True
                    break
            if not seen:
                continue
            seen_at[n_seen] = j - first
            if v_codec[0] == F32:
                v_at[n_seen] = (j * n_kv + kh) * dv
            else:
                v_at[n_seen] = n_seen * dv
                decode_in_place(v_bytes, (j * n_kv + kh) * v_row_bytes, v_codec, v_table, half_table, bits,
                                bits_f, v_rows[n_seen * dv:(n_seen + 1) * dv])
            n_seen += 1
        if n_seen == 0:
            continue
        # each row's value sums in register tiles over the sub-block's keys: four rows by 64 columns (per
        # key four weights and four V loads feed sixteen FMAs), then four rows or 64 columns by 16
        r = 0
        while r + 4 <= rows:
            c = 0
            while c + 64 <= whole:
                _accumulate_tile(acc, r * dv + c, dv, weights, r * block_keys, block_keys, v_src, c, seen_at, v_at,
                                 n_seen)
                c += 64
            for c in range(c, whole, 16):
                _accumulate_rows_4(acc, r * dv + c, dv, weights, r * block_keys, block_keys, v_src, c, seen_at,
                                   v_at, n_seen)
            r += 4
        for r in range(r, rows):
            c = 0
            while c + 64 <= whole:
                _accumulate_columns_64(acc, r * dv + c, weights, r * block_keys, v_src, c, seen_at, v_at, n_seen)
                c += 64
            for c in range(c, whole, 16):
                _accumulate_columns_16(acc, r * dv + c, weights, r * block_keys, v_src, c, seen_at, v_at, n_seen)
        for c in range(whole, dv):
            for r in range(rows):
                for n in range(n_seen):
                    acc[r * dv + c] += weights[r * block_keys + seen_at[n]] * v_src[v_at[n] + c]
    part_acc[kh, task % n_blocks] = acc.reshape(rows, dv)
    part_max[kh, task % n_blocks] = row_max
    part_sum[kh, task % n_blocks] = total



@njit(parallel=True, cache=True, nogil=True)  # no fastmath: the inlined row decode stays exact
def _attend_encoded(q, q_offset, q_pos, k_data, v_data, k_pos, window, chunk_len, scale, softcap,
                    k_codec, k_table, v_codec, v_table, half_table, block_keys, scratch, index_scratch,
                    part_acc, part_max, part_sum):  # pragma: no cover - compiled
    n_regime, n_q, n_head, d = q.shape
    n_k, n_kv, _ = k_data.shape
    n_blocks = part_max.shape[1]
    k_row_bytes, v_row_bytes = k_data.shape[2], v_data.shape[2]
    # Every array the loops read is borrowed (simd.borrow: no reference counts, which numba would otherwise take
    # per row for the inlined helpers): the arguments' views here, each thread's slice of `scratch` below.
    q_flat, q_offset, q_pos, k_pos = borrow(q.reshape(q.size)), borrow(q_offset), borrow(q_pos), borrow(k_pos)
    k_codec, k_table, v_codec, v_table = borrow(k_codec), borrow(k_table), borrow(v_codec), borrow(v_table)
    half_table = borrow(half_table)
    # float32 rows (the mirror) are read in place, flat; encoded rows are decoded in place
    no_floats = np.empty(0, np.float32)
    k_all = borrow(k_data.view(np.float32).reshape(k_data.size // 4) if k_codec[0] == F32 else no_floats)
    v_all = borrow(v_data.view(np.float32).reshape(v_data.size // 4) if v_codec[0] == F32 else no_floats)
    k_bytes, v_bytes = borrow(k_data.reshape(k_data.size)), borrow(v_data.reshape(v_data.size))
    for task in prange(n_kv * n_blocks):
        # (the task as an int64: in the parallel function numba makes of this body the index is a uint64, and
        # passed on as it is it would compile _attend_task a second time, for that type)
        _attend_task(np.int64(task), q_flat, q_offset, q_pos, k_pos, k_bytes, v_bytes, k_all, v_all, k_codec,
                     k_table, v_codec, v_table, half_table, n_q, n_head, n_k, d, k_row_bytes, v_row_bytes, window,
                     chunk_len, scale, softcap, block_keys, scratch, index_scratch, part_acc, part_max, part_sum)


def attend_encoded(q: np.ndarray, q_pos: np.ndarray, layer_kv, *, scale: float, window: int = 0,
                   softcap: float = 0.0, chunk_len: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(O [n_q, n_head, dv], LSE [n_q, n_head]) of a few queries over a LayerKV's encoded slots. window > 0:
    keys within `window` positions of the query; < 0: keys at least -window behind it (reference.causal_mask).

    q: [n_q, n_head, d], or [3, n_q, n_head, d] for DCA (intra, successive, inter rotations; chunk_len > 0
    picks each key's regime by its position, as dca_few; scale then includes DCA's logit scale)."""
    q = np.asarray(q, np.float32)
    q = q[None] if q.ndim == 3 else q
    n_k = layer_kv.n_used
    q, q_offset = _query_for_stored_keys(q, layer_kv, q.shape[2] // layer_kv.n_kv)
    out, lse = attend_rows(q, q_offset, q_pos, layer_kv.k_data[:n_k], layer_kv.v_data[:n_k],
                           layer_kv.slot_pos[:n_k], layer_kv.k_format, layer_kv.v_format, layer_kv.v_head_dim,
                           scale=scale, window=window, softcap=softcap, chunk_len=chunk_len)
    if is_rotated(layer_kv.v_format.name):  # sum_j p_j rotate(v_j) = rotate(sum_j p_j v_j): unrotate once
        n_q, n_head, dv = out.shape
        out = layer_kv.v_format.unrotate(out.reshape(n_q * n_head, dv)).reshape(n_q, n_head, dv)
    return np.ascontiguousarray(out, np.float32), lse


def attend_floats(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, k_pos: np.ndarray, *,
                  scale: float, window: int = 0, softcap: float = 0.0,
                  chunk_len: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """attend_encoded's (O, LSE) over float32 K [n_k, n_kv, d] and V [n_k, n_kv, dv] (the CPU cache's float32
    mirror: its rows read as the f32 format's), keys at slot positions k_pos; q as attend_encoded's."""
    q = np.ascontiguousarray(q, np.float32)
    q = q[None] if q.ndim == 3 else q
    f32 = get_format("f32")
    return attend_rows(q, np.zeros(q.shape[:3], np.float32), q_pos,
                       np.ascontiguousarray(k, np.float32).view(np.uint8),
                       np.ascontiguousarray(v, np.float32).view(np.uint8), k_pos, f32, f32, v.shape[-1],
                       scale=scale, window=window, softcap=softcap, chunk_len=chunk_len)


def attend_rows(q, q_offset, q_pos, k_data, v_data, k_pos, k_format, v_format, dv: int, *, scale: float,
                window: int, softcap: float, chunk_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(O [n_q, n_head, dv] in V's stored domain, LSE) of q [n_regime, n_q, n_head, d] (as it dots the stored
    K rows; q_offset [n_regime, n_q, n_head] added to each score) over encoded rows k_data / v_data
    [n_k, n_kv, row bytes] at slot positions k_pos: _attend_encoded's split-K partials merged by LSE."""
    n_regime, n_q, n_head, d = q.shape
    n_k, n_kv = k_data.shape[:2]
    group = n_head // n_kv
    block_keys = BLOCK_KEYS if n_kv > 1 else BLOCK_KEYS // 2
    n_blocks = max(1, -(-n_k // block_keys))
    part_acc = np.zeros((n_kv, n_blocks, n_q * group, dv), np.float32)
    part_max = np.full((n_kv, n_blocks, n_q * group), -np.inf, np.float32)
    part_sum = np.zeros((n_kv, n_blocks, n_q * group), np.float32)
    k_codec, k_table = row_codec(k_format)
    v_codec, v_table = row_codec(v_format)
    words = _scratch_words(n_q * group, block_keys, d, dv, k_data.shape[2], v_data.shape[2])
    scratch = np.empty((numba.config.NUMBA_NUM_THREADS, words), np.float32)  # a slice per thread
    index_scratch = np.empty((numba.config.NUMBA_NUM_THREADS, 2 * VALUE_KEYS), np.int64)  # pass 3's key lists
    _attend_encoded(q, np.ascontiguousarray(q_offset, np.float32), np.ascontiguousarray(q_pos, np.int64), k_data,
                    v_data, np.ascontiguousarray(k_pos, np.int64), int(window), int(chunk_len), np.float32(scale),
                    np.float32(softcap), k_codec, k_table, v_codec, v_table, HALF_TABLE, block_keys, scratch,
                    index_scratch, part_acc, part_max, part_sum)
    out, lse = _merge_blocks(part_acc, part_max, part_sum)  # [n_kv, n_q * group, ...]
    out = out.reshape(n_kv, n_q, group, dv).transpose(1, 0, 2, 3).reshape(n_q, n_head, dv)
    lse = lse.reshape(n_kv, n_q, group).transpose(1, 0, 2).reshape(n_q, n_head)
    return out, np.ascontiguousarray(lse)


def _query_for_stored_keys(q: np.ndarray, layer_kv, group: int) -> tuple[np.ndarray, np.ndarray]:
    """(q as it dots the stored K rows, q . offset [n_regime, n_q, n_head]): scaled by K's normalisation, rotated
    into a rotated K format's domain."""
    n_regime, n_q, n_head, d = q.shape
    offset = np.zeros((n_regime, n_q, n_head), np.float32)
    if layer_kv.k_offset is not None:
        k_scale = np.repeat(layer_kv.k_scale, group, axis=0)  # [n_head, d]: each query head's KV head
        offset = np.einsum("rqhd,hd->rqh", q, np.repeat(layer_kv.k_offset, group, axis=0)).astype(np.float32)
        q = q * k_scale
    if is_rotated(layer_kv.k_format.name):
        q = layer_kv.k_format.rotate(q.reshape(-1, d)).reshape(q.shape)
    return np.ascontiguousarray(q, np.float32), offset


@njit(cache=True, nogil=True)
def _merge_blocks(part_acc, part_max, part_sum):
    """Split-K partials [n_kv, n_blocks, rows, ...] -> (O, LSE) [n_kv, rows, ...] by log-sum-exp: each block's
    share weighted by exp(its max - the rows' max), none for a block that saw no key. (One compiled call: a
    decode step merges a few rows per layer, where a dozen NumPy calls cost more than the attention's passes.)"""
    n_kv, n_blocks, rows, dv = part_acc.shape
    out = np.zeros((n_kv, rows, dv), np.float32)
    lse = np.full((n_kv, rows), -np.inf, np.float32)
    weight = np.empty(n_blocks, np.float32)
    for kh in range(n_kv):
        for r in range(rows):
            best = part_max[kh, 0, r]
            for b in range(1, n_blocks):
                best = max(best, part_max[kh, b, r])
            safe = best if np.isfinite(best) else np.float32(0.0)
            total = np.float32(0.0)
            for b in range(n_blocks):
                m = part_max[kh, b, r]
                weight[b] = np.exp(m - safe) if np.isfinite(m) else np.float32(0.0)
                total += weight[b] * part_sum[kh, b, r]
            if not total > 0:
                continue
            row = out[kh, r]
            for b in range(n_blocks):
                if weight[b] != 0:
                    w, acc = weight[b], part_acc[kh, b, r]
                    for c in range(dv):
                        row[c] += w * acc[c]
            for c in range(dv):
                row[c] /= total
            lse[kh, r] = safe + np.log(total)
    return out, lse


MAX_QUERIES = 16  # decode steps and verify runs of drafts: this file's kernels, which give each query the same
# values whatever the others (speculative decoding keeps greedy text unchanged); above this the reference's BLAS path


def attend_few(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, k_pos: np.ndarray, *, scale: float,
               window: int = 0, softcap: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """(O, LSE) of a few queries [n_q, n_head, d] over float32 keys [n_k, n_kv, d] at slot positions k_pos:
    `reference.attend`'s semantics in one numba call per layer instead of a dozen NumPy ones."""
    return attend_floats(q, k, v, q_pos, k_pos, scale=scale, window=window, softcap=softcap)


def dca_few(q_intra, q_successive, q_inter, k, v, q_pos, k_pos, dca, *, scale: float,
            softcap: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Dual Chunk Attention of a few queries over float32 K / V (`dca.DCAConfig` dca), the CPU twin of
    kernels_cu/attention/dca_fused.cu: one pass over the keys, each scored with its regime's query rotation, one
    softmax. Prefill streams key blocks through `dca.attend_dca` instead (backend/cpu.py)."""
    return attend_floats(np.stack([q_intra, q_successive, q_inter]), k, v, q_pos, k_pos,
                         scale=scale * dca.logit_scale, softcap=softcap, chunk_len=dca.chunk_len)
