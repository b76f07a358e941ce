"""Qwen2 / Qwen2.5 (q/k/v biases) and Qwen3 (q/k RMSNorm): pre-norm decoder blocks with SwiGLU.

    h = x + Attn(RMSNorm(x))
    y = h + W_down( SiLU(W_gate RMSNorm(h)) * W_up RMSNorm(h) )
"""
from __future__ import annotations

from .layers import gated_mlp, self_attention


def qwen_block(ops, cfg, w, layer, x, positions, cache, attention=None):
    h = x + self_attention(ops, cfg, w, layer, ops.rms_norm(x, w.attn_norm, cfg.norm_eps), positions, cache, attention)
    return h + gated_mlp(ops, w, ops.rms_norm(h, w.ffn_norm, cfg.norm_eps), cfg.activation)
