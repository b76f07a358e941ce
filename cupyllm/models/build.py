"""Pick the architecture, load its weights, and run the decoder stack.

    x = Embed(tokens) * embed_scale
    e = PerLayerInputs(tokens, x)           (Gemma 4 E2B/E4B only: one small embedding per layer)
    x = Block_l(x, e_l) for l in layers     (writes each layer's k/v into the cache; a layer plan runs some
                                             stored blocks twice: layer_plan.py)
    logits = W_out RMSNorm(x)               (optionally soft-capped)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import numpy as np
from tqdm.auto import tqdm

from ..backend.base import Backend
from ..files.config import ModelConfig, config_from_gguf
from ..files.gguf import GGUFFile
from ..kv.cache import KVCache
from .weights import Weight, load_matrix, load_vector
from .gemma import gemma_block, per_layer_inputs
from .layer_plan import LayerBlocks, planned_config
from .layers import LayerWeights
from .qwen import qwen_block
from .qwen35 import qwen35_block, qwen35_layer_weights
from .residual import ResidualStream

BLOCKS: dict[str, Callable] = {"qwen2": qwen_block, "qwen3": qwen_block, "qwen3moe": qwen_block,
                               "gemma3": gemma_block, "gemma4": gemma_block, "qwen35": qwen35_block,
                               "qwen35moe": qwen35_block, "qwen3next": qwen35_block}
# the others: LayerWeights.from_gguf
LAYER_WEIGHTS: dict[str, Callable] = {arch: qwen35_layer_weights for arch in ("qwen35", "qwen35moe", "qwen3next")}


@dataclass
class Transformer:
    cfg: ModelConfig
    ops: Backend  # backend/base.py: the operations the blocks call
    token_embd: Weight
    output_norm: np.ndarray
    output: Weight
    layers: list[LayerWeights]
    attention: Callable | None = None  # replaces default_attention (Dual Chunk Attention)
    per_layer: tuple | None = None  # Gemma 4 per-layer embeddings: (token table, model projection, norm)
    unplanned: "Transformer | None" = None  # with a layer plan: the same model running each stored layer once

    @classmethod
    def from_gguf(cls, gguf: GGUFFile, ops, progress: bool = True) -> "Transformer":
        cfg = config_from_gguf(gguf)
        token_embd = load_matrix(gguf, "token_embd.weight")
        output = token_embd if cfg.tied_output else load_matrix(gguf, "output.weight")
        layer_weights = LAYER_WEIGHTS.get(cfg.arch, LayerWeights.from_gguf)
        layers = [layer_weights(gguf, il, cfg).on(ops)
                  for il in tqdm(range(cfg.n_layer), desc="loading layers", unit="layer", disable=not progress,
                                 leave=False)]
        per_layer = None
        if cfg.per_layer_dim:
            per_layer = (ops.upload(load_matrix(gguf, "per_layer_token_embd.weight")),
                         ops.upload(load_matrix(gguf, "per_layer_model_proj.weight")),
                         ops.asarray(load_vector(gguf, "per_layer_proj_norm.weight")))
        return cls(cfg, ops, ops.upload(token_embd), ops.asarray(load_vector(gguf, "output_norm.weight")),
                   ops.upload(output), layers, per_layer=per_layer)

    def with_layer_plan(self, blocks: LayerBlocks) -> "Transformer":
        """This model running `blocks` of its layers twice (models/layer_plan.py): the stored weights shared, the
        config re-indexed by the stack's layers. No blocks: self."""
        if not blocks:
            return self
        cfg = planned_config(self.cfg, blocks)
        return dataclasses.replace(self, cfg=cfg, layers=[self.layers[s] for s in cfg.layer_order], unplanned=self)

    @property
    def stored(self) -> "Transformer":
        """The model as its file stores it: each layer once."""
        return self.unplanned or self

    def forward(self, tokens: np.ndarray, positions: np.ndarray, cache: KVCache, all_logits: bool = False,
                on_hidden: Callable | None = None):
        """Run `tokens` at `positions` (appending to `cache`); logits of every token, or of the last one.
        on_hidden: called with the stack's normed output rows of every token (what the logits are taken from;
        an MTP drafter reads them, speculative/mtp.py) before the logits are computed."""
        normed = self.hidden(tokens, positions, cache)
        if on_hidden is not None:
            on_hidden(normed)
        return self.logits(normed if all_logits else normed[-1:])

    def hidden(self, tokens: np.ndarray, positions: np.ndarray, cache, attention: Callable | None = None,
               ops=None):
        """The decoder stack's normed output rows of `tokens` (the embedding through the final RMSNorm).
        `attention` / `ops`: in place of self.attention / self.ops (a batched forward's, models/batch.py)."""
        ops, cfg = ops or self.ops, self.cfg
        attention = attention or self.attention
        block = BLOCKS[cfg.arch]
        x = ops.embed(self.token_embd, tokens)
        if cfg.embed_scale != 1.0:
            x = x * np.float32(cfg.embed_scale)
        per_layer = per_layer_inputs(ops, cfg, *self.per_layer, tokens, x) if self.per_layer else None
        stream = ResidualStream(ops, x, cfg.norm_eps)
        for layer, weights in enumerate(self.layers):
            extra = {} if per_layer is None else {"per_layer_input": per_layer[:, cfg.stored_layer(layer)]}
            block(ops, cfg, weights, layer, stream, positions, cache, attention, **extra)
        return stream.norm(self.output_norm)

    def logits(self, normed, ops=None):
        """W_out normed (soft-capped where the model caps its logits)."""
        ops = ops or self.ops
        logits = ops.linear(normed, self.output)
        if self.cfg.final_logit_softcap > 0.0:
            logits = ops.softcap(logits, self.cfg.final_logit_softcap)
        return logits
