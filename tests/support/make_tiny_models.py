"""Write tiny random-weight Qwen2, Qwen3 (dense and MoE), Qwen3.5, Gemma 3 and Gemma 4 models as GGUF (with the `gguf` package's writer), and
build the matching HF `transformers` models from the very same tensors, for exact parity tests.

    python tests/support/make_tiny_models.py OUT_DIR        # writes tiny-qwen2.gguf, ..., tiny-gemma4-moe.gguf
    python tests/support/make_tiny_models.py OUT_DIR --preset qwen2.5-7b   # random weights with a real model's shapes

Presets (PRESETS) give the shapes, vocabulary sizes and Q4_K_M-like tensor types of real models, for speed
benchmarks; their quantized matrices are random valid blocks written straight from random bytes (no float
values drawn, no decode: a 7B model is written in about a minute), with scales set for a weight standard
deviation of 1/sqrt(n_in).

Weights are random (seeded); most matrices are stored as F32, some as F16/BF16/Q8_0/Q4_K/... so the quantized
paths run too: the HF model gets exactly the values the GGUF blocks decode to (gguf's own dequantizer).
The tokenizers are small but real: byte-level BPE (Qwen), SentencePiece with byte fallback (Gemma 3) and
character BPE with byte fallback (Gemma 4).

Gemma 4 comes in two tiny variants that between them use every feature the engine implements, written as
llama.cpp's convert_hf_to_gguf.py writes the real models: `gemma4` (E2B-like: per-layer embeddings, the last
layers reading earlier layers' caches, double-wide MLPs there, global layers with their own head dim) and
`gemma4-moe` (26B-A4B-like: a mixture of experts beside the dense MLP, global layers whose V is K's
projection and with fewer KV heads).
"""
from __future__ import annotations

import argparse
import functools
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T

ARCHES = ("qwen2", "qwen3", "qwen3-moe", "gemma3", "gemma4", "gemma4-moe")
HYBRID_ARCHES = ("qwen35", "qwen35-moe", "qwen3next")  # Gated DeltaNet layers between full-attention ones
GEMMA4_LAYER_TYPES = (True, True, False, True, False, True, False)  # sliding? per layer


@dataclass
class TinySpec:
    arch: str
    n_layer: int = 3
    d_model: int = 64
    n_head: int = 4
    n_kv_head: int = 2
    head_dim: int = 32
    ffn_dim: int = 128
    ctx_train: int = 256
    rope_base: float = 10000.0
    sliding_window: int = 6  # gemma3: small, so short test sequences cross it
    seed: int = 0
    # tensor name suffix -> storage type (everything else F32); a tuple alternates by layer (layer % len)
    types: dict = field(default_factory=lambda: {
        "attn_q.weight": T.Q8_0, "attn_output.weight": T.F16, "ffn_down.weight": T.Q4_K, "ffn_up.weight": T.BF16,
        "ffn_gate.weight": T.Q5_0,
    })
    n_vocab: int | None = None  # pad the tokenizer's vocabulary with unused tokens up to this size
    random_blocks: bool = False  # quantized matrices as random valid blocks, not quantized values (presets)
    # Gemma 4 (0 / False elsewhere)
    global_head_dim: int = 0
    n_global_kv_head: int = 0  # with k_eq_v only, as transformers reads it
    k_eq_v: bool = False
    per_layer_dim: int = 0
    n_kv_shared: int = 0
    double_wide: bool = False
    n_expert: int = 0
    n_expert_used: int = 0
    expert_ffn_dim: int = 0
    final_softcap: float = 0.0
    sliding_pattern: tuple[bool, ...] = ()  # sliding? per layer, repeating (default GEMMA4_LAYER_TYPES)
    # Qwen3.5 (0 elsewhere): Gated DeltaNet layers, every full_attn_interval-th layer full attention
    full_attn_interval: int = 0
    ssm_k_heads: int = 0
    ssm_v_heads: int = 0
    ssm_k_dim: int = 0
    ssm_v_dim: int = 0
    conv_kernel: int = 4
    n_rot: int = 0  # rotated dims per head (0: all)
    shared_expert_ffn_dim: int = 0  # Qwen3.5-MoE's shared expert
    # Qwen3.5 / Qwen3-Next multi-token-prediction (NextN) blocks after the decoder's, as llama.cpp's converter
    # writes them (block_count counts them, `nextn_predict_layers` says how many); 0: none (the files the stored
    # references were made from)
    n_nextn: int = 0

    @property
    def gguf_arch(self) -> str:
        return {"gemma4-moe": "gemma4", "qwen3-moe": "qwen3moe", "qwen35-moe": "qwen35moe"}.get(self.arch, self.arch)


_Q4_K_M_QWEN = {"token_embd.weight": T.Q4_K, "output.weight": T.Q6_K, "attn_q.weight": T.Q4_K,
                "attn_k.weight": T.Q4_K, "attn_v.weight": (T.Q6_K, T.Q4_K), "attn_output.weight": T.Q4_K,
                "ffn_gate.weight": T.Q4_K, "ffn_up.weight": T.Q4_K, "ffn_down.weight": (T.Q6_K, T.Q4_K)}
# rows of 640 / 896 values are not whole 256-value super-blocks: llama.cpp falls back to 32-value types there
_Q4_K_M_SMALL = {"token_embd.weight": T.Q8_0, "output.weight": T.Q8_0, "attn_q.weight": T.Q5_0,
                 "attn_k.weight": T.Q5_0, "attn_v.weight": (T.Q8_0, T.Q5_0), "attn_output.weight": T.Q5_0,
                 "ffn_gate.weight": T.Q5_0, "ffn_up.weight": T.Q5_0, "ffn_down.weight": (T.Q6_K, T.Q4_K)}

PRESETS: dict[str, TinySpec] = {
    "gemma3-270m": TinySpec("gemma3", n_layer=18, d_model=640, n_head=4, n_kv_head=1, head_dim=256, ffn_dim=2048,
                            ctx_train=32768, rope_base=1_000_000.0, sliding_window=512, n_vocab=262144,
                            random_blocks=True, types={**_Q4_K_M_SMALL, "attn_output.weight": T.Q4_K}),
    "qwen2.5-0.5b": TinySpec("qwen2", n_layer=24, d_model=896, n_head=14, n_kv_head=2, head_dim=64, ffn_dim=4864,
                             ctx_train=32768, rope_base=1_000_000.0, n_vocab=151936, random_blocks=True,
                             types={**_Q4_K_M_SMALL, "token_embd.weight": T.Q5_0}),
    "qwen2.5-7b": TinySpec("qwen2", n_layer=28, d_model=3584, n_head=28, n_kv_head=4, head_dim=128, ffn_dim=18944,
                           ctx_train=32768, rope_base=1_000_000.0, n_vocab=152064, random_blocks=True,
                           types=dict(_Q4_K_M_QWEN)),
    # Qwen/Qwen3-8B: the layer bench/kv_encode.py measures the TCQ encode against (head dim 128, 8 KV heads)
    "qwen3-8b": TinySpec("qwen3", n_layer=36, d_model=4096, n_head=32, n_kv_head=8, head_dim=128, ffn_dim=12288,
                         ctx_train=40960, rope_base=1_000_000.0, n_vocab=151936, random_blocks=True,
                         types=dict(_Q4_K_M_QWEN)),
    # google/gemma-4-E2B's text config: 35 layers (4 sliding : 1 global), the last 20 reading earlier caches with
    # double-wide MLPs, per-layer embeddings of 256, head dims 256 / 512, one KV head
    "gemma4-e2b": TinySpec("gemma4", n_layer=35, d_model=1536, n_head=8, n_kv_head=1, head_dim=256,
                           global_head_dim=512, ffn_dim=6144, per_layer_dim=256, n_kv_shared=20, double_wide=True,
                           final_softcap=30.0, ctx_train=131072, rope_base=1_000_000.0, sliding_window=512,
                           n_vocab=262144, random_blocks=True, sliding_pattern=(True, True, True, True, False),
                           types={**_Q4_K_M_QWEN, "per_layer_token_embd.weight": T.Q4_K,
                                  "per_layer_model_proj.weight": T.Q4_K, "inp_gate.weight": T.Q4_K,
                                  "proj.weight": T.Q4_K}),
    # Qwen/Qwen3.5-0.8B's text model: 24 layers (3 Gated DeltaNet : 1 gated attention), hidden 1024, attention
    # 8 q / 2 kv heads of 256 with 64 rotated dims, DeltaNet 16 key / 16 value heads of 128, MLP 3584 (its output
    # head is tied to the embedding; here a separate one of the same shape: the same work per token)
    "qwen3.5-0.8b": TinySpec("qwen35", n_layer=24, d_model=1024, n_head=8, n_kv_head=2, head_dim=256, ffn_dim=3584,
                             full_attn_interval=4, ssm_k_heads=16, ssm_v_heads=16, ssm_k_dim=128, ssm_v_dim=128,
                             n_rot=64, ctx_train=262144, rope_base=10_000_000.0, n_vocab=248320, random_blocks=True,
                             types={**_Q4_K_M_QWEN, "attn_qkv.weight": T.Q4_K, "attn_gate.weight": T.Q4_K,
                                    "ssm_out.weight": T.Q4_K}),
    # Qwen/Qwen3.6-35B-A3B's layers (hidden 2048, attention 16 q / 2 kv heads of 256, DeltaNet 16 key / 32 value
    # heads of 128, 256 experts of 512, 8 used, a shared expert of 512), 8 of its 40 layers (4.8 GB): all 40 are
    # ~24 GB with these types, more than a 24 GB machine shared with other work holds beside a second engine
    "qwen3.6-35b-a3b-8l": TinySpec("qwen35-moe", n_layer=8, d_model=2048, n_head=16, n_kv_head=2, head_dim=256,
                                   full_attn_interval=4, ssm_k_heads=16, ssm_v_heads=32, ssm_k_dim=128,
                                   ssm_v_dim=128, n_rot=64, n_expert=256, n_expert_used=8, expert_ffn_dim=512,
                                   shared_expert_ffn_dim=512, ctx_train=262144, rope_base=10_000_000.0,
                                   n_vocab=248320, random_blocks=True,
                                   types={**_Q4_K_M_QWEN, "attn_qkv.weight": T.Q4_K, "attn_gate.weight": T.Q4_K,
                                          "ssm_out.weight": T.Q4_K, "ffn_gate_exps.weight": T.Q4_K,
                                          "ffn_up_exps.weight": T.Q4_K, "ffn_down_exps.weight": (T.Q6_K, T.Q4_K),
                                          "ffn_gate_shexp.weight": T.Q4_K, "ffn_up_shexp.weight": T.Q4_K,
                                          "ffn_down_shexp.weight": (T.Q6_K, T.Q4_K)}),
}


def tiny_spec(arch: str) -> TinySpec:
    """The test models' shapes: TinySpec's defaults, and for Gemma 4 its two variants."""
    if arch == "gemma4":  # E2B-like
        return TinySpec("gemma4", n_layer=7, head_dim=32, global_head_dim=64, per_layer_dim=16, n_kv_shared=2,
                        double_wide=True, final_softcap=30.0, rope_base=1_000_000.0)
    if arch == "qwen35":  # Qwen3.5-like: DeltaNet, full attention, DeltaNet, full attention; 2 key heads for 4 value
        return TinySpec("qwen35", n_layer=4, full_attn_interval=2, ssm_k_heads=2, ssm_v_heads=4, ssm_k_dim=16,
                        ssm_v_dim=16, n_rot=16, rope_base=1_000_000.0,
                        types={"attn_q.weight": T.Q8_0, "attn_qkv.weight": T.Q8_0, "attn_gate.weight": T.Q8_0,
                               "ssm_out.weight": T.Q5_0, "ffn_up.weight": T.BF16, "ffn_gate.weight": T.Q5_0})
    if arch == "qwen35-moe":  # Qwen3.5-35B-A3B-like: the dense one's layers, routed experts and a shared expert
        spec = tiny_spec("qwen35")
        spec.arch, spec.n_expert, spec.n_expert_used, spec.expert_ffn_dim = "qwen35-moe", 4, 2, 32
        spec.shared_expert_ffn_dim = 48
        spec.types = {**spec.types, "ffn_down_exps.weight": T.Q8_0, "ffn_up_exps.weight": T.Q5_0,
                      "ffn_gate_shexp.weight": T.Q8_0}
        return spec
    if arch == "qwen3next":  # Qwen3-Next-80B-A3B-like: the MoE one with grouped value heads and a fused ssm_ba
        spec = tiny_spec("qwen35-moe")
        spec.arch = "qwen3next"
        return spec
    if arch == "qwen3-moe":  # Qwen3-30B-A3B-like
        return TinySpec("qwen3-moe", n_expert=4, n_expert_used=2, expert_ffn_dim=32,
                        types={"attn_q.weight": T.Q8_0, "ffn_down_exps.weight": T.Q8_0, "ffn_up_exps.weight": T.Q5_0})
    if arch == "gemma4-moe":  # 26B-A4B-like
        return TinySpec("gemma4-moe", n_layer=6, head_dim=32, global_head_dim=64, n_global_kv_head=1, k_eq_v=True,
                        n_expert=4, n_expert_used=2, expert_ffn_dim=32, final_softcap=30.0, rope_base=1_000_000.0,
                        types={"attn_q.weight": T.Q8_0, "ffn_down_exps.weight": T.Q8_0, "ffn_up.weight": T.BF16})
    return TinySpec(arch)


def _bytes_to_unicode() -> dict[int, str]:
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def qwen_vocab() -> tuple[list[str], list[int], list[str]]:
    """Byte-level BPE: 256 byte symbols, a few merges, ChatML specials."""
    byte_chars = _bytes_to_unicode()
    tokens = [byte_chars[b] for b in range(256)]
    merges = []
    for pair in ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s", "r e", "a n", "Ġ w", "Ġ c", "o r", "Ġ the"]:
        a, b = pair.split(" ")
        if a + b not in tokens:
            tokens.append(a + b)
        merges.append(pair)
    types = [1] * len(tokens)
    for special in ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]:
        tokens.append(special)
        types.append(3)
    return tokens, types, merges


def gemma_vocab() -> tuple[list[str], list[float], list[int]]:
    """SentencePiece: control tokens, byte fallback, a few scored pieces, chat specials."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"]
    types = [3, 3, 3, 2]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    pieces = ["▁", "e", "t", "a", "o", "h", "▁t", "he", "▁the", "▁a", "in", "er", "▁s", "on", "re", "▁w", "an", "s", "n", "r", "i"]
    tokens += pieces
    types += [1] * len(pieces)
    tokens += ["<start_of_turn>", "<end_of_turn>"]
    types += [3, 3]
    scores = [0.0] * 260 + [-float(i) for i in range(len(pieces))] + [0.0, 0.0]
    return tokens, scores, types


def gemma4_vocab() -> tuple[list[str], list[int], list[str]]:
    """Character BPE: control tokens, byte fallback, characters, a few merges, Gemma 4's turn markers."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"]
    types = [3, 3, 3, 2]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    chars = ["▁", "e", "t", "a", "o", "h", "i", "n", "s", "r", "w", "\n"]
    merges = ["▁ t", "h e", "▁t he", "i n", "▁ a", "e r", "o n", "▁ s", "r e", "a n", "▁ w", "\n \n"]
    pieces = chars + [m.replace(" ", "") for m in merges]
    tokens += pieces
    types += [1] * len(pieces)
    tokens += ["<|turn>", "<turn|>"]
    types += [3, 3]
    return tokens, types, merges


# A minimal template in Gemma 4's turn format (<|turn>role ... <turn|>); like the released ones it leaves an empty
# thought channel in the generation prompt unless enable_thinking is set
GEMMA4_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] | trim }}<turn|>\n{% endfor %}{% if add_generation_prompt %}<|turn>model\n"
    "{% if not enable_thinking | default(false) %}<|channel>thought\n<channel|>{% endif %}{% endif %}")


def gemma4_layer(spec: TinySpec, il: int) -> tuple[bool, int, int, bool]:
    """(sliding, head dim, KV heads, has its own K/V) of layer il."""
    pattern = spec.sliding_pattern or GEMMA4_LAYER_TYPES
    sliding = pattern[il % len(pattern)] and il != spec.n_layer - 1
    head_dim = spec.head_dim if sliding else spec.global_head_dim
    n_kv = spec.n_kv_head if sliding or not spec.k_eq_v else spec.n_global_kv_head
    return sliding, head_dim, n_kv, il < spec.n_layer - spec.n_kv_shared


def gemma4_ffn_dim(spec: TinySpec, has_kv: bool) -> int:
    """The MLP width of a layer: double on the layers that read shared caches when the model says so."""
    return 2 * spec.ffn_dim if spec.double_wide and not has_kv else spec.ffn_dim


def _unused_tokens(n_have: int, n_vocab: int | None) -> list[str]:
    """Filler tokens that bring a vocabulary of n_have tokens up to n_vocab (a real model's size)."""
    return [f"<unused{i}>" for i in range(max(0, (n_vocab or 0) - n_have))]


# Offsets of the f16 scale fields: (d, min or None) for the block types random_blocks() writes.
_SCALE_FIELDS = {T.Q8_0: (0, None), T.Q4_0: (0, None), T.Q5_0: (0, None), T.Q4_1: (0, 2), T.Q5_1: (0, 2),
                 T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208, None)}


def _set_f16(raw: np.ndarray, offset: int, values: np.ndarray) -> None:
    raw[:, offset:offset + 2] = values.astype(np.float16).view(np.uint8).reshape(-1, 2)


@functools.lru_cache(maxsize=None)
def _unit_moments(qtype: T) -> tuple[float, float]:
    """(min factor that centres the values, std with d = 1) of random blocks, from a sample."""
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    sample = np.random.default_rng(1234).integers(0, 256, (4096, block_bytes), dtype=np.uint8)
    d_off, m_off = _SCALE_FIELDS[qtype]
    _set_f16(sample, d_off, np.ones(len(sample)))
    centre = 0.0
    if m_off is not None:
        _set_f16(sample, m_off, np.zeros(len(sample)))
        mean_d = gguf.quants.dequantize(sample, qtype).mean()
        _set_f16(sample, d_off, np.zeros(len(sample)))
        _set_f16(sample, m_off, np.ones(len(sample)))
        mean_m = gguf.quants.dequantize(sample, qtype).mean()
        centre = float(-mean_d / mean_m)  # min = centre * d cancels the mean
        _set_f16(sample, d_off, np.ones(len(sample)))
        _set_f16(sample, m_off, np.full(len(sample), centre))
    return centre, float(gguf.quants.dequantize(sample, qtype).std())


def random_blocks(qtype: T, shape: tuple[int, int], rng: np.random.Generator, std: float) -> np.ndarray:
    """uint8 [n_rows, row_bytes] of random valid blocks whose values have mean ~0 and standard deviation ~std."""
    n_rows, n_in = shape
    if qtype in (T.F32, T.F16, T.BF16):
        values = (rng.standard_normal(shape, dtype=np.float32) * np.float32(std))
        if qtype == T.BF16:
            return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(n_rows, -1)
        return values.astype(np.float16 if qtype == T.F16 else np.float32).view(np.uint8).reshape(n_rows, -1)
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = n_rows * n_in // block_values
    raw = np.frombuffer(bytearray(rng.bytes(n_blocks * block_bytes)), np.uint8).reshape(n_blocks, block_bytes)
    centre, unit_std = _unit_moments(qtype)
    d = (std / unit_std) * rng.uniform(0.5, 1.5, n_blocks)
    d_off, m_off = _SCALE_FIELDS[qtype]
    _set_f16(raw, d_off, d)
    if m_off is not None:
        _set_f16(raw, m_off, centre * d)
    return raw.reshape(n_rows, -1)


def _store(values: np.ndarray, qtype: T) -> tuple[np.ndarray, np.ndarray]:
    """(what the GGUF stores, the float32 values it decodes to)."""
    if qtype == T.F32:
        return values, values
    if qtype in (T.Q4_K, T.Q5_K, T.Q6_K):  # gguf has no quantizer for these: random valid blocks instead
        # seeded by the values' bytes, not hash(): Python salts that per process, and stored references
        # (tests/data/hf_reference_tiny.npz) need the same file in every run
        rng = np.random.default_rng(zlib.crc32(values.tobytes()))
        block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        n_blocks = values.size // block_values
        raw = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
        small = np.float16(0.01)  # keep d/dmin small and finite so the decoded weights stay moderate
        scale_offsets = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}[qtype]
        for off in scale_offsets:
            raw[:, off:off + 2] = (rng.uniform(0.2, 1.0, n_blocks).astype(np.float16) * small).view(np.uint8).reshape(-1, 2)
        raw = raw.reshape(values.shape[0], -1)
    else:
        raw = gguf.quants.quantize(values, qtype)
    decoded = gguf.quants.dequantize(raw, qtype).reshape(values.shape).astype(np.float32)
    return raw, decoded


def build_tensors(spec: TinySpec) -> tuple[dict[str, tuple[np.ndarray, T]], dict[str, np.ndarray]]:
    """GGUF tensors (name -> (stored array, type)) and the float32 values they decode to."""
    rng = np.random.default_rng(spec.seed)
    vocab = len({"qwen2": qwen_vocab, "qwen3": qwen_vocab, "qwen3moe": qwen_vocab, "qwen35": qwen_vocab,
                 "qwen35moe": qwen_vocab, "qwen3next": qwen_vocab,
                 "gemma3": gemma_vocab,
                 "gemma4": gemma4_vocab}[spec.gguf_arch]()[0])
    vocab = max(vocab, spec.n_vocab or 0)
    d, hd, nh, nkv, ffn = spec.d_model, spec.head_dim, spec.n_head, spec.n_kv_head, spec.ffn_dim
    shapes = {"token_embd.weight": (vocab, d), "output_norm.weight": (d,)}
    if spec.arch.startswith("qwen"):
        shapes["output.weight"] = (vocab, d)  # Gemma ties its output head to the embedding
    if spec.gguf_arch == "gemma4":
        shapes.update(_gemma4_shapes(spec, vocab))
    if spec.arch in HYBRID_ARCHES:
        shapes.update(_qwen35_shapes(spec))
    for il in range(spec.n_layer if spec.gguf_arch != "gemma4" and spec.arch not in HYBRID_ARCHES else 0):
        p = f"blk.{il}."
        shapes.update({
            p + "attn_norm.weight": (d,), p + "attn_q.weight": (nh * hd, d), p + "attn_k.weight": (nkv * hd, d),
            p + "attn_v.weight": (nkv * hd, d), p + "attn_output.weight": (d, nh * hd), p + "ffn_norm.weight": (d,),
            p + "ffn_gate.weight": (ffn, d), p + "ffn_up.weight": (ffn, d), p + "ffn_down.weight": (d, ffn),
        })
        if spec.arch == "qwen2":
            shapes.update({p + "attn_q.bias": (nh * hd,), p + "attn_k.bias": (nkv * hd,), p + "attn_v.bias": (nkv * hd,)})
        if spec.arch in ("qwen3", "qwen3-moe", "gemma3"):
            shapes.update({p + "attn_q_norm.weight": (hd,), p + "attn_k_norm.weight": (hd,)})
        if spec.n_expert:  # Qwen3-MoE: experts instead of the dense MLP
            e, fe = spec.n_expert, spec.expert_ffn_dim
            for name in ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"):
                del shapes[p + name]
            shapes.update({p + "ffn_gate_inp.weight": (e, d), p + "ffn_gate_exps.weight": (e, fe, d),
                           p + "ffn_up_exps.weight": (e, fe, d), p + "ffn_down_exps.weight": (e, d, fe)})
        if spec.arch == "gemma3":
            shapes.update({p + "post_attention_norm.weight": (d,), p + "post_ffw_norm.weight": (d,)})
    stored, decoded = {}, {}
    for name, shape in shapes.items():
        qtype = next((t for suffix, t in spec.types.items() if name.endswith(suffix)), T.F32)
        if isinstance(qtype, tuple):  # alternates by layer
            qtype = qtype[int(name.split(".")[1]) % len(qtype)] if name.startswith("blk.") else qtype[0]
        if len(shape) == 1 or shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
            qtype = T.F32
        if spec.random_blocks and len(shape) >= 2 and qtype != T.F32:  # presets: no decoded copy (F32: the values)
            rows = int(np.prod(shape[:-1]))  # experts' matrices stacked
            raw = random_blocks(qtype, (rows, shape[-1]), rng, 1.0 / np.sqrt(shape[-1]))
            stored[name] = (raw.reshape(*shape[:-1], -1), qtype)
            continue
        if name == "rope_freqs.weight":  # not random: the proportional rope of Gemma 4's global layers
            values = _gemma4_rope_freqs(spec)
        elif name.endswith(".ssm_a"):  # -exp(A_log): negative, decays from exp(-0.4) to exp(-4.5) per unit dt
            values = -np.exp(rng.uniform(-1.0, 1.5, shape)).astype(np.float32)
        elif "norm" in name or name.endswith("scale") or name.endswith("scale.weight"):
            values = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            if spec.gguf_arch == "gemma4" and name.endswith("attn_q_norm.weight"):
                # Gemma 4 scores are q . k unscaled: q's norm weight carries 1/sqrt(head_dim) here, so the scores
                # are as sharp as the other tiny models' (f16 GPU paths are compared at their tolerances)
                values /= np.float32(np.sqrt(shape[0]))
        else:
            values = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
            if name.endswith(".bias"):
                values *= 0.5
        raw, dec = _store(values, qtype)
        stored[name] = (raw, qtype)
        decoded[name] = dec
    return stored, decoded


def qwen35_recurrent(spec: TinySpec, il: int) -> bool:
    """Whether Qwen3.5's layer il is a Gated DeltaNet layer (llama.cpp: (il + 1) % full_attention_interval)."""
    return (il + 1) % spec.full_attn_interval != 0


def _qwen35_shapes(spec: TinySpec) -> dict[str, tuple[int, ...]]:
    """Qwen3.5's layers as llama.cpp's converter writes them (gguf-py MODEL_ARCH.QWEN35)."""
    d, nh, nkv, hd, ff = spec.d_model, spec.n_head, spec.n_kv_head, spec.head_dim, spec.ffn_dim
    nk, nv, dk, dv = spec.ssm_k_heads, spec.ssm_v_heads, spec.ssm_k_dim, spec.ssm_v_dim
    channels = 2 * nk * dk + nv * dv
    shapes: dict[str, tuple[int, ...]] = {}
    for il in range(spec.n_layer):
        p = f"blk.{il}."
        shapes.update({p + "attn_norm.weight": (d,), p + "post_attention_norm.weight": (d,)})
        if spec.n_expert:  # routed experts (the converter splits HF's gate_up_proj) and the gated shared expert
            e, fe, fs = spec.n_expert, spec.expert_ffn_dim, spec.shared_expert_ffn_dim
            shapes.update({p + "ffn_gate_inp.weight": (e, d), p + "ffn_gate_exps.weight": (e, fe, d),
                           p + "ffn_up_exps.weight": (e, fe, d), p + "ffn_down_exps.weight": (e, d, fe),
                           p + "ffn_gate_inp_shexp.weight": (1, d), p + "ffn_gate_shexp.weight": (fs, d),
                           p + "ffn_up_shexp.weight": (fs, d), p + "ffn_down_shexp.weight": (d, fs)})
        else:
            shapes.update({p + "ffn_gate.weight": (ff, d), p + "ffn_up.weight": (ff, d), p + "ffn_down.weight": (d, ff)})
        if qwen35_recurrent(spec, il):
            shapes.update({p + "attn_qkv.weight": (channels, d), p + "attn_gate.weight": (nv * dv, d)})
            if spec.arch == "qwen3next":  # in_proj_ba as it is: per key head, r beta rows then r alpha rows
                shapes[p + "ssm_ba.weight"] = (2 * nv, d)
            else:
                shapes.update({p + "ssm_alpha.weight": (nv, d), p + "ssm_beta.weight": (nv, d)})
            shapes.update({p + "ssm_a": (nv,),
                           p + "ssm_dt.bias": (nv,), p + "ssm_conv1d.weight": (channels, spec.conv_kernel),
                           p + "ssm_norm.weight": (dv,), p + "ssm_out.weight": (d, nv * dv)})
        else:
            shapes.update({p + "attn_q.weight": (2 * nh * hd, d), p + "attn_k.weight": (nkv * hd, d),
                           p + "attn_v.weight": (nkv * hd, d), p + "attn_output.weight": (d, nh * hd),
                           p + "attn_q_norm.weight": (hd,), p + "attn_k_norm.weight": (hd,)})
    if spec.n_nextn:
        shapes.update(_qwen35_nextn_shapes(spec, shapes))
    return shapes


def _qwen35_nextn_shapes(spec: TinySpec, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The MTP blocks blk.{n_layer + i}: a full-attention block shaped as the decoder's (its norms, gated
    attention and MLP or experts: the last full-attention layer's tensor set) and the NextN tensors llama.cpp's
    converter maps Qwen3.5's mtp.* to (conversion/qwen.py _Qwen35MtpMixin: mtp.fc -> nextn.eh_proj [d, 2d],
    pre_fc_norm_embedding -> nextn.enorm, pre_fc_norm_hidden -> nextn.hnorm, norm -> nextn.shared_head_norm)."""
    d = spec.d_model
    attention_layer = max(il for il in range(spec.n_layer) if not qwen35_recurrent(spec, il))
    template = f"blk.{attention_layer}."
    out: dict[str, tuple[int, ...]] = {}
    for i in range(spec.n_nextn):
        p = f"blk.{spec.n_layer + i}."
        out.update({p + name[len(template):]: shape for name, shape in shapes.items() if name.startswith(template)})
        out.update({p + "nextn.eh_proj.weight": (d, 2 * d), p + "nextn.enorm.weight": (d,),
                    p + "nextn.hnorm.weight": (d,), p + "nextn.shared_head_norm.weight": (d,)})
    return out


def _write_qwen35_metadata(writer, spec: TinySpec) -> None:
    writer.add_ssm_conv_kernel(spec.conv_kernel)
    writer.add_ssm_state_size(spec.ssm_k_dim)
    writer.add_ssm_group_count(spec.ssm_k_heads)
    writer.add_ssm_time_step_rank(spec.ssm_v_heads)
    writer.add_ssm_inner_size(spec.ssm_v_dim * spec.ssm_v_heads)
    writer.add_full_attention_interval(spec.full_attn_interval)
    writer.add_rope_dimension_count(spec.n_rot)
    if spec.arch != "qwen3next":  # Qwen3-Next's rope is plain NEOX
        writer.add_rope_dimension_sections(list(QWEN35_MROPE_SECTIONS) + [0])


QWEN35_MROPE_SECTIONS = (3, 3, 2)  # t, h, w pairs of the tiny model's 8 rotated pairs (text: all alike)


def _gemma4_shapes(spec: TinySpec, vocab: int) -> dict[str, tuple[int, ...]]:
    d, nh = spec.d_model, spec.n_head
    shapes: dict[str, tuple[int, ...]] = {"rope_freqs.weight": (spec.global_head_dim // 2,)}
    if spec.per_layer_dim:
        width = spec.n_layer * spec.per_layer_dim
        shapes.update({"per_layer_token_embd.weight": (vocab, width), "per_layer_model_proj.weight": (width, d),
                       "per_layer_proj_norm.weight": (spec.per_layer_dim,)})
    for il in range(spec.n_layer):
        p = f"blk.{il}."
        sliding, hd, nkv, has_kv = gemma4_layer(spec, il)
        ff = gemma4_ffn_dim(spec, has_kv)
        shapes.update({
            p + "attn_norm.weight": (d,), p + "attn_q.weight": (nh * hd, d), p + "attn_q_norm.weight": (hd,),
            p + "attn_output.weight": (d, nh * hd), p + "post_attention_norm.weight": (d,),
            p + "ffn_norm.weight": (d,), p + "ffn_gate.weight": (ff, d), p + "ffn_up.weight": (ff, d),
            p + "ffn_down.weight": (d, ff), p + "post_ffw_norm.weight": (d,), p + "layer_output_scale.weight": (1,),
        })
        if has_kv:
            shapes.update({p + "attn_k.weight": (nkv * hd, d), p + "attn_k_norm.weight": (hd,)})
            if sliding or not spec.k_eq_v:
                shapes[p + "attn_v.weight"] = (nkv * hd, d)
        if spec.per_layer_dim:
            shapes.update({p + "inp_gate.weight": (spec.per_layer_dim, d), p + "proj.weight": (d, spec.per_layer_dim),
                           p + "post_norm.weight": (d,)})
        if spec.n_expert:
            e, fe = spec.n_expert, spec.expert_ffn_dim
            shapes.update({p + "ffn_gate_inp.weight": (e, d), p + "ffn_gate_inp.scale": (d,),
                           p + "ffn_gate_up_exps.weight": (e, 2 * fe, d), p + "ffn_down_exps.weight": (e, d, fe),
                           p + "ffn_down_exps.scale": (e,), p + "pre_ffw_norm_2.weight": (d,),
                           p + "post_ffw_norm_1.weight": (d,), p + "post_ffw_norm_2.weight": (d,)})
    return shapes


def _gemma4_rope_freqs(spec: TinySpec) -> np.ndarray:
    """llama.cpp's encoding of the proportional rope (a quarter of the global head's pairs rotate)."""
    n_pairs = spec.global_head_dim // 2
    rotated = int(spec.global_head_dim * 0.25 / 2)
    return np.array([1.0] * rotated + [1e30] * (n_pairs - rotated), np.float32)


def _write_gemma4_metadata(writer, spec: TinySpec) -> None:
    layers = [gemma4_layer(spec, il) for il in range(spec.n_layer)]
    writer.add_feed_forward_length([gemma4_ffn_dim(spec, has_kv) for _, _, _, has_kv in layers])
    writer.add_head_count_kv([nkv for _, _, nkv, _ in layers])
    writer.add_key_length(spec.global_head_dim)
    writer.add_value_length(spec.global_head_dim)
    writer.add_key_length_swa(spec.head_dim)
    writer.add_value_length_swa(spec.head_dim)
    writer.add_rope_dimension_count(spec.global_head_dim)
    writer.add_rope_dimension_count_swa(spec.head_dim)
    writer.add_rope_freq_base_swa(10000.0)
    writer.add_sliding_window(spec.sliding_window)
    writer.add_sliding_window_pattern([sliding for sliding, _, _, _ in layers])
    writer.add_shared_kv_layers(spec.n_kv_shared)
    writer.add_embedding_length_per_layer_input(spec.per_layer_dim)
    if spec.final_softcap:
        writer.add_final_logit_softcapping(spec.final_softcap)
    tokens, types, merges = gemma4_vocab()
    filler = _unused_tokens(len(tokens), spec.n_vocab)
    writer.add_tokenizer_model("gemma4")
    writer.add_tokenizer_pre("gemma4")
    writer.add_token_list(tokens + filler)
    writer.add_token_types(types + [5] * len(filler))
    writer.add_token_merges(merges)
    _add_gemma_specials(writer)
    writer.add_chat_template(GEMMA4_TEMPLATE)


# A minimal template in Qwen3.5's form: ChatML turns, and a generation prompt that opens a thought (<think>) unless
# enable_thinking is false, which closes an empty one; earlier assistant turns keep only what follows </think>
QWEN35_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{{ m['content'].split('</think>')[-1] | trim }}{% else %}{{ m['content'] }}"
    "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% else %}<think>\n"
    "{% endif %}{% endif %}")


def _add_gemma_specials(writer) -> None:
    """Gemma's special-token ids (both vocabularies start <pad> <eos> <bos> <unk>) and flags."""
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(False)


def write_gguf(spec: TinySpec, path: Path, *, arch_name: str | None = None,
               override_types: dict[str, T] | None = None, chat_template: str | None = None) -> dict[str, np.ndarray]:
    """Write the tiny model; returns the decoded float32 tensors (what the HF twin loads; with
    spec.random_blocks only the vectors: decode the matrices from the file). chat_template: one to store (the
    default files keep the bytes the stored references were made from)."""
    arch = arch_name or spec.gguf_arch
    stored, decoded = build_tensors(spec)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{spec.arch}")
    writer.add_block_count(spec.n_layer + spec.n_nextn)
    if spec.n_nextn:
        writer.add_nextn_predict_layers(spec.n_nextn)
    writer.add_context_length(spec.ctx_train)
    writer.add_embedding_length(spec.d_model)
    writer.add_head_count(spec.n_head)
    writer.add_rope_freq_base(spec.rope_base)
    writer.add_layer_norm_rms_eps(1e-6)
    if spec.gguf_arch == "gemma4":  # per-layer shapes
        _write_gemma4_metadata(writer, spec)
    else:
        writer.add_feed_forward_length(spec.ffn_dim)
        writer.add_head_count_kv(spec.n_kv_head)
        writer.add_key_length(spec.head_dim)
        writer.add_value_length(spec.head_dim)
    if spec.arch in HYBRID_ARCHES:
        _write_qwen35_metadata(writer, spec)
    if spec.shared_expert_ffn_dim:
        writer.add_expert_shared_feed_forward_length(spec.shared_expert_ffn_dim)
    if spec.n_expert:
        writer.add_expert_count(spec.n_expert)
        writer.add_expert_used_count(spec.n_expert_used)
        writer.add_expert_feed_forward_length(spec.expert_ffn_dim)
    if spec.arch == "gemma3":
        writer.add_sliding_window(spec.sliding_window)
        tokens, scores, types = gemma_vocab()
        filler = _unused_tokens(len(tokens), spec.n_vocab)
        tokens, scores, types = tokens + filler, scores + [0.0] * len(filler), types + [5] * len(filler)
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        _add_gemma_specials(writer)
    elif spec.arch.startswith("qwen"):
        tokens, types, merges = qwen_vocab()
        filler = _unused_tokens(len(tokens), spec.n_vocab)
        tokens, types = tokens + filler, types + [5] * len(filler)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        writer.add_eos_token_id(tokens.index("<|im_end|>"))
        writer.add_bos_token_id(tokens.index("<|endoftext|>"))
        writer.add_add_bos_token(False)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    for name, (raw, qtype) in stored.items():
        if name in (override_types or {}):  # an arbitrary type (e.g. one we do not support): zero blocks
            qtype = override_types[name]
            shape = decoded[name].shape if name in decoded else gguf.quants.quant_shape_from_byte_shape(raw.shape, stored[name][1])
            raw = np.zeros(gguf.quants.quant_shape_to_byte_shape(shape, qtype), np.uint8)
        writer.add_tensor(name, raw, raw_dtype=qtype if qtype != T.F32 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return decoded


def hf_config(spec: TinySpec, n_vocab: int):
    """(transformers config, model class) with the spec's hyperparameters."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=n_vocab, hidden_size=spec.d_model, intermediate_size=spec.ffn_dim,
                  num_hidden_layers=spec.n_layer, num_attention_heads=spec.n_head, num_key_value_heads=spec.n_kv_head,
                  head_dim=spec.head_dim, max_position_embeddings=spec.ctx_train, rms_norm_eps=1e-6)
    if spec.gguf_arch == "gemma4":
        from transformers import Gemma4ForCausalLM, Gemma4TextConfig

        layer_types = ["sliding_attention" if gemma4_layer(spec, il)[0] else "full_attention" for il in range(spec.n_layer)]
        extra = dict(num_global_key_value_heads=spec.n_global_kv_head) if spec.n_global_kv_head else {}
        moe = dict(enable_moe_block=True, num_experts=spec.n_expert, top_k_experts=spec.n_expert_used,
                   moe_intermediate_size=spec.expert_ffn_dim) if spec.n_expert else {}
        config = Gemma4TextConfig(
            **common, **extra, **moe, global_head_dim=spec.global_head_dim, sliding_window=spec.sliding_window,
            layer_types=layer_types, hidden_activation="gelu_pytorch_tanh", attention_k_eq_v=spec.k_eq_v,
            hidden_size_per_layer_input=spec.per_layer_dim, vocab_size_per_layer_input=n_vocab,
            num_kv_shared_layers=spec.n_kv_shared, use_double_wide_mlp=spec.double_wide,
            final_logit_softcapping=spec.final_softcap or None, tie_word_embeddings=True,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                "rope_theta": spec.rope_base}})
        return config, Gemma4ForCausalLM
    if spec.arch == "gemma3":
        layer_types = ["sliding_attention" if (il % 6) < 5 else "full_attention" for il in range(spec.n_layer)]
        config = Gemma3TextConfig(**common, sliding_window=spec.sliding_window, query_pre_attn_scalar=spec.head_dim,
                                  layer_types=layer_types, hidden_activation="gelu_pytorch_tanh",
                                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                   "full_attention": {"rope_type": "default", "rope_theta": spec.rope_base}},
                                  attn_logit_softcapping=None, final_logit_softcapping=None, tie_word_embeddings=True)
        return config, Gemma3ForCausalLM
    rope = {"rope_type": "default", "rope_theta": spec.rope_base}
    if spec.arch in HYBRID_ARCHES:
        from transformers import (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig,
                                  Qwen3NextConfig, Qwen3NextForCausalLM)

        layer_types = ["linear_attention" if qwen35_recurrent(spec, il) else "full_attention"
                       for il in range(spec.n_layer)]
        moe = dict(num_experts=spec.n_expert, num_experts_per_tok=spec.n_expert_used,
                   moe_intermediate_size=spec.expert_ffn_dim,
                   shared_expert_intermediate_size=spec.shared_expert_ffn_dim) if spec.n_expert else {}
        if spec.arch == "qwen3next":
            config = Qwen3NextConfig(
                **common, **moe, layer_types=layer_types, linear_conv_kernel_dim=spec.conv_kernel,
                linear_key_head_dim=spec.ssm_k_dim, linear_value_head_dim=spec.ssm_v_dim,
                linear_num_key_heads=spec.ssm_k_heads, linear_num_value_heads=spec.ssm_v_heads,
                tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                rope_parameters={**rope, "partial_rotary_factor": spec.n_rot / spec.head_dim})
            return config, Qwen3NextForCausalLM
        if moe:
            del common["intermediate_size"]
        config = (Qwen3_5MoeTextConfig if moe else Qwen3_5TextConfig)(
            **common, **moe, layer_types=layer_types, linear_conv_kernel_dim=spec.conv_kernel,
            linear_key_head_dim=spec.ssm_k_dim, linear_value_head_dim=spec.ssm_v_dim,
            linear_num_key_heads=spec.ssm_k_heads, linear_num_value_heads=spec.ssm_v_heads, tie_word_embeddings=False,
            rope_parameters={**rope, "partial_rotary_factor": spec.n_rot / spec.head_dim,
                             "mrope_section": list(QWEN35_MROPE_SECTIONS)})
        return config, Qwen3_5MoeForCausalLM if moe else Qwen3_5ForCausalLM
    if spec.arch == "qwen3-moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
        config = Qwen3MoeConfig(**common, rope_parameters=rope, tie_word_embeddings=False, num_experts=spec.n_expert,
                                num_experts_per_tok=spec.n_expert_used, moe_intermediate_size=spec.expert_ffn_dim,
                                norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
        return config, Qwen3MoeForCausalLM
    cls_config, cls_model = (Qwen2Config, Qwen2ForCausalLM) if spec.arch == "qwen2" else (Qwen3Config, Qwen3ForCausalLM)
    config = cls_config(**common, rope_parameters=rope, tie_word_embeddings=False, attention_bias=spec.arch == "qwen2")
    return config, cls_model


_GEMMA4_NAMES = {"layer_output_scale.weight": "layer_scalar", "inp_gate.weight": "per_layer_input_gate.weight",
                 "proj.weight": "per_layer_projection.weight", "post_norm.weight": "post_per_layer_input_norm.weight",
                 "ffn_gate_inp.weight": "router.proj.weight", "ffn_gate_inp.scale": "router.scale",
                 "ffn_down_exps.scale": "router.per_expert_scale", "ffn_gate_up_exps.weight": "experts.gate_up_proj",
                 "ffn_down_exps.weight": "experts.down_proj", "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
                 "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
                 "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight"}


def hf_names(spec: TinySpec) -> tuple[dict[str, str], float]:
    """GGUF tensor name -> transformers parameter name, and the offset to subtract from norm weights (HF Gemma 3
    norms scale by 1 + w; the GGUF stores 1 + w; Gemma 4 norms scale by w)."""
    gemma = spec.arch.startswith("gemma")
    names = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
    per_layer = {"attn_norm.weight": "input_layernorm.weight", "attn_q.weight": "self_attn.q_proj.weight",
                 "attn_k.weight": "self_attn.k_proj.weight", "attn_v.weight": "self_attn.v_proj.weight",
                 "attn_output.weight": "self_attn.o_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
                 "attn_k.bias": "self_attn.k_proj.bias", "attn_v.bias": "self_attn.v_proj.bias",
                 "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
                 "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
                 "ffn_down.weight": "mlp.down_proj.weight",
                 "ffn_norm.weight": "pre_feedforward_layernorm.weight" if gemma else "post_attention_layernorm.weight",
                 "post_attention_norm.weight": "post_attention_layernorm.weight",
                 "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
    if spec.arch == "qwen3-moe":  # (gate and up experts are one fused tensor there: hf_model joins them)
        per_layer.update({"ffn_gate_inp.weight": "mlp.gate.weight", "ffn_down_exps.weight": "mlp.experts.down_proj"})
    if spec.gguf_arch == "gemma4":
        per_layer.update(_GEMMA4_NAMES)
        names.update({"per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
                      "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
                      "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight"})
    for il in range(spec.n_layer):
        for g_name, h_name in per_layer.items():
            names[f"blk.{il}.{g_name}"] = f"model.layers.{il}.{h_name}"
    return names, 1.0 if spec.arch == "gemma3" else 0.0


def _grouped_heads(x: np.ndarray, axis: int, n_k_heads: int, head_dim: int) -> np.ndarray:
    """Undo llama.cpp's converter's value-head reorder (_LinearAttentionVReorderBase) along `axis`: the GGUF holds
    value heads tiled over the key heads (head j * Hk + i), HF grouped by key head (head i * r + j)."""
    x = np.moveaxis(x, axis, 0)
    r = x.shape[0] // (n_k_heads * head_dim)
    grouped = x.reshape((r, n_k_heads, head_dim) + x.shape[1:]).swapaxes(0, 1).reshape(x.shape)
    return np.moveaxis(grouped, 0, axis)


def qwen35_hf_state(spec: TinySpec, decoded: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The tiny Qwen3.5's GGUF tensors as HF parameters: the inverse of llama.cpp's converter (Qwen3_5TextModel):
    norms stored as 1 + w (all but the DeltaNet's gated norm), A_log stored as -exp(A_log), the conv squeezed,
    value heads reordered from grouped to tiled."""
    nk, dk, dv = spec.ssm_k_heads, spec.ssm_k_dim, spec.ssm_v_dim
    qk = 2 * nk * dk
    layer = {"attn_norm.weight": "input_layernorm.weight",
             "post_attention_norm.weight": "post_attention_layernorm.weight",
             "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
             "ffn_down.weight": "mlp.down_proj.weight", "attn_q.weight": "self_attn.q_proj.weight",
             "attn_k.weight": "self_attn.k_proj.weight", "attn_v.weight": "self_attn.v_proj.weight",
             "attn_output.weight": "self_attn.o_proj.weight", "attn_q_norm.weight": "self_attn.q_norm.weight",
             "attn_k_norm.weight": "self_attn.k_norm.weight", "ffn_gate_inp.weight": "mlp.gate.weight",
             "ffn_down_exps.weight": "mlp.experts.down_proj", "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
             "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
             "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
             "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight"}
    def qkv(x):  # q and k keep their order, v's heads were reordered
        return np.concatenate([x[:qk], _grouped_heads(x[qk:], 0, nk, dv)])
    delta = {"attn_qkv.weight": ("in_proj_qkv.weight", qkv),
             "attn_gate.weight": ("in_proj_z.weight", lambda x: _grouped_heads(x, 0, nk, dv)),
             "ssm_alpha.weight": ("in_proj_a.weight", lambda x: _grouped_heads(x, 0, nk, 1)),
             "ssm_beta.weight": ("in_proj_b.weight", lambda x: _grouped_heads(x, 0, nk, 1)),
             "ssm_a": ("A_log", lambda x: np.log(-_grouped_heads(x, 0, nk, 1))),
             "ssm_dt.bias": ("dt_bias", lambda x: _grouped_heads(x, 0, nk, 1)),
             "ssm_conv1d.weight": ("conv1d.weight", lambda x: qkv(x)[:, None, :]),  # HF: [C, 1, K]
             "ssm_norm.weight": ("norm.weight", lambda x: x),
             "ssm_out.weight": ("out_proj.weight", lambda x: _grouped_heads(x, 1, nk, dv))}
    if spec.arch == "qwen3next":  # HF's order: no value-head reorder; q|k|v and z interleaved per key head
        def qkvz_of(layer: str) -> np.ndarray:
            qkv, z = decoded[layer + "attn_qkv.weight"], decoded[layer + "attn_gate.weight"]
            d = qkv.shape[1]
            q, k, v = qkv[:nk * dk], qkv[nk * dk:qk], qkv[qk:]
            parts = [t.reshape(nk, -1, d) for t in (q, k, v, z)]
            return np.concatenate(parts, axis=1).reshape(-1, d)
        delta = {part: (name, (lambda x: x) if part != "ssm_a" else (lambda x: np.log(-x)))
                 for part, (name, _) in delta.items()}
        delta["ssm_conv1d.weight"] = ("conv1d.weight", lambda x: x[:, None, :])
        delta["ssm_ba.weight"] = ("in_proj_ba.weight", lambda x: x)
    state = {"model.embed_tokens.weight": decoded["token_embd.weight"], "lm_head.weight": decoded["output.weight"],
             "model.norm.weight": decoded["output_norm.weight"] - 1.0}
    for g_name, values in decoded.items():
        if not g_name.startswith("blk."):
            continue
        _, il, part = g_name.split(".", 2)
        if part in ("ffn_gate_exps.weight", "ffn_up_exps.weight"):  # HF keeps them fused: [gate; up] per expert
            if part == "ffn_gate_exps.weight":
                state[f"model.layers.{il}.mlp.experts.gate_up_proj"] = np.concatenate(
                    [values, decoded[g_name.replace("gate_exps", "up_exps")]], axis=1)
            continue
        if spec.arch == "qwen3next" and part in ("attn_qkv.weight", "attn_gate.weight"):
            if part == "attn_qkv.weight":
                state[f"model.layers.{il}.linear_attn.in_proj_qkvz.weight"] = qkvz_of(f"blk.{il}.")
            continue
        if part in delta:
            h_name, convert = delta[part]
            state[f"model.layers.{il}.linear_attn.{h_name}"] = convert(values).astype(np.float32)
        else:
            state[f"model.layers.{il}.{layer[part]}"] = values - 1.0 if "norm" in part else values
    return state


def hf_model(spec: TinySpec, decoded: dict[str, np.ndarray]):
    """The transformers model with the same hyperparameters and exactly the decoded GGUF weights (float32)."""
    import torch

    config, cls = hf_config(spec, decoded["token_embd.weight"].shape[0])
    model = cls(config)
    names, norm_offset = hf_names(spec)
    state = {}
    if spec.arch in HYBRID_ARCHES:
        state = {name: torch.from_numpy(np.ascontiguousarray(values))
                 for name, values in qwen35_hf_state(spec, decoded).items()}
        decoded = {}
    for g_name, values in decoded.items():
        if g_name == "rope_freqs.weight":
            continue  # transformers computes the proportional rope itself
        if g_name.endswith(("ffn_gate_exps.weight", "ffn_up_exps.weight")):
            if g_name.endswith("ffn_gate_exps.weight"):  # Qwen3-MoE: [gate; up] per expert, as transformers fuses
                fused = np.concatenate([values, decoded[g_name.replace("gate_exps", "up_exps")]], axis=1)
                state[names[g_name.replace("ffn_gate_exps.weight", "attn_norm.weight")].replace(
                    "input_layernorm.weight", "mlp.experts.gate_up_proj")] = torch.from_numpy(fused)
            continue
        if "norm" in g_name:
            values = values - norm_offset
        state[names[g_name]] = torch.from_numpy(np.ascontiguousarray(values))
    if spec.arch.startswith("gemma"):
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if "rotary" not in m]
    if missing or unexpected:
        raise RuntimeError(f"HF state mismatch: missing {missing}, unexpected {unexpected}")
    return model.float().eval()


# --- the Gemma 4 assistant (MTP drafter, transformers' gemma4_assistant) -------------------------------------------

ASSISTANT_ARCH = "gemma4-assistant"  # llama.cpp's MODEL_ARCH.GEMMA4_ASSISTANT


@dataclass
class AssistantSpec:
    """A tiny Gemma 4 assistant for a tiny Gemma 4 target (`target`): Q-only layers reading the target's last
    sliding and last global caches (`sliding` per layer; the last layer global, as transformers forces), tied
    embeddings of its own width, and with n_centroids > 0 the E-series' masked embedder (the tokens of the top
    `centroid_top_k` centroids scored)."""

    target: TinySpec
    n_layer: int = 2
    d_model: int = 32
    n_head: int = 4
    ffn_dim: int = 64
    sliding: tuple[bool, ...] = (True, False)
    n_centroids: int = 0
    centroid_top_k: int = 0
    seed: int = 1
    types: dict = field(default_factory=lambda: {"attn_q.weight": T.Q8_0, "ffn_down.weight": T.F16})


def assistant_target_spec() -> TinySpec:
    """The E2B-like tiny Gemma 4 with its vocabulary padded to 288 (8 centroids of 36 tokens)."""
    spec = tiny_spec("gemma4")
    spec.n_vocab = 288
    return spec


def assistant_spec(masked: bool = False) -> AssistantSpec:
    """The tests' assistants: a 31B-like one (full output head) and an E-series-like one (masked embedder)."""
    target = assistant_target_spec()
    return AssistantSpec(target, n_centroids=8 if masked else 0, centroid_top_k=2 if masked else 0,
                         seed=2 if masked else 1)


def _assistant_shapes(spec: AssistantSpec, vocab: int) -> dict[str, tuple[int, ...]]:
    d, bb, nh = spec.d_model, spec.target.d_model, spec.n_head
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (vocab, d), "output_norm.weight": (d,), "rope_freqs.weight": (spec.target.global_head_dim // 2,),
        "nextn.pre_projection.weight": (d, 2 * bb), "nextn.post_projection.weight": (bb, d)}
    if spec.n_centroids:
        shapes["masked_embd_centroids.weight"] = (spec.n_centroids, d)
    for il, sliding in enumerate(spec.sliding):
        p, hd = f"blk.{il}.", spec.target.head_dim if sliding else spec.target.global_head_dim
        shapes.update({
            p + "attn_norm.weight": (d,), p + "attn_q.weight": (nh * hd, d), p + "attn_q_norm.weight": (hd,),
            p + "attn_output.weight": (d, nh * hd), p + "post_attention_norm.weight": (d,),
            p + "ffn_norm.weight": (d,), p + "ffn_gate.weight": (spec.ffn_dim, d), p + "ffn_up.weight": (spec.ffn_dim, d),
            p + "ffn_down.weight": (d, spec.ffn_dim), p + "post_ffw_norm.weight": (d,),
            p + "layer_output_scale.weight": (1,)})
    return shapes


def write_assistant_gguf(spec: AssistantSpec, path: Path) -> dict[str, np.ndarray]:
    """Write the tiny assistant as llama.cpp's converter (Gemma4AssistantModel) writes the real ones: arch
    `gemma4-assistant`, the Gemma 4 text keys, `embedding_length_out` (the target's width), `nextn_predict_layers`
    (every layer), `nextn.pre_projection` / `nextn.post_projection`; and, where the model has the masked embedder
    (which llama.cpp's converter drops), `masked_embd_centroids.weight`, `masked_embd_ordering` (I32) and
    `gemma4-assistant.centroid_intermediate_top_k`. Returns the decoded float32 tensors."""
    assert spec.n_layer == len(spec.sliding) and not spec.sliding[-1]
    target = spec.target
    tokens, types, merges = gemma4_vocab()
    filler = _unused_tokens(len(tokens), target.n_vocab)
    vocab = len(tokens) + len(filler)
    rng = np.random.default_rng(spec.seed)
    stored, decoded = {}, {}
    for name, shape in _assistant_shapes(spec, vocab).items():
        qtype = next((t for suffix, t in spec.types.items() if name.endswith(suffix)), T.F32)
        if len(shape) == 1 or shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
            qtype = T.F32
        if name == "rope_freqs.weight":
            values = _gemma4_rope_freqs(target)
        elif "norm" in name or name.endswith("scale.weight"):
            values = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            if name.endswith("attn_q_norm.weight"):  # (as the target's: unscaled q . k kept as sharp as elsewhere)
                values /= np.float32(np.sqrt(shape[0]))
        else:
            values = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
            if name == "token_embd.weight":  # logits of a useful spread (the head's input is RMS-normed)
                values *= np.float32(4.0)
        raw, dec = _store(values, qtype)
        stored[name] = (raw, qtype)
        decoded[name] = dec
    if spec.n_centroids:
        ordering = rng.permutation(vocab).astype(np.int32)
        stored["masked_embd_ordering"] = (ordering, None)
        decoded["masked_embd_ordering"] = ordering
    arch = ASSISTANT_ARCH
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny-gemma4-assistant")
    writer.add_block_count(spec.n_layer)
    writer.add_context_length(target.ctx_train)
    writer.add_embedding_length(spec.d_model)
    writer.add_feed_forward_length(spec.ffn_dim)
    writer.add_head_count(spec.n_head)
    writer.add_head_count_kv(target.n_kv_head)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_key_length(target.global_head_dim)
    writer.add_value_length(target.global_head_dim)
    writer.add_key_length_swa(target.head_dim)
    writer.add_value_length_swa(target.head_dim)
    writer.add_rope_freq_base(target.rope_base)
    writer.add_rope_freq_base_swa(10000.0)
    writer.add_rope_dimension_count(target.global_head_dim)
    writer.add_rope_dimension_count_swa(target.head_dim)
    writer.add_sliding_window(target.sliding_window)
    writer.add_sliding_window_pattern(list(spec.sliding))
    writer.add_shared_kv_layers(spec.n_layer)
    writer.add_embedding_length_per_layer_input(0)
    writer.add_uint32(f"{arch}.embedding_length_out", target.d_model)
    writer.add_uint32(f"{arch}.nextn_predict_layers", spec.n_layer)
    if spec.n_centroids:
        writer.add_uint32(f"{arch}.centroid_intermediate_top_k", spec.centroid_top_k)
    writer.add_tokenizer_model("gemma4")
    writer.add_tokenizer_pre("gemma4")
    writer.add_token_list(tokens + filler)
    writer.add_token_types(types + [5] * len(filler))
    writer.add_token_merges(merges)
    _add_gemma_specials(writer)
    for name, (raw, qtype) in stored.items():
        writer.add_tensor(name, raw, raw_dtype=qtype if qtype not in (T.F32, None) else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return decoded


_ASSISTANT_LAYER_NAMES = {"attn_norm.weight": "input_layernorm.weight", "attn_q.weight": "self_attn.q_proj.weight",
                          "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_output.weight": "self_attn.o_proj.weight",
                          "post_attention_norm.weight": "post_attention_layernorm.weight",
                          "ffn_norm.weight": "pre_feedforward_layernorm.weight", "ffn_gate.weight": "mlp.gate_proj.weight",
                          "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight",
                          "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
                          "layer_output_scale.weight": "layer_scalar"}


def hf_assistant_model(spec: AssistantSpec, decoded: dict[str, np.ndarray]):
    """transformers' Gemma4AssistantForCausalLM with the spec's shapes and exactly the decoded GGUF weights."""
    import torch
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4TextConfig

    target = spec.target
    vocab = decoded["token_embd.weight"].shape[0]
    text = Gemma4TextConfig(
        vocab_size=vocab, hidden_size=spec.d_model, intermediate_size=spec.ffn_dim, num_hidden_layers=spec.n_layer,
        num_attention_heads=spec.n_head, num_key_value_heads=target.n_kv_head, head_dim=target.head_dim,
        global_head_dim=target.global_head_dim, max_position_embeddings=target.ctx_train, rms_norm_eps=1e-6,
        sliding_window=target.sliding_window,
        layer_types=["sliding_attention" if s else "full_attention" for s in spec.sliding],
        hidden_activation="gelu_pytorch_tanh", hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
        num_kv_shared_layers=spec.n_layer, use_double_wide_mlp=False, enable_moe_block=False, tie_word_embeddings=True,
        final_logit_softcapping=None,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                            "rope_theta": target.rope_base}})
    config = Gemma4AssistantConfig(text_config=text, backbone_hidden_size=target.d_model,
                                   use_ordered_embeddings=bool(spec.n_centroids), num_centroids=spec.n_centroids or 1,
                                   centroid_intermediate_top_k=spec.centroid_top_k or 1, tie_word_embeddings=True)
    model = Gemma4AssistantForCausalLM(config)
    names = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "nextn.pre_projection.weight": "pre_projection.weight",
             "nextn.post_projection.weight": "post_projection.weight",
             "masked_embd_centroids.weight": "masked_embedding.centroids.weight",
             "masked_embd_ordering": "masked_embedding.token_ordering"}
    for il in range(spec.n_layer):
        names.update({f"blk.{il}.{g}": f"model.layers.{il}.{h}" for g, h in _ASSISTANT_LAYER_NAMES.items()})
    state = {names[g]: torch.from_numpy(np.ascontiguousarray(values)) for g, values in decoded.items()
             if g != "rope_freqs.weight"}
    if "masked_embedding.token_ordering" in state:
        state["masked_embedding.token_ordering"] = state["masked_embedding.token_ordering"].long()
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if "rotary" not in m]
    if missing or unexpected:
        raise RuntimeError(f"HF assistant state mismatch: missing {missing}, unexpected {unexpected}")
    model.generation_config.num_assistant_tokens = 4
    return model.float().eval()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--preset", choices=sorted(PRESETS), help="write one model with a real model's shapes")
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.preset:
        path = args.out_dir / f"random-{args.preset}.gguf"
        write_gguf(PRESETS[args.preset], path)
        print(path)
        return 0
    for arch in ARCHES + HYBRID_ARCHES:
        path = args.out_dir / f"tiny-{arch}.gguf"
        write_gguf(tiny_spec(arch), path)
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
