"""Blocks shared by every architecture: weights of one layer, self-attention over the cache, gated MLP."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..files.config import ModelConfig
from ..files.gguf import GGUFFile
from ..kv.cache import KVCache
from .weights import Weight, load_matrix, load_vector


@dataclass(frozen=True)
class LayerWeights:
    attn_norm: np.ndarray
    wq: Weight
    wk: Weight | None  # None: the layer reads an earlier layer's cache (Gemma 4 KV sharing)
    wv: Weight | None  # None: V is K's projection (Gemma 4 global layers), or KV shared
    wo: Weight
    ffn_norm: np.ndarray
    w_gate: Weight | None  # None: the layer's MLP is only its experts (Qwen3-MoE)
    w_up: Weight | None
    w_down: Weight | None
    bq: np.ndarray | None = None  # Qwen2 q/k/v biases
    bk: np.ndarray | None = None
    bv: np.ndarray | None = None
    q_norm: np.ndarray | None = None  # Qwen3 / Gemma 3 per-head RMSNorm of q and k
    k_norm: np.ndarray | None = None
    post_attn_norm: np.ndarray | None = None  # Gemma sandwich norms
    post_ffn_norm: np.ndarray | None = None
    v_norm: np.ndarray | None = None  # Gemma 4: V's RMSNorm has no weight; ones, so every backend runs one op
    out_scale: np.ndarray | None = None  # Gemma 4 `layer_output_scale`: scales the block's whole output
    ple_gate: Weight | None = None  # Gemma 4 per-layer embedding: gate [per_layer_dim, d], projection back,
    ple_proj: Weight | None = None  # and the norm after it
    ple_post_norm: np.ndarray | None = None
    moe: "MoEWeights | None" = None
    # Gemma 4's experts beside its dense MLP: the router's own RMSNorm (weight: router scale / sqrt(d)), the
    # experts' input norm, and the two output norms before they are added
    router_norm: np.ndarray | None = None
    experts_norm: np.ndarray | None = None
    post_dense_norm: np.ndarray | None = None
    post_experts_norm: np.ndarray | None = None
    deltanet: WeightGroup | None = None  # Qwen3.5's linear-attention layers: models/qwen35.py DeltaNetWeights
    shared_expert_gate: Weight | None = None  # Qwen3.5-MoE: [1, d], the shared expert's (w_gate/up/down) gate

    @classmethod
    def from_gguf(cls, gguf: GGUFFile, layer: int, cfg: ModelConfig | None = None) -> "LayerWeights":
        p = f"blk.{layer}."
        vec = lambda name: load_vector(gguf, p + name, optional=True)  # noqa: E731
        has_kv = cfg is None or cfg.kv_source(layer) == layer  # a KV-shared layer never writes the cache
        v_may_be_k = cfg is not None and cfg.arch == "gemma4"  # no attn_v: V is K's projection
        optional = lambda name: load_matrix(gguf, p + name) if p + name in gguf.tensors else None  # noqa: E731
        wv = optional("attn_v.weight") if v_may_be_k else load_matrix(gguf, p + "attn_v.weight")
        moe = MoEWeights.from_gguf(gguf, layer) if p + "ffn_gate_inp.weight" in gguf.tensors else None
        dense = optional if moe is not None else (lambda name: load_matrix(gguf, p + name))
        router_scale = vec("ffn_gate_inp.scale")
        return cls(
            attn_norm=load_vector(gguf, p + "attn_norm.weight"),
            wq=load_matrix(gguf, p + "attn_q.weight"),
            wk=load_matrix(gguf, p + "attn_k.weight") if has_kv else None,
            wv=wv if has_kv else None,
            wo=load_matrix(gguf, p + "attn_output.weight"),
            ffn_norm=load_vector(gguf, p + "ffn_norm.weight"),
            w_gate=dense("ffn_gate.weight"), w_up=dense("ffn_up.weight"), w_down=dense("ffn_down.weight"),
            bq=vec("attn_q.bias"), bk=vec("attn_k.bias"), bv=vec("attn_v.bias"),
            q_norm=vec("attn_q_norm.weight"), k_norm=vec("attn_k_norm.weight"),
            post_attn_norm=vec("post_attention_norm.weight"), post_ffn_norm=vec("post_ffw_norm.weight"),
            v_norm=np.ones(cfg.v_head_dim_of(layer), np.float32) if cfg is not None and cfg.v_norm else None,
            out_scale=vec("layer_output_scale.weight"),
            ple_gate=optional("inp_gate.weight"), ple_proj=optional("proj.weight"),
            ple_post_norm=vec("post_norm.weight"),
            moe=moe,
            router_norm=None if router_scale is None else (router_scale / np.float32(np.sqrt(cfg.d_model))),
            experts_norm=vec("pre_ffw_norm_2.weight"), post_dense_norm=vec("post_ffw_norm_1.weight"),
            post_experts_norm=vec("post_ffw_norm_2.weight"),
        )

    def on(self, backend) -> "LayerWeights":
        """The same weights on `backend`'s device."""
        return type(self)(**{name: _move(getattr(self, name), backend) for name in self.__dataclass_fields__})


def _move(w, backend):
    if w is None:
        return None
    if isinstance(w, Weight):
        return backend.upload(w)
    if isinstance(w, WeightGroup):
        return w.on(backend)
    return backend.asarray(w)


def self_attention(ops, cfg: ModelConfig, w: LayerWeights, layer: int, x, positions: np.ndarray,
                   cache: KVCache, attention=None):
    """Project to q/k/v, normalise and rotate them, append k/v to the cache, attend, project out. A KV-shared
    layer (w.wk is None) projects q only and attends over the cache its source layer wrote."""
    n = x.shape[0]
    head_dim, v_head_dim, n_kv = cfg.head_dim_of(layer), cfg.v_head_dim_of(layer), cfg.n_kv_head_of(layer)
    projections = [p for p in (w.wq, w.wk, w.wv) if p is not None]
    q, *kv = ops.linear_many(x, projections, (w.bq, w.bk, w.bv)[:len(projections)])
    q = q.reshape(n, cfg.n_head, head_dim)
    k = v = None
    if kv:
        k = kv[0].reshape(n, n_kv, head_dim)
        v = kv[1].reshape(n, n_kv, v_head_dim) if len(kv) > 1 else k  # Gemma 4 global layers: V is K's projection
    if w.v_norm is not None and v is not None:
        v = ops.rms_norm(v, w.v_norm, cfg.norm_eps)
    attention = attention or default_attention
    out = attention(ops, cfg, w, layer, q, k, v, positions, cache)
    return ops.linear(out.reshape(n, cfg.n_head * v_head_dim), w.wo)


def rotate(ops, cfg: ModelConfig, w: LayerWeights, layer: int, q, k, q_positions, k_positions=None):
    """RoPE(RMSNorm(q)), RoPE(RMSNorm(k)) with the layer's per-head q / k norms (Qwen3, Gemma; none: RoPE
    alone); k None: q alone. One pass on the GPU."""
    return ops.rope_qk(q, k, cfg.rope_for(layer), q_positions, k_positions, w.q_norm,
                       w.k_norm if k is not None else None, cfg.norm_eps)


def default_attention(ops, cfg: ModelConfig, w: LayerWeights, layer: int, q, k, v, positions: np.ndarray,
                      cache: KVCache):
    """Norm and RoPE q and k at the true positions, write k/v into the cache (k None: a KV-shared layer, whose
    source layer has written them), then causal (or sliding-window) attention."""
    q, k = rotate(ops, cfg, w, layer, q, k, positions)
    return attend_rotated(ops, cfg, layer, q, k, v, positions, cache)


def attend_rotated(ops, cfg: ModelConfig, layer: int, q, k, v, positions: np.ndarray, cache: KVCache):
    """default_attention after its RoPE: write k/v (already normed and roped; k None: a KV-shared layer) into the
    cache, then causal (or sliding-window) attention of q."""
    layer_kv = cache.layers[layer]
    if k is not None:
        layer_kv.write(k, v, positions, queries=q)
    window = cfg.sliding_window if cfg.is_sliding(layer) else 0
    return ops.attention(q, positions, layer_kv, scale=cfg.attn_scale, window=window, softcap=cfg.attn_logit_softcap)


def dca_attention(dca):
    """Attention with Dual Chunk Attention on global layers (sliding-window layers keep plain attention):
    K is roped and cached at its in-chunk position, Q roped three times (intra, successive, inter)."""
    from ..ops.attention.dca import key_positions, query_positions

    def attention(ops, cfg: ModelConfig, w: LayerWeights, layer: int, q, k, v, positions: np.ndarray,
                  cache: KVCache):
        if cfg.is_sliding(layer):
            return default_attention(ops, cfg, w, layer, q, k, v, positions, cache)
        layer_kv = cache.layers[layer]
        intra, successive, inter = query_positions(positions, dca)
        keys = key_positions(positions, dca) if k is not None else None  # None: a KV-shared layer
        q_intra, k = rotate(ops, cfg, w, layer, q, k, intra, keys)
        (q_successive, _), (q_inter, _) = (rotate(ops, cfg, w, layer, q, None, p) for p in (successive, inter))
        if k is not None:
            layer_kv.write(k, v, positions, queries=q_intra)
        return ops.dca_attention(q_intra, q_successive, q_inter, positions, layer_kv, dca, scale=cfg.attn_scale,
                                 softcap=cfg.attn_logit_softcap)

    attention.dca = dca  # (what a reader of the cache needs: the Gemma 4 assistant's queries)
    return attention


def gated_mlp(ops, w: LayerWeights, x, activation: str):
    """down( act(gate(x)) * up(x) ): SwiGLU for Qwen, GeGLU (tanh GELU) for Gemma."""
    return ops.linear(ops.gated_linear(x, w.w_gate, activation, w_up=w.w_up), w.w_down)


class WeightGroup:
    """Several weights a block uses together (a mixture of experts, a DeltaNet layer): moved to a backend as one."""

    def on(self, backend) -> "WeightGroup":
        raise NotImplementedError


@dataclass(frozen=True)
class MoEWeights(WeightGroup):
    """A mixture of experts: a router [n_expert, d] and per expert a gated MLP, its gate and up either fused
    (`gate_up` [2 * ffn, d], Gemma 4) or apart (`gate`, `up` [ffn, d], Qwen3-MoE), `down` [d, ffn], and a
    per-expert output scale (Gemma 4; ones elsewhere)."""

    router: Weight
    down: list[Weight]
    expert_scale: np.ndarray  # [n_expert], on the host: routing is decided there
    gate_up: list[Weight] | None = None
    gate: list[Weight] | None = None
    up: list[Weight] | None = None

    @classmethod
    def from_gguf(cls, gguf: GGUFFile, layer: int) -> "MoEWeights":
        p = f"blk.{layer}."
        router = load_matrix(gguf, p + "ffn_gate_inp.weight")
        expert_scale = load_vector(gguf, p + "ffn_down_exps.scale", optional=True)
        fused = p + "ffn_gate_up_exps.weight" in gguf.tensors
        return cls(
            router=router, down=expert_matrices(gguf, p + "ffn_down_exps.weight"),
            expert_scale=expert_scale if expert_scale is not None else np.ones(router.shape[0], np.float32),
            gate_up=expert_matrices(gguf, p + "ffn_gate_up_exps.weight") if fused else None,
            gate=None if fused else expert_matrices(gguf, p + "ffn_gate_exps.weight"),
            up=None if fused else expert_matrices(gguf, p + "ffn_up_exps.weight"),
        )

    def on(self, backend) -> "MoEWeights":
        moved = {name: None if value is None else [backend.upload(w) for w in value]
                 for name, value in self.__dict__.items() if isinstance(value, list) or value is None}
        return MoEWeights(router=backend.upload(self.router), expert_scale=self.expert_scale, **moved)


def moe_mlp(ops, cfg: ModelConfig, moe: MoEWeights, x, router_input):
    """sum over the top-k experts e of weight_e * scale_e * down_e( act(gate_e(x)) * up_e(x) ); weights: the
    softmax of the router logits (of `router_input`) over all experts, kept for the top k and renormalised to
    sum 1 (as llama.cpp does for both architectures). The routing is decided on the host (NumPy), so each
    expert multiplies only the tokens routed to it."""
    logits = ops.to_numpy(ops.linear(router_input, moe.router)).astype(np.float32)
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    top = np.argsort(-probs, axis=-1, kind="stable")[:, :cfg.n_expert_used]
    weights = np.take_along_axis(probs, top, axis=-1)
    weights = weights / weights.sum(axis=-1, keepdims=True) * moe.expert_scale[top]
    if x.shape[0] == 1:  # decode: the chosen experts' products in one op each, not expert by expert
        return _experts_of_one_token(ops, cfg, moe, x, top[0], weights[0])
    return _experts_of_tokens(ops, cfg, moe, x, top, weights)


def _experts_of_tokens(ops, cfg: ModelConfig, moe: MoEWeights, x, top: np.ndarray, weights: np.ndarray):
    """moe_mlp's sum for several tokens x [T, d]: the (token, expert) pairs sorted by expert, each expert's
    tokens a group of ops.linear_grouped; each token's k products then summed in ascending expert order."""
    n_tok, k = top.shape
    order = np.argsort(top.reshape(-1), kind="stable")  # by expert, tokens ascending within one
    experts, starts = np.unique(top.reshape(-1)[order], return_index=True)
    bounds = np.append(starts, len(order))
    routed = x[ops.asarray(order // k)]
    if moe.gate_up is not None:
        gate_up, = ops.linear_grouped(routed, [(moe.gate_up[e],) for e in experts], bounds)
        gate, up = gate_up[:, :gate_up.shape[-1] // 2], gate_up[:, gate_up.shape[-1] // 2:]
    else:
        gate, up = ops.linear_grouped(routed, [(moe.gate[e], moe.up[e]) for e in experts], bounds)
    hidden = ops.gated_act(gate, up, cfg.activation)
    y, = ops.linear_grouped(hidden, [(moe.down[e],) for e in experts], bounds)
    y = y * ops.asarray(weights.reshape(-1)[order].astype(np.float32))[:, None]
    sorted_at = np.empty_like(order)
    sorted_at[order] = np.arange(len(order))  # where pair (t, slot) = t * k + slot sits in y
    by_expert = np.take_along_axis(sorted_at.reshape(n_tok, k), np.argsort(top, axis=-1, kind="stable"), axis=-1)
    out = ops.xp.zeros_like(x)
    for j in range(k):
        out += y[ops.asarray(by_expert[:, j])]
    return out


def _experts_of_one_token(ops, cfg: ModelConfig, moe: MoEWeights, x, experts: np.ndarray, weights: np.ndarray):
    """moe_mlp's sum for one token x [1, d], its k chosen experts' gate / up in one ops.linear_each and their
    down in another; summed in ascending expert order, as moe_mlp's loop sums (the same float32 additions)."""
    order = np.argsort(experts, kind="stable")
    experts, weights, k = experts[order], weights[order], len(experts)
    if moe.gate_up is not None:
        gate_up = ops.linear_each(x, [moe.gate_up[e] for e in experts], np.zeros(k, np.int64))
        gate, up = gate_up[:, :gate_up.shape[-1] // 2], gate_up[:, gate_up.shape[-1] // 2:]
    else:
        gate_up = ops.linear_each(x, [moe.gate[e] for e in experts] + [moe.up[e] for e in experts],
                                  np.zeros(2 * k, np.int64))
        gate, up = gate_up[:k], gate_up[k:]
    hidden = ops.gated_act(gate, up, cfg.activation)
    y = ops.linear_each(hidden, [moe.down[e] for e in experts], np.arange(k))
    y = y * ops.asarray(weights.astype(np.float32))[:, None]
    out = ops.xp.zeros_like(x)
    for j in range(k):
        out += y[j]
    return out


def expert_matrices(gguf: GGUFFile, name: str) -> list[Weight]:
    """A 3-D expert tensor [n_expert, n_out, n_in] as one Weight per expert (views of the GGUF blocks)."""
    stacked = load_matrix(gguf, name)
    n_expert, n_out = stacked.shape[0], stacked.shape[1]
    blocks = np.asarray(stacked.data).reshape(n_expert, n_out, -1)
    return [Weight(f"{name}[{e}]", stacked.fmt, tuple(stacked.shape[1:]), blocks[e]) for e in range(n_expert)]
