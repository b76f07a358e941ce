"""End-to-end GPU speed on random-weight models with the real shapes and Q4_K_M-like types of Gemma 3 270M,
Qwen2.5-0.5B, Gemma 4 E2B and Qwen2.5-7B (tests/support/make_tiny_models.py PRESETS, written on the device: real GGUFs
are too big to carry), beside HF transformers (torch, float16) on the very same weights in the same run.

    python bench/e2e_gpu.py [--models gemma3-270m qwen2.5-0.5b gemma4-e2b qwen2.5-7b] [--skip-transformers]
                            [--budget-s 600] [--work-dir DIR] [--out bench/results/e2e_gpu.json]
    python bench/e2e_gpu.py --smoke   # tiny models, no transformers: checks the script (the CUDA emulator too)

Per model: prefill tok/s of a 512-token prompt through both prefill paths (cuBLAS on an f16 copy of each
matrix dequantized on the fly, our tensor-core kernel dequantizing tile by tile, and the engine's default
"auto" that picks one per matrix size: `prefill_paths`, the comparison behind backend/gpu.py's rule), decode tok/s of 64 greedy tokens eagerly and with
CUDA-graph replay (the difference is the Python/launch overhead per token), the decode roofline (weight + KV
bytes read per token / PEAK_BANDWIDTH), GEMV bandwidth per matrix shape, and HF's prefill/decode tok/s plus
the largest logit difference between the two engines on the prompt's last token (a correctness check at
full size). Models run small to large; one whose start would pass --budget-s is recorded as skipped.
Without a CUDA device the script says so and writes nothing.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "support"))  # make_tiny_models

from cupyllm.cuda import device_name  # noqa: E402

PEAK_BANDWIDTH = 4.8e12  # bytes/s, H200 HBM3e
PEAK_F16_FLOPS = 989e12  # dense f16 tensor-core FLOP/s, H100/H200 SXM
PROMPT_TOKENS, DECODE_TOKENS = 512, 64
MODELS = ("gemma3-270m", "qwen2.5-0.5b", "gemma4-e2b", "qwen2.5-7b")
GEMV_REPEATS = 20


def _sync():
    import cupy
    cupy.cuda.get_current_stream().synchronize()


def _timed(fn, repeats: int = 1) -> tuple[float, object]:
    """(best wall seconds over `repeats` runs, the last result); the device is synchronized around each run."""
    best, result = float("inf"), None
    for _ in range(repeats):
        _sync()
        t0 = time.perf_counter()
        result = fn()
        _sync()
        best = min(best, time.perf_counter() - t0)
    return best, result


def matrices(transformer) -> list:
    """Every weight matrix one decode token reads (embeddings contribute one row, ignored; a mixture of experts
    counts every expert, an upper bound)."""
    out = [transformer.output] + ([transformer.per_layer[1]] if transformer.per_layer else [])
    for layer in transformer.layers:
        out += [layer.wq, layer.wk, layer.wv, layer.wo, layer.w_gate, layer.w_up, layer.w_down, layer.ple_gate,
                layer.ple_proj]
        if layer.moe is not None:
            out += [layer.moe.router, *layer.moe.gate_up, *layer.moe.down]
    return [w for w in out if w is not None]


def kv_bytes(cache, n_keys: int | None = None) -> int:
    """The KV bytes attention reads at `n_keys` cached positions (a sliding layer: its window of them; None: the
    positions each layer holds now). A hybrid's recurrent layers hold no K / V."""
    total = 0
    for layer in cache.layers:
        if not hasattr(layer, "k_data"):
            continue
        row = int(layer.k_data.shape[-1] + layer.v_data.shape[-1]) * layer.n_kv
        if n_keys is None:
            total += row * layer.n_used
        else:
            total += row * (min(n_keys, layer.window) if layer.window else n_keys)
    return total


def decode_bytes_per_token(transformer, cache, n_keys: int) -> int:
    """Weight bytes plus the KV bytes attention reads at `n_keys` cached positions."""
    return sum(int(w.data.nbytes) for w in matrices(transformer)) + kv_bytes(cache, n_keys)


def gemv_bandwidth(ops, transformer) -> list[dict]:
    """One-token GEMV per distinct (type, shape): GB/s of weight bytes and the fraction of PEAK_BANDWIDTH."""
    import cupy
    seen, rows = set(), []
    for w in matrices(transformer):
        key = (w.fmt.name, tuple(w.shape))
        if key in seen:
            continue
        seen.add(key)
        x = cupy.asarray(np.random.default_rng(0).standard_normal((1, w.shape[-1])).astype(np.float32))
        ops.kernels.gemv(w, x)  # compiled and warm
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        for _ in range(GEMV_REPEATS):
            ops.kernels.gemv(w, x)
        stop.record()
        stop.synchronize()
        seconds = cupy.cuda.get_elapsed_time(start, stop) / 1e3 / GEMV_REPEATS
        rows.append({"type": w.fmt.name, "shape": list(w.shape), "bytes": int(w.data.nbytes),
                     "us": seconds * 1e6, "gb_per_s": w.data.nbytes / seconds / 1e9,
                     "fraction_of_peak": w.data.nbytes / seconds / PEAK_BANDWIDTH})
    return rows


def gated_mlp_timing(ops, transformer) -> list[dict]:
    """One decode token's gated-MLP input per distinct (type, shape) of gate / up (and Gemma 4's per-layer gate,
    whose up is a given array): the fused GEMV (weight_gemv_gated) against what it replaced, the gate and up
    GEMVs then gated_act, both replayed from CUDA graphs (bench/attention_gpu.py time_calls: no host launch
    overhead in either); fused_over_apart < 1 is the saving."""
    import cupy
    from attention_gpu import time_calls
    seen, rows = set(), []
    for layer in transformer.layers:
        pairs = [(layer.ple_gate, None)] if layer.ple_gate is not None else []
        if layer.w_gate is not None and layer.w_up is not None and (
                layer.w_gate.fmt.name, layer.w_gate.shape) == (layer.w_up.fmt.name, layer.w_up.shape):
            pairs.append((layer.w_gate, layer.w_up))  # (a pair of two types takes the kernels apart anyway)
        for gate, up in pairs:
            key = (gate.fmt.name, tuple(gate.shape), up is None)
            if key in seen:
                continue
            seen.add(key)
            rng = np.random.default_rng(0)
            x = cupy.asarray(rng.standard_normal((1, gate.shape[-1])).astype(np.float32))
            given = None if up is not None else cupy.asarray(rng.standard_normal((1, gate.shape[0])).astype(np.float32))
            act = transformer.cfg.activation

            def apart(_):
                g, u = ops.kernels.gemv_many([gate, up], x) if up is not None else (ops.kernels.gemv(gate, x), given)
                return ops.elementwise.gated_act(g, u, act)

            fused_s, how = time_calls(cupy, lambda _: ops.kernels.gemv_gated(gate, x, act, up=up, up_given=given),
                                      n_calls=GEMV_REPEATS, repeats=5)
            apart_s, _ = time_calls(cupy, apart, n_calls=GEMV_REPEATS, repeats=5)
            rows.append({"type": gate.fmt.name, "shape": list(gate.shape), "up": "matrix" if up is not None else "given",
                         "timing": how, "fused_us": fused_s * 1e6, "apart_us": apart_s * 1e6,
                         "fused_over_apart": fused_s / apart_s})
    return rows


def bench_cupyllm(path: Path, ids: np.ndarray) -> tuple[dict, np.ndarray]:
    from cupyllm.backend.gpu import GPUBackend
    from cupyllm.generate import prefill
    from cupyllm.files.gguf import read_gguf
    from cupyllm.kv.cache import KVSpec
    from cupyllm.models.build import Transformer

    t0 = time.perf_counter()
    ops = GPUBackend()
    transformer = Transformer.from_gguf(read_gguf(path), ops, progress=False)
    _sync()
    row = {"load_s": time.perf_counter() - t0, "weight_bytes": sum(int(w.data.nbytes) for w in matrices(transformer))}
    cache = ops.new_cache(transformer.cfg, KVSpec(ctx=PROMPT_TOKENS + DECODE_TOKENS + 16, max_chunk=PROMPT_TOKENS))

    def forward(tokens, positions, kv, all_logits=False):
        return ops.to_numpy(transformer.forward(tokens, positions, kv, all_logits))

    def run_prefill():
        cache.clear()
        return prefill(forward, ids, cache, PROMPT_TOKENS)

    paths, last_logits = {}, None
    for path_name in ("cublas", "mma", "auto"):  # auto: the engine's default, by matrix size
        ops.prefill = path_name
        run_prefill()  # compile and warm up
        seconds, logits = _timed(run_prefill, repeats=3)
        paths[path_name] = {"prefill_tps": len(ids) / seconds, "ms": seconds * 1e3}
        if last_logits is None:
            last_logits = np.asarray(logits, np.float32).reshape(-1)
    best = max(paths, key=lambda p: paths[p]["prefill_tps"])
    ops.prefill = best
    flops = 2.0 * sum(int(np.prod(w.shape)) for w in matrices(transformer)) * len(ids)  # matmuls only
    row.update(prefill_paths=paths, prefill_best=best, prefill_tps=paths[best]["prefill_tps"],
               prefill_tensor_core_utilisation=flops / (paths[best]["ms"] / 1e3) / PEAK_F16_FLOPS)

    def decode(step_fn) -> float:
        logits = run_prefill()
        token = int(np.argmax(logits))
        _sync()
        t0 = time.perf_counter()
        for _ in range(DECODE_TOKENS):
            logits = step_fn(np.array([token]), np.array([cache.n_past]), cache)
            cache.n_past += 1
            token = int(np.argmax(logits))
        return time.perf_counter() - t0

    decode(forward)  # warm up the one-token kernels
    eager_s = decode(forward)
    graphs = ops.decode_forward(transformer.forward)
    graph_step = lambda *a: ops.to_numpy(graphs(*a))  # noqa: E731
    graph_s = decode(graph_step)
    n_keys = PROMPT_TOKENS + DECODE_TOKENS // 2
    roofline_tps = PEAK_BANDWIDTH / decode_bytes_per_token(transformer, cache, n_keys)
    row.update(
        decode_tps_eager=DECODE_TOKENS / eager_s, decode_tps_graph=DECODE_TOKENS / graph_s,
        graph={"enabled": graphs.enabled, "captures": graphs.captures, "replays": graphs.replays,
               "disabled_reason": graphs.disabled_reason},
        launch_overhead_ms_per_token=(eager_s - graph_s) / DECODE_TOKENS * 1e3 if graphs.enabled else None,
        decode_roofline_tps=roofline_tps,
        decode_fraction_of_roofline=max(DECODE_TOKENS / eager_s, DECODE_TOKENS / graph_s) / roofline_tps,
        gemv=gemv_bandwidth(ops, transformer),
        gated_mlp=gated_mlp_timing(ops, transformer),
    )
    return row, last_logits


def hf_from_gguf(spec, path: Path):
    """The transformers model (float16, on the GPU) holding exactly the GGUF's decoded weights (decoded by our
    dequantization kernel, which tests/ops/test_matmul_gpu.py checks bit for bit against the reference)."""
    import cupy
    import torch
    from make_tiny_models import hf_config, hf_names
    from cupyllm.ops.matmul.gpu import WeightKernels
    from cupyllm.files.gguf import read_gguf
    from cupyllm.models.weights import load_matrix, load_vector

    gguf_file = read_gguf(path)
    n_vocab = gguf_file.tensors["token_embd.weight"].shape[0]
    config, cls = hf_config(spec, n_vocab)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)
    try:
        with torch.device("cuda"):
            model = cls(config).eval()
    finally:
        torch.set_default_dtype(default)
    names, norm_offset = hf_names(spec)
    kernels = WeightKernels()
    params = {**dict(model.named_parameters()), **dict(model.named_buffers())}  # Gemma 4's layer_scalar: a buffer
    with torch.no_grad():
        for name, info in gguf_file.tensors.items():
            if name not in names:
                continue  # rope_freqs: transformers computes the proportional rope itself
            if len(info.shape) == 2:
                values = torch.from_dlpack(kernels.dequantize(kernels.upload(load_matrix(gguf_file, name))))
            else:
                values = torch.from_numpy(load_vector(gguf_file, name) - (norm_offset if "norm" in name else 0.0))
            params[names[name]].copy_(values.to(device="cuda", dtype=torch.float16))
            del values
            cupy.get_default_memory_pool().free_all_blocks()
        if spec.arch.startswith("gemma"):
            model.tie_weights()
    return model


def bench_transformers(spec, path: Path, ids: np.ndarray) -> tuple[dict, np.ndarray]:
    import torch
    from transformers import __version__ as version

    t0 = time.perf_counter()
    model = hf_from_gguf(spec, path)
    torch.cuda.synchronize()
    row = {"load_s": time.perf_counter() - t0, "dtype": "float16", "version": version}
    prompt = torch.tensor([ids.tolist()], device="cuda")
    with torch.no_grad():
        model(prompt[:, :16])
        best = float("inf")
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = model(prompt, use_cache=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        last_logits = out.logits[0, -1].float().cpu().numpy()
        past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(DECODE_TOKENS):
            out = model(token, past_key_values=past, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        decode_s = time.perf_counter() - t0
    row.update(prefill_tps=len(ids) / best, decode_tps=DECODE_TOKENS / decode_s)
    del model, out, past
    torch.cuda.empty_cache()
    return row, last_logits


def _vocab_size(path: Path) -> int:
    """The vocabulary of a GGUF (the tiny specs take their tokenizer's)."""
    from cupyllm.files.config import config_from_gguf
    from cupyllm.files.gguf import read_gguf
    return config_from_gguf(read_gguf(path)).n_vocab


def write_report(out: Path, results: dict, start: float) -> None:
    report = {"bench": "e2e_gpu", "device": device_name(), "peak_bandwidth_bytes_per_s": PEAK_BANDWIDTH,
              "peak_f16_flops": PEAK_F16_FLOPS, "prompt_tokens": PROMPT_TOKENS, "decode_tokens": DECODE_TOKENS,
              "time": time.strftime("%Y-%m-%d %H:%M:%S"), "seconds": time.perf_counter() - start, "results": results}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))


def main(argv=None) -> int:
    from cupyllm.cuda import gpu_count

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--budget-s", type=float, default=600.0, help="start no model after this many seconds")
    parser.add_argument("--work-dir", type=Path, default=None, help="where the random GGUFs are written (kept)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "e2e_gpu.json")
    parser.add_argument("--smoke", action="store_true", help="tiny models, 16 prompt and 4 decode tokens, no "
                        "transformers: checks the script (the CUDA emulator too)")
    args = parser.parse_args(argv)
    if gpu_count() == 0:
        print("e2e_gpu: no CUDA device here (CuPy missing or no GPU); nothing measured")
        return 0
    from make_tiny_models import PRESETS, tiny_spec, write_gguf
    specs = dict(PRESETS)
    if args.smoke:
        global PROMPT_TOKENS, DECODE_TOKENS, GEMV_REPEATS
        PROMPT_TOKENS, DECODE_TOKENS, GEMV_REPEATS = 16, 4, 1
        specs = {f"tiny-{arch}": tiny_spec(arch) for arch in ("gemma3", "qwen2", "gemma4")}
        args.models, args.skip_transformers = list(specs), True

    start = time.perf_counter()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="cupyllm-e2e-"))
    work.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in tqdm(args.models, desc="e2e gpu bench", unit="model"):
        if time.perf_counter() - start > args.budget_s:
            results[name] = {"skipped": f"time budget of {args.budget_s:.0f} s spent"}
            continue
        spec = specs[name]
        path = work / f"random-{name}.gguf"
        t0 = time.perf_counter()
        if not path.exists():
            write_gguf(spec, path)
        row = {"gguf_write_s": time.perf_counter() - t0, "gguf_bytes": path.stat().st_size}
        ids = np.random.default_rng(0).integers(0, spec.n_vocab or _vocab_size(path), PROMPT_TOKENS)
        row["cupyllm"], ours = bench_cupyllm(path, ids)
        if not args.skip_transformers:
            row["transformers"], theirs = bench_transformers(spec, path, ids)
            row["last_token_max_abs_logit_diff"] = float(np.abs(ours - theirs).max())
            row["last_token_argmax_equal"] = bool(np.argmax(ours) == np.argmax(theirs))
            row["ratio_vs_transformers"] = {
                "prefill_tps": row["cupyllm"]["prefill_tps"] / row["transformers"]["prefill_tps"],
                "decode_tps": max(row["cupyllm"]["decode_tps_eager"], row["cupyllm"]["decode_tps_graph"])
                / row["transformers"]["decode_tps"]}
        results[name] = row
        if args.work_dir is None:
            path.unlink()  # a 7B GGUF is 4.8 GB
        write_report(args.out, results, start)  # after every model: a run cut short keeps what it measured
    write_report(args.out, results, start)
    for name, row in results.items():
        if "skipped" in row:
            print(f"{name}: skipped ({row['skipped']})")
            continue
        ours = row["cupyllm"]
        print(f"{name}: prefill {ours['prefill_tps']:.0f} tok/s ({ours['prefill_best']}; "
              + ", ".join(f"{p} {v['prefill_tps']:.0f}" for p, v in ours["prefill_paths"].items())
              + f"), decode {ours['decode_tps_eager']:.1f} eager / {ours['decode_tps_graph']:.1f} graph tok/s, "
              f"roofline {ours['decode_roofline_tps']:.0f} tok/s ({ours['decode_fraction_of_roofline']:.0%})")
        if "transformers" in row:
            hf = row["transformers"]
            print(f"   transformers f16: prefill {hf['prefill_tps']:.0f}, decode {hf['decode_tps']:.1f} tok/s; "
                  f"last-token max |dlogit| {row['last_token_max_abs_logit_diff']:.3f}")
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
