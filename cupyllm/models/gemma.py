"""Gemma 3 and Gemma 4: sandwich-normed blocks (a norm before and after attention and the MLP), GeGLU, q/k
RMSNorm, sliding-window layers between global ones, embeddings scaled by sqrt(d_model). The query scale rides
on `cfg.attn_scale` (Gemma 3: 1/sqrt(head_dim); Gemma 4: 1, its q and k are RMS-normalised); the GGUF norm
weights already include Gemma 3's +1.

Gemma 3:
    h = x + PostNorm_attn( Attn(PreNorm_attn(x)) )
    y = h + PostNorm_ffn( W_down( GELU_tanh(W_gate PreNorm_ffn(h)) * W_up PreNorm_ffn(h) ) )

Gemma 4 adds, per block (each where the model has it):
    V = RMSNorm(V)  (no weight; global layers may take V = K's projection; the last layers may reuse an
                     earlier layer's cache)
    FFN(h) = PostNorm_1( MLP(PreNorm_ffn(h)) ) + PostNorm_2( MoE(PreNorm_2(h); router(h)) )   (MoE models)
    y = y + PostNorm_ple( W_proj( GELU_tanh(W_gate y) * e_l ) )    (e_l: the per-layer embedding, build.py)
    y = y * layer_output_scale
"""
from __future__ import annotations

import numpy as np

from .layers import gated_mlp, moe_mlp, self_attention
from .residual import ResidualStream


def gemma_block(ops, cfg, w, layer, x: ResidualStream, positions, cache, attention=None, per_layer_input=None):
    """One block on the residual stream x: h, then y (Gemma 4: with its MoE, per-layer input and output scale)."""
    eps = cfg.norm_eps
    x.add(self_attention(ops, cfg, w, layer, x.norm(w.attn_norm), positions, cache, attention),
          post_norm=w.post_attn_norm)
    mlp = gated_mlp(ops, w, x.norm(w.ffn_norm), cfg.activation)
    if w.moe is not None:
        h = x.value
        experts = moe_mlp(ops, cfg, w.moe, ops.rms_norm(h, w.experts_norm, eps),
                          router_input=ops.rms_norm(h, w.router_norm, eps))
        mlp = ops.rms_norm(mlp, w.post_dense_norm, eps) + ops.rms_norm(experts, w.post_experts_norm, eps)
    if per_layer_input is None:
        x.add(mlp, post_norm=w.post_ffn_norm, scale=w.out_scale)
        return
    x.add(mlp, post_norm=w.post_ffn_norm)
    gated = ops.gated_linear(x.value, w.ple_gate, cfg.activation, up=per_layer_input)
    x.add(ops.linear(gated, w.ple_proj), post_norm=w.ple_post_norm, scale=w.out_scale)


def per_layer_inputs(ops, cfg, token_embd_per_layer, model_proj, proj_norm, tokens, x):
    """Gemma 4's per-layer embeddings e [n, stored layers, per_layer_dim]: a token's own per-layer embedding (scaled
    by sqrt(per_layer_dim)) and a projection of its scaled input embedding x (times 1/sqrt(d_model), RMS-normed
    per layer), averaged as (a + b) / sqrt(2)."""
    n, width, n_stored = x.shape[0], cfg.per_layer_dim, cfg.n_stored_layer
    own = ops.embed(token_embd_per_layer, tokens).reshape(n, n_stored, width) * np.float32(np.sqrt(width))
    projected = (ops.linear(x, model_proj) * np.float32(1.0 / np.sqrt(cfg.d_model))).reshape(n, n_stored, width)
    return (ops.rms_norm(projected, proj_norm, cfg.norm_eps) + own) * np.float32(2.0 ** -0.5)
