"""`cupyllm rys-probe` on the real models, and the chosen plans' perplexity on held-out text.

    python bench/rys_probe.py [--models gemma qwen] [--out-dir bench/results]

For each model: the probe with its defaults (auto band and widths, the shipped corpus and battery, ctx 2048), its
table, then perplexity over bench/rys_heldout.txt (text the probe never saw) of the model without a plan, with
each chosen plan and with the top-ranked block (chosen or not). Writes bench/results/rys_probe_<model>.json and prints the tables (docs/layer-plans.md).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from host_cpu import cpu_description

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

HELD_OUT = Path(__file__).with_name("rys_heldout.txt")


def main() -> int:
    import cupyllm
    from cupyllm.rys_probe import probe
    from models import gemma_path, qwen_path

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["gemma", "qwen"], choices=["gemma", "qwen"])
    parser.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    paths = {"gemma": gemma_path, "qwen": qwen_path}
    for name in args.models:
        model = cupyllm.load(paths[name](), device="cpu", ctx=2048)
        start = time.perf_counter()
        result = probe(model)
        seconds = time.perf_counter() - start
        held_out_ids = model.tokenize(HELD_OUT.read_text(encoding="utf-8"))
        held_out = {}
        ranked = result.ranked()
        # the chosen plans, and the top-ranked block even where it gains nothing (so a loss is reported too)
        for label, best in (("none", None), ("most_efficient", result.most_efficient()),
                            ("largest_gain", result.largest_gain()), ("top_ranked", ranked[0] if ranked else None)):
            if label != "none" and best is None:
                continue
            plan = "" if best is None else best.plan
            nll = model.with_layer_plan(plan).token_nll(held_out_ids)
            held_out[label] = {"plan": plan, "perplexity": math.exp(float(nll.mean()))}
        table = result.table(top_k=10)
        print(f"== {model.path.name}\n{table}\nheld-out perplexity ({len(held_out_ids)} tokens): "
              + ", ".join(f"{k} {v['plan'] or '-'}: {v['perplexity']:.3f}" for k, v in held_out.items()))
        out = args.out_dir / f"rys_probe_{name}.json"
        out.write_text(json.dumps({"machine": cpu_description(), "command": "python bench/rys_probe.py --models "
                                   + name, "probe_seconds": seconds, **result.to_json(), "table": table.splitlines(),
                                   "held_out_tokens": len(held_out_ids), "held_out": held_out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
