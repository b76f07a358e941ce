"""Blocks shared by every architecture: weights of one layer, self-attention over the cache, gated MLP."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..config import ModelConfig
from ..gguf_io import GGUFFile
from ..kv.cache import KVCache
from ..weights import Weight, load_matrix, load_vector


@dataclass(frozen=True)
class LayerWeights:
    attn_norm: np.ndarray
    wq: Weight
    wk: Weight
    wv: Weight
    wo: Weight
    ffn_norm: np.ndarray
    w_gate: Weight
    w_up: Weight
    w_down: Weight
    bq: np.ndarray | None = None  # Qwen2 q/k/v biases
    bk: np.ndarray | None = None
    bv: np.ndarray | None = None
    q_norm: np.ndarray | None = None  # Qwen3 / Gemma 3 per-head RMSNorm of q and k
    k_norm: np.ndarray | None = None
    post_attn_norm: np.ndarray | None = None  # Gemma sandwich norms
    post_ffn_norm: np.ndarray | None = None

    @classmethod
    def from_gguf(cls, gguf: GGUFFile, layer: int) -> "LayerWeights":
        p = f"blk.{layer}."
        vec = lambda name: load_vector(gguf, p + name, optional=True)  # noqa: E731
        return cls(
            attn_norm=load_vector(gguf, p + "attn_norm.weight"),
            wq=load_matrix(gguf, p + "attn_q.weight"), wk=load_matrix(gguf, p + "attn_k.weight"),
            wv=load_matrix(gguf, p + "attn_v.weight"), wo=load_matrix(gguf, p + "attn_output.weight"),
            ffn_norm=load_vector(gguf, p + "ffn_norm.weight"),
            w_gate=load_matrix(gguf, p + "ffn_gate.weight"), w_up=load_matrix(gguf, p + "ffn_up.weight"),
            w_down=load_matrix(gguf, p + "ffn_down.weight"),
            bq=vec("attn_q.bias"), bk=vec("attn_k.bias"), bv=vec("attn_v.bias"),
            q_norm=vec("attn_q_norm.weight"), k_norm=vec("attn_k_norm.weight"),
            post_attn_norm=vec("post_attention_norm.weight"), post_ffn_norm=vec("post_ffw_norm.weight"),
        )

    def on(self, backend) -> "LayerWeights":
        """The same weights on `backend`'s device."""
        move = lambda w: None if w is None else (backend.upload(w) if isinstance(w, Weight) else backend.asarray(w))  # noqa: E731
        return LayerWeights(**{name: move(getattr(self, name)) for name in self.__dataclass_fields__})


def self_attention(ops, cfg: ModelConfig, w: LayerWeights, layer: int, x, positions: np.ndarray,
                   cache: KVCache, attention=None):
    """Project to q/k/v, normalise and rotate them, append k/v to the cache, attend, project out."""
    n = x.shape[0]
    q, k, v = ops.linear_many(x, (w.wq, w.wk, w.wv), (w.bq, w.bk, w.bv))
    q = q.reshape(n, cfg.n_head, cfg.head_dim)
    k = k.reshape(n, cfg.n_kv_head, cfg.head_dim)
    v = v.reshape(n, cfg.n_kv_head, cfg.v_head_dim)
    if w.q_norm is not None:
        q = ops.rms_norm(q, w.q_norm, cfg.norm_eps)
        k = ops.rms_norm(k, w.k_norm, cfg.norm_eps)
    attention = attention or default_attention
    out = attention(ops, cfg, layer, q, k, v, positions, cache)
    return ops.linear(out.reshape(n, cfg.n_head * cfg.v_head_dim), w.wo)


def default_attention(ops, cfg: ModelConfig, layer: int, q, k, v, positions: np.ndarray, cache: KVCache):
    """RoPE at the true positions, write k/v into the cache, then causal (or sliding-window) attention."""
    rope = cfg.rope_for(layer)
    q = ops.rope(q, rope, positions)
    k = ops.rope(k, rope, positions)
    layer_kv = cache.layers[layer]
    layer_kv.write(k, v, positions, queries=q)
    window = cfg.sliding_window if cfg.is_sliding(layer) else 0
    return ops.attention(q, positions, layer_kv, scale=cfg.attn_scale, window=window, softcap=cfg.attn_logit_softcap)


def dca_attention(dca):
    """Attention with Dual Chunk Attention on global layers (sliding-window layers keep plain attention):
    K is roped and cached at its in-chunk position, Q roped three times (intra, successive, inter)."""
    from ..attention.dca import key_positions, query_positions

    def attention(ops, cfg: ModelConfig, layer: int, q, k, v, positions: np.ndarray, cache: KVCache):
        if cfg.is_sliding(layer):
            return default_attention(ops, cfg, layer, q, k, v, positions, cache)
        rope = cfg.rope_for(layer)
        layer_kv = cache.layers[layer]
        q_intra, q_successive, q_inter = (ops.rope(q, rope, p) for p in query_positions(positions, dca))
        layer_kv.write(ops.rope(k, rope, key_positions(positions, dca)), v, positions, queries=q_intra)
        return ops.dca_attention(q_intra, q_successive, q_inter, positions, layer_kv, dca, scale=cfg.attn_scale,
                                 softcap=cfg.attn_logit_softcap)

    return attention


def gated_mlp(ops, w: LayerWeights, x, activation: str):
    """down( act(gate(x)) * up(x) ): SwiGLU for Qwen, GeGLU (tanh GELU) for Gemma."""
    gate, up = ops.linear_many(x, (w.w_gate, w.w_up))
    act = ops.silu(gate) if activation == "silu" else ops.gelu_tanh(gate)
    return ops.linear(act * up, w.w_down)
