"""Qwen2 / Qwen2.5 (q/k/v biases), Qwen3 (q/k RMSNorm) and Qwen3-MoE: pre-norm decoder blocks with SwiGLU.

    h = x + Attn(RMSNorm(x))
    y = h + W_down( SiLU(W_gate RMSNorm(h)) * W_up RMSNorm(h) )
    Qwen3-MoE: y = h + sum_{e in top-k(router(n))} p_e * Expert_e(n),  n = RMSNorm(h), p renormalised over the k
"""
from __future__ import annotations

from .layers import gated_mlp, moe_mlp, self_attention


def qwen_block(ops, cfg, w, layer, x, positions, cache, attention=None, x_normed=None, next_norm=None):
    """(y, RMSNorm(y) with `next_norm`'s weight, or None without it). `x_normed`: RMSNorm(x) with this block's
    attn_norm, when the previous block made it (the add that ends a block and the norm that starts the next are
    one pass: one launch on the GPU)."""
    normed = x_normed if x_normed is not None else ops.rms_norm(x, w.attn_norm, cfg.norm_eps)
    attn = self_attention(ops, cfg, w, layer, normed, positions, cache, attention)
    h, n = ops.rms_norm_residual(x, attn, w.ffn_norm, cfg.norm_eps)  # h = x + attn, n = RMSNorm(h), one pass
    mlp = moe_mlp(ops, cfg, w.moe, n, router_input=n) if w.moe is not None else gated_mlp(ops, w, n, cfg.activation)
    if next_norm is None:
        return h + mlp, None
    return ops.rms_norm_residual(h, mlp, next_norm, cfg.norm_eps)  # y = h + mlp and the next block's input
