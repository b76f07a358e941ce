"""End-to-end CPU speed: prefill (a 128-token prompt) and decode (64 tokens, greedy) on the two real models,
beside llama.cpp (llama-cpp-python, n_threads=2) and HF transformers (float32) in the same run; and on a
random-weight Gemma 4 E2B (tests/support/make_tiny_models.py preset `gemma4-e2b`, Q4_K blocks with the real shapes,
written to ~/.cache/cupyllm/bench once: no Gemma 4 GGUF ships on PyPI) beside llama.cpp; likewise the hybrid
Qwen3.5-0.8B (`qwen3.5-0.8b`) and 8 of Qwen3.6-35B-A3B's 40 layers (`qwen3.6-35b-a3b-8l`).

    python bench/e2e_cpu.py [--models gemma qwen gemma4-e2b qwen3.5-0.8b qwen3.6-35b-a3b-8l]
                            [--skip-transformers] [--rounds 3] [--prompt-tokens 128] [--decode-tokens 64]
                            [--llama-flash-attn] [--out bench/results/e2e_cpu.json]

Long context: `--prompt-tokens 4096` (the decode then runs over that cache); `--llama-flash-attn` gives llama.cpp
its flash attention (`flash_attn=True`, llama-server's `-fa`), its faster setting at long context.

Ratios are cupyllm / peer (above 1: cupyllm faster). The engines of a model are loaded together in one process
and timed alone, one after the other, in `--rounds` rounds whose engine order alternates, so each engine's runs
sit beside its peers' in time; each figure is the median over the rounds (all rounds are in the JSON): on a
shared 2-core machine one run of the same code varies by 25%.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm
from host_cpu import cpu_description

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "support"))  # make_tiny_models

PROMPT_TOKENS, DECODE_TOKENS, THREADS = 128, 64, 2  # (defaults)
# random-weight presets of tests/support/make_tiny_models.py -> the size of their tokenizer's real vocabulary
RANDOM_MODELS = {"gemma4-e2b": 280, "qwen3.5-0.8b": 272, "qwen3.6-35b-a3b-8l": 272}
TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable "
        "metal type, oil-based ink and a wooden screw press into a system that could produce books far faster than "
        "scribes. Within fifty years presses had spread to more than two hundred cities across Europe, and the price "
        "of books fell so far that ordinary merchants could own them. Printers standardised spelling, spread "
        "scientific results, and made pamphlets a political weapon during the Reformation. ") * 4


def prompt_ids(model, n: int = PROMPT_TOKENS) -> list[int]:
    """The first n tokens of TEXT, repeated as often as it takes."""
    ids = model.tokenize(TEXT)
    return (ids * -(-n // len(ids)))[:n]


def preset_path(name: str) -> Path:
    """A random-weight model with a real model's shapes (written once; the text is meaningless to it)."""
    from cupyllm.files.model_store import cache_dir
    from make_tiny_models import PRESETS, write_gguf
    path = cache_dir().parent / "bench" / f"random-{name}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_gguf(PRESETS[name], path.with_suffix(".part"))
        path.with_suffix(".part").rename(path)
    return path


def _timed(prefill, step, ids: list[int], decode_tokens: int = DECODE_TOKENS) -> dict:
    """Prefill `ids`, then `decode_tokens` greedy steps: tokens/s of each. prefill(ids) -> last logits (starting
    from an empty cache); step(token) -> logits."""
    t0 = time.perf_counter()
    logits = prefill(ids)
    t_prefill = time.perf_counter() - t0
    token = int(np.argmax(logits))
    t0 = time.perf_counter()
    for _ in range(decode_tokens):
        token = int(np.argmax(step(token)))
    t_decode = time.perf_counter() - t0
    return {"prefill_tps": len(ids) / t_prefill, "decode_tps": decode_tokens / t_decode}


def _warm_up(prefill, step, ids: list[int]) -> None:
    """A short prefill and two decode steps before any timing: each engine's kernels compiled (numba's for both
    the GEMM and the GEMV), its buffers allocated."""
    prefill(ids[:16])
    step(ids[16])
    step(ids[17])


def cupyllm_engine(path: Path, ids: list[int], decode_tokens: int = DECODE_TOKENS):
    import cupyllm
    from cupyllm.generate import prefill

    model = cupyllm.load(path, device="cpu", ctx=len(ids) + decode_tokens + 8, progress=False)
    forward = model.transformer.forward
    state = {}

    def run_prefill(prompt):
        state["cache"] = model.new_cache()
        return prefill(forward, prompt, state["cache"], 512)

    def step(token):
        cache = state["cache"]
        logits = forward(np.array([token]), np.array([cache.n_past]), cache)
        cache.n_past += 1
        return logits

    _warm_up(run_prefill, step, ids)
    return lambda: _timed(run_prefill, step, ids, decode_tokens), {}


def llama_cpp_engine(path: Path, ids: list[int], decode_tokens: int = DECODE_TOKENS, flash_attn: bool = False):
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_threads=THREADS, n_threads_batch=THREADS, verbose=False,
                n_ctx=max(512, len(ids) + decode_tokens + 8), n_batch=512, flash_attn=flash_attn)

    def last_logits():  # (llm.scores holds no row without logits_all: the context's last logits)
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))

    def run_prefill(prompt):
        llm.reset()
        llm.eval(prompt)
        return last_logits()

    def step(token):
        llm.eval([token])
        return last_logits()

    _warm_up(run_prefill, step, ids)
    return lambda: _timed(run_prefill, step, ids, decode_tokens), {"version": _version("llama_cpp"),
                                                                  "flash_attn": flash_attn}


def transformers_engine(path: Path, ids: list[int], decode_tokens: int = DECODE_TOKENS):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(THREADS)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    state = {}

    @torch.no_grad()
    def run_prefill(prompt):
        out = model(torch.tensor([prompt]), use_cache=True)
        state["past"] = out.past_key_values
        return out.logits[0, -1].numpy()

    @torch.no_grad()
    def step(token):
        out = model(torch.tensor([[token]]), past_key_values=state["past"], use_cache=True)
        state["past"] = out.past_key_values
        return out.logits[0, -1].numpy()

    _warm_up(run_prefill, step, ids)
    return lambda: _timed(run_prefill, step, ids, decode_tokens), {"version": _version("transformers")}


def _version(module: str) -> str:
    try:
        return __import__(module).__version__
    except Exception:
        return "unknown"


def main(argv=None) -> int:
    from models import gemma_path, qwen_path

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["gemma", "qwen"], choices=["gemma", "qwen", *RANDOM_MODELS])
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--rounds", type=int, default=3, help="timed runs per engine and model (median reported)")
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS)
    parser.add_argument("--decode-tokens", type=int, default=DECODE_TOKENS)
    parser.add_argument("--llama-flash-attn", action="store_true", help="llama.cpp with flash_attn=True")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "e2e_cpu.json")
    args = parser.parse_args(argv)

    import cupyllm

    paths = {"gemma": gemma_path, "qwen": qwen_path, **{m: (lambda m=m: preset_path(m)) for m in RANDOM_MODELS}}
    engines = {"cupyllm": cupyllm_engine,
               "llama.cpp": lambda *a: llama_cpp_engine(*a, flash_attn=args.llama_flash_attn)}
    if not args.skip_transformers:
        engines["transformers"] = transformers_engine
    results = {}
    for name in tqdm(args.models, desc="e2e cpu bench", unit="model"):
        path = paths[name]()
        if name in RANDOM_MODELS:  # random weights: random ids of its small real vocabulary
            ids = np.random.default_rng(0).integers(4, RANDOM_MODELS[name], args.prompt_tokens).tolist()
        else:
            ids = prompt_ids(cupyllm.load(path, device="cpu", ctx=64, progress=False), args.prompt_tokens)
        loaded = {e: engines[e](path, ids, args.decode_tokens) for e in engines
                  if not (name in RANDOM_MODELS and e == "transformers")}
        runs = {e: [] for e in loaded}
        for r in tqdm(range(args.rounds), desc=name, unit="round", leave=False):
            for engine in (list(loaded) if r % 2 == 0 else list(loaded)[::-1]):
                runs[engine].append(loaded[engine][0]())
        row = results.setdefault(name, {"model": path.name})
        for engine, engine_runs in runs.items():
            row[engine] = {k: float(np.median([run[k] for run in engine_runs])) for k in ("prefill_tps", "decode_tps")}
            row[engine].update(loaded[engine][1], rounds=engine_runs)
        del loaded
    for name, row in results.items():
        ours = row["cupyllm"]
        for peer in [e for e in engines if e != "cupyllm" and e in row]:
            row[f"ratio_vs_{peer}"] = {k: ours[k] / row[peer][k] for k in ("prefill_tps", "decode_tps")}
    report = {
        "bench": "e2e_cpu", "device": cpu_description(),
        "threads": THREADS, "prompt_tokens": args.prompt_tokens, "decode_tokens": args.decode_tokens,
        "rounds": args.rounds, "llama_flash_attn": args.llama_flash_attn,
        "figures": "median over the rounds (engines interleaved)",
        "time": time.strftime("%Y-%m-%d %H:%M:%S"), "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    for name, row in results.items():
        cells = "  ".join(f"{e}: prefill {row[e]['prefill_tps']:.1f} decode {row[e]['decode_tps']:.1f} tok/s"
                          for e in engines if e in row)
        print(f"{name}: {cells}")
        for peer in [e for e in engines if e != "cupyllm" and e in row]:
            r = row[f"ratio_vs_{peer}"]
            print(f"   cupyllm / {peer}: prefill x{r['prefill_tps']:.2f}, decode x{r['decode_tps']:.2f}")
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
