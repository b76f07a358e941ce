"""Pick the architecture, load its weights, and run the decoder stack.

    x = Embed(tokens) * embed_scale
    x = Block_l(x) for l in layers          (writes each layer's k/v into the cache)
    logits = W_out RMSNorm(x)               (optionally soft-capped)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
from tqdm.auto import tqdm

from ..config import ModelConfig, config_from_gguf
from ..gguf_io import GGUFFile
from ..kv.cache import KVCache
from ..weights import Weight, load_matrix, load_vector
from .gemma import gemma_block
from .layers import LayerWeights
from .qwen import qwen_block

BLOCKS: dict[str, Callable] = {"qwen2": qwen_block, "qwen3": qwen_block, "gemma3": gemma_block}


@dataclass
class Transformer:
    cfg: ModelConfig
    ops: object  # a backend (backend/cpu.py, backend/gpu.py)
    token_embd: Weight
    output_norm: np.ndarray
    output: Weight
    layers: list[LayerWeights]
    attention: Callable | None = None  # replaces default_attention (Dual Chunk Attention)

    @classmethod
    def from_gguf(cls, gguf: GGUFFile, ops, progress: bool = True) -> "Transformer":
        cfg = config_from_gguf(gguf)
        token_embd = load_matrix(gguf, "token_embd.weight")
        output = token_embd if cfg.tied_output else load_matrix(gguf, "output.weight")
        layers = [LayerWeights.from_gguf(gguf, il).on(ops)
                  for il in tqdm(range(cfg.n_layer), desc="loading layers", unit="layer", disable=not progress,
                                 leave=False)]
        return cls(cfg, ops, ops.upload(token_embd), ops.asarray(load_vector(gguf, "output_norm.weight")),
                   ops.upload(output), layers)

    def forward(self, tokens: np.ndarray, positions: np.ndarray, cache: KVCache, all_logits: bool = False):
        """Run `tokens` at `positions` (appending to `cache`); logits of every token, or of the last one."""
        ops, cfg = self.ops, self.cfg
        block = BLOCKS[cfg.arch]
        x = ops.embed(self.token_embd, tokens)
        if cfg.embed_scale != 1.0:
            x = x * np.float32(cfg.embed_scale)
        for layer, weights in enumerate(self.layers):
            x = block(ops, cfg, weights, layer, x, positions, cache, self.attention)
        if not all_logits:
            x = x[-1:]
        logits = ops.linear(ops.rms_norm(x, self.output_norm, cfg.norm_eps), self.output)
        if cfg.final_logit_softcap > 0.0:
            cap = np.float32(cfg.final_logit_softcap)
            logits = cap * ops.xp.tanh(logits / cap)
        return logits
