"""The Gated DeltaNet layer core on the CPU, float32 (the state too, as HF keeps it): numba kernels for the causal
conv, the recurrence over a prompt or one token (`gated_delta_tokens`, `decode`) and the gated RMSNorm (their
SiLUs in NumPy); and the chunked form (`gated_delta_chunked`: NumPy BLAS products around a numba triangular
inverse). `reference.py` is the definition (float64); shapes and the state layout [Hv, Dk, Dv] are its.
A prompt's conv rows, q / k heads and norm rows are split over numba's threads; a decode step's few stay on the
calling thread, where a parallel region's wake-up would cost more than the work (the sums are the same).

A prompt runs through the token loop (`_delta_tiles`): each task carries a [Dk, 16] tile of one head's state
through every token in L1, in SIMD registers' width (ops/simd.py), one pass over the tile per token. At head dim
128 it is faster than the chunked form (several times, bench/deltanet_cpu.py, docs/deltanet.md) and a digit more
accurate in float32: the chunked form does more arithmetic (its [64, 64] products and triangular solves on top of
the same state products) in many small batched products, which do not run at BLAS's large-matrix speed.

No fastmath: the sums keep their order, so a prompt run in pieces (prefill, decode steps, prefill) gives the
values of one run over the whole prompt, bit for bit.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .. import simd
from .reference import CHUNK_SIZE, L2_EPS

LANES = simd.WIDE_LANES  # float32 lanes of one state tile: an AVX-512 register
_TILE_FROM_TOKENS = 8  # fewer tokens (decode) update the state in place: copying a tile out costs more
_CHUNKS_PER_BLOCK = 16  # chunks whose [C, C] products are held at once: bounds a long prompt's scratch memory
_CONV_TOKENS_PER_TASK = 8  # conv rows a task; fewer than two tasks' tokens (decode) run on the calling thread
_NORM_ROWS_ON_THREADS = 64  # gated-norm rows (tokens x value heads) from which the rows go to the threads


@njit(cache=True, nogil=True, inline="always")
def _conv_row(x, taps, conv_state, t, row):
    """Row t of the conv: row[c] = sum_j taps[j, c] * xx[t + j, c], the taps summed in order j = 0 .. K - 1, the
    channel loop innermost (contiguous rows, vectorised)."""
    hist = taps.shape[0] - 1
    row[:] = 0.0
    for j in range(taps.shape[0]):
        src = t + j
        xs = conv_state[src] if src < hist else x[src - hist]
        w = taps[j]
        for c in range(row.shape[0]):
            row[c] += w[c] * xs[c]


@njit(parallel=True, cache=True, nogil=True)
def _conv_token_blocks(x, taps, conv_state, out):
    """_conv_row for every token, _CONV_TOKENS_PER_TASK tokens a task."""
    n = x.shape[0]
    for task in prange((n + _CONV_TOKENS_PER_TASK - 1) // _CONV_TOKENS_PER_TASK):
        for t in range(task * _CONV_TOKENS_PER_TASK, min(n, (task + 1) * _CONV_TOKENS_PER_TASK)):
            _conv_row(x, taps, conv_state, t, out[t])


@njit(cache=True, nogil=True)
def conv1d_rows(x, weight, conv_state, out):
    """out[t, c] = sum_j weight[c, j] * xx[t + j, c], xx = conv_state [K - 1, C] followed by x [T, C]; conv_state
    becomes the last K - 1 rows of xx (in place). A prompt's tokens on the threads, a decode step's on this one
    (the same sums either way)."""
    n = x.shape[0]
    hist = weight.shape[1] - 1
    taps = np.ascontiguousarray(weight.T)  # [K, C]
    if n >= 2 * _CONV_TOKENS_PER_TASK:
        _conv_token_blocks(x, taps, conv_state, out)
    else:
        for t in range(n):
            _conv_row(x, taps, conv_state, t, out[t])
    # the last hist inputs, older state first (element by element: an array assigned to a slice compiles numba's
    # formatted shape-mismatch error, seconds of the first run's compile)
    for r in range(hist):
        src = r + n  # position in [state, x]
        for c in range(x.shape[1]):
            conv_state[r, c] = conv_state[src, c] if src < hist else x[src - hist, c]


def conv1d_silu_rows(x, weight, conv_state, out):
    """out = silu(causal depthwise conv of x [T, C] with weight [C, K] over conv_state [K - 1, C]), conv_state
    updated in place (`reference.causal_conv1d_silu`). The SiLU in NumPy, in place: its float32 exp is
    vectorised, numba's is a scalar call per value (twice the conv's time at Qwen shapes)."""
    conv1d_rows(x, weight, conv_state, out)
    t = np.negative(out)
    np.exp(t, out=t)
    t += np.float32(1.0)
    np.divide(out, t, out=out)
    return out


@njit(cache=True, nogil=True, inline="always")
def _normalize_head(q, k, qn, kn, kq, h):
    """normalize_qk's work for key head h, all tokens."""
    dk = q.shape[2]
    scale = np.float32(1.0) / np.sqrt(np.float32(dk))
    eps = np.float32(L2_EPS)
    for t in range(q.shape[0]):
        sq = np.float32(0.0)
        sk = np.float32(0.0)
        for i in range(dk):
            sq += q[t, h, i] * q[t, h, i]
            sk += k[t, h, i] * k[t, h, i]
        inv_q = np.float32(1.0) / np.sqrt(sq + eps)
        inv_k = np.float32(1.0) / np.sqrt(sk + eps)
        dot = np.float32(0.0)
        for i in range(dk):
            qi = (q[t, h, i] * inv_q) * scale
            ki = k[t, h, i] * inv_k
            qn[h, t, i] = qi
            kn[h, t, i] = ki
            dot += ki * qi
        kq[h, t] = dot


@njit(parallel=True, cache=True, nogil=True)
def _normalize_heads(q, k, qn, kn, kq):
    for h in prange(q.shape[1]):
        _normalize_head(q, k, qn, kn, kq, h)


@njit(cache=True, nogil=True)
def normalize_qk(q, k, qn, kn, kq):
    """qn = l2norm(q) / sqrt(Dk), kn = l2norm(k) (HF's l2norm: x / sqrt(sum(x^2) + eps)), kq = kn . qn, for q, k
    [T, Hk, Dk] in any layout; written head-major, qn, kn [Hk, T, Dk] and kq [Hk, T], so that a head's tokens
    are consecutive for the recurrence. A prompt's heads on the threads, a decode step's on this one."""
    if q.shape[0] >= _TILE_FROM_TOKENS:
        _normalize_heads(q, k, qn, kn, kq)
    else:
        for h in range(q.shape[1]):
            _normalize_head(q, k, qn, kn, kq, h)


@njit(inline="always")
def _decay_and_write(rows, at, step, kf, k_at, delta, decay, i):
    """Row i of a state tile: a S[i] + k[i] d (the token's decay and its delta-rule write); returns the new row."""
    row = simd.fma(simd.splat_at_16(kf, k_at + i), delta, simd.fmul(simd.load_f32_16(rows, at + i * step), decay))
    simd.store_f32(rows, at + i * step, row)
    return row


@njit(parallel=True, cache=True, nogil=True)
def _delta_tiles(qn, kn, kq, v, g, beta, state, out):
    """The recurrence over T tokens, head-major: qn, kn [Hk, T, Dk] normalised (kq their dot products),
    v [Hv, T, Dv], g, beta [Hv, T]; state [Hv, Dk, Dv] updated and out [Hv, T, Dv] written, all C-contiguous
    float32.

    The value columns do not mix: column j of S_t depends only on column j of S_{t-1}. So each task takes one
    value head's 16 columns (one SIMD register wide) through all T tokens; for a prompt, as a [Dk, 16] tile
    copied out of the state (8 KiB that stay in L1). Per token, with a = exp(g) and S the tile before it:
        mem = S^T k, read = S^T q, d = beta (v - a mem), o = a read + (k . q) d     (= S_t^T q)
        S <- a S + k d^T
    and the write of token t and the reads of token t + 1 share one pass over the tile's rows."""
    n_k_heads, n, dk = qn.shape
    n_heads, dv = v.shape[0], v.shape[2]
    group = n_heads // n_k_heads
    n_tiles = dv // LANES
    qf, kf, sf, vf, of = qn.reshape(-1), kn.reshape(-1), state.reshape(-1), v.reshape(-1), out.reshape(-1)
    for task in prange(n_heads * n_tiles):
        h = task // n_tiles
        col = (task % n_tiles) * LANES
        hk = h // group
        first = h * dk * dv + col
        if n >= _TILE_FROM_TOKENS:  # a contiguous copy: the state's rows are dv apart, and share L1 sets
            rows, at, step = np.empty(dk * LANES, np.float32), 0, LANES
            for i in range(dk):
                simd.store_f32(rows, i * LANES, simd.load_f32_16(sf, first + i * dv))
        else:
            rows, at, step = sf, first, dv
        k_next = hk * n * dk  # token 0's reads: a pass of their own
        mem = simd.zeros_16()
        read = simd.zeros_16()
        for i in range(dk):
            row = simd.load_f32_16(rows, at + i * step)
            mem = simd.fma(row, simd.splat_at_16(kf, k_next + i), mem)
            read = simd.fma(row, simd.splat_at_16(qf, k_next + i), read)
        for t in range(n):
            decay = simd.splat_16(np.exp(g[h, t]))
            vo = (h * n + t) * dv + col
            delta = simd.fmul(simd.fsub(simd.load_f32_16(vf, vo), simd.fmul(decay, mem)), simd.splat_16(beta[h, t]))
            simd.store_f32(of, vo, simd.fma(simd.splat_16(kq[hk, t]), delta, simd.fmul(decay, read)))
            k_at = (hk * n + t) * dk
            if t + 1 < n:
                k_next = k_at + dk
                mem = simd.zeros_16()
                read = simd.zeros_16()
                for i in range(dk):
                    row = _decay_and_write(rows, at, step, kf, k_at, delta, decay, i)
                    mem = simd.fma(row, simd.splat_at_16(kf, k_next + i), mem)
                    read = simd.fma(row, simd.splat_at_16(qf, k_next + i), read)
            else:
                for i in range(dk):
                    _decay_and_write(rows, at, step, kf, k_at, delta, decay, i)
        if n >= _TILE_FROM_TOKENS:
            for i in range(dk):
                simd.store_f32(sf, first + i * dv, simd.load_f32_16(rows, i * LANES))


def gated_delta_tokens(q, k, v, g, beta, state, out):
    """The recurrence over T tokens (`reference.gated_delta_rule`), float32: q, k [T, Hk, Dk], v [T, Hv, Dv],
    g, beta [T, Hv]; out [T, Hv, Dv] written and state [Hv, Dk, Dv] (C-contiguous float32) updated in place.
    Dv must be a multiple of 16 (Qwen's is 128)."""
    n, n_k_heads, dk = q.shape
    n_heads, dv = v.shape[1:]
    if dv % LANES or n_heads % n_k_heads:
        raise ValueError(f"gated_delta_tokens: the value head dim ({dv}) must be a multiple of {LANES} and the "
                         f"value heads ({n_heads}) a multiple of the key heads ({n_k_heads})")
    if state.dtype != np.float32 or not state.flags.c_contiguous:
        raise ValueError(f"gated_delta_tokens: the state must be a C-contiguous float32 array, got {state.dtype}"
                         f"{'' if state.flags.c_contiguous else ', strided'}")
    qn = np.empty((n_k_heads, n, dk), np.float32)
    kn = np.empty_like(qn)
    kq = np.empty((n_k_heads, n), np.float32)
    normalize_qk(q, k, qn, kn, kq)

    def head_major(x):
        return np.ascontiguousarray(np.swapaxes(x, 0, 1), dtype=np.float32)
    out_heads = np.empty((n_heads, n, dv), np.float32)
    _delta_tiles(qn, kn, kq, head_major(v), head_major(g), head_major(beta), state, out_heads)
    out[...] = np.swapaxes(out_heads, 0, 1)


def decode(q, k, v, g, beta, state, out=None):
    """One token: q, k [Hk, Dk], v [Hv, Dv], g, beta [Hv]; state [Hv, Dk, Dv] float32 updated in place.
    Returns out [Hv, Dv]."""
    if out is None:
        out = np.empty(v.shape, np.float32)
    gated_delta_tokens(q[None], k[None], v[None], g[None], beta[None], state, out[None])
    return out


@njit(parallel=True, cache=True, nogil=True)
def unit_lower_inverse(lower, inv):
    """inv[b] = (I + lower[b])^-1 for strictly lower triangular lower [B, C, C], by forward substitution:
    row i = e_i - sum_{j < i} lower[i, j] row j (rows of the inverse are zero right of their diagonal)."""
    n_batch, c, _ = lower.shape
    for b in prange(n_batch):
        for i in range(c):
            for col in range(c):
                inv[b, i, col] = 0.0
            inv[b, i, i] = 1.0
            for j in range(i):
                f = lower[b, i, j]
                for col in range(j + 1):
                    inv[b, i, col] -= f * inv[b, j, col]


def _chunked_block(q, k, v, g, beta, state, chunk):
    """Whole chunks, chunk-major q, k [N, H, C, Dk], v [N, H, C, Dv], g, beta [N, H, C] (q normalised and
    scaled, k normalised, both repeated to the value heads): HF's torch_chunk_gated_delta_rule in float32.
    Returns out [N, H, C, Dv] and the state after the last chunk."""
    cum = np.cumsum(g, axis=-1)
    causal = np.tril(np.ones((chunk, chunk), dtype=bool))
    decay = np.exp(np.where(causal, cum[..., :, None] - cum[..., None, :], -np.inf)).astype(np.float32)
    k_beta = k * beta[..., None]
    lower = np.tril((k_beta @ k.swapaxes(-1, -2)) * decay, -1)
    inv = np.empty_like(lower)
    unit_lower_inverse(lower.reshape(-1, chunk, chunk), inv.reshape(-1, chunk, chunk))
    u = inv @ (v * beta[..., None])
    w = inv @ (k_beta * np.exp(cum)[..., None])
    attn = (q @ k.swapaxes(-1, -2)) * decay
    q_decayed = q * np.exp(cum)[..., None]
    last = cum[..., -1:]
    k_decayed = np.ascontiguousarray((k * np.exp(last - cum)[..., None]).swapaxes(-1, -2))  # [N, H, Dk, C]
    chunk_decay = np.exp(last)[..., None]  # [N, H, 1, 1]
    out = np.empty(v.shape, np.float32)
    for i in range(q.shape[0]):
        v_new = u[i] - w[i] @ state
        out[i] = q_decayed[i] @ state + attn[i] @ v_new
        state = state * chunk_decay[i] + k_decayed[i] @ v_new
    return out, state


def gated_delta_chunked(q, k, v, g, beta, state, chunk: int = CHUNK_SIZE):
    """The recurrence over T tokens in chunks (`reference.gated_delta_rule_chunked`), float32, shapes as
    `gated_delta_tokens`: returns out [T, Hv, Dv], state updated in place. Slower than the token loop on the CPU
    at head dim 128 (bench/deltanet_cpu.py): kept as the tested float32 form of the algorithm a GPU runs."""
    n, n_k_heads, dk = q.shape
    n_heads, dv = v.shape[1:]
    f32 = np.float32

    def inv_norm(x):
        return f32(1.0) / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + f32(L2_EPS))
    qs = q * inv_norm(q) * (f32(1.0) / np.sqrt(f32(dk)))
    ks = k * inv_norm(k)
    pad = (-n) % chunk
    n_chunks = (n + pad) // chunk

    def chunk_major(x):  # [T, H, ...] -> [N, H, C, ...], zero padded: a padded token writes and reads nothing
        if x.ndim == 3 and x.shape[1] != n_heads:
            x = np.repeat(x, n_heads // n_k_heads, axis=1)
        if pad:
            x = np.concatenate([x, np.zeros((pad,) + x.shape[1:], x.dtype)])
        x = x.astype(f32, copy=False).reshape((n_chunks, chunk) + x.shape[1:])
        return np.ascontiguousarray(np.swapaxes(x, 1, 2))

    qc, kc, vc, gc, bc = (chunk_major(x) for x in (qs, ks, v, g, beta))
    out = np.empty((n_chunks, n_heads, chunk, dv), f32)
    s = np.asarray(state, dtype=f32)
    for b in range(0, n_chunks, _CHUNKS_PER_BLOCK):
        sl = slice(b, b + _CHUNKS_PER_BLOCK)
        out[sl], s = _chunked_block(qc[sl], kc[sl], vc[sl], gc[sl], bc[sl], s, chunk)
    state[...] = s
    return np.swapaxes(out, 1, 2).reshape(n_chunks * chunk, n_heads, dv)[:n].copy()


@njit(cache=True, nogil=True, inline="always")
def _gated_norm_row(x, gate, weight, eps, out, r):
    d = x.shape[1]
    ss = np.float32(0.0)
    for c in range(d):
        ss += x[r, c] * x[r, c]
    inv = np.float32(1.0) / np.sqrt(ss / np.float32(d) + eps)
    for c in range(d):
        out[r, c] = ((x[r, c] * inv) * weight[c]) * gate[r, c]


@njit(parallel=True, cache=True, nogil=True)
def _gated_norm_row_blocks(x, gate, weight, eps, out):
    for r in prange(x.shape[0]):
        _gated_norm_row(x, gate, weight, eps, out, r)


@njit(cache=True, nogil=True)
def _gated_norm(x, gate, weight, eps, out):
    """out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight * gate[r]: a prompt's rows on the threads."""
    if x.shape[0] >= _NORM_ROWS_ON_THREADS:
        _gated_norm_row_blocks(x, gate, weight, eps, out)
    else:
        for r in range(x.shape[0]):
            _gated_norm_row(x, gate, weight, eps, out, r)


def gated_rms_norm_rows(x, z, weight, eps, out):
    """out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight * silu(z[r]), rows [R, D] (`reference.gated_rms_norm`).
    silu(z) in NumPy first: its float32 exp is vectorised, numba's a scalar call per value (three times the
    norm's own time)."""
    gate = np.negative(z)
    np.exp(gate, out=gate)
    gate += np.float32(1.0)
    np.divide(z, gate, out=gate)
    _gated_norm(x, gate, weight, eps, out)
