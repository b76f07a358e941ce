"""Measured quality of every KV-cache format: KLD and perplexity on real models, MSE on N(0, 1) vectors.

For each model and each K/V configuration the tool runs one fixed text (default tests/data/kv_eval_text.txt,
about 2,330 tokens) through the model on the CPU from an empty cache of that configuration, with the
engine's chunked prefill (``cupyllm.generate.prefill`` with ``all_logits=True``, exactly what
``Model.logits`` does): every chunk is written into the quantized cache before it attends, so later tokens
see quantized K/V. At every position it compares the next-token distribution Q with that of the f16 cache P:

* ``KLD = sum_v P(v) (log P(v) - log Q(v))`` (float64 from the float32 logits; KL(P || Q), as llama.cpp's
  ``--kl-divergence`` reports it), mean / median / p99 over positions, with a bootstrap 95% interval;
* the perplexity ``exp(mean NLL)`` of the text's own next tokens (positions 0 .. n-2), and the change against
  f16 with a paired bootstrap 95% interval;
* top-1 agreement: how often Q's most likely token is P's.

The f32 cache is the exactness check and the noise floor: its KLD against f16 is what f16's own rounding costs.

The model is loaded once per model; each configuration gets its own fresh ``KVCache`` of the same spec
``cupyllm.load(..., kv_type_k=, kv_type_v=)`` would build. The f16 logits are kept in a float32 memmap in
``--work-dir`` (2.4 GB for Gemma's 262k vocabulary) so nothing holds more than one chunk of logits;
per-position results are saved there too, and a rerun reuses them (delete the folder to start over).

Also: MSE per value of ``decode(encode(x))`` on N(0, 1) rows for every format at G = 128 and G = 64, beside
the Lloyd-Max MSE of N(0, 1) at the format's code bits and the Gaussian rate-distortion bound ``2^(-2R)``
at its storage bits per value R.

    python tools/kv_quality.py                                  # the full table (about 1.5 h on 2 cores)
    python tools/kv_quality.py --models qwen --configs q8_0 turbo3_tcq/turbo2_tcq --tokens 512
    python tools/kv_quality.py --codebook-dir /tmp/cb --configs turbo3_tcq turbo2_tcq   # try other TCQ codebooks
    python tools/kv_quality.py --configs q8_0 q4_0 "f16>q4_0@128" "q8_0>q4_0@128" --tokens 2048   # mixed tails

A configuration "MAIN>TAIL@N" (each side K or K/V) is a mixed cache (kv/window.py, --kv-window N -ctkt -ctvt):
every global layer's newest N positions in MAIN, older ones in TAIL.

Writes bench/results/kv_quality.json and bench/results/kv_quality.md.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import cupyllm  # noqa: E402
from cupyllm.generate import prefill  # noqa: E402
from cupyllm.kv import get_format, is_rotated, list_formats
from cupyllm.ops.kv_formats import lloyd_max, tcq, turbo  # noqa: E402
from cupyllm.kv.cache import KVCache, KVSpec, key_normalization  # noqa: E402

BASELINE = "f16"
DEFAULT_TEXT = ROOT / "tests" / "data" / "kv_eval_text.txt"
# The pairs, plus q8_0/turbo2 and q8_0/turbo2_tcq: with K in q8_0 the KLD stays in the small-error
# regime where it tracks the V error, so turbo2_tcq vs turbo2 can be compared there too.
DEFAULT_PAIRS = ("q8_0/q4_0", "q8_0/turbo3", "q8_0/turbo3_tcq", "turbo3_tcq/turbo2_tcq", "q8_0/turbo2",
                 "q8_0/turbo2_tcq")
ROW_BLOCK = 32  # logit rows turned into float64 log-probabilities at a time (memory: ROW_BLOCK * vocab * 8 B)
BOOTSTRAP = 1000
NOISE_TOKENS = 256  # tokens of the text the attention-logit noise diagnostic runs over

# Published median KLD (Qwen3.6-27B, 16k context) for the ordering comparison.
# Mixed types by position (kv/window.py) with a small window: between uniform q8_0 and q4_0 in quality (issue 35).
DEFAULT_MIXED = ("f16>q4_0@128", "q8_0>q4_0@128")

REFERENCE_MEDIAN_KLD = {"q8_0": 0.0002, "q4_0": 0.0012, "turbo4": 0.0009, "turbo3_tcq": 0.0016, "turbo3": 0.0028,
                        "turbo2_tcq": 0.0056, "turbo2": 0.0108}


# -- configurations ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KVConfig:
    k: str
    v: str
    tail_k: str | None = None  # mixed by position: the types past the newest `window` positions
    tail_v: str | None = None
    window: int = 0

    @classmethod
    def parse(cls, text: str) -> "KVConfig":
        """'q8_0' (K and V), 'q8_0/q4_0' (K / V), or 'f16>q4_0@128' (newest 128 positions f16, older q4_0)."""
        main, _, rest = text.partition(">")
        k, _, v = main.partition("/")
        if not rest:
            return cls(k, v or k)
        tail, _, window = rest.partition("@")
        tail_k, _, tail_v = tail.partition("/")
        if not window.isdigit() or int(window) < 1:
            raise SystemExit(f"mixed configuration {text!r}: write MAIN>TAIL@N with a window N >= 1")
        return cls(k, v or k, tail_k, tail_v or tail_k, int(window))

    @property
    def label(self) -> str:
        main = self.k if self.k == self.v else f"{self.k}/{self.v}"
        if not self.window:
            return main
        tail = self.tail_k if self.tail_k == self.tail_v else f"{self.tail_k}/{self.tail_v}"
        return f"{main}>{tail}@{self.window}"

    def spec(self, ctx: int, max_chunk: int, normalize_k: bool | None) -> KVSpec:
        return KVSpec(ctx=ctx, kv_type_k=self.k, kv_type_v=self.v, max_chunk=max_chunk, normalize_k=normalize_k,
                      kv_window=self.window, kv_type_k_tail=self.tail_k, kv_type_v_tail=self.tail_v)


def default_configs() -> list[KVConfig]:
    """f16 (the baseline) first, then every other format for K and V, then the mixed pairs."""
    same = [KVConfig(BASELINE, BASELINE)] + [KVConfig(f, f) for f in list_formats() if f != BASELINE]
    return same + [KVConfig.parse(p) for p in DEFAULT_PAIRS + DEFAULT_MIXED]


# -- the statistics (NumPy, float64) -----------------------------------------------------------------------


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-probabilities of float logits [n, V]."""
    x = np.asarray(logits, dtype=np.float64)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


@dataclass
class RowStats:
    """Per position of one chunk: KL(P || Q), the NLL of the next token under Q, and whether the argmaxes agree."""

    kld: np.ndarray
    nll: np.ndarray  # NaN where the next token is unknown (the last position)
    top1_same: np.ndarray

    def as_array(self) -> np.ndarray:
        return np.stack([self.kld, self.nll, self.top1_same.astype(np.float64)], axis=1)


def row_stats(logits: np.ndarray, base_logits: np.ndarray | None, targets: np.ndarray) -> RowStats:
    """Statistics of logits [n, V] against the baseline's [n, V] (None: the baseline itself, KLD 0).
    ``targets`` [n]: the next token of each position, -1 where there is none."""
    n = logits.shape[0]
    kld, nll, same = np.zeros(n), np.full(n, np.nan), np.ones(n, dtype=bool)
    for s in range(0, n, ROW_BLOCK):
        e = min(s + ROW_BLOCK, n)
        logq = log_softmax(logits[s:e])
        rows = np.arange(e - s)
        t = targets[s:e]
        has = t >= 0
        nll[s:e][has] = -logq[rows[has], t[has]]
        if base_logits is not None:
            logp = log_softmax(base_logits[s:e])
            kld[s:e] = np.sum(np.exp(logp) * (logp - logq), axis=1)
            same[s:e] = np.argmax(logp, axis=1) == np.argmax(logq, axis=1)
    return RowStats(kld, nll, same)


def perplexity(nll: np.ndarray) -> float:
    nll = nll[np.isfinite(nll)]
    return float(math.exp(nll.mean()))


def bootstrap_ci(values: np.ndarray, stat, n_boot: int = BOOTSTRAP, seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of ``stat`` over ``n_boot`` resamples of ``values`` (positions, with replacement)."""
    values = np.asarray(values, dtype=np.float64)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(values), size=(n_boot, len(values)))
    stats = np.array([stat(values[i]) for i in idx])
    lo, hi = np.percentile(stats, [2.5, 97.5])
    return float(lo), float(hi)


def summarize(stats: np.ndarray, base_nll: np.ndarray) -> dict:
    """Summary of per-position [n, 3] (kld, nll, top1) results, against the baseline's NLLs."""
    kld, nll, top1 = stats[:, 0], stats[:, 1], stats[:, 2]
    has = np.isfinite(nll) & np.isfinite(base_nll)
    delta = nll[has] - base_nll[has]
    ppl, base_ppl = perplexity(nll), perplexity(base_nll)
    d_lo, d_hi = bootstrap_ci(delta, np.mean)
    n_lo, n_hi = bootstrap_ci(nll[np.isfinite(nll)], np.mean)
    return {
        "positions": int(len(kld)),
        "kld_mean": float(kld.mean()),
        "kld_mean_ci95": bootstrap_ci(kld, np.mean),
        "kld_median": float(np.median(kld)),
        "kld_median_ci95": bootstrap_ci(kld, np.median),
        "kld_p99": float(np.percentile(kld, 99)),
        "kld_max": float(kld.max()),
        "top1_agree": float(top1.mean()),
        "ppl": ppl,
        "ppl_ci95": (math.exp(n_lo), math.exp(n_hi)),  # the PPL's own noise: which positions the text has
        "ppl_change": ppl / base_ppl - 1.0,
        # exp(mean NLL difference) - 1 is exactly ppl / base_ppl - 1; its interval from the paired bootstrap
        "ppl_change_ci95": (math.expm1(d_lo), math.expm1(d_hi)),
    }


# -- running one model -------------------------------------------------------------------------------------


def format_for(name: str, head_dim: int, codebooks: dict[str, np.ndarray], norm_mode: str | None):
    """The cache format of ``name``; rotated formats optionally with another norm mode or TCQ codebook."""
    fmt = get_format(name, head_dim=head_dim)
    if not is_rotated(name) or (norm_mode is None and name not in codebooks):
        return fmt
    mode = norm_mode or fmt.norm_mode
    if name.endswith("_tcq"):
        return tcq.make_format(name, fmt.group_values, codebook=codebooks.get(name), norm_mode=mode)
    return turbo.make_format(name, fmt.group_values, norm_mode=mode)


def new_cache(model, config: KVConfig, ctx: int, codebooks: dict[str, np.ndarray] | None = None,
              norm_mode: str | None = None, normalize_k: bool | None = None) -> KVCache:
    """An empty cache like ``cupyllm.load(kv_type_k=config.k, kv_type_v=config.v)`` gives, with the overrides
    (normalize_k: KVSpec.normalize_k, None for the engine's default)."""
    spec = config.spec(ctx, model.kv_spec.max_chunk, normalize_k)
    cache = KVCache.for_model(model.cfg, spec, mirror=bool(model.kv_spec.float_mirror))
    codebooks = codebooks or {}
    if (codebooks or norm_mode) and config.window:
        raise SystemExit(f"{config.label}: --codebook-dir / --norm-mode apply to uniform configurations only")
    if codebooks or norm_mode:
        k_fmt = format_for(config.k, model.cfg.head_dim, codebooks, norm_mode)
        v_fmt = format_for(config.v, model.cfg.v_head_dim, codebooks, norm_mode)
        for layer in cache.layers:  # same block sizes, so the allocated byte arrays still fit
            layer.k_format, layer.v_format = k_fmt, v_fmt
    return cache


def evaluate_config(model, ids: np.ndarray, config: KVConfig, base_logits: np.ndarray | None,
                    store_logits: np.ndarray | None = None, codebooks=None, norm_mode=None,
                    progress: bool = True, normalize_k: bool | None = None) -> np.ndarray:
    """Per-position [n, 3] (kld vs base_logits, nll, top1_same) of ``config`` over ``ids``.
    ``store_logits``: an [n, V] array to receive the raw logits (the baseline run)."""
    ids = np.asarray(ids, dtype=np.int64)
    n = len(ids)
    targets = np.append(ids[1:], -1)
    cache = new_cache(model, config, n, codebooks, norm_mode, normalize_k)
    transformer = model.transformer

    def forward_stats(tokens, positions, cache, all_logits=True):
        logits = np.asarray(transformer.ops.to_numpy(transformer.forward(tokens, positions, cache, all_logits=True)),
                            dtype=np.float32)
        rows = slice(int(positions[0]), int(positions[-1]) + 1)
        if store_logits is not None:
            store_logits[rows] = logits
        base = None if base_logits is None else base_logits[rows]
        return row_stats(logits, base, targets[rows]).as_array()

    return prefill(forward_stats, ids, cache, model.kv_spec.max_chunk, all_logits=True, progress=progress)


def model_path(name: str) -> Path:
    from models import gemma_path, qwen_path  # tests/models.py assembles the real models from their packages

    return {"gemma": gemma_path, "qwen": qwen_path}[name]() if name in ("gemma", "qwen") else Path(name)


def result_tag(config: KVConfig, codebooks: dict[str, np.ndarray], norm_mode: str | None) -> str:
    """What besides the format names decides a configuration's numbers: the TCQ codebooks it uses (package
    data or override, by content hash) and a norm-mode override. Part of the saved result's file name."""
    tag = ""
    for name in dict.fromkeys((config.k, config.v)):
        if name in tcq.TCQ_PARAMS:
            cb = codebooks.get(name)
            cb = tcq.load_codebook(name) if cb is None else cb
            tag += f"-{name}.{hashlib.sha256(np.ascontiguousarray(cb, np.float32).tobytes()).hexdigest()[:8]}"
    if norm_mode and (is_rotated(config.k) or is_rotated(config.v)):
        tag += f"-{norm_mode}"
    return tag


def run_model(name: str, path: Path, text: str, configs: list[KVConfig], max_tokens: int, work_dir: Path,
              codebooks: dict[str, np.ndarray], norm_mode: str | None, log, normalize_k: bool | None = None) -> dict:
    model = cupyllm.load(path, device="cpu", ctx=8, progress=False)  # the caches are built per configuration
    ids = np.asarray(model.tokenize(text), dtype=np.int64)
    if max_tokens:
        ids = ids[:max_tokens]
    n = len(ids)
    key = hashlib.sha256(ids.tobytes() + path.name.encode()).hexdigest()[:12]
    mdir = work_dir / f"{name}-{key}"
    mdir.mkdir(parents=True, exist_ok=True)

    base_cfg = KVConfig(BASELINE, BASELINE)
    base_file = mdir / "f16_logits.f32"
    base_stats_file = mdir / "f16_stats.npy"
    if not (base_stats_file.exists() and base_file.exists()):
        log(f"[{name}] {n} tokens: f16 baseline")
        t0 = time.time()
        probe = model.transformer.forward(ids[:1], np.arange(1), new_cache(model, base_cfg, 1), all_logits=True)
        vocab = int(np.asarray(probe).shape[-1])  # the output head's rows (may exceed the tokenizer's count)
        store = np.lib.format.open_memmap(base_file, mode="w+", dtype=np.float32, shape=(n, vocab))
        stats = evaluate_config(model, ids, base_cfg, None, store_logits=store)
        store.flush()
        del store
        np.save(base_stats_file, stats)
        log(f"[{name}] f16: ppl {perplexity(stats[:, 1]):.4f} ({time.time() - t0:.0f} s)")
    base_logits = np.load(base_file, mmap_mode="r")
    base_stats = np.load(base_stats_file)

    results = {}
    for config in tqdm(configs, desc=f"{name} configs", unit="cfg"):
        if config == base_cfg:
            results[config.label] = _entry(model, config, summarize(base_stats, base_stats[:, 1]), 0.0)
            continue
        normalized = "-normk" if config.spec(n, 1, normalize_k).k_normalized else ""
        stem = config.label.replace("/", "__").replace(">", "--").replace("@", "-w")
        out = mdir / f"{stem}{result_tag(config, codebooks, norm_mode)}{normalized}.npy"
        t0 = time.time()
        if out.exists():
            stats = np.load(out)
        else:
            stats = evaluate_config(model, ids, config, base_logits, codebooks=codebooks, norm_mode=norm_mode,
                                    normalize_k=normalize_k)
            np.save(out, stats)
        summary = summarize(stats, base_stats[:, 1])
        results[config.label] = _entry(model, config, summary, time.time() - t0)
        log(f"[{name}] {config.label}: KLD mean {summary['kld_mean']:.6f} median {summary['kld_median']:.6f} "
            f"top1 {summary['top1_agree']:.4f} ppl {summary['ppl']:.4f} ({time.time() - t0:.0f} s)")
    noise_ids = ids[:NOISE_TOKENS]
    noise = attention_logit_noise(model, noise_ids)
    return {"model": path.name, "arch": model.cfg.arch, "head_dim": model.cfg.head_dim,
            "n_kv_head": model.cfg.n_kv_head, "n_layer": model.cfg.n_layer, "tokens": int(n),
            "max_chunk": model.kv_spec.max_chunk, "configs": results,
            "k_logit_noise": {"tokens": int(len(noise_ids)), "queries": 64, "per_layer": noise}}


def _entry(model, config: KVConfig, summary: dict, seconds: float) -> dict:
    bk = get_format(config.k, head_dim=model.cfg.head_dim).bits_per_value
    bv = get_format(config.v, head_dim=model.cfg.v_head_dim).bits_per_value
    tail = {}
    if config.window:  # mixed by position: the tail's types and bits, and the window
        tail = {"tail_k": config.tail_k, "tail_v": config.tail_v, "window": config.window,
                "bits_per_value_tail_k": get_format(config.tail_k, head_dim=model.cfg.head_dim).bits_per_value,
                "bits_per_value_tail_v": get_format(config.tail_v, head_dim=model.cfg.v_head_dim).bits_per_value}
    return {"k": config.k, "v": config.v, "bits_per_value_k": bk, "bits_per_value_v": bv, **tail, **summary,
            "seconds": round(seconds, 1)}


# -- why K is the sensitive half: attention-logit noise ----------------------------------------------------

NOISE_FORMATS = ("q8_0", "q4_0", "turbo4", "turbo3", "turbo3_tcq", "turbo2", "turbo2_tcq")
NORMALIZED = " (K normalised)"  # the same format on K as the cache stores it: (K - mean) / scale


def attention_logit_noise(model, ids: np.ndarray, formats=NOISE_FORMATS, queries: int = 64) -> dict[str, list[float]]:
    """Per format and layer: how large the error a K format puts on the attention logits is, relative to how
    much the logits differ between keys. Over the last ``queries`` queries of ``ids`` (run with an f32 cache)
    and every head: ``std_keys(scale * q.(k_hat - k)) / std_keys(scale * q.k)`` over the causal keys after
    the first (the BOS sink), median over queries and heads. About 1 means the error swamps the signal."""
    cfg, ops = model.cfg, model.transformer.ops
    cache = new_cache(model, KVConfig("f32", "f32"), len(ids))
    layer_of = {id(layer): i for i, layer in enumerate(cache.layers)}
    group = cfg.n_head // cfg.n_kv_head
    ratios = {f + c: [0.0] * cfg.n_layer for f in formats for c in ("", NORMALIZED)}
    original = ops.attention

    def attention(q, q_pos, layer_kv, *, scale, window=0, softcap=0.0):
        if q_pos[-1] == len(ids) - 1:  # the chunk holding the last queries: every key is cached
            k = np.asarray(layer_kv.decode(0, layer_kv.n_used)[0])  # f32 cache: the exact keys [n, n_kv, d]
            k_pos = layer_kv.slot_pos[: layer_kv.n_used]
            qq, qp = q[-queries:], q_pos[-queries:]
            future = (k_pos[None, :] > qp[:, None]) | (k_pos[None, :] <= 0)  # causal keys, BOS dropped
            signal = np.einsum("qhd,khd->qhk", qq, np.repeat(k, group, axis=1)) * scale
            signal[np.broadcast_to(future[:, None, :], signal.shape)] = np.nan
            spread = np.nanstd(signal, axis=-1)
            # the cache's normalisation over these keys and queries (one first write, as long as the text fits
            # one prefill chunk): the format's error falls on (K - offset) / scale and is scaled back
            offset, k_scale = key_normalization(k, k_pos, queries=q if len(q) == len(k_pos) else None)
            for name in formats:
                fmt = get_format(name, head_dim=cfg.head_dim)
                for key, rows, back in ((name, k, 1.0), (name + NORMALIZED, (k - offset) / k_scale, k_scale)):
                    flat = np.ascontiguousarray(rows.reshape(-1, cfg.head_dim))
                    err = (fmt.decode(fmt.encode(flat), cfg.head_dim) - flat).reshape(k.shape) * back
                    noise = np.einsum("qhd,khd->qhk", qq, np.repeat(err, group, axis=1)) * scale
                    noise[np.broadcast_to(future[:, None, :], noise.shape)] = np.nan
                    ratios[key][layer_of[id(layer_kv)]] = float(np.median(np.nanstd(noise, axis=-1) / spread))
        return original(q, q_pos, layer_kv, scale=scale, window=window, softcap=softcap)

    ops.attention = attention  # this backend object only, for this one run
    try:
        prefill(model.transformer.forward, np.asarray(ids), cache, model.kv_spec.max_chunk, progress=False)
    finally:
        del ops.attention
    return ratios


# -- N(0, 1) MSE -------------------------------------------------------------------------------------------


CODE_BITS = {"f32": None, "f16": None, "bf16": None, "q8_0": 8, "q6_0": 6, "q5_1": 5, "q5_0": 5, "q4_1": 4,
             "q4_0": 4, "turbo4": 4, "turbo3": 3, "turbo2": 2, "turbo3_tcq": 3, "turbo2_tcq": 2}


def lloyd_max_mse(bits: int) -> float:
    """MSE of the N(0, 1) Lloyd-Max quantizer with 2^bits levels. Beyond 4 bits (the scalar q* formats, only a
    reference point there) the iteration stops at a level movement of 1e-10, which changes the MSE in the 12th
    digit and takes seconds instead of the minutes tol=1e-14 needs at 8 bits."""
    return lloyd_max.gaussian_lloyd_max(bits).mse if bits <= 4 else lloyd_max.gaussian_lloyd_max(bits, tol=1e-10).mse


def gaussian_mse(rows: int = 4096, seed: int = 0, codebooks=None, norm_mode=None,
                 formats: list[str] | None = None) -> dict:
    """Per format and head dim (256 -> G = 128, 64 -> G = 64): MSE per value of decode(encode(x)), x ~ N(0, 1)."""
    x = np.random.default_rng(seed).standard_normal((rows, 256)).astype(np.float32)
    table = {}
    for name in formats or list_formats():
        bits = CODE_BITS[name]
        entry = {"code_bits": bits, "lloyd_max_mse": None if bits is None else lloyd_max_mse(bits)}
        for head_dim in (256, 64):
            fmt = format_for(name, head_dim, codebooks or {}, norm_mode)
            xs = x.reshape(-1, head_dim)
            err = fmt.decode(fmt.encode(xs), head_dim).astype(np.float64) - xs
            entry[f"head_dim_{head_dim}"] = {"bits_per_value": fmt.bits_per_value, "mse": float(np.mean(err ** 2)),
                                             "rate_distortion_bound": 2.0 ** (-2.0 * fmt.bits_per_value)}
        table[name] = entry
    return table


# -- report ------------------------------------------------------------------------------------------------


def check_targets(models: dict) -> dict:
    """The issue's targets, per model: turbo3_tcq < turbo3 and turbo2_tcq <= 0.6 turbo2 (median KLD), for K and
    V in the format and for V only (K in q8_0); q8_0 within noise of f16: its PPL inside the f16 PPL's 95%
    interval (the measurement's own noise, what llama-perplexity's "PPL = x +/- y" reports). Listed beside it:
    the paired interval of the PPL change (far more sensitive: it shows whether the change is detectable at
    all) and f32's KLD (the floor of f16's own rounding)."""
    out = {}
    for name, m in models.items():
        c = m["configs"]
        checks = {}
        for prefix in ("", "q8_0/"):
            t3, t3q, t2, t2q = (prefix + f for f in ("turbo3", "turbo3_tcq", "turbo2", "turbo2_tcq"))
            if {t3, t3q} <= c.keys():
                checks[f"{t3q} < {t3}"] = {
                    "median": [c[t3q]["kld_median"], c[t3]["kld_median"]],
                    "mean": [c[t3q]["kld_mean"], c[t3]["kld_mean"]],
                    "met": c[t3q]["kld_median"] < c[t3]["kld_median"]}
            if {t2, t2q} <= c.keys():
                ratio = c[t2q]["kld_median"] / c[t2]["kld_median"]
                checks[f"{t2q} <= 0.6 x {t2}"] = {
                    "median_ratio": ratio, "mean_ratio": c[t2q]["kld_mean"] / c[t2]["kld_mean"], "met": ratio <= 0.6}
        for label, r in c.items():  # mixed tails: between uniform q8_0 and uniform q4_0 (median KLD)
            if r.get("window") and r.get("tail_k") == r.get("tail_v") == "q4_0" and {"q8_0", "q4_0"} <= c.keys():
                kld = [c["q8_0"]["kld_median"], r["kld_median"], c["q4_0"]["kld_median"]]
                checks[f"q8_0 <= {label} <= q4_0"] = {"median": kld, "met": kld[0] <= kld[1] <= kld[2]}
        if {"q8_0", "f32"} <= c.keys():
            q8, f32 = c["q8_0"], c["f32"]
            lo, hi = q8["ppl_change_ci95"]
            f16_lo, f16_hi = c[BASELINE]["ppl_ci95"]
            checks["q8_0 within noise of f16"] = {
                "q8_0_ppl": q8["ppl"], "f16_ppl_ci95": [f16_lo, f16_hi],
                "q8_0_ppl_change_paired_ci95": [lo, hi], "paired_change_detectable": not (lo <= 0.0 <= hi),
                "q8_0_kld_median": q8["kld_median"], "f32_kld_median": f32["kld_median"],
                "met": bool(f16_lo <= q8["ppl"] <= f16_hi)}
        out[name] = checks
    return out


def _g(x: float) -> str:
    return f"{x:.2e}" if x and abs(x) < 1e-3 else f"{x:.4f}"


def _fmt_value(val) -> str:
    if isinstance(val, (list, tuple)):
        return "[" + ", ".join(_fmt_value(x) for x in val) + "]"
    return _g(val) if isinstance(val, float) else str(val)


def markdown(report: dict) -> str:
    lines = ["# KV-cache quality", "",
             f"Generated by `tools/kv_quality.py` ({report['date']}, {report['machine']}, commit "
             f"{report.get('git_commit')}, TCQ codebooks {report.get('tcq_codebooks_sha256')}). Text: "
             f"`{report['text']}` (sha256 {report['text_sha256'][:12]}). Baseline: f16 cache. KLD = KL(P_f16 || Q) "
             "of the next-token distributions at every position, chunked prefill (each chunk is written to the "
             "quantized cache before it attends). 95% intervals: bootstrap over positions (1000 resamples). "
             "f32 vs f16 is the noise floor (what f16's own rounding costs)."
             + " " + K_STORAGE[report.get("normalize_k", "off")], ""]
    for name, m in report["models"].items():
        lines += [f"## {m['model']} (head_dim {m['head_dim']}, {m['n_layer']} layers, {m['n_kv_head']} KV heads, "
                  f"{m['tokens']} tokens, chunk {m['max_chunk']})", "",
                  "| K / V | bits/value K / V | mean KLD [95% CI] | median KLD | published median | p99 KLD | "
                  "top-1 agree | PPL | PPL change [95% CI] |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for label, r in m["configs"].items():
            lo, hi = r["kld_mean_ci95"]
            plo, phi = r["ppl_change_ci95"]
            bits = (f"{r['bits_per_value_k']:g}" if r["k"] == r["v"] else
                    f"{r['bits_per_value_k']:g} / {r['bits_per_value_v']:g}")
            if r.get("window"):  # newest `window` positions, then the tail's
                bits += (f" > {r['bits_per_value_tail_k']:g}" if r["tail_k"] == r["tail_v"] else
                         f" > {r['bits_per_value_tail_k']:g} / {r['bits_per_value_tail_v']:g}")
            ref = REFERENCE_MEDIAN_KLD.get(label, "")
            lines.append(f"| {label} | {bits} | {_g(r['kld_mean'])} [{_g(lo)}, {_g(hi)}] | {_g(r['kld_median'])} | "
                         f"{ref} | {_g(r['kld_p99'])} | {100 * r['top1_agree']:.2f}% | {r['ppl']:.4f} | "
                         f"{100 * r['ppl_change']:+.2f}% [{100 * plo:+.2f}, {100 * phi:+.2f}] |")
        lines += ["", ordering_line(m["configs"]), ""]
    if all("k_logit_noise" in m for m in report["models"].values()):
        lines += k_noise_section(report)
    lines += ["## Targets", ""]
    for name, checks in report["targets"].items():
        for check, v in checks.items():
            detail = ", ".join(f"{k} {_fmt_value(val)}" for k, val in v.items() if k != "met")
            lines.append(f"* {name}: {check}: **{'met' if v['met'] else 'MISSED'}** ({detail})")
    lines += ["", "Published reference (Qwen3.6-27B, 16k context, median KLD; compare the ordering): " +
              ", ".join(f"{k} {v}" for k, v in REFERENCE_MEDIAN_KLD.items()), ""]
    lines += ["## MSE per value on N(0, 1) rows", "",
              f"{report['gaussian_rows']} rows of 256 values (also read as rows of 64); `decode(encode(x))`. "
              "Lloyd-Max: the optimal scalar quantizer of N(0, 1) at the format's code bits. D(R) = 2^(-2R): the "
              "Gaussian rate-distortion bound at the storage bits/value R (norms and scales included).", "",
              "| format | code bits | Lloyd-Max MSE | head_dim 256: bits/value | MSE | D(R) | head_dim 64: bits/value | "
              "MSE | D(R) |", "|---|---|---|---|---|---|---|---|---|"]
    for name, e in report["gaussian_mse"].items():
        a, b = e["head_dim_256"], e["head_dim_64"]
        lm = "" if e["lloyd_max_mse"] is None else _g(e["lloyd_max_mse"])
        lines.append(f"| {name} | {e['code_bits'] or ''} | {lm} | {a['bits_per_value']:g} | {_g(a['mse'])} | "
                     f"{_g(a['rate_distortion_bound'])} | {b['bits_per_value']:g} | {_g(b['mse'])} | "
                     f"{_g(b['rate_distortion_bound'])} |")
    if report.get("notes"):
        lines += ["", report["notes"].rstrip()]
    return "\n".join(lines) + "\n"


K_STORAGE = {  # what the report's caches did to K before quantizing it (reports before the switch: "off")
    "auto": "**K normalised** (the engine's default, KVSpec.normalize_k): every quantized K is stored as "
            "(K - mean) / scale per channel, scale = sqrt(RMS of K / RMS of Q), both from the first prefill "
            "chunk past position 0 (`key_normalization`), and restored on decode; f16/f32 K as is.",
    "on": "**K normalised** in every cache (`--normalize-k`; KVSpec.normalize_k=True): (K - mean) / scale per "
          "channel, scale = sqrt(RMS of K / RMS of Q) from the first prefill chunk past position 0.",
    "off": "**K raw** (`--no-normalize-k`; KVSpec.normalize_k=False): every format quantizes K as the model "
           "computes it.",
}


def k_noise_section(report: dict) -> list[str]:
    lines = ["## K error on the attention logits", "",
              "Per layer: `std_keys(q.(k_hat - k)) / std_keys(q.k)` (scaled logits, causal keys after BOS, median "
              "over heads and the last 64 queries of the first 256 tokens, f32 cache): the K format's error on the "
              "attention logits relative to how much the logits differ between keys. Mean over layers, and the "
              "worst layer. Rows marked `(K normalised)`: the same format on (K - mean) / scale per channel "
              "(`key_normalization` of the cached keys and their queries: what the cache stores by default), "
              "the error mapped back to K.", "",
              "| format | " + " | ".join(f"{m['model'].split('-q4')[0]} mean | worst (layer)" for m in
                                      report["models"].values()) + " |",
              "|---|" + "---|---|" * len(report["models"])]
    for fmt in [f + c for f in NOISE_FORMATS for c in ("", NORMALIZED)]:
        if any(fmt not in m["k_logit_noise"]["per_layer"] for m in report["models"].values()):
            continue  # a report written before these rows existed
        cells = []
        for m in report["models"].values():
            r = np.array(m["k_logit_noise"]["per_layer"][fmt])
            cells += [f"{r.mean():.3f}", f"{r.max():.3f} ({int(r.argmax())})"]
        lines.append(f"| {fmt} | " + " | ".join(cells) + " |")
    return lines + [""]


def ordering_line(configs: dict) -> str:
    """Our order of the published formats by median KLD, and how many of their pairs it orders as published."""
    names = [n for n in REFERENCE_MEDIAN_KLD if n in configs]
    ours = sorted(names, key=lambda n: configs[n]["kld_median"])
    pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1:]]
    same = sum((configs[a]["kld_median"] < configs[b]["kld_median"]) ==
               (REFERENCE_MEDIAN_KLD[a] < REFERENCE_MEDIAN_KLD[b]) for a, b in pairs)
    published = sorted(names, key=REFERENCE_MEDIAN_KLD.get)
    return (f"Order by median KLD: {' < '.join(ours)} (published: {' < '.join(published)}; "
            f"{same} of {len(pairs)} pairs in the published order).")


def _git_commit() -> str | None:
    """HEAD of the checkout the numbers came from ('+dirty' when files differ from it), if git is at hand."""
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["gemma", "qwen"], help="gemma, qwen or GGUF paths")
    ap.add_argument("--configs", nargs="+", help="K or K/V formats, or MAIN>TAIL@N mixed by position (default: "
                                                 "every format, the pairs and the mixed tails)")
    ap.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    ap.add_argument("--tokens", type=int, default=0, help="evaluate at most this many tokens (0: the whole text)")
    ap.add_argument("--codebook-dir", type=Path, help="folder with tcq_turbo3.npy / tcq_turbo2.npy to use instead")
    ap.add_argument("--norm-mode", choices=turbo.NORM_MODES, help="norm mode of the rotated formats (default lsq)")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/kv_quality"))
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "kv_quality",
                    help="output path without extension (.json and .md are written)")
    ap.add_argument("--gaussian-rows", type=int, default=4096, help="N(0, 1) rows of 256 values for the MSE table")
    ap.add_argument("--gaussian-formats", nargs="+", choices=list_formats(), help="MSE table formats (default all)")
    ap.add_argument("--notes", type=Path, default=ROOT / "bench" / "results" / "kv_quality.notes.md",
                    help="hand-written findings appended to the Markdown report (if the file exists)")
    ap.add_argument("--render", type=Path, help="only rewrite the Markdown from this JSON report (no runs)")
    ap.add_argument("--normalize-k", action=argparse.BooleanOptionalAction, default=None,
                    help="store K normalised per channel in every cache / in none (default: the engine's "
                         "default, quantized K only; the f16 baseline is never touched)")
    args = ap.parse_args(argv)

    notes = args.notes.read_text(encoding="utf-8") if args.notes and args.notes.exists() else ""
    if args.render:
        report = json.loads(args.render.read_text())
        report["notes"] = notes
        args.out.with_suffix(".md").write_text(markdown(report))
        return

    configs = [KVConfig.parse(c) for c in args.configs] if args.configs else default_configs()
    if KVConfig(BASELINE, BASELINE) not in configs:
        configs.insert(0, KVConfig(BASELINE, BASELINE))
    codebooks = {}
    if args.codebook_dir:
        codebooks = {name: np.load(args.codebook_dir / tcq.codebook_path(name).name).astype(np.float32)
                     for name in tcq.TCQ_PARAMS}
    text = args.text.read_text(encoding="utf-8")

    def log(msg: str) -> None:
        tqdm.write(f"{time.strftime('%H:%M:%S')} {msg}")
        sys.stdout.flush()

    report = {"date": time.strftime("%Y-%m-%d"), "machine": f"CPU ({platform.machine()}), NumPy backend",
              "text": str(args.text.resolve().relative_to(ROOT)) if args.text.resolve().is_relative_to(ROOT)
              else str(args.text), "text_sha256": hashlib.sha256(text.encode()).hexdigest(),
              "baseline": BASELINE, "codebook_dir": str(args.codebook_dir) if args.codebook_dir else None,
              "norm_mode": args.norm_mode or turbo.DEFAULT_NORM_MODE,
              "tcq_codebooks_sha256": {name: hashlib.sha256(np.ascontiguousarray(
                  codebooks.get(name, tcq.load_codebook(name)), np.float32).tobytes()).hexdigest()[:8]
                  for name in tcq.TCQ_PARAMS},
              "git_commit": _git_commit(), "models": {},
              "normalize_k": {None: "auto", True: "on", False: "off"}[args.normalize_k]}
    for name in args.models:
        report["models"][name] = run_model(name, model_path(name), text, configs, args.tokens, args.work_dir,
                                           codebooks, args.norm_mode, log, normalize_k=args.normalize_k)
    report["targets"] = check_targets(report["models"])
    report["gaussian_rows"] = args.gaussian_rows
    report["gaussian_mse"] = gaussian_mse(args.gaussian_rows, codebooks=codebooks, norm_mode=args.norm_mode,
                                         formats=args.gaussian_formats)
    report["reference_median_kld"] = REFERENCE_MEDIAN_KLD
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    report["notes"] = notes
    args.out.with_suffix(".md").write_text(markdown(report))
    log(f"wrote {args.out.with_suffix('.json')} and {args.out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
