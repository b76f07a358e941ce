"""Qwen2 / Qwen2.5 (q/k/v biases), Qwen3 (q/k RMSNorm) and Qwen3-MoE: pre-norm decoder blocks with SwiGLU.

    h = x + Attn(RMSNorm(x))
    y = h + W_down( SiLU(W_gate RMSNorm(h)) * W_up RMSNorm(h) )
    Qwen3-MoE: y = h + sum_{e in top-k(router(n))} p_e * Expert_e(n),  n = RMSNorm(h), p renormalised over the k
"""
from __future__ import annotations

from .layers import gated_mlp, moe_mlp, self_attention
from .residual import ResidualStream


def qwen_block(ops, cfg, w, layer, x: ResidualStream, positions, cache, attention=None):
    """One block on the residual stream x: h, then y."""
    x.add(self_attention(ops, cfg, w, layer, x.norm(w.attn_norm), positions, cache, attention))
    n = x.norm(w.ffn_norm)
    x.add(moe_mlp(ops, cfg, w.moe, n, router_input=n) if w.moe is not None else gated_mlp(ops, w, n, cfg.activation))
