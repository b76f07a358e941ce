"""End-to-end CPU speed of this checkout against an earlier commit, in the same run: a change that should not
change speed (a refactor) is shown to be within noise.

    python bench/e2e_cpu_revisions.py --baseline REV [--models gemma qwen] [--rounds 5] [--prompt-tokens 128]
                                      [--out bench/results/e2e_cpu_revisions.json]

Each round runs, for each model, one process per revision in alternating order (two versions of the package
cannot share a process): the model loaded, bench/e2e_cpu.py's warm-up, then its timing (a 128-token prefill, or
`--prompt-tokens`, then e2e_cpu's 64 greedy decode steps over that cache, tokens/s). The baseline runs from a git
worktree of REV; each figure is the median over the rounds (all rounds are in the JSON); ratio = this checkout /
baseline (above 1: faster now).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm
from host_cpu import cpu_description
from e2e_cpu import DECODE_TOKENS

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"

# One timing in a fresh process whose `cupyllm` comes from TREE (bench/e2e_cpu.py's engine, warm-up and timer).
WORKER = """
import json, sys
tree, bench, path, prompt_tokens = sys.argv[1:5]
sys.path[:] = [tree, bench] + [p for p in sys.path if p not in ("", tree, bench)]
import e2e_cpu
import cupyllm
assert cupyllm.__file__.startswith(tree), (cupyllm.__file__, tree)
ids = e2e_cpu.prompt_ids(cupyllm.load(path, device="cpu", ctx=64, progress=False), int(prompt_tokens))
run, _ = e2e_cpu.cupyllm_engine(path, ids)
print(json.dumps(run()))
"""


def timed_run(tree: Path, model: Path, prompt_tokens: int) -> dict:
    result = subprocess.run([sys.executable, "-c", WORKER, str(tree), str(BENCH), str(model), str(prompt_tokens)],
                            cwd=tree, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise SystemExit(f"the run of {model.name} at {tree} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="the commit to compare with (a git revision)")
    parser.add_argument("--models", nargs="+", default=["gemma", "qwen"], choices=["gemma", "qwen"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=BENCH / "results" / "e2e_cpu_revisions.json")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    base = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.baseline], capture_output=True,
                          text=True, check=True).stdout.strip()
    sys.path.insert(0, str(ROOT / "tests"))
    from models import gemma_path, qwen_path

    paths = {"gemma": gemma_path, "qwen": qwen_path}
    work = Path(tempfile.mkdtemp(prefix="cupyllm-revisions-"))
    tree = work / "baseline"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree), base], check=True)
    try:
        trees = {"now": ROOT, "baseline": tree}
        for model in tqdm(args.models, desc="compiling each revision's kernels", unit="model", leave=False):
            for t in trees.values():
                timed_run(t, paths[model](), args.prompt_tokens)  # each tree's numba cache filled before timing
        runs = {model: {name: [] for name in trees} for model in args.models}
        for r in tqdm(range(args.rounds), desc="rounds", unit="round"):
            for model in args.models:
                for name in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
                    runs[model][name].append(timed_run(trees[name], paths[model](), args.prompt_tokens))
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    results = {}
    for model, by_tree in runs.items():
        row = results[model] = {}
        for name, tree_runs in by_tree.items():
            row[name] = {k: float(np.median([run[k] for run in tree_runs])) for k in ("prefill_tps", "decode_tps")}
            row[name]["rounds"] = tree_runs
        row["ratio_now_over_baseline"] = {k: row["now"][k] / row["baseline"][k] for k in ("prefill_tps", "decode_tps")}
    report = {"bench": "e2e_cpu_revisions", "device": cpu_description(), "now": head, "baseline": base,
              "rounds": args.rounds, "prompt_tokens": args.prompt_tokens, "decode_tokens": DECODE_TOKENS,
              "figures": "median over the rounds (revisions alternating, one process each)",
              "time": time.strftime("%Y-%m-%d %H:%M:%S"), "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    for model, row in results.items():
        r = row["ratio_now_over_baseline"]
        print(f"{model}: {head} / {base}: prefill x{r['prefill_tps']:.3f} ({row['now']['prefill_tps']:.1f} / "
              f"{row['baseline']['prefill_tps']:.1f} tok/s), decode x{r['decode_tps']:.3f} "
              f"({row['now']['decode_tps']:.1f} / {row['baseline']['decode_tps']:.1f} tok/s)")
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
