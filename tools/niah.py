"""Long-context retrieval in the style of RULER: needle-in-a-haystack (single, multi-key, multi-value) and variable
tracking, generated deterministically from a seed and scored by substring match.

    python tools/niah.py --lengths 8192 16384 --tasks single --depths 0.25 0.75 --modes plain dca
    python tools/niah.py --lengths 8192 --dca-chunk-size 4096 --modes plain dca       # short-chunk check

Needle: "One of the special magic numbers for {key} is: {value}." inside a repetitive noise haystack; the prompt
ends with the start of the answer, so base models can complete it. Writes JSON (and a Markdown table) under
bench/results/. `--device gpu` runs the same on the GPU.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

NOISE = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")
NEEDLE = "One of the special magic numbers for {key} is: {value}."
WORDS = ("amber", "breeze", "cobalt", "delta", "ember", "falcon", "glacier", "harbor", "ivory", "juniper", "kestrel",
         "lantern", "meadow", "nimbus", "orchid", "pebble", "quartz", "raven", "saffron", "tundra", "umber", "velvet",
         "willow", "zephyr")


@dataclass
class Sample:
    task: str
    length: int
    depth: float
    prompt: str
    answers: list[str]
    answer_prefix: str


def _key(rng: random.Random) -> str:
    return f"{rng.choice(WORDS)}-{rng.choice(WORDS)}"


def _value(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _haystack(tokenizer, n_tokens: int) -> list[str]:
    """Noise sentences whose token count is about n_tokens."""
    per = len(tokenizer.encode(NOISE, add_bos=False))
    return [NOISE] * max(1, n_tokens // per)


def _insert(sentences: list[str], needles: list[str], depths: list[float]) -> str:
    parts = list(sentences)
    for needle, depth in sorted(zip(needles, depths), key=lambda t: -t[1]):
        parts.insert(int(round(depth * len(sentences))), needle + " ")
    return "".join(parts)


def make_sample(task: str, length: int, depth: float, seed: int, tokenizer, slack: int = 0) -> Sample:
    """`slack`: tokens the haystack gives up beyond the usual room (fit_sample: a tokenizer that spends more tokens
    on the needles and question than Gemma's and Qwen's)."""
    rng = random.Random(f"{task}-{length}-{depth}-{seed}")
    budget = length - 120 - slack  # room for question and answer
    if task == "vartrack":
        value, names = _value(rng), [f"X{rng.randint(10000, 99999)}" for _ in range(4)]
        chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, 4)]
        depths = sorted(rng.uniform(0.05, 0.95) for _ in chain) if depth < 0 else [min(depth + 0.02 * i, 1.0) for i in range(4)]
        text = _insert(_haystack(tokenizer, budget - 60), chain, depths)
        question = (f"\nQuestion: Find all variables that are assigned the value {value} in the text above.\n"
                    f"Answer: According to the chain(s) of variable assignment in the text above, 4 variables are "
                    f"assigned the value {value}, they are:")
        return Sample(task, length, depth, text + question, names, "")
    keys = [_key(rng) for _ in range(4 if task == "multikey" else 1)]
    values = [_value(rng) for _ in range(3 if task == "multivalue" else len(keys))]
    if task == "multivalue":
        needles = [NEEDLE.format(key=keys[0], value=v) for v in values]
        depths = [min(depth + 0.05 * i, 1.0) for i in range(len(values))]
    else:
        needles = [NEEDLE.format(key=k, value=v) for k, v in zip(keys, values)]
        others = [rng.uniform(0.0, 1.0) for _ in keys[1:]]
        depths = [depth] + others
    text = _insert(_haystack(tokenizer, budget - 30 * len(needles)), needles, depths)
    target = keys[0]
    if task == "multivalue":
        question = f"\nWhat are all the special magic numbers for {target} mentioned in the provided text?"
        prefix = f" The special magic numbers for {target} mentioned in the provided text are"
        answers = values
    else:
        question = f"\nWhat is the special magic number for {target} mentioned in the provided text?"
        prefix = f" The special magic number for {target} mentioned in the provided text is"
        answers = values[:1]
    return Sample(task, length, depth, text + question + prefix, answers, prefix)


def fit_sample(task: str, length: int, depth: float, seed: int, model, room: int) -> tuple[Sample, list[int]]:
    """make_sample's sample and its ids, the haystack cut where the prompt would pass `room` tokens (the samples
    that fit, as every sample with the Gemma and Qwen tokenizers does, are make_sample's own)."""
    slack = 0
    while True:
        sample = make_sample(task, length, depth, seed, model.tokenizer, slack)
        ids = model.tokenize(sample.prompt)
        if len(ids) <= room or slack >= length:
            return sample, ids
        slack += len(ids) - room


def score(sample: Sample, output: str) -> float:
    return sum(a in output for a in sample.answers) / len(sample.answers)


def run(args) -> dict:
    import cupyllm
    from models import gemma_path

    path = Path(args.model) if args.model else gemma_path()
    rows = _previous_rows(args) if args.append else []
    jobs = [(mode, length, task, depth) for mode in args.modes for length in args.lengths for task in args.tasks
            for depth in (args.depths if task != "vartrack" else [-1.0])]
    models = {}
    for mode, length, task, depth in tqdm(jobs, desc="niah", unit="sample"):
        key = (mode, length)
        if key not in models:
            models.clear()  # one model (and cache) at a time
            dca = None if mode == "plain" else {"chunk_size": args.dca_chunk_size, "local_size": args.dca_local_size}
            models[key] = cupyllm.load(path, device=args.device, ctx=length + 64, kv_type_k=args.kv_type,
                                       kv_type_v=args.kv_type, dca=dca, progress=False)
        model = models[key]
        sample, ids = fit_sample(task, length, depth, args.seed, model, length + 64 - args.max_tokens - 1)
        t0 = time.perf_counter()
        output = model.generate(ids, max_tokens=args.max_tokens, temperature=0.0, progress=True)
        seconds = time.perf_counter() - t0
        row = {"mode": mode, "length": length, "prompt_tokens": len(ids), "task": task, "depth": depth,
               "score": score(sample, output), "answers": sample.answers, "output": output, "seconds": round(seconds, 1),
               "prefill_tps": round(model.last_stats.prefill_tps, 1)}
        rows.append(row)
        tqdm.write(f"{mode:5s} {length:6d} {task:10s} depth {depth:5.2f}: score {row['score']:.2f} "
                   f"({seconds:.0f} s) -> {output.strip()[:60]!r}")
        if args.out:
            _write(args, path, rows)
    return {"rows": rows}


def _previous_rows(args) -> list[dict]:
    """Rows of an earlier run into the same --out (same model settings), so one table can grow run by run."""
    out = Path(args.out)
    return json.loads(out.read_text())["rows"] if out.exists() else []


def _write(args, path: Path, rows: list[dict]) -> None:
    from cupyllm.files.config import config_from_gguf
    from cupyllm.files.gguf import read_gguf

    cfg = config_from_gguf(read_gguf(path))
    chunk = args.dca_chunk_size or cfg.ctx_train
    report = {"tool": "niah", "model": path.name, "trained_context": cfg.ctx_train, "device": args.device,
              "kv_type": args.kv_type, "dca": {"chunk_size": chunk, "local_size": args.dca_local_size or chunk // 32},
              "seed": args.seed, "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    lines = [f"# NIAH ({path.name}, trained context {cfg.ctx_train}, DCA chunk {chunk}, {args.device})", "",
             "| mode | length | task | depth | score | seconds |", "|---|---|---|---|---|---|"]
    for r in rows:
        depth = "random" if r["depth"] < 0 else f"{r['depth']:.2f}"
        lines.append(f"| {r['mode']} | {r['length']} | {r['task']} | {depth} | {r['score']:.2f} | {r['seconds']} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-m", "--model", help="GGUF model (default: Gemma 3 270M)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768, 49152, 65536])
    parser.add_argument("--tasks", nargs="+", default=["single"], choices=["single", "multikey", "multivalue", "vartrack"])
    parser.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    parser.add_argument("--modes", nargs="+", default=["plain", "dca"], choices=["plain", "dca"])
    parser.add_argument("--dca-chunk-size", type=int, default=None)
    parser.add_argument("--dca-local-size", type=int, default=None)
    parser.add_argument("--kv-type", default="f16")
    parser.add_argument("--device", default="cpu", choices=["cpu", "gpu"])
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "niah.json"))
    parser.add_argument("--append", action="store_true", help="keep the rows already in --out and add these")
    args = parser.parse_args(argv)
    run(args)
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
