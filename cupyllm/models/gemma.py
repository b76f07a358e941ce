"""Gemma 3: sandwich-normed blocks (a norm before and after attention and the MLP), GeGLU, q/k RMSNorm,
five sliding-window layers for every global one, embeddings scaled by sqrt(d_model). The query scale
(1/sqrt(head_dim)) rides on `cfg.attn_scale`; the GGUF norm weights already include Gemma's +1.

    h = x + PostNorm_attn( Attn(PreNorm_attn(x)) )
    y = h + PostNorm_ffn( W_down( GELU_tanh(W_gate PreNorm_ffn(h)) * W_up PreNorm_ffn(h) ) )
"""
from __future__ import annotations

from .layers import gated_mlp, self_attention


def gemma_block(ops, cfg, w, layer, x, positions, cache, attention=None):
    attn = self_attention(ops, cfg, w, layer, ops.rms_norm(x, w.attn_norm, cfg.norm_eps), positions, cache, attention)
    h = x + ops.rms_norm(attn, w.post_attn_norm, cfg.norm_eps)
    mlp = gated_mlp(ops, w, ops.rms_norm(h, w.ffn_norm, cfg.norm_eps), cfg.activation)
    return h + ops.rms_norm(mlp, w.post_ffn_norm, cfg.norm_eps)
