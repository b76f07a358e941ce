"""Few-query attention on the CPU straight from the encoded cache (decode steps; the default, no float32 mirror).

What the GPU's FA-VEC kernel does, in numba: each K/V row is decoded into a small scratch inside the loop
(ops/kv_formats/cpu.py decode_in_place, 16 values at a time), never the whole cache; every array the loops read is
borrowed (simd.borrow), so that numba counts no references per row. The rotated formats (turbo*, *_tcq) are
read in their rotated domain: Q is rotated once for K (dot products are rotation-invariant) and the output is
unrotated once for V (it is linear in V). K channel normalisation (kv/cache.py key_normalization) folds into
the query: with K stored as (K - offset) / scale, q . K = (q * scale) . K_stored + q . offset.

Work is split over (KV head, block of `BLOCK_KEYS` slots, half that for one KV head), each task decoding its rows
once for every query head of its group (GQA) and returning a partial (sum, max, weighted values); the partials merge
by log-sum-exp (split-K flash decoding). In a block, the keys 16 at a time: which of them each query sees (a bit
per key), the rows some query sees decoded once, then each query head's 16 scores in one register: every key's
products summed 16 columns at a time in a register of its own (each q load feeding 16 FMAs), the 16 horizontal
sums in one shuffle tree (`simd.hsums_16`: 45 instructions for 16 sums, where one sum alone takes 8), stored
under the key mask; the scores scaled and their maxima taken 16 at a time, the softmax weights 16 at a time
(`simd.fexp`); then the seen value rows `VALUE_KEYS` at a time, decoded once, summed into register tiles of four
rows by 64 columns (four weights and four V loads per key feed sixteen FMAs), never a load and store of the sums
per key. bench/attention_cpu.py measures it.

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
from .reference import grouped_queries, normalized, nothing_seen
from ..simd import (borrow, fadd, fexp, fma, fmax, fmul, fsub, hmax, hsum, hsums_16, load_f32_16, splat_16,
                    splat_at_16, store_f32, store_f32_where, zeros_16)

# slots per task (a multiple of 16): enough work per task, and the task's scores stay in L1; with one KV head,
# half as many, so that a short cache still makes a task per core (Gemma 3 270M's decode step over 200 slots: 47
# us a layer with 256, 31 with 128; over 4000 slots 90 / 83 us; at two KV heads and 16k slots 128 was slower).
# A model's blocks start at fixed slots, so a query's values do not depend on how many follow it (a verify run).
BLOCK_KEYS = 256
VALUE_KEYS = 16  # value rows decoded together (16 KiB at dv 256: in L1 beside the scores), then summed in registers;
# 16 as pass 1's key masks (a bit per key of 16)


@njit(inline="always")
def _scores_16(q, qo, k, ko, stride, d):
    """Lane t: sum_c q[qo + c] * k[ko + t * stride + c] over c < d (a multiple of 16): the 16 keys' products
    summed 16 columns at a time in a register each (each load of q feeds 16 FMAs, each K load one), then the 16
    horizontal sums in one tree (simd.hsums_16), not 16 trees."""
    p0, p1, p2, p3, p4, p5, p6, p7 = (zeros_16(), zeros_16(), zeros_16(), zeros_16(), zeros_16(), zeros_16(),
                                      zeros_16(), zeros_16())
    p8, p9, p10, p11, p12, p13, p14, p15 = (zeros_16(), zeros_16(), zeros_16(), zeros_16(), zeros_16(), zeros_16(),
                                            zeros_16(), zeros_16())
    for c in range(0, d, 16):
        x = load_f32_16(q, qo + c)
        o = ko + c
        p0, p1 = fma(x, load_f32_16(k, o), p0), fma(x, load_f32_16(k, o + stride), p1)
        p2, p3 = fma(x, load_f32_16(k, o + 2 * stride), p2), fma(x, load_f32_16(k, o + 3 * stride), p3)
        p4, p5 = fma(x, load_f32_16(k, o + 4 * stride), p4), fma(x, load_f32_16(k, o + 5 * stride), p5)
        p6, p7 = fma(x, load_f32_16(k, o + 6 * stride), p6), fma(x, load_f32_16(k, o + 7 * stride), p7)
        p8, p9 = fma(x, load_f32_16(k, o + 8 * stride), p8), fma(x, load_f32_16(k, o + 9 * stride), p9)
        p10, p11 = fma(x, load_f32_16(k, o + 10 * stride), p10), fma(x, load_f32_16(k, o + 11 * stride), p11)
        p12, p13 = fma(x, load_f32_16(k, o + 12 * stride), p12), fma(x, load_f32_16(k, o + 13 * stride), p13)
        p14, p15 = fma(x, load_f32_16(k, o + 14 * stride), p14), fma(x, load_f32_16(k, o + 15 * stride), p15)
    return hsums_16(p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15)


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


def _scratch_words(rows: int, block_keys: int, d_pad: int, dv: int, k_row_bytes: int, v_row_bytes: int) -> int:
    """float32 words of one thread's scratch in _attend_encoded: scores and weights [rows, block_keys], the rows'
    maxima and sums, their value sums [rows, dv], 16 decoded K rows [16, d_pad], VALUE_KEYS decoded V rows, the
    row decoder's uint32 scratch."""
    bits_words = max(d_pad, dv, (max(k_row_bytes, v_row_bytes) + 7) // 4)
    return 2 * rows * block_keys + 2 * rows + rows * dv + 16 * d_pad + VALUE_KEYS * dv + bits_words


@njit(nogil=True)  # no fastmath: the inlined row decode stays exact
def _attend_task(task, q_flat, q_offset, q_pos, k_pos, k_bytes, v_bytes, k_all, v_all, k_codec, k_table, v_codec,
                 v_table, half_table, n_q, n_head, n_k, d, d_pad, k_row_bytes, v_row_bytes, window, chunk_len, scale,
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
    k_rows, at = _take(work, at, 16 * d_pad)
    v_rows, at = _take(work, at, VALUE_KEYS * dv)
    bits_f = work[at:]  # the row decoder's scratch
    bits = bits_f.view(np.uint32)
    scores[:] = -np.inf
    row_max[:] = -np.inf
    total[:] = 0.0
    acc[:] = 0.0
    k_rows[:] = 0.0  # (columns past d stay 0: q's are 0 there too)
    index = borrow(index_scratch[get_thread_id()])
    seen_at, v_at = index[:VALUE_KEYS], index[VALUE_KEYS:2 * VALUE_KEYS]
    seen_subs = index[2 * VALUE_KEYS:2 * VALUE_KEYS + block_keys // 16]  # each 16 keys' seen_keys, for pass 3
    masks = index[2 * VALUE_KEYS + block_keys // 16:]
    # pass 1: the keys 16 at a time: which each query sees, in which DCA regime (a bit per key: masks[3 * i +
    # regime]); the rows some query sees decoded once (or read in place), then each query head's 16 scores
    # in one register (_scores_16), stored where seen
    for sub in range(first, stop, 16):
        n = min(16, stop - sub)
        seen_keys = 0
        for i in range(n_q):
            masks[3 * i] = masks[3 * i + 1] = masks[3 * i + 2] = 0
            for t in range(n):
                kp = k_pos[sub + t]
                if kp < 0 or kp > q_pos[i] or (window > 0 and q_pos[i] - kp >= window) or \
                        (window < 0 and q_pos[i] - kp < -window):  # (the complement: a mixed cache's tail)
                    continue
                regime = 0 if chunk_len == 0 else min(q_pos[i] // chunk_len - kp // chunk_len, 2)
                masks[3 * i + regime] |= 1 << t
            seen_keys |= masks[3 * i] | masks[3 * i + 1] | masks[3 * i + 2]
        seen_subs[(sub - first) // 16] = seen_keys
        if seen_keys == 0:
            continue
        if k_codec[0] == F32 and n == 16 and d == d_pad:  # float32 rows (the mirror) in place
            k_src, k_at, k_stride = k_all, (sub * n_kv + kh) * d, n_kv * d
        else:
            for t in range(n):
                if seen_keys >> t & 1:
                    decode_in_place(k_bytes, ((sub + t) * n_kv + kh) * k_row_bytes, k_codec, k_table, half_table,
                                    bits, bits_f, k_rows, t * d_pad, d)
            k_src, k_at, k_stride = k_rows, 0, d_pad
        for i in range(n_q):
            for regime in range(3):
                mask = masks[3 * i + regime]
                if mask == 0:
                    continue
                q_at = ((regime * n_q + i) * n_head + kh * group) * d_pad
                for g in range(group):
                    s = fadd(splat_16(q_offset[regime, i, kh * group + g]),
                             _scores_16(q_flat, q_at + g * d_pad, k_src, k_at, k_stride, d_pad))
                    store_f32_where(scores, (i * group + g) * block_keys + sub - first, s, mask)
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
    # pass 3: the value rows some query sees (pass 1's masks), VALUE_KEYS at a time: decoded once (or found in
    # place), then each 16-lane column of four rows' value sums kept in registers over them (one V load, four FMAs)
    v_src = v_all if v_codec[0] == F32 else v_rows
    whole = dv - dv % 16
    for sub in range(first, stop, VALUE_KEYS):
        seen_keys = seen_subs[(sub - first) // 16]
        n_seen = 0
        for t in range(min(VALUE_KEYS, stop - sub)):
            if not seen_keys >> t & 1:
                continue
            j = sub + t
            seen_at[n_seen] = j - first
            if v_codec[0] == F32:
                v_at[n_seen] = (j * n_kv + kh) * dv
            else:
                v_at[n_seen] = n_seen * dv
                decode_in_place(v_bytes, (j * n_kv + kh) * v_row_bytes, v_codec, v_table, half_table, bits,
                                bits_f, v_rows, n_seen * dv, dv)
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
    # (element by element: an array assigned to a slice compiles numba's formatted shape-mismatch error, seconds
    # of the first run's compile for a message no valid call raises)
    b = task % n_blocks
    for r in range(rows):
        part_max[kh, b, r] = row_max[r]
        part_sum[kh, b, r] = total[r]
        for c in range(dv):
            part_acc[kh, b, r, c] = acc[r * dv + c]



@njit(parallel=True, cache=True, nogil=True)  # no fastmath: the inlined row decode stays exact
def _attend_encoded(q, q_offset, q_pos, k_data, v_data, k_pos, d, window, chunk_len, scale, softcap,
                    k_codec, k_table, v_codec, v_table, half_table, block_keys, scratch, index_scratch,
                    part_acc, part_max, part_sum):  # pragma: no cover - compiled
    n_regime, n_q, n_head, d_pad = q.shape
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
                     k_table, v_codec, v_table, half_table, n_q, n_head, n_k, d, d_pad, k_row_bytes, v_row_bytes,
                     window, chunk_len, scale, softcap, block_keys, scratch, index_scratch, part_acc, part_max,
                     part_sum)


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
    d_pad = -(-d // 16) * 16  # the kernel's dot products run 16 columns at a time: q's pad columns are 0
    if d_pad != d:
        q = np.concatenate([q, np.zeros((n_regime, n_q, n_head, d_pad - d), np.float32)], axis=-1)
    block_keys = BLOCK_KEYS if n_kv > 1 else BLOCK_KEYS // 2
    n_blocks = max(1, -(-n_k // block_keys))
    part_acc = np.zeros((n_kv, n_blocks, n_q * group, dv), np.float32)
    part_max = np.full((n_kv, n_blocks, n_q * group), -np.inf, np.float32)
    part_sum = np.zeros((n_kv, n_blocks, n_q * group), np.float32)
    k_codec, k_table = row_codec(k_format)
    v_codec, v_table = row_codec(v_format)
    words = _scratch_words(n_q * group, block_keys, d_pad, dv, k_data.shape[2], v_data.shape[2])
    scratch = np.empty((numba.config.NUMBA_NUM_THREADS, words), np.float32)  # a slice per thread
    # pass 3's key lists, pass 1's key masks
    index_scratch = np.empty((numba.config.NUMBA_NUM_THREADS, 2 * VALUE_KEYS + block_keys // 16 + 3 * n_q), np.int64)
    _attend_encoded(q, np.ascontiguousarray(q_offset, np.float32), np.ascontiguousarray(q_pos, np.int64), k_data,
                    v_data, np.ascontiguousarray(k_pos, np.int64), d, int(window), int(chunk_len), np.float32(scale),
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


ROWS_PER_BLOCK = 128  # a prefill block's queries scored together (a matmul of 128 x group rows still runs at
# BLAS speed; a smaller block sees fewer keys: at 4k tokens Gemma 3 270M's sliding layers score 640 keys a query
# block instead of 1,024)
SEEN_FRACTION_TO_GATHER = 0.9  # a block's keys are gathered when it sees fewer than this share of them


def attend_block(q: np.ndarray, k: np.ndarray, v: np.ndarray, allowed: np.ndarray | None, *, scale: float,
                 softcap: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """`reference.attend` for a prefill's block of queries, in fewer passes over its [n_kv, group, n_q, n_k] scores
    (the part of a long prefill that is not matmul): the scale folded into q before the matmul, the mask written
    in place over only the columns that some query of the block does not see (a causal block: its own slots), and
    the weights' row sums a column of the P @ V matmul (V with a column of ones) instead of a pass of their own.
    Within float32 rounding of the reference (the same operations, summed in another order). Queries go
    `ROWS_PER_BLOCK` at a time, each block over only the keys it sees: a sliding window's block reads its window,
    not the whole ring, and a causal block near its chunk's start not the chunk's later slots."""
    n_q, n_head, d = q.shape
    n_k, n_kv, dv = v.shape
    group = n_head // n_kv
    if allowed is not None and n_q > ROWS_PER_BLOCK:
        parts = [attend_block(q[a:a + ROWS_PER_BLOCK], k, v, allowed[a:a + ROWS_PER_BLOCK], scale=scale,
                              softcap=softcap) for a in range(0, n_q, ROWS_PER_BLOCK)]
        return np.concatenate([o for o, _ in parts]), np.concatenate([lse for _, lse in parts])
    if allowed is not None:
        seen = np.flatnonzero(allowed.any(axis=0))
        if seen.size < SEEN_FRACTION_TO_GATHER * n_k:  # (a gather of K and V rows: cheap beside the matmuls)
            k, v, allowed, n_k = k[seen], v[seen], allowed[:, seen], seen.size
    if n_k == 0:
        return nothing_seen(n_q, n_head, dv)
    qg = grouped_queries(np.asarray(q, np.float32) * np.float32(scale), n_kv)
    scores = np.matmul(qg, np.ascontiguousarray(k.transpose(1, 2, 0))).reshape(n_kv, group, n_q, n_k)
    if softcap > 0.0:
        scores = np.float32(softcap) * np.tanh(scores / np.float32(softcap))
    if allowed is not None:
        unseen = np.flatnonzero(~allowed.all(axis=0))  # columns some query does not see
        if unseen.size:
            lo, hi = unseen[0], unseen[-1] + 1
            np.copyto(scores[..., lo:hi], np.float32(-np.inf), where=~allowed[:, lo:hi])
    row_max = scores.max(axis=-1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, np.float32(0.0))
    scores -= row_max
    probs = np.exp(scores, out=scores)
    v_ones = np.empty((n_kv, n_k, dv + 1), np.float32)
    v_ones[..., :dv] = v.transpose(1, 0, 2)
    v_ones[..., dv] = 1.0
    out = np.matmul(probs.reshape(n_kv, group * n_q, n_k), v_ones).reshape(n_kv, group, n_q, dv + 1)
    return normalized(out[..., :dv], row_max, out[..., dv])


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
