"""What a GGUF's hyperparameters promise, checked against each other and against its tensors.

`files/gguf.py` checks the file's layout (counts, lengths, offsets, types); this module checks its meaning, as
llama.cpp's loader does when it creates every tensor with the shape the hyperparameters require:

- `Hyperparameters` reads metadata with its type and range checked (an integer is an integer, a rope base or an
  epsilon is finite and positive, a per-layer array has one entry per layer), each failure one ModelFileError
  naming the file, the key, the value and what was expected.
- `check_tokenizer_metadata` checks the vocabulary's arrays and special token ids (in range).
- `check_tensors` builds the tensor table a model of the configuration must have (`expected_tensors`), refuses
  the file when a required tensor is missing, has another shape, or belongs to a configuration the
  hyperparameters rule out (K on a KV-shared layer, experts in a dense model), and sets aside, with one
  warning, tensors no architecture here reads.
"""
from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ModelFileError, ModelFileWarning
from .gguf import GGUFFile

_REQUIRED = object()
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _show(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"an array of {len(value)} {value.dtype}" if value.size > 8 else f"{value.tolist()}"
    if isinstance(value, list):
        return f"a list of {len(value)} items"
    return repr(value)[:80]


class Hyperparameters:
    """Typed, range-checked reads of one GGUF's metadata."""

    def __init__(self, gguf: GGUFFile, arch: str):
        self.gguf, self.arch, self.path = gguf, arch, gguf.path

    def fail(self, key: str, value: Any, expected: str) -> ModelFileError:
        return ModelFileError(f"{self.path}: metadata '{key}' is {_show(value)}, expected {expected}; the file is "
                              f"corrupt or not a valid {self.arch} model")

    def _raw(self, key: str, default: Any):
        value = self.gguf.get(key)
        if value is None:
            if default is _REQUIRED:
                raise ModelFileError(f"{self.path}: metadata key '{key}' is missing; the file is not a complete "
                                     f"{self.arch} model")
            return None
        return value

    def integer(self, key: str, default: Any = _REQUIRED, lo: int = 0, hi: int | None = None) -> int:
        """An integer in [lo, hi] (a per-layer array is refused: see per_layer / uniform)."""
        value = self._raw(key, default)
        if value is None:
            return default
        expected = f"an integer >= {lo}" + (f" and <= {hi}" if hi is not None else "")
        if not _is_int(value) or value < lo or (hi is not None and value > hi):
            raise self.fail(key, value, expected)
        return int(value)

    def real(self, key: str, default: Any = _REQUIRED, positive: bool = True) -> float:
        """A finite float, > 0 when `positive` (>= 0 otherwise). An integer is refused, as llama.cpp refuses a
        key of another type than it reads: a float key stored as an integer is a corrupt type field."""
        value = self._raw(key, default)
        if value is None:
            return default
        if (not isinstance(value, (float, np.floating)) or not math.isfinite(float(value))
                or (float(value) <= 0 if positive else float(value) < 0)):
            raise self.fail(key, value, "a finite float " + ("> 0" if positive else ">= 0"))
        return float(value)

    def text(self, key: str, default: Any = _REQUIRED) -> str | None:
        value = self._raw(key, default)
        if value is None:
            return default
        if not isinstance(value, str):
            raise self.fail(key, value, "a string")
        return value

    def per_layer(self, key: str, n_layer: int, default: Any = _REQUIRED, lo: int = 0,
                  hi: int | None = None) -> tuple[int, ...]:
        """One integer per layer: a scalar for all, or an array of n_layer integers."""
        value = self._raw(key, default)
        if value is None:
            return (default,) * n_layer
        if isinstance(value, np.ndarray):
            if len(value) != n_layer or value.dtype.kind not in "iub":
                raise self.fail(key, value, f"one integer, or an array of {n_layer} integers (one per layer)")
            values = tuple(int(v) for v in value)
            if any(v < lo or (hi is not None and v > hi) for v in values):
                raise self.fail(key, value, f"integers >= {lo}" + (f" and <= {hi}" if hi is not None else ""))
            return values
        return (self.integer(key, default, lo, hi),) * n_layer

    def uniform(self, key: str, n_layer: int, default: Any = _REQUIRED, lo: int = 0, hi: int | None = None) -> int:
        """One integer for every layer; a per-layer array must repeat one value (cupyllm runs these
        architectures with one value for all layers)."""
        values = self.per_layer(key, n_layer, default, lo, hi)
        if len(set(values)) > 1:
            raise ModelFileError(f"{self.path}: metadata '{key}' differs between layers ({sorted(set(values))}); "
                                 f"cupyllm runs {self.arch} with one value for every layer")
        return values[0] if values else (default if default is not _REQUIRED else lo)


_TOKEN_TYPES = range(0, 7)  # llama.cpp's LLAMA_TOKEN_TYPE_*: undefined, normal, unknown, control, user, unused, byte


def check_tokenizer_metadata(gguf: GGUFFile, n_vocab: int) -> None:
    """The vocabulary's arrays have one entry per token and the types the tokenizer reads; special token ids
    and flags are in range."""
    path, meta = gguf.path, gguf.metadata

    def fail(key, value, expected):
        return ModelFileError(f"{path}: metadata '{key}' is {_show(value)}, expected {expected}; the vocabulary "
                              "is corrupt")

    # (the reader returns a list only for an array of strings, every item a str)
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is not None and not isinstance(tokens, list):
        raise fail("tokenizer.ggml.tokens", tokens, "an array of strings")
    for key, kinds in (("tokenizer.ggml.scores", "iuf"), ("tokenizer.ggml.token_type", "iu")):
        value = meta.get(key)
        if value is None:
            continue
        if not isinstance(value, np.ndarray) or value.dtype.kind not in kinds or len(value) != n_vocab:
            raise fail(key, value, f"an array of {n_vocab} {'numbers' if 'f' in kinds else 'integers'} (one per token)")
        types = _TOKEN_TYPES
        if key.endswith("token_type") and len(value) and (value.min() < types.start or value.max() >= types.stop):
            raise fail(key, value, f"token types {types.start}..{types.stop - 1}")
        if key.endswith("scores") and np.isnan(value).any():
            raise fail(key, value, "scores that are numbers (no NaN)")
    merges = meta.get("tokenizer.ggml.merges")
    if merges is not None and not isinstance(merges, list):
        raise fail("tokenizer.ggml.merges", merges, "an array of strings")
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template"):
        if key in meta and not isinstance(meta[key], str):
            raise fail(key, meta[key], "a string")
    for key, value in meta.items():
        if not key.startswith("tokenizer.ggml."):
            continue
        if key.endswith("_token_id") and (not _is_int(value) or not 0 <= value < n_vocab):
            raise fail(key, value, f"a token id in 0..{n_vocab - 1}")
        if key.startswith("tokenizer.ggml.add_") and not isinstance(value, (bool, np.bool_)):
            raise fail(key, value, "a boolean")


@dataclass(frozen=True)
class Expected:
    shape: tuple[int, ...]
    required: bool = True


# Tensor names (per block: the part after "blk.N.") that the model code reads for some configuration. One of
# these where the hyperparameters rule it out is an error (the model code would read it); any other name is
# unknown and set aside with a warning.
_KNOWN_GLOBAL = {"token_embd.weight", "output.weight", "output_norm.weight", "rope_freqs.weight",
                 "per_layer_token_embd.weight", "per_layer_model_proj.weight", "per_layer_proj_norm.weight"}
_KNOWN_BLOCK = {
    "attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "attn_q.bias",
    "attn_qkv.weight", "attn_gate.weight", "ssm_alpha.weight", "ssm_beta.weight", "ssm_a", "ssm_dt.bias",
    "ssm_conv1d.weight", "ssm_norm.weight", "ssm_out.weight", "ssm_ba.weight", "ffn_gate_inp_shexp.weight",
    "ffn_gate_shexp.weight",
    "ffn_up_shexp.weight", "ffn_down_shexp.weight",
    "attn_k.bias", "attn_v.bias", "attn_q_norm.weight", "attn_k_norm.weight", "post_attention_norm.weight",
    "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight", "post_ffw_norm.weight",
    "layer_output_scale.weight", "inp_gate.weight", "proj.weight", "post_norm.weight", "ffn_gate_inp.weight",
    "ffn_gate_inp.scale", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_gate_up_exps.weight",
    "ffn_down_exps.weight", "ffn_down_exps.scale", "pre_ffw_norm_2.weight", "post_ffw_norm_1.weight",
    "post_ffw_norm_2.weight",
}


def block_indices(gguf: GGUFFile) -> set[int]:
    """The N of every `blk.N.<known name>` tensor."""
    found = set()
    for name in gguf.tensors:
        match = _BLOCK.fullmatch(name)
        if match and match.group(2) in _KNOWN_BLOCK:
            found.add(int(match.group(1)))
    return found


def check_block_count(gguf: GGUFFile, key: str, n_layer: int) -> None:
    """`block_count` equals the blocks the file holds, checked before anything is sized by it."""
    present = block_indices(gguf)
    if len(present) != n_layer or present != set(range(n_layer)):
        missing = sorted(set(range(min(n_layer, max(present, default=-1) + 2))) - present)[:3]
        detail = (f"blocks {min(present)}..{max(present)} ({len(present)} distinct)" if present else "no blocks")
        raise ModelFileError(f"{gguf.path}: metadata '{key}' is {n_layer} but the file holds tensors of {detail}"
                             + (f", none of block {missing[0]}" if missing else "")
                             + "; the file is corrupt or incomplete")


def expected_tensors(gguf: GGUFFile, cfg, layer_ffn: tuple[int, ...],
                     expert_ffn: tuple[int, ...]) -> dict[str, Expected]:
    """Every tensor a model of `cfg` reads, with its row-major shape and whether it must be present (what
    llama.cpp's load_tensors creates for the architecture). `layer_ffn` / `expert_ffn`: the MLP and expert
    widths per layer. Where the file may take one of two forms (experts' gate and up fused or apart), the form
    it has is expected."""
    d, v, arch = cfg.d_model, cfg.n_vocab, cfg.arch
    gemma4 = arch == "gemma4"
    table = {"token_embd.weight": Expected((v, d)), "output_norm.weight": Expected((d,)),
             "output.weight": Expected((v, d), required=False)}  # absent: tied to the embedding
    if cfg.rope.n_rot // 2:
        table["rope_freqs.weight"] = Expected((cfg.rope.n_rot // 2,), required=False)
    if cfg.per_layer_dim:
        width = cfg.n_layer * cfg.per_layer_dim
        table.update({"per_layer_token_embd.weight": Expected((v, width)),
                      "per_layer_model_proj.weight": Expected((width, d)),
                      "per_layer_proj_norm.weight": Expected((cfg.per_layer_dim,))})
    for il in range(cfg.n_layer):
        p = f"blk.{il}."
        if cfg.ssm is not None:
            rows = _hybrid_layer_tensors(cfg, il, layer_ffn[il], expert_ffn[il], gguf)
            table.update({p + name: spec for name, spec in rows.items()})
            continue
        hd, vhd, nkv, nh = cfg.head_dim_of(il), cfg.v_head_dim_of(il), cfg.n_kv_head_of(il), cfg.n_head
        has_kv = cfg.kv_source(il) == il
        rows = {"attn_norm.weight": Expected((d,)), "attn_q.weight": Expected((nh * hd, d)),
                "attn_output.weight": Expected((d, nh * vhd)), "ffn_norm.weight": Expected((d,))}
        if has_kv:
            rows["attn_k.weight"] = Expected((nkv * hd, d))
            rows["attn_v.weight"] = Expected((nkv * vhd, d), required=not gemma4)  # Gemma 4: absent, V = K
        if arch == "qwen2":
            rows.update({"attn_q.bias": Expected((nh * hd,)), "attn_k.bias": Expected((nkv * hd,)),
                         "attn_v.bias": Expected((nkv * vhd,))})
        if cfg.qk_norm:
            rows["attn_q_norm.weight"] = Expected((hd,))
            if has_kv:
                rows["attn_k_norm.weight"] = Expected((hd,))
        if cfg.sandwich_norm:
            rows.update({"post_attention_norm.weight": Expected((d,)), "post_ffw_norm.weight": Expected((d,))})
        if arch != "qwen3moe":  # Qwen3-MoE's MLP is its experts alone
            f = layer_ffn[il]
            rows.update({"ffn_gate.weight": Expected((f, d)), "ffn_up.weight": Expected((f, d)),
                         "ffn_down.weight": Expected((d, f))})
        if cfg.n_expert:
            e, fe = cfg.n_expert, expert_ffn[il]
            rows.update({"ffn_gate_inp.weight": Expected((e, d)), "ffn_down_exps.weight": Expected((e, d, fe))})
            if p + "ffn_gate_up_exps.weight" in gguf.tensors:
                rows["ffn_gate_up_exps.weight"] = Expected((e, 2 * fe, d))
            else:
                rows.update({"ffn_gate_exps.weight": Expected((e, fe, d)), "ffn_up_exps.weight": Expected((e, fe, d))})
            if gemma4:
                rows.update({"ffn_gate_inp.scale": Expected((d,)),
                             "ffn_down_exps.scale": Expected((e,), required=False),
                             "pre_ffw_norm_2.weight": Expected((d,)), "post_ffw_norm_1.weight": Expected((d,)),
                             "post_ffw_norm_2.weight": Expected((d,))})
        if gemma4:
            rows["layer_output_scale.weight"] = Expected((1,), required=False)
            if cfg.per_layer_dim:
                rows.update({"inp_gate.weight": Expected((cfg.per_layer_dim, d)),
                             "proj.weight": Expected((d, cfg.per_layer_dim)), "post_norm.weight": Expected((d,))})
        table.update({p + name: spec for name, spec in rows.items()})
    return table


def _hybrid_layer_tensors(cfg, il: int, ffn: int, expert_ffn: int, gguf: GGUFFile) -> dict[str, Expected]:
    """Qwen3.5's layer il as llama.cpp's converter writes it: the norm before the token mixer (`attn_norm`) and
    before the MLP (`post_attention_norm`), a SwiGLU MLP, and either the Gated DeltaNet (q|k|v projection
    `attn_qkv`, its output gate `attn_gate`, the decay and write-strength projections `ssm_alpha` / `ssm_beta`,
    `ssm_a` = -exp(A_log), `ssm_dt.bias`, the conv `ssm_conv1d` [channels, taps], the gated norm `ssm_norm` over
    a value head, `ssm_out`) or full attention whose `attn_q` gives each head's q and its output gate. The MoE
    model's MLP: the router, the experts' gate, up and down, and a shared expert with its gate (`_shexp`)."""
    d, f, s = cfg.d_model, ffn, cfg.ssm
    rows = {"attn_norm.weight": Expected((d,)), "post_attention_norm.weight": Expected((d,))}
    if cfg.n_expert:
        e, fe, fs = cfg.n_expert, expert_ffn, cfg.shared_expert_ffn
        shared_gate = gguf.tensors.get(f"blk.{il}.ffn_gate_inp_shexp.weight")
        rows.update({"ffn_gate_inp.weight": Expected((e, d)), "ffn_gate_exps.weight": Expected((e, fe, d)),
                     "ffn_up_exps.weight": Expected((e, fe, d)), "ffn_down_exps.weight": Expected((e, d, fe)),
                     "ffn_gate_shexp.weight": Expected((fs, d)), "ffn_up_shexp.weight": Expected((fs, d)),
                     "ffn_down_shexp.weight": Expected((d, fs)),
                     # [1, d] as the converter writes HF's shared_expert_gate; llama.cpp also reads [d]
                     "ffn_gate_inp_shexp.weight": Expected((d,) if shared_gate is not None
                                                           and len(shared_gate.shape) == 1 else (1, d))})
    else:
        rows.update({"ffn_gate.weight": Expected((f, d)), "ffn_up.weight": Expected((f, d)),
                     "ffn_down.weight": Expected((d, f))})
    if cfg.is_recurrent(il):
        value = s.n_v_heads * s.v_head_dim
        if cfg.arch == "qwen3next":  # per key head: its value heads' beta inputs, then their alpha inputs
            rows["ssm_ba.weight"] = Expected((2 * s.n_v_heads, d))
        else:
            rows.update({"ssm_alpha.weight": Expected((s.n_v_heads, d)), "ssm_beta.weight": Expected((s.n_v_heads, d))})
        rows.update({"attn_qkv.weight": Expected((s.conv_channels, d)), "attn_gate.weight": Expected((value, d)),
                     "ssm_a": Expected((s.n_v_heads,)), "ssm_dt.bias": Expected((s.n_v_heads,)),
                     "ssm_conv1d.weight": Expected((s.conv_channels, s.conv_kernel)),
                     "ssm_norm.weight": Expected((s.v_head_dim,)), "ssm_out.weight": Expected((d, value))})
    else:
        hd, nh, nkv = cfg.head_dim, cfg.n_head, cfg.n_kv_head
        rows.update({"attn_q.weight": Expected((2 * nh * hd, d)), "attn_k.weight": Expected((nkv * hd, d)),
                     "attn_v.weight": Expected((nkv * hd, d)), "attn_output.weight": Expected((d, nh * hd)),
                     "attn_q_norm.weight": Expected((hd,)), "attn_k_norm.weight": Expected((hd,))})
    return rows


def _why_not(cfg, name: str) -> str:
    """Why the hyperparameters rule out a tensor the model code knows."""
    match = _BLOCK.fullmatch(name)
    if match:
        il, part = int(match.group(1)), match.group(2)
        if part.startswith(("attn_k", "attn_v")) and cfg.kv_source(il) != il:
            return f"layer {il} reads layer {cfg.kv_source(il)}'s KV cache (attention.shared_kv_layers)"
        if "exps" in part or part.startswith(("ffn_gate_inp", "pre_ffw_norm_2", "post_ffw_norm_")):
            return ("expert_count is 0 (a dense model)" if not cfg.n_expert
                    else "the experts' gate and up are stored both fused and apart")
        if part in ("inp_gate.weight", "proj.weight", "post_norm.weight"):
            return "embedding_length_per_layer_input is 0"
        if cfg.ssm is not None:
            kind = "linear-attention" if cfg.is_recurrent(il) else "full-attention"
            return f"layer {il} is a {kind} layer (full_attention_interval)"
    elif name.startswith("per_layer_"):
        return "embedding_length_per_layer_input is 0"
    return f"{cfg.arch} has no such tensor"


def check_tensors(gguf: GGUFFile, cfg, layer_ffn: tuple[int, ...], expert_ffn: tuple[int, ...]) -> None:
    """Refuse the file unless every tensor a model of `cfg` needs is there with its expected shape and none
    it rules out is; set aside (gguf.unused_tensors) and warn about tensors of no known name."""
    table = expected_tensors(gguf, cfg, layer_ffn, expert_ffn)
    unknown = []
    for name, info in gguf.tensors.items():
        if cfg.is_nextn_tensor(name):  # a NextN (MTP) head's: the MTP drafter checks it (models/qwen35.py)
            continue
        spec = table.get(name)
        if spec is not None:
            if tuple(info.shape) != spec.shape:
                raise ModelFileError(f"{gguf.path}: tensor '{name}' has shape {list(info.shape)}, expected "
                                     f"{list(spec.shape)} from the hyperparameters (d_model {cfg.d_model}, "
                                     f"{cfg.n_head} heads, {cfg.n_kv_head} KV heads, head dim {cfg.head_dim}, "
                                     f"vocabulary {cfg.n_vocab}); the file is corrupt or its metadata disagrees "
                                     "with its tensors")
            continue
        match = _BLOCK.fullmatch(name)
        if name in _KNOWN_GLOBAL or (match and match.group(2) in _KNOWN_BLOCK):
            raise ModelFileError(f"{gguf.path}: tensor '{name}' does not belong in this model: {_why_not(cfg, name)}; "
                                 "the file is corrupt or its metadata disagrees with its tensors")
        unknown.append(name)
    for name, spec in table.items():
        if spec.required and name not in gguf.tensors:
            raise ModelFileError(f"{gguf.path}: tensor '{name}' (shape {list(spec.shape)}) is missing; the file is "
                                 f"incomplete or is not a {cfg.arch} model of the shape its metadata gives")
    if unknown:
        for name in unknown:
            gguf.unused_tensors[name] = gguf.tensors.pop(name)
        shown = ", ".join(f"'{n}'" for n in unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
        warnings.warn(f"{gguf.path}: {len(unknown)} tensor(s) that cupyllm does not use for {cfg.arch}, ignored: "
                      f"{shown}", ModelFileWarning, stacklevel=3)
