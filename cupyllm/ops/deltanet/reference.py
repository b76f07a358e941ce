"""The Gated DeltaNet layer core (Qwen3.5, Qwen3.6, Qwen3-Next linear-attention layers), defined in NumPy as HF
transformers' `modeling_qwen3_next.py` / `modeling_qwen3_5.py` compute it (the two files hold the same functions).
Every function computes in float64 and returns float64: this is the definition, the kernels are checked against it.

One sequence, token-major:
    q, k [T, Hk, Dk]   v [T, Hv, Dv]   g, beta [T, Hv]   recurrent state S [Hv, Dk, Dv]   output o [T, Hv, Dv]
    conv input x [T, C] (C = 2 Hk Dk + Hv Dv: q, k, v side by side)   conv weight [C, K]   conv state [K - 1, C]

The recurrence (Yang et al., Gated Delta Networks), per value head, in HF's layout: S is [Dk, Dv], the paper's
S transposed. With q and k L2-normalised and q scaled by 1 / sqrt(Dk):
    S'  = exp(g_t) S_{t-1}                      (g_t <= 0: the log of the decay)
    d_t = beta_t (v_t - S'^T k_t)               (the delta: what the decayed memory mispredicts for k_t)
    S_t = S' + k_t d_t^T
    o_t = S_t^T q_t
i.e. the paper's M = S^T: M_t = M_{t-1} exp(g_t) (I - beta_t k_t k_t^T) + beta_t v_t k_t^T, o_t = M_t q_t.

Value head h reads query/key head h // (Hv / Hk) (torch `repeat_interleave` on the head axis). llama.cpp's ggml
op stores each head's state transposed ([Hv, Dv, Dk] in C order, as its CPU kernel indexes it): a state handed
between the two transposes its last two axes.

The layer around it (HF `Qwen3NextGatedDeltaNet.forward`): x = in_proj(h) -> causal_conv1d_silu over the q|k|v
channels -> split into q, k, v heads -> g, beta = decay_and_beta(a, b, A_log, dt_bias) -> gated_delta_rule with the
q / k L2 norm -> gated_rms_norm(o, z, weight) -> out_proj.
"""
from __future__ import annotations

import numpy as np

L2_EPS = 1e-6  # HF / flash-linear-attention's l2norm eps, inside the square root
CHUNK_SIZE = 64  # HF's torch_chunk_gated_delta_rule and flash-linear-attention's chunk length


def silu(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x / (1.0 + np.exp(-x))


def softplus(x: np.ndarray) -> np.ndarray:
    """log(1 + exp(x)), written so that large x does not overflow (torch's threshold 20 gives the same values)."""
    x = np.asarray(x, dtype=np.float64)
    return np.logaddexp(0.0, x)


def causal_conv1d_silu(x: np.ndarray, weight: np.ndarray,
                       conv_state: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """silu of the causal depthwise convolution of x [T, C] with weight [C, K], no bias (Qwen's conv1d has none):
        y[t, c] = silu(sum_j weight[c, j] * xx[t + j, c]),  xx = conv_state followed by x,
    conv_state [K - 1, C] holding the K - 1 inputs before x, oldest first (None: zeros, a sequence's start).
    Returns (y [T, C], the new conv state [K - 1, C]: the last K - 1 rows of xx).

    One token (T = 1) is HF's `causal_conv1d_update`, whose state keeps K columns of which the oldest is never
    read (ours = its state[:, 1:].T); a prompt from an empty state is `causal_conv1d_fn` (left zero padding)."""
    x = np.asarray(x, dtype=np.float64)
    weight = np.asarray(weight, dtype=np.float64)
    n, channels = x.shape
    width = weight.shape[1]
    if conv_state is None:
        conv_state = np.zeros((width - 1, channels))
    xx = np.concatenate([np.asarray(conv_state, dtype=np.float64), x], axis=0)
    y = np.zeros((n, channels))
    for j in range(width):
        y += weight[None, :, j] * xx[j:j + n]
    return silu(y), xx[n:].copy()


def l2_normalize(x: np.ndarray, eps: float = L2_EPS) -> np.ndarray:
    """x / sqrt(sum(x^2) + eps) over the last axis (HF `l2norm`; llama.cpp's ggml_l2_norm divides by
    max(|x|, eps) instead, the same values for any |x| far from sqrt(eps))."""
    x = np.asarray(x, dtype=np.float64)
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def repeat_heads(x: np.ndarray, n_heads: int) -> np.ndarray:
    """[T, Hk, D] -> [T, n_heads, D]: head h is input head h // (n_heads / Hk) (torch repeat_interleave)."""
    n_in = x.shape[1]
    if n_heads % n_in:
        raise ValueError(f"{n_heads} value heads are not a multiple of {n_in} key heads")
    return np.repeat(x, n_heads // n_in, axis=1)


def decay_and_beta(a: np.ndarray, b: np.ndarray, a_log: np.ndarray,
                   dt_bias: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The per-token, per-value-head gates from the projections a, b [T, Hv] and the layer's A_log, dt_bias [Hv]:
    g = -exp(A_log) * softplus(a + dt_bias) (the log decay, <= 0), beta = sigmoid(b) (the write strength)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    g = -np.exp(np.asarray(a_log, dtype=np.float64)) * softplus(a + np.asarray(dt_bias, dtype=np.float64))
    return g, 1.0 / (1.0 + np.exp(-b))


def _prepared(q, k, v, g, beta, l2norm_qk: bool):
    """float64 q (normalised, scaled by 1 / sqrt(Dk)) and k (normalised), both repeated to the value heads."""
    q, k, v, g, beta = (np.asarray(a, dtype=np.float64) for a in (q, k, v, g, beta))
    if l2norm_qk:
        q, k = l2_normalize(q), l2_normalize(k)
    q = q / np.sqrt(q.shape[-1])
    n_v_heads = v.shape[1]
    return repeat_heads(q, n_v_heads), repeat_heads(k, n_v_heads), v, g, beta


def _initial(state, n_v_heads: int, dk: int, dv: int) -> np.ndarray:
    if state is None:
        return np.zeros((n_v_heads, dk, dv))
    return np.array(state, dtype=np.float64)  # a copy: the caller's state is not updated in place


def gated_delta_rule(q, k, v, g, beta, initial_state=None, l2norm_qk: bool = True):
    """The recurrence, token by token (HF `torch_recurrent_gated_delta_rule` with use_qk_l2norm_in_kernel):
    the definition. Returns (o [T, Hv, Dv], the final state [Hv, Dk, Dv])."""
    q, k, v, g, beta = _prepared(q, k, v, g, beta, l2norm_qk)
    n, n_heads, dv = v.shape
    state = _initial(initial_state, n_heads, k.shape[-1], dv)
    out = np.zeros((n, n_heads, dv))
    for t in range(n):
        state *= np.exp(g[t])[:, None, None]
        predicted = np.einsum("hkv,hk->hv", state, k[t])
        delta = beta[t][:, None] * (v[t] - predicted)
        state += k[t][:, :, None] * delta[:, None, :]
        out[t] = np.einsum("hkv,hk->hv", state, q[t])
    return out, state


def _solve_unit_lower(lower: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """X with (I + lower) X = rhs, lower [..., C, C] strictly lower triangular, by forward substitution."""
    x = np.array(rhs, dtype=np.float64)
    for i in range(1, lower.shape[-1]):
        x[..., i, :] -= np.einsum("...j,...jd->...d", lower[..., i, :i], x[..., :i, :])
    return x


def gated_delta_rule_chunked(q, k, v, g, beta, initial_state=None, l2norm_qk: bool = True,
                             chunk_size: int = CHUNK_SIZE):
    """The same outputs as `gated_delta_rule`, chunk by chunk (HF `torch_chunk_gated_delta_rule`, the
    flash-linear-attention algorithm): within a chunk of C tokens the C rank-one updates are condensed by the UT
    transform (the WY representation of the product of the (I - beta k k^T)) into matrix products, and only the
    state passes from chunk to chunk. In a chunk, with G_i = g_1 + ... + g_i (cumulative log decay) and
    D_ij = exp(G_i - G_j) for j <= i:
        L  = strictly lower part of (beta_i k_i . k_j D_ij)        (the UT system, unit lower triangular I + L)
        U  = (I + L)^-1 (beta v)          W = (I + L)^-1 (beta k exp(G))
        V' = U - W S                      (the chunk's deltas, with the state at the chunk's start)
        o  = (q exp(G)) S + ((q k^T) * D, lower with diagonal) V'
        S <- exp(G_C) S + (k exp(G_C - G))^T V'
    A last chunk shorter than C is what HF's zero padding computes. Returns (o [T, Hv, Dv], state)."""
    q, k, v, g, beta = _prepared(q, k, v, g, beta, l2norm_qk)
    n, n_heads, dv = v.shape
    dk = k.shape[-1]
    state = _initial(initial_state, n_heads, dk, dv)
    out = np.zeros((n, n_heads, dv))
    for start in range(0, n, chunk_size):
        sl = slice(start, min(start + chunk_size, n))
        # head-major within the chunk: [H, C, D]
        qc, kc, vc = (a[sl].transpose(1, 0, 2) for a in (q, k, v))
        gc, bc = g[sl].T, beta[sl].T
        cum = np.cumsum(gc, axis=1)  # [H, C]
        c = cum.shape[1]
        causal = np.tril(np.ones((c, c), dtype=bool))
        decay = np.where(causal, np.exp(np.where(causal, cum[:, :, None] - cum[:, None, :], 0.0)), 0.0)
        k_beta = kc * bc[:, :, None]
        lower = np.tril(k_beta @ kc.transpose(0, 2, 1) * decay, -1)
        u = _solve_unit_lower(lower, vc * bc[:, :, None])
        w = _solve_unit_lower(lower, k_beta * np.exp(cum)[:, :, None])
        v_new = u - w @ state
        attn = (qc @ kc.transpose(0, 2, 1)) * decay
        out[sl] = ((qc * np.exp(cum)[:, :, None]) @ state + attn @ v_new).transpose(1, 0, 2)
        last = cum[:, -1:]
        state = (state * np.exp(last)[:, :, None]
                 + (kc * np.exp(last - cum)[:, :, None]).transpose(0, 2, 1) @ v_new)
    return out, state


def gated_rms_norm(x: np.ndarray, z: np.ndarray, weight: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """RMSNorm of x over its last axis (the value head dim), times weight, times silu(z): HF
    `Qwen3NextRMSNormGated` (norm before the gate; the plain weight, not Qwen3.5's 1 + weight of its other norms)."""
    x = np.asarray(x, dtype=np.float64)
    normed = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return normed * np.asarray(weight, dtype=np.float64) * silu(z)
