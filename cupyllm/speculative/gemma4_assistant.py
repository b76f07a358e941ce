"""The Gemma 4 assistant: a small drafter that reads the target's own state (transformers' `gemma4_assistant`,
llama.cpp's `gemma4-assistant` GGUF and `--spec-type draft-mtp`).

Each draft is one step of a few Q-only Gemma 4 layers at the position P of the pending token (the token sampled
but not yet run through the target), the same position for every draft of a run:

    x   = W_pre [ E_target(t) * sqrt(d_target) ; h ]     t: the last token, h: the target's normed output row at
                                                         P - 1 (then each draft's projected state, below)
    per layer:  q = RoPE_P(RMSNorm_q(W_q RMSNorm(x)))    K, V: the target's cache of its last layer of the same
                x = x + PostNorm(W_o Attn(q; K, V))      kind (sliding / global), positions < P; no K/V of its own
                x = (x + PostNorm(MLP(PreNorm(x)))) * layer_output_scale
    n   = RMSNorm(x);  logits = E_assistant n  (tied; the E-series scores only the tokens of the top centroids:
          Gemma4AssistantMaskedEmbedder);  h' = W_post n  (the next draft's h)

The attention reads the target's LayerKV through the backend's own attention op, so rotated (turbo/TCQ) and
normalised K are read as the target reads them: the query meets the key the cache stores, transformed alike.
A sliding layer sees the last window + 1 keys before P, as transformers' flipped bidirectional window mask
gives them (the target itself sees window keys, its own among them). With Dual Chunk Attention on the target, a
global layer's keys are cached at their in-chunk positions: the assistant's query is roped at P's three DCA
positions (intra, successive, inter) and meets them as the target's own queries do (ops.dca_attention).

The GGUF layout is llama.cpp's (convert_hf_to_gguf.py Gemma4AssistantModel, src/models/gemma4-assistant.cpp):
the Gemma 4 text keys under `gemma4-assistant.`, `embedding_length_out` = the target's width,
`nextn.pre_projection.weight` [d, 2 d_target], `nextn.post_projection.weight` [d_target, d], per layer
attn_norm / attn_q / attn_q_norm / attn_output / post_attention_norm / ffn_* / post_ffw_norm /
layer_output_scale, no attn_k / attn_v. llama.cpp's converter drops the masked embedder; where a file keeps it
(`masked_embd_centroids.weight` [n_centroids, d], `masked_embd_ordering` I32 [n_vocab]) the top-k comes from
`gemma4-assistant.centroid_intermediate_top_k` (transformers' name; default 32): a key of cupyllm's, no
llama.cpp key exists for it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np
from gguf import GGMLQuantizationType

from ..errors import InputError, ModelFileError
from ..files.config import ModelConfig, RopeConfig, _rope_freq_factors, _rope_scaling, _rotary_dims
from ..files.gguf import GGUFFile
from ..files.validate import Hyperparameters
from ..models.residual import ResidualStream
from ..models.weights import Weight, load_matrix, load_vector
from ..ops.attention.dca import query_positions
from ..ops.matmul.reference import dequantize, weight_format

ARCH = "gemma4-assistant"


@dataclass(frozen=True)
class AssistantConfig:
    n_layer: int
    d_model: int
    backbone_dim: int  # the target's width (embedding_length_out)
    n_head: int
    n_kv_head: int  # per kind, the target's (the assistant attends over the target's cache)
    sliding_layers: tuple[bool, ...]
    head_dim: int  # global layers' (key_length)
    head_dim_swa: int
    ffn_dim: int
    n_vocab: int
    norm_eps: float
    sliding_window: int
    rope: RopeConfig
    rope_local: RopeConfig
    n_centroids: int = 0  # the masked embedder (0: every token scored)
    centroid_top_k: int = 0

    def head_dim_of(self, layer: int) -> int:
        return self.head_dim_swa if self.sliding_layers[layer] else self.head_dim

    def rope_for(self, layer: int) -> RopeConfig:
        return self.rope_local if self.sliding_layers[layer] else self.rope

    @property
    def attention_window(self) -> int:
        """The sliding layers' window in the backend's terms (key k seen from query position P where
        P - k < window): transformers' assistant sees the last sliding_window + 1 keys before P."""
        return self.sliding_window + 2


def is_assistant(gguf: GGUFFile) -> bool:
    return gguf.get("general.architecture") == ARCH


def assistant_config(gguf: GGUFFile) -> AssistantConfig:
    """The assistant's hyperparameters, read and range-checked as llama.cpp's loader reads them."""
    if not is_assistant(gguf):
        raise ModelFileError(f"{gguf.path}: architecture '{gguf.get('general.architecture')}' is not a Gemma 4 "
                             f"assistant ({ARCH})")
    hp, a = Hyperparameters(gguf, ARCH), ARCH
    n_layer = hp.integer(f"{a}.block_count", lo=1)
    d_model = hp.integer(f"{a}.embedding_length", lo=1)
    backbone = hp.integer(f"{a}.embedding_length_out", lo=1)
    n_head = hp.uniform(f"{a}.attention.head_count", n_layer, lo=1)
    kv_heads = hp.per_layer(f"{a}.attention.head_count_kv", n_layer, n_head, lo=1)
    head_dim = hp.integer(f"{a}.attention.key_length", lo=1)
    head_dim_swa = hp.integer(f"{a}.attention.key_length_swa", head_dim, lo=1)
    if hp.integer(f"{a}.attention.value_length", head_dim) != head_dim or \
            hp.integer(f"{a}.attention.value_length_swa", head_dim_swa) != head_dim_swa:
        raise ModelFileError(f"{gguf.path}: a Gemma 4 assistant needs value length = key length")
    pattern = gguf.get(f"{a}.attention.sliding_window_pattern", False)
    if isinstance(pattern, np.ndarray):
        if len(pattern) != n_layer:
            raise hp.fail(f"{a}.attention.sliding_window_pattern", pattern, f"an array of {n_layer} booleans")
        sliding = tuple(bool(v) for v in pattern)
    else:
        sliding = (bool(pattern),) * n_layer
    n_rot = _rotary_dims(hp, f"{a}.rope.dimension_count", head_dim, partial=True)
    rope = _rope_scaling(hp, a, n_rot, hp.real(f"{a}.rope.freq_base", 10000.0))
    if "rope_freqs.weight" in gguf.tensors:
        rope = replace(rope, freq_factors=_rope_freq_factors(gguf))
    rope_local = RopeConfig(base=hp.real(f"{a}.rope.freq_base_swa", rope.base),
                            n_rot=_rotary_dims(hp, f"{a}.rope.dimension_count_swa", head_dim_swa, partial=True))
    embd = gguf.tensor("token_embd.weight")
    n_centroids = 0
    if "masked_embd_centroids.weight" in gguf.tensors:
        n_centroids = gguf.tensor("masked_embd_centroids.weight").shape[0]
    cfg = AssistantConfig(
        n_layer=n_layer, d_model=d_model, backbone_dim=backbone, n_head=n_head, n_kv_head=kv_heads[0],
        sliding_layers=sliding, head_dim=head_dim, head_dim_swa=head_dim_swa,
        ffn_dim=hp.uniform(f"{a}.feed_forward_length", n_layer, lo=1), n_vocab=embd.shape[0],
        norm_eps=hp.real(f"{a}.attention.layer_norm_rms_epsilon", 1e-6),
        sliding_window=hp.integer(f"{a}.attention.sliding_window", 512, lo=1), rope=rope, rope_local=rope_local,
        n_centroids=n_centroids,
        centroid_top_k=hp.integer(f"{a}.centroid_intermediate_top_k", 32, lo=1, hi=max(n_centroids, 1))
        if n_centroids else 0)
    _check_shapes(gguf, cfg)
    return cfg


def _check_shapes(gguf: GGUFFile, cfg: AssistantConfig) -> None:
    d, bb = cfg.d_model, cfg.backbone_dim
    want = {"token_embd.weight": (cfg.n_vocab, d), "output_norm.weight": (d,),
            "nextn.pre_projection.weight": (d, 2 * bb), "nextn.post_projection.weight": (bb, d)}
    if cfg.n_centroids:
        want["masked_embd_centroids.weight"] = (cfg.n_centroids, d)
        want["masked_embd_ordering"] = (cfg.n_vocab,)
        if cfg.n_vocab % cfg.n_centroids:
            raise ModelFileError(f"{gguf.path}: {cfg.n_centroids} centroids do not divide the {cfg.n_vocab} tokens")
    for il in range(cfg.n_layer):
        p, hd, ff = f"blk.{il}.", cfg.head_dim_of(il), cfg.ffn_dim
        want.update({p + "attn_norm.weight": (d,), p + "attn_q.weight": (cfg.n_head * hd, d),
                     p + "attn_q_norm.weight": (hd,), p + "attn_output.weight": (d, cfg.n_head * hd),
                     p + "post_attention_norm.weight": (d,), p + "ffn_norm.weight": (d,),
                     p + "ffn_gate.weight": (ff, d), p + "ffn_up.weight": (ff, d), p + "ffn_down.weight": (d, ff),
                     p + "post_ffw_norm.weight": (d,), p + "layer_output_scale.weight": (1,)})
    for name, shape in want.items():
        if name not in gguf.tensors:
            raise ModelFileError(f"{gguf.path}: the Gemma 4 assistant has no tensor '{name}'; the file is not a "
                                 "complete assistant (convert it with llama.cpp's convert_hf_to_gguf.py)")
        if tuple(gguf.tensor(name).shape) != shape:
            raise ModelFileError(f"{gguf.path}: tensor '{name}' has shape {tuple(gguf.tensor(name).shape)}, the "
                                 f"hyperparameters give {shape}")


@dataclass(frozen=True)
class AssistantLayer:
    attn_norm: object
    wq: Weight
    q_norm: object
    wo: Weight
    post_attn_norm: object
    ffn_norm: object
    w_gate: Weight
    w_up: Weight
    w_down: Weight
    post_ffn_norm: object
    out_scale: object


def _f32_weight(name: str, values: np.ndarray) -> Weight:
    """A float32 matrix as an F32 Weight (GGUF rows of 4-byte floats)."""
    values = np.ascontiguousarray(values, np.float32)
    return Weight(name, weight_format(GGMLQuantizationType.F32), values.shape,
                  values.view(np.uint8).reshape(values.shape[0], -1))


class Gemma4Assistant:
    """The assistant's weights on a backend, and one draft step on its operations (`step`)."""

    def __init__(self, cfg: AssistantConfig, gguf: GGUFFile, ops):
        self.cfg, self.ops, self.path = cfg, ops, gguf.path
        pre = load_matrix(gguf, "nextn.pre_projection.weight")  # (its type checked)
        pre = dequantize(pre.data, gguf.tensor(pre.name).type, 2 * cfg.backbone_dim).reshape(cfg.d_model, -1)
        # [E ; h] meets W_pre as two products (no concatenation on the device): its halves as F32 matrices
        self.pre_embd = ops.upload(_f32_weight("nextn.pre_projection.embd", pre[:, :cfg.backbone_dim]))
        self.pre_hidden = ops.upload(_f32_weight("nextn.pre_projection.hidden", pre[:, cfg.backbone_dim:]))
        self.post = ops.upload(load_matrix(gguf, "nextn.post_projection.weight"))
        self.token_embd = ops.upload(load_matrix(gguf, "token_embd.weight"))
        self.output_norm = ops.asarray(load_vector(gguf, "output_norm.weight"))
        vec = lambda name: ops.asarray(load_vector(gguf, name))  # noqa: E731
        mat = lambda name: ops.upload(load_matrix(gguf, name))  # noqa: E731
        self.layers = [AssistantLayer(
            attn_norm=vec(f"blk.{il}.attn_norm.weight"), wq=mat(f"blk.{il}.attn_q.weight"),
            q_norm=vec(f"blk.{il}.attn_q_norm.weight"), wo=mat(f"blk.{il}.attn_output.weight"),
            post_attn_norm=vec(f"blk.{il}.post_attention_norm.weight"), ffn_norm=vec(f"blk.{il}.ffn_norm.weight"),
            w_gate=mat(f"blk.{il}.ffn_gate.weight"), w_up=mat(f"blk.{il}.ffn_up.weight"),
            w_down=mat(f"blk.{il}.ffn_down.weight"), post_ffn_norm=vec(f"blk.{il}.post_ffw_norm.weight"),
            out_scale=vec(f"blk.{il}.layer_output_scale.weight")) for il in range(cfg.n_layer)]
        self.centroids = self.ordering = None
        if cfg.n_centroids:
            self.centroids = ops.upload(load_matrix(gguf, "masked_embd_centroids.weight"))
            ordering = np.asarray(gguf.tensor("masked_embd_ordering").data).view(np.int32).reshape(-1)
            if sorted(ordering.tolist()) != list(range(cfg.n_vocab)):
                raise ModelFileError(f"{gguf.path}: masked_embd_ordering is not a permutation of the "
                                     f"{cfg.n_vocab} token ids")
            self.ordering = ordering.reshape(cfg.n_centroids, -1).astype(np.int64)  # [centroid, its tokens]
        self.sources: tuple[int, ...] = ()  # per layer: the target layer whose cache it reads (bind())

    @classmethod
    def from_gguf(cls, gguf: GGUFFile, ops) -> "Gemma4Assistant":
        return cls(assistant_config(gguf), gguf, ops)

    def bind(self, target: ModelConfig) -> "Gemma4Assistant":
        """Check the assistant fits `target` and pick, per layer, the target cache it reads: that of the target's
        last layer of its kind (the last that writes one: a KV-shared layer reads an earlier one's)."""
        cfg, name = self.cfg, self.path.name if hasattr(self.path, "name") else str(self.path)
        if target.arch != "gemma4":
            raise InputError(f"{name} is a Gemma 4 assistant; it drafts for a Gemma 4 model, not {target.arch}")
        problems = []
        if cfg.backbone_dim != target.d_model:
            problems.append(f"it was trained for a model of width {cfg.backbone_dim}, this one has {target.d_model}")
        if abs(cfg.n_vocab - target.n_vocab) > 128:
            problems.append(f"its vocabulary has {cfg.n_vocab} tokens, the model's {target.n_vocab}")
        sources = []
        for il, sliding in enumerate(cfg.sliding_layers):
            kind = [layer for layer in range(target.n_layer) if target.is_sliding(layer) == sliding]
            if not kind:
                problems.append(f"its layer {il} reads a {'sliding' if sliding else 'global'} layer's cache; the "
                                "model has none")
                continue
            source = target.kv_source(kind[-1])
            sources.append(source)
            if target.head_dim_of(source) != cfg.head_dim_of(il):
                problems.append(f"its layer {il} has head dim {cfg.head_dim_of(il)}, the cache it reads "
                                f"{target.head_dim_of(source)}")
            if cfg.n_head % target.n_kv_head_of(source):
                problems.append(f"its {cfg.n_head} heads are not groups of the cache's "
                                f"{target.n_kv_head_of(source)} KV heads")
        if problems:
            raise InputError(f"{name} is not an assistant of this model: " + "; ".join(problems) +
                             ". Use the assistant released with this model (e.g. gemma-4-E2B-it-assistant for "
                             "gemma-4-E2B-it)")
        self.sources = tuple(sources)
        return self

    def step(self, target, cache, token: int, hidden, position: int, dca=None):
        """One draft: (logits [1, n_vocab], the next draft's hidden [1, d_target]) on the backend, from the
        target (a Transformer: its embedding), its cache (positions < `position`), the last token and h; `dca`:
        the target's Dual Chunk Attention (DCAConfig) where it runs with it."""
        ops, cfg = self.ops, self.cfg
        positions = np.array([position], dtype=np.int64)
        x = ops.embed(target.token_embd, np.array([token], dtype=np.int64)) * np.float32(target.cfg.embed_scale)
        x = ops.linear(x, self.pre_embd) + ops.linear(hidden, self.pre_hidden)
        stream = ResidualStream(ops, x, cfg.norm_eps)
        for il, w in enumerate(self.layers):
            hd = cfg.head_dim_of(il)
            q = ops.linear(stream.norm(w.attn_norm), w.wq).reshape(1, cfg.n_head, hd)
            layer_kv = cache.layers[self.sources[il]]
            if dca is not None and not cfg.sliding_layers[il]:
                q_intra, q_successive, q_inter = (
                    ops.rope_qk(q, None, cfg.rope_for(il), p, q_norm=w.q_norm, eps=cfg.norm_eps)[0]
                    for p in query_positions(positions, dca))
                out = ops.dca_attention(q_intra, q_successive, q_inter, positions, layer_kv, dca, scale=1.0)
            else:
                q, _ = ops.rope_qk(q, None, cfg.rope_for(il), positions, q_norm=w.q_norm, eps=cfg.norm_eps)
                window = cfg.attention_window if cfg.sliding_layers[il] else 0
                out = ops.attention(q, positions, layer_kv, scale=1.0, window=window)
            stream.add(ops.linear(out.reshape(1, cfg.n_head * hd), w.wo), post_norm=w.post_attn_norm)
            mlp = ops.linear(ops.gated_linear(stream.norm(w.ffn_norm), w.w_gate, "gelu_tanh", w_up=w.w_up), w.w_down)
            stream.add(mlp, post_norm=w.post_ffn_norm, scale=w.out_scale)
        normed = stream.norm(self.output_norm)
        return self._logits(normed), ops.linear(normed, self.post)

    def _logits(self, normed):
        ops = self.ops
        if self.centroids is None:
            return ops.linear(normed, self.token_embd)
        top = _top_k(ops.to_numpy(ops.linear(normed, self.centroids)).reshape(-1), self.cfg.centroid_top_k)
        ids = self.ordering[top].reshape(-1)
        rows = ops.embed(self.token_embd, ids)  # [top_k * tokens per centroid, d], dequantized
        selected = ops.to_numpy(rows @ normed.reshape(-1)).astype(np.float32)
        return ops.asarray(_scatter(selected, ids, self.cfg.n_vocab)[None])


def _top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest scores, largest first (ties: the lower index)."""
    order = np.argsort(-scores, kind="stable")
    return order[:k]


def _scatter(selected: np.ndarray, ids: np.ndarray, n_vocab: int) -> np.ndarray:
    """Logits of every token: the selected ones at their ids, the rest below them all (transformers: their
    minimum minus 1)."""
    out = np.full(n_vocab, selected.min() - np.float32(1.0), np.float32)
    out[ids] = selected
    return out


# --- the definition, in NumPy -------------------------------------------------------------------------------------

def reference_step(cfg: AssistantConfig, tensors: dict[str, np.ndarray], target_embedding: np.ndarray,
                   embed_scale: float, hidden: np.ndarray, position: int,
                   kv: dict[bool, tuple[np.ndarray, np.ndarray, np.ndarray]], dca=None):
    """One assistant step from float32 tensors (GGUF names, decoded), the target's embedding row of the last
    token (unscaled), its hidden row h, and the target's K/V per kind (True: sliding): (k [n, n_kv, hd],
    v, their positions), all before `position`. Returns (logits [n_vocab], h' [d_target]), float32. `dca` (a
    DCAConfig): the target's Dual Chunk Attention, its global K roped at in-chunk positions as it caches them."""
    from ..ops.attention.dca import attend_dca
    from ..ops.attention.reference import attend, causal_mask
    from ..ops.elementwise.reference import apply_rope, gelu_tanh, rms_norm, rope_tables

    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    eps = cfg.norm_eps
    xh = np.concatenate([f32(target_embedding) * np.float32(embed_scale), f32(hidden)])
    x = f32(tensors["nextn.pre_projection.weight"] @ xh)
    for il, sliding in enumerate(cfg.sliding_layers):
        p, hd = f"blk.{il}.", cfg.head_dim_of(il)
        q = f32(tensors[p + "attn_q.weight"] @ f32(rms_norm(x, tensors[p + "attn_norm.weight"], eps)))
        q = f32(rms_norm(q.reshape(1, cfg.n_head, hd), tensors[p + "attn_q_norm.weight"], eps))
        rope = cfg.rope_for(il)
        k, v, k_pos = kv[sliding]
        if dca is not None and not sliding:
            q_intra, q_successive, q_inter = (apply_rope(q, *rope_tables(rope, p), rope.neox)
                                              for p in query_positions(np.array([position]), dca))
            out, _ = attend_dca(q_intra, q_successive, q_inter, f32(k), f32(v), np.array([position]), k_pos, dca,
                                scale=1.0)
        else:
            cos, sin = rope_tables(rope, np.array([position]))
            q = apply_rope(q, cos, sin, rope.neox)
            allowed = causal_mask(np.array([position]), k_pos, cfg.attention_window if sliding else 0)
            out, _ = attend(q, f32(k), f32(v), allowed, scale=1.0)
        attn = f32(tensors[p + "attn_output.weight"] @ out.reshape(-1))
        x = x + f32(rms_norm(attn, tensors[p + "post_attention_norm.weight"], eps))
        h = f32(rms_norm(x, tensors[p + "ffn_norm.weight"], eps))
        mlp = tensors[p + "ffn_down.weight"] @ (gelu_tanh(f32(tensors[p + "ffn_gate.weight"] @ h))
                                                * f32(tensors[p + "ffn_up.weight"] @ h))
        x = x + f32(rms_norm(f32(mlp), tensors[p + "post_ffw_norm.weight"], eps))
        x = x * tensors[p + "layer_output_scale.weight"]
    n = f32(rms_norm(x, tensors["output_norm.weight"], eps))
    embd = tensors["token_embd.weight"]
    if cfg.n_centroids:
        top = _top_k(f32(tensors["masked_embd_centroids.weight"] @ n), cfg.centroid_top_k)
        ids = np.asarray(tensors["masked_embd_ordering"], np.int64).reshape(cfg.n_centroids, -1)[top].reshape(-1)
        logits = _scatter(f32(embd[ids] @ n), ids, cfg.n_vocab)
    else:
        logits = f32(embd @ n)
    return logits, f32(tensors["nextn.post_projection.weight"] @ n)


# --- the drafter --------------------------------------------------------------------------------------------------

class AssistantDrafter:
    """Drafts with a Gemma4Assistant from the target's own state. The target must run through `target_forward` (in
    place of its plain forward): it keeps the normed output rows of the last forward, whose row at P - 1 (P: the
    pending token's position, the cache's length) is the first draft's h. Drafts greedily, stopping where the
    assistant's top probability is under p_min; none where that row is not at hand (a prompt cache held the whole
    prompt: the next step has it)."""

    def __init__(self, assistant: Gemma4Assistant, target, threads: int | None = None, p_min: float = 0.0):
        self.dca = getattr(target.attention, "dca", None)  # (the one attention hook the assistant can read past)
        if target.attention is not None and self.dca is None:
            raise InputError("the Gemma 4 assistant drafts from the model's cache as plain attention or Dual Chunk "
                             "Attention reads it, not with this model's attention: drop the assistant")
        self.assistant, self.target, self.threads, self.p_min = assistant.bind(target.cfg), target, threads, p_min
        self.cache = None
        self._rows = None  # (positions, tokens, normed rows on the backend) of the last target forward
        self.execute = lambda work: work()  # runs the assistant's steps (a server: on its batcher's thread)

    def target_forward(self, tokens, positions, cache, all_logits: bool = False) -> np.ndarray:
        """The target's forward (logits as float32 NumPy), keeping its normed output rows."""
        target = self.target
        with target.ops.running_on(self.threads):
            normed = target.hidden(tokens, positions, cache)
            self.cache, self._rows = cache, (np.asarray(positions).copy(), np.asarray(tokens).copy(), normed)
            out = target.logits(normed if all_logits else normed[-1:])
            return np.asarray(target.ops.to_numpy(out), dtype=np.float32)

    def draft(self, history: Sequence[int], n_max: int) -> list[int]:
        if n_max <= 0 or self._rows is None or len(history) < 2:
            return []
        position = len(history) - 1  # the pending token's (the cache holds the history before it)
        positions, tokens, normed = self._rows
        at = np.flatnonzero(positions == position - 1)
        if self.cache is None or self.cache.n_past != position or not len(at) or \
                int(tokens[at[0]]) != int(history[position - 1]):
            return []  # that row is not the last forward's (a shifted or another cache)
        ops = self.target.ops
        token, hidden = int(history[-1]), normed[int(at[0]):int(at[0]) + 1]

        def work() -> list[int]:
            drafts: list[int] = []
            with ops.running_on(self.threads):
                step, state = token, hidden
                for _ in range(n_max):
                    logits, state = self.assistant.step(self.target, self.cache, step, state, position, self.dca)
                    logits = np.asarray(ops.to_numpy(logits), np.float32).reshape(-1)
                    step = int(np.argmax(logits))
                    if self.p_min > 0.0 and 1.0 / np.exp(logits - logits[step]).sum() < self.p_min:
                        break
                    if step >= self.target.cfg.n_vocab:
                        break
                    drafts.append(step)
            return drafts

        return self.execute(work)


__all__ = ["ARCH", "AssistantConfig", "AssistantDrafter", "Gemma4Assistant", "assistant_config", "is_assistant",
           "reference_step"]
