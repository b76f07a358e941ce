"""Qwen2 / Qwen2.5 (q/k/v biases), Qwen3 (q/k RMSNorm) and Qwen3-MoE: pre-norm decoder blocks with SwiGLU.

    h = x + Attn(RMSNorm(x))
    y = h + W_down( SiLU(W_gate RMSNorm(h)) * W_up RMSNorm(h) )
    Qwen3-MoE: y = h + sum_{e in top-k(router(n))} p_e * Expert_e(n),  n = RMSNorm(h), p renormalised over the k
"""
from __future__ import annotations

from .layers import gated_mlp, moe_mlp, self_attention


def qwen_block(ops, cfg, w, layer, x, positions, cache, attention=None):
    attn = self_attention(ops, cfg, w, layer, ops.rms_norm(x, w.attn_norm, cfg.norm_eps), positions, cache, attention)
    h, n = ops.rms_norm_residual(x, attn, w.ffn_norm, cfg.norm_eps)  # h = x + attn, n = RMSNorm(h), one pass
    if w.moe is not None:
        return h + moe_mlp(ops, cfg, w.moe, n, router_input=n)
    return h + gated_mlp(ops, w, n, cfg.activation)
