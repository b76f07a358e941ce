"""The GPU decode figures the server, drafting and hybrid issues owe, on random-weight models with real shapes
(tests/support/make_tiny_models.py PRESETS, written on the device), each against its bandwidth roofline:

- batched decode (`models/batch.py` forward_batch, what `cupyllm serve` runs each step): 1, 4, 16 and 64
  sequences on the Qwen2.5-7B shape, each with its own cache holding a 128-token prompt; aggregate tok/s, and the
  roofline: the sequences' tokens per (weight bytes + every sequence's KV bytes) / PEAK_BANDWIDTH;
- n-gram drafting on the same model: greedy tok/s with and without `spec="ngram"` on a prompt that repeats a
  passage (random weights write loops, which the lookup also finds), with the drafts kept;
- a hybrid's decode: the Qwen3.6-35B-A3B shape's first 8 layers (Gated DeltaNet, gated attention, 256 experts):
  tok/s against the bytes one token reads (the dense weights, the router, the 8 chosen experts and the shared
  one, the recurrent states read and written, the KV cache).

    python bench/decode_gpu.py [--batches 1 4 16 64] [--budget-s 240] [--out bench/results/decode_gpu.json]
    python bench/decode_gpu.py --smoke   # tiny models, a few tokens: checks the script (the CUDA emulator too)

Each part writes the JSON when done (a run cut short keeps what it measured) and starts only within --budget-s.
Without a CUDA device the script says so and writes nothing.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests" / "support"))  # make_tiny_models

from e2e_gpu import PEAK_BANDWIDTH, _sync, kv_bytes, matrices  # noqa: E402

PROMPT_TOKENS, STEPS = 128, 32
PASSAGE = 48  # tokens of the passage the n-gram prompt states twice
DENSE, HYBRID = "qwen2.5-7b", "qwen3.6-35b-a3b-8l"


def weight_bytes(weights) -> int:
    return sum(int(w.data.nbytes) for w in weights if w is not None)


def hybrid_token_bytes(transformer, cache) -> int:
    """What one token of a Qwen3.5 / 3.6 MoE hybrid reads: the output head, each layer's projections (DeltaNet's
    or gated attention's), the router, the shared expert and n_expert_used experts (an expert's gate, up and
    down), the recurrent states read and written, and the KV cache."""
    cfg = transformer.cfg
    total = weight_bytes([transformer.output])
    for layer in transformer.layers:
        total += weight_bytes([layer.wq, layer.wk, layer.wv, layer.wo, layer.w_gate, layer.w_up, layer.w_down,
                               layer.shared_expert_gate])
        if layer.deltanet is not None:
            d = layer.deltanet
            total += weight_bytes([getattr(d, name, None) for name in ("qkv", "gate", "alpha", "beta", "beta_alpha",
                                                                       "out")])
        if layer.moe is not None:
            moe = layer.moe
            one = weight_bytes([moe.gate_up[0]] if moe.gate_up is not None else [moe.gate[0], moe.up[0]])
            total += weight_bytes([moe.router]) + cfg.n_expert_used * (one + weight_bytes([moe.down[0]]))
    for il in range(cfg.n_layer):
        if cfg.is_recurrent(il):
            for _, state in cache.recurrent_parts(il):
                total += 2 * (int(state.conv.nbytes) + int(state.recurrent.nbytes))
    return total + kv_bytes(cache)


def batched_decode(model, batches: list[int], budget_end: float) -> list[dict]:
    """Aggregate decode tok/s of N sequences stepping together (forward_batch), each after its own prompt."""
    from cupyllm.models.batch import Segment, forward_batch
    t = model.transformer
    rows = []
    rng = np.random.default_rng(0)
    weights = weight_bytes(matrices(t))  # (a dense model: every matrix a step reads)
    for n in batches:
        if time.perf_counter() > budget_end:
            rows.append({"sequences": n, "skipped": "time budget spent"})
            continue
        caches = [t.ops.new_cache(model.cfg, model.kv_spec) for _ in range(n)]
        tokens = []
        for cache in caches:  # each prompt prefilled alone, as a server's slots take their requests
            ids = rng.integers(3, model.cfg.n_vocab, PROMPT_TOKENS)
            logits = t.ops.to_numpy(t.forward(ids, np.arange(PROMPT_TOKENS), cache))
            cache.n_past = PROMPT_TOKENS
            tokens.append(int(np.argmax(logits)))

        def step():
            got = forward_batch(t, [Segment(np.array([tok]), c) for tok, c in zip(tokens, caches)])
            for i, (logits, cache) in enumerate(zip(got, caches)):
                cache.n_past += 1
                tokens[i] = int(np.argmax(logits))

        step()  # warm up (kernels for this row count)
        _sync()
        t0 = time.perf_counter()
        for _ in range(STEPS):
            step()
        _sync()
        seconds = (time.perf_counter() - t0) / STEPS
        step_bytes = weights + sum(kv_bytes(c) for c in caches)
        roofline = n / (step_bytes / PEAK_BANDWIDTH)
        rows.append({"sequences": n, "step_ms": seconds * 1e3, "aggregate_tok_s": n / seconds,
                     "roofline_tok_s": roofline, "fraction_of_roofline": n / seconds / roofline,
                     "step_bytes": step_bytes})
        print(f"batched decode, {n} sequences: {n / seconds:.1f} tok/s ({seconds * 1e3:.2f} ms a step), "
              f"roofline {roofline:.0f} ({n / seconds / roofline:.0%})", flush=True)
        del caches
    return rows


def ngram_drafting(model, max_tokens: int) -> dict:
    """Greedy decode tok/s with and without n-gram drafting, on a prompt that states a passage twice."""
    rng = np.random.default_rng(1)
    passage = rng.integers(3, model.cfg.n_vocab, PASSAGE).tolist()
    prompt = passage + passage + passage[:8]
    row = {}
    for mode, spec in (("plain", False), ("ngram", "ngram"), ("plain_again", False), ("ngram_again", "ngram")):
        model.generate(prompt, max_tokens=max_tokens, temperature=0, spec=spec)
        stats = model.last_stats
        entry = {"tokens": stats.generated_tokens,
                 "decode_tps": (stats.generated_tokens - 1) / stats.decode_seconds if stats.generated_tokens > 1
                 else 0.0}
        if stats.draft is not None:
            entry.update(drafted=stats.draft.drafted, accepted=stats.draft.accepted,
                         tokens_per_forward=stats.draft.tokens_per_forward)
        row[mode] = entry
    plain = max(row["plain"]["decode_tps"], row["plain_again"]["decode_tps"])
    ngram = max(row["ngram"]["decode_tps"], row["ngram_again"]["decode_tps"])
    row["speedup"] = ngram / plain if plain else None
    print(f"n-gram drafting: {plain:.1f} -> {ngram:.1f} tok/s (x{row['speedup']:.2f}), kept "
          f"{row['ngram_again'].get('accepted')}/{row['ngram_again'].get('drafted')}", flush=True)
    return row


def hybrid_decode(model, steps: int) -> dict:
    """One sequence's decode tok/s on the hybrid, eager (no CUDA graphs for its layers), against the bytes a
    token reads."""
    t = model.transformer
    cache = t.ops.new_cache(model.cfg, model.kv_spec)
    ids = np.random.default_rng(2).integers(3, model.cfg.n_vocab, PROMPT_TOKENS)
    logits = t.ops.to_numpy(t.forward(ids, np.arange(PROMPT_TOKENS), cache))
    cache.n_past = PROMPT_TOKENS
    token = int(np.argmax(logits))

    def run(n):
        nonlocal token
        for _ in range(n):
            logits = t.ops.to_numpy(t.forward(np.array([token]), np.array([cache.n_past]), cache))
            cache.n_past += 1
            token = int(np.argmax(logits))

    run(2)  # warm up
    _sync()
    t0 = time.perf_counter()
    run(steps)
    _sync()
    seconds = (time.perf_counter() - t0) / steps
    token_bytes = hybrid_token_bytes(t, cache)
    roofline = PEAK_BANDWIDTH / token_bytes
    print(f"hybrid decode: {1 / seconds:.1f} tok/s, roofline {roofline:.0f} ({1 / seconds / roofline:.0%})",
          flush=True)
    return {"decode_tps": 1 / seconds, "roofline_tok_s": roofline, "fraction_of_roofline": 1 / seconds / roofline,
            "token_bytes": token_bytes}


def main(argv=None) -> int:
    from cupyllm.cuda import device_name, gpu_count

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--budget-s", type=float, default=240.0, help="start no part after this many seconds")
    parser.add_argument("--work-dir", type=Path, default=None, help="where the random GGUFs are written (kept)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "decode_gpu.json")
    parser.add_argument("--smoke", action="store_true", help="tiny models, a few tokens: checks the script")
    args = parser.parse_args(argv)
    if gpu_count() == 0:
        print("decode_gpu: no CUDA device here (CuPy missing or no GPU); nothing measured")
        return 0
    import cupyllm
    from make_tiny_models import PRESETS, tiny_spec, write_gguf

    global PROMPT_TOKENS, STEPS
    specs = {DENSE: PRESETS[DENSE], HYBRID: PRESETS[HYBRID]}
    max_tokens = 96
    if args.smoke:
        PROMPT_TOKENS, STEPS, max_tokens = 8, 2, 12
        # (DeltaNet head dims 32: the tiny models' 16 is below the smallest the GPU kernels take)
        specs = {DENSE: tiny_spec("qwen2"),
                 HYBRID: dataclasses.replace(tiny_spec("qwen35-moe"), ssm_k_dim=32, ssm_v_dim=32)}
        args.batches = [1, 3]
    start = time.perf_counter()
    budget_end = start + args.budget_s
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="cupyllm-decode-gpu-"))
    work.mkdir(parents=True, exist_ok=True)
    report = {"bench": "decode_gpu", "device": device_name(), "peak_bandwidth": PEAK_BANDWIDTH,
              "prompt_tokens": PROMPT_TOKENS, "steps": STEPS, "command": " ".join(["python", *sys.argv]),
              "time": time.strftime("%Y-%m-%d %H:%M:%S"), "results": {}}

    def write():
        report["seconds"] = time.perf_counter() - start
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")

    for name, spec in specs.items():
        if time.perf_counter() > budget_end:
            report["results"][name] = {"skipped": "time budget spent"}
            continue
        path = work / f"random-{name}.gguf"
        if not path.exists():
            write_gguf(spec, path)
        ctx = max(PROMPT_TOKENS + STEPS, 2 * PASSAGE + 8 + max_tokens) + 32
        model = cupyllm.load(path, device="gpu", ctx=ctx, progress=False)
        if name == DENSE:
            report["results"][name] = {"batched_decode": batched_decode(model, args.batches, budget_end)}
            write()
            if time.perf_counter() < budget_end:
                report["results"][name]["ngram"] = ngram_drafting(model, max_tokens)
        else:
            report["results"][name] = {"decode": hybrid_decode(model, STEPS)}
        write()
        del model
        if args.work_dir is None:
            path.unlink()
    write()
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
