"""Reference logits from HF transformers (float32, loading the same GGUF) for the real-model parity tests.

    python tools/make_hf_reference.py            # writes tests/data/hf_reference_{gemma,qwen}.npz

For each text: the token ids (cupyllm's tokenizer, itself checked id-for-id against llama.cpp), and at every
position the indices and values of HF's top-32 logits plus its argmax. The tests recompute the logits with
cupyllm and compare on exactly those entries, so CI does not need to run transformers.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

TEXTS = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a wooden screw press into a system that could produce books far "
    "faster than scribes. Within fifty years, presses had spread to more than two hundred cities across Europe.",
    "def fibonacci(n: int) -> list[int]:\n    \"\"\"Return the first n Fibonacci numbers.\"\"\"\n    values = [0, 1]\n"
    "    while len(values) < n:\n        values.append(values[-1] + values[-2])\n    return values[:n]\n\n"
    "print(fibonacci(10))\n",
    "Question: A train leaves the station at 9:15 and travels 180 kilometres at an average speed of 72 km/h. "
    "At what time does it arrive? Answer: The journey takes 180 / 72 = 2.5 hours, so the train arrives at 11:45.",
    "Mountains shape the weather around them. Moist air is forced upward on the windward side, cools, and drops "
    "its water as rain or snow; the far side lies in a rain shadow, which is why deserts often sit just beyond "
    "high ranges such as the Andes or the Sierra Nevada.",
]
TOP = 32


def reference(model_path: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from cupyllm.files.gguf import read_gguf
    from cupyllm.files.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_metadata(read_gguf(model_path).metadata)
    hf = AutoModelForCausalLM.from_pretrained(model_path.parent, gguf_file=model_path.name, dtype=torch.float32).eval()
    arrays = {}
    for i, text in enumerate(TEXTS):
        ids = tokenizer.encode(text)
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0].float().numpy()
        top = np.argsort(-logits, axis=-1, kind="stable")[:, :TOP]
        arrays[f"ids_{i}"] = np.asarray(ids, np.int64)
        arrays[f"top_idx_{i}"] = top.astype(np.int32)
        arrays[f"top_val_{i}"] = np.take_along_axis(logits, top, axis=-1).astype(np.float32)
        print(f"{model_path.name}: text {i}: {len(ids)} tokens")
    np.savez_compressed(out, **arrays)
    print("wrote", out)


def main(argv=None) -> int:
    from models import gemma_path, qwen_path

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=ROOT / "tests" / "data")
    args = parser.parse_args(argv)
    reference(gemma_path(), args.out_dir / "hf_reference_gemma.npz")
    reference(qwen_path(), args.out_dir / "hf_reference_qwen.npz")
    return 0


if __name__ == "__main__":
    sys.exit(main())
