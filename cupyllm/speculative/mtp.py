"""Qwen3.5 / Qwen3-Next NextN (multi-token-prediction) heads as a drafter (`--spec-type mtp`).

A Qwen3.5 file converted with its MTP block carries it after the decoder's blocks (`nextn_predict_layers` of
them; models/qwen35.py NextNWeights). For the target position i, with h_i the target's hidden state there (the
decoder stack's output after its final RMSNorm: what the logits of position i are taken from) and t_{i+1} the
token that followed:

    x_i  = W_eh [ RMSNorm(Embed(t_{i+1}); enorm) | RMSNorm(h_i; hnorm) ]     (embedding first, then hidden)
    x_i  = Block(x_i)          a full-attention decoder layer (gated attention, MLP or experts) over the MTP
                               rows 0..i, with a KV cache of its own, at position i
    h'_i = RMSNorm(x_i; shared_head_norm),   logits_i = W_out h'_i          -> a guess of t_{i+2}

Drafting k tokens after the pending token t_n chains the head on its own output: d_1 from row n - 1 (pair
(t_n, h_{n-1})), then d_{j+1} from the row at position n - 1 + j with the pair (d_j, h'_{n-2+j}).

Sources (the order of the concat and which norm reads what): vLLM vllm/model_executor/models/qwen3_5_mtp.py and
qwen3_next_mtp.py (`Qwen3_5MultiTokenPredictor.forward`: inputs_embeds = pre_fc_norm_embedding(embed(ids)),
hidden = pre_fc_norm_hidden(hidden), fc(cat([inputs_embeds, hidden])), one `full_attention` decoder layer, then
`norm`; the target hands over the hidden states its own `compute_logits` reads, i.e. after its final norm, and
the head's normed output is what it chains on); llama.cpp src/models/qwen35.cpp (`graph_mtp`: concat(enorm(embd),
hnorm(h)) -> eh_proj -> attn_norm / gated attention / post_attention_norm / FFN -> shared_head_norm, that
output kept as `t_h_nextn` for the next draft step; the target's `t_h_nextn` is the output_norm'ed state) and its
converter conversion/qwen.py `_Qwen35MtpMixin` (the tensor names). transformers does not implement Qwen's MTP (it
drops the `mtp.*` weights), so `mtp_reference` below, written from vLLM's code in NumPy, is the definition the
engine path (`mtp_forward`, the backend's ops: CPU and GPU) is tested against.

The drafter keeps the target's hidden rows as its forward produces them (MTPDrafter.target_forward wraps the
target's forward), folds the verified positions into its cache when asked for drafts, and cuts the rows of its
own chained drafts before the next step: its cache only ever holds rows of tokens the target kept.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np

from ..errors import InputError
from ..files.config import ModelConfig
from ..files.gguf import GGUFFile
from ..kv.cache import KVCache, KVSpec
from ..models.qwen35 import NextNWeights, nextn_weights, qwen35_block
from ..models.residual import ResidualStream


def mtp_config(cfg: ModelConfig) -> ModelConfig:
    """The MTP block as a one-layer model: full attention of the decoder's attention shapes (its KV cache)."""
    return dataclasses.replace(cfg, n_layer=1, recurrent_layers=(False,), layer_order=(), sliding_layers=())


def mtp_forward(ops, cfg: ModelConfig, w: NextNWeights, token_embd, tokens: np.ndarray, hidden,
                positions: np.ndarray, cache: KVCache):
    """The engine's MTP step over rows (tokens[j] = t_{i+1}, hidden[j] = h_i) at the MTP cache's `positions`
    (appending to `cache`, a one-layer cache of mtp_config); the normed output rows h' (logits: W_out h')."""
    eps, xp = cfg.norm_eps, ops.xp
    embedded = ops.rms_norm(ops.embed(w.embed if w.embed is not None else token_embd, tokens), w.enorm, eps)
    x = ops.linear(xp.concatenate([embedded, ops.rms_norm(hidden, w.hnorm, eps)], axis=-1), w.eh_proj)
    stream = ResidualStream(ops, x, eps)
    qwen35_block(ops, mtp_config(cfg), w.block, 0, stream, positions, cache)
    return stream.norm(w.head_norm)


def mtp_reference(tensors: Mapping[str, np.ndarray], cfg: ModelConfig, layer: int, next_tokens: Sequence[int],
                  hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """NumPy definition of the MTP block `layer` (blk.{layer}.*, float tensors by GGUF name) over rows 0..n-1 of
    one sequence, each attending to the rows before it: row i reads (next_tokens[i], hidden[i]) at position i.
    Returns (h' [n, d], logits [n, n_vocab]), float64. Plain rope only (no scaling, no frequency factors)."""
    if cfg.rope.scaling != "none" or cfg.rope.freq_factors:
        raise NotImplementedError("mtp_reference: plain rope only")
    t = {name: np.asarray(value, np.float64) for name, value in tensors.items()}
    p, eps = f"blk.{layer}.", cfg.norm_eps
    n, hd, nh, nkv = len(next_tokens), cfg.head_dim, cfg.n_head, cfg.n_kv_head

    def rms(x, weight):
        return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * weight

    def silu(x):
        return x / (1.0 + np.exp(-x))

    def sigmoid(x):
        return 1.0 / (1.0 + np.exp(-x))

    embed = t.get(p + "nextn.embed_tokens.weight", t["token_embd.weight"])
    e = rms(embed[np.asarray(next_tokens)], t[p + "nextn.enorm.weight"])
    h = rms(np.asarray(hidden, np.float64), t[p + "nextn.hnorm.weight"])
    x = np.concatenate([e, h], axis=-1) @ t[p + "nextn.eh_proj.weight"].T

    # gated attention: per head its q rows then its gate rows; q and k RMS-normed per head, NEOX rope on the
    # first n_rot dims, causal softmax(q.k / sqrt(hd)) with query head j reading KV head j // (nh / nkv)
    a = rms(x, t[p + "attn_norm.weight"])
    q_gate = (a @ t[p + "attn_q.weight"].T).reshape(n, nh, 2, hd)
    q, gate = rms(q_gate[:, :, 0], t[p + "attn_q_norm.weight"]), q_gate[:, :, 1].reshape(n, nh * hd)
    k = rms((a @ t[p + "attn_k.weight"].T).reshape(n, nkv, hd), t[p + "attn_k_norm.weight"])
    v = (a @ t[p + "attn_v.weight"].T).reshape(n, nkv, hd)
    half = cfg.rope.n_rot // 2
    angle = np.arange(n)[:, None] * cfg.rope.base ** (-2.0 * np.arange(half) / cfg.rope.n_rot)[None, :]
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]

    def rope(z):
        z = z.copy()
        first, second = z[..., :half].copy(), z[..., half:2 * half].copy()
        z[..., :half], z[..., half:2 * half] = first * cos - second * sin, second * cos + first * sin
        return z

    q, k = rope(q), rope(k)
    group = nh // nkv
    out = np.zeros((n, nh, hd))
    causal = np.tril(np.ones((n, n), bool))
    for head in range(nh):
        scores = q[:, head] @ k[:, head // group].T / np.sqrt(hd)
        scores = np.where(causal, scores, -np.inf)
        weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
        out[:, head] = (weights / weights.sum(axis=-1, keepdims=True)) @ v[:, head // group]
    x = x + (out.reshape(n, nh * hd) * sigmoid(gate)) @ t[p + "attn_output.weight"].T

    m = rms(x, t[p + "post_attention_norm.weight"])
    if cfg.n_expert:  # softmax over every expert, the top k renormalised, beside a sigmoid-gated shared expert
        probs = np.exp(m @ t[p + "ffn_gate_inp.weight"].T)
        probs /= probs.sum(axis=-1, keepdims=True)
        mlp = np.zeros_like(x)
        for row in range(n):
            top = np.argsort(-probs[row], kind="stable")[:cfg.n_expert_used]
            for e_id, weight in zip(top, probs[row, top] / probs[row, top].sum()):
                gate_e, up_e = (t[p + f"ffn_{name}_exps.weight"][e_id] @ m[row] for name in ("gate", "up"))
                mlp[row] += weight * (t[p + "ffn_down_exps.weight"][e_id] @ (silu(gate_e) * up_e))
        shared = (silu(m @ t[p + "ffn_gate_shexp.weight"].T) * (m @ t[p + "ffn_up_shexp.weight"].T)) \
            @ t[p + "ffn_down_shexp.weight"].T
        mlp += shared * sigmoid(m @ t[p + "ffn_gate_inp_shexp.weight"].reshape(1, -1).T)
    else:
        mlp = (silu(m @ t[p + "ffn_gate.weight"].T) * (m @ t[p + "ffn_up.weight"].T)) @ t[p + "ffn_down.weight"].T
    x = x + mlp

    head_norm = t.get(p + "nextn.shared_head_norm.weight", t["output_norm.weight"])
    out_rows = rms(x, head_norm)
    head = t.get(p + "nextn.shared_head_head.weight", t.get("output.weight", t["token_embd.weight"]))
    return out_rows, out_rows @ head.T


class MTPDrafter:
    """Greedy drafts of a NextN head (see the module docstring). `target`: the target Transformer; `weights`:
    its NextN block on the target's backend; `cache`: the head's own one-layer cache (mtp_config's); chunk: the
    most rows run at once; p_min: stop drafting where the head's own probability of its token is below it.

    `target_forward` replaces the target's forward in the token loop: the same logits, and the hidden rows kept
    for the head. The head's cache position of target position i is i - base, base being the first position
    whose hidden row it saw (a prompt cache's positions have none; should the target go back past what the head
    holds, it starts over there): attention is relative, so the offset changes nothing within what it holds."""

    def __init__(self, target, weights: NextNWeights, cache: KVCache, chunk: int, p_min: float = 0.75,
                 threads: int | None = None):
        self.target, self.w, self.cache, self.chunk, self.p_min, self.threads = \
            target, weights, cache, chunk, p_min, threads
        self.output = weights.head if weights.head is not None else target.output
        self.execute = lambda work: work()  # runs the head's forwards (the server: on its batcher's thread)
        self.reset()

    @classmethod
    def for_model(cls, model) -> "MTPDrafter":
        """The drafter of a loaded cupyllm Model (api.Model): the file's first NextN block on the model's backend,
        and a cache of the model's context and KV types for it."""
        check_mtp_file(model.gguf, model.transformer.stored.cfg)
        target = model.transformer
        weights = nextn_weights(model.gguf, target.stored.cfg).on(target.ops)
        cache = target.ops.new_cache(mtp_config(target.cfg), mtp_cache_spec(model.kv_spec))
        return cls(target, weights, cache, model.kv_spec.max_chunk, threads=model.threads)

    def reset(self) -> None:
        """Forget everything: a new generation."""
        self.cache.clear()
        self.base = self.done = 0  # head cache position 0 is target position base; rows folded in: [base, done)
        self._rows, self._rows_start = None, 0  # target hidden rows of positions [rows_start, rows_start + len)

    # --- the target's side -------------------------------------------------------------------------------
    def target_forward(self, tokens, positions, cache, all_logits=False):
        """The target's forward (float32 NumPy logits, as Model._forward_numpy), keeping its hidden rows."""
        ops = self.target.ops
        with ops.running_on(self.threads):
            out = self.target.forward(tokens, positions, cache, all_logits, on_hidden=lambda rows: self._keep(
                int(positions[0]), rows))
            return np.asarray(ops.to_numpy(out), dtype=np.float32)

    def _keep(self, start: int, rows) -> None:
        if start < self.done:  # the target went back past what the head folded in (a cache reused or shifted)
            self.cache.clear()
            self.base = self.done = start
        if self._rows is None or not self._rows_start <= start <= self._rows_start + len(self._rows):
            self._rows, self._rows_start = rows, start  # (rows past `start` are of tokens the target dropped)
        else:
            self._rows = self.target.ops.xp.concatenate([self._rows[:start - self._rows_start], rows])

    # --- drafting ----------------------------------------------------------------------------------------
    def draft(self, history: Sequence[int], n_max: int) -> list[int]:
        """At most n_max tokens to follow `history` (the target's held tokens and the pending one after them)."""
        if n_max <= 0:
            return []
        n = len(history) - 1  # the target holds positions [0, n); history[n] is pending
        self.cache.truncate(self.done - self.base)  # the last step's chained drafts go
        if self._rows is None or self._rows_start + len(self._rows) < n:
            return []  # (no hidden rows up to the pending token: nothing to draft from)
        if self._rows_start > self.done or self.done > n:  # a gap the head cannot fill: start over from the rows
            self.cache.clear()
            self.base = self.done = self._rows_start
        if self.done == n:  # (the pending token's row was folded in: only after a caller's odd history)
            return []
        if n - self.base + n_max > self.cache.spec.ctx:
            return []
        out = None
        for start in range(self.done, n, self.chunk):
            stop = min(start + self.chunk, n)
            rows = self._rows[start - self._rows_start:stop - self._rows_start]
            out = self._run(np.asarray(history[start + 1:stop + 1], dtype=np.int64), rows, start)
        self.done = n
        self._rows, self._rows_start = self._rows[n - self._rows_start:], n  # (folded rows are not needed again)
        drafts: list[int] = []
        hidden = out[-1:]
        ops = self.target.ops
        for i in range(n_max):
            logits = np.asarray(self.execute(lambda: ops.to_numpy(ops.linear(hidden, self.output))),
                                np.float32).reshape(-1)
            token = int(np.argmax(logits))
            if self.p_min > 0.0 and 1.0 / np.exp(logits - logits[token]).sum() < self.p_min:
                break
            drafts.append(token)
            if i + 1 == n_max:
                break
            hidden = self._run(np.array([token], dtype=np.int64), hidden, n + i)
        return drafts

    def _run(self, tokens: np.ndarray, hidden, start: int):
        """The head over rows at target positions [start, start + len(tokens)), appended to its cache."""
        ops = self.target.ops
        positions = np.arange(start - self.base, start - self.base + len(tokens))
        def work():
            with ops.running_on(self.threads):
                return mtp_forward(ops, self.target.cfg, self.w, self.target.token_embd, tokens, hidden, positions,
                                   self.cache)
        out = self.execute(work)
        self.cache.n_past += len(tokens)
        return out


def mtp_cache_spec(spec: KVSpec) -> KVSpec:
    """The head's cache: the target's context, KV types and chunk, one plain layer (no spill, window or tail)."""
    return KVSpec(ctx=spec.ctx, kv_type_k=spec.kv_type_k, kv_type_v=spec.kv_type_v, max_chunk=spec.max_chunk,
                  normalize_k=spec.normalize_k, float_mirror=spec.float_mirror)


def check_mtp_file(gguf: GGUFFile, cfg: ModelConfig) -> None:
    """InputError unless the file carries a NextN head cupyllm runs (spec type "mtp")."""
    if cfg.n_nextn_layer == 0:
        raise InputError(f"{gguf.path.name} has no NextN (MTP) head: spec type 'mtp' (--spec-type mtp) drafts with "
                         "the multi-token-prediction layers of Qwen3.5 / Qwen3-Next GGUFs converted with them "
                         f"(`{cfg.arch}.nextn_predict_layers` > 0); use a GGUF that carries them, or --spec-type "
                         "ngram, or a draft model (-md FILE)")
