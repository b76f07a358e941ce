"""The Gated DeltaNet layer core on the CPU, float32 (the state too, as HF keeps it): numba kernels for the causal
conv, the recurrence over a prompt or one token (`gated_delta_tokens`, `decode`) and the gated RMSNorm; and the
chunked form (`gated_delta_chunked`: NumPy BLAS products around a numba triangular inverse). `reference.py` is
the definition (float64); shapes and the state layout [Hv, Dk, Dv] are its.

A prompt runs through the token loop, value heads in parallel: at head dim 128 it is several times faster here
than the chunked form (bench/deltanet_cpu.py, docs/deltanet.md). Per token it passes over each head's state
(Dk x Dv floats, 64 KiB, cache-resident) twice, about 3 Dk Dv multiply-adds; the chunked form does more
arithmetic (its [64, 64] products and triangular solves on top of the same state products) in many small batched
products, which NumPy's stacked matmul does not run at BLAS speed.

No fastmath: the sums keep their order (the inner loops are axpys along the contiguous value axis, which vectorise
without reassociation), so a prompt run token by token gives the values of one run over the whole prompt.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .reference import CHUNK_SIZE, L2_EPS

_CHUNKS_PER_BLOCK = 16  # chunks whose [C, C] products are held at once: bounds a long prompt's scratch memory


@njit(cache=True, nogil=True)
def conv1d_silu_rows(x, weight, conv_state, out):
    """out[t, c] = silu(sum_j weight[c, j] * xx[t + j, c]), xx = conv_state [K - 1, C] followed by x [T, C];
    conv_state becomes the last K - 1 rows of xx (in place). `reference.causal_conv1d_silu`. The channel loop is
    innermost (contiguous rows, vectorised), the taps in order j = 0 .. K - 1."""
    n, channels = x.shape
    width = weight.shape[1]
    hist = width - 1
    taps = np.ascontiguousarray(weight.T)  # [K, C]
    for t in range(n):
        row = out[t]
        row[:] = 0.0
        for j in range(width):
            src = t + j
            xs = conv_state[src] if src < hist else x[src - hist]
            w = taps[j]
            for c in range(channels):
                row[c] += w[c] * xs[c]
        for c in range(channels):
            row[c] = row[c] / (np.float32(1.0) + np.exp(-row[c]))
    if n >= hist:
        conv_state[:] = x[n - hist:]
    else:
        for r in range(hist - n):
            conv_state[r] = conv_state[r + n]
        conv_state[hist - n:] = x


@njit(inline="always")
def _normalized(src, dst, scale):
    """dst = src / sqrt(sum(src^2) + eps) * scale (HF l2norm, then the query's 1 / sqrt(Dk))."""
    ss = np.float32(0.0)
    for i in range(src.shape[0]):
        ss += src[i] * src[i]
    inv = np.float32(1.0) / np.sqrt(ss + np.float32(L2_EPS))
    for i in range(src.shape[0]):
        dst[i] = (src[i] * inv) * scale


@njit(inline="always")
def _step(q, k, v, g, beta, state, out, qn, kn, mem, read):
    """One token of one value head (`reference.gated_delta_rule`), in two passes over the state instead of the
    definition's three (decay, write, read): with S the state before the token and a = exp(g),
        mem = S^T k, read = S^T q                      (one pass, reading S)
        d   = beta (v - a mem),  o = a read + (k . q) d   (= S_t^T q, S_t = a S + k d^T)
        S  <- a S + k d^T                              (one pass, reading and writing S)
    The same values as the definition up to float32 rounding (the tests hold both to it)."""
    dk, dv = state.shape
    _normalized(q, qn, np.float32(1.0) / np.sqrt(np.float32(dk)))
    _normalized(k, kn, np.float32(1.0))
    decay = np.exp(g)
    kq = np.float32(0.0)
    for i in range(dk):
        kq += kn[i] * qn[i]
    mem[:] = 0.0
    read[:] = 0.0
    for i in range(dk):
        ki = kn[i]
        qi = qn[i]
        for j in range(dv):
            s = state[i, j]
            mem[j] += s * ki
            read[j] += s * qi
    for j in range(dv):
        delta = (v[j] - decay * mem[j]) * beta
        mem[j] = delta
        out[j] = decay * read[j] + kq * delta
    for i in range(dk):
        ki = kn[i]
        for j in range(dv):
            state[i, j] = state[i, j] * decay + ki * mem[j]


@njit(parallel=True, cache=True, nogil=True)
def gated_delta_tokens(q, k, v, g, beta, state, out):
    """The recurrence over T tokens, q, k [T, Hk, Dk], v [T, Hv, Dv], g, beta [T, Hv]: out [T, Hv, Dv] written,
    state [Hv, Dk, Dv] updated in place. Value heads in parallel, each running its tokens in order."""
    n, n_k_heads, dk = q.shape
    n_heads, dv = v.shape[1], v.shape[2]
    group = n_heads // n_k_heads
    for h in prange(n_heads):
        qn = np.empty(dk, np.float32)
        kn = np.empty(dk, np.float32)
        mem = np.empty(dv, np.float32)
        read = np.empty(dv, np.float32)
        hk = h // group
        for t in range(n):
            _step(q[t, hk], k[t, hk], v[t, h], g[t, h], beta[t, h], state[h], out[t, h], qn, kn, mem, read)


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


@njit(cache=True, nogil=True)
def gated_rms_norm_rows(x, z, weight, eps, out):
    """out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight * silu(z[r]), rows [R, D] (`reference.gated_rms_norm`)."""
    n, d = x.shape
    for r in range(n):
        ss = np.float32(0.0)
        for c in range(d):
            ss += x[r, c] * x[r, c]
        inv = np.float32(1.0) / np.sqrt(ss / np.float32(d) + eps)
        for c in range(d):
            gate = z[r, c] / (np.float32(1.0) + np.exp(-z[r, c]))
            out[r, c] = ((x[r, c] * inv) * weight[c]) * gate
