"""Reference logits from llama.cpp (llama-cpp-python) for the tiny Gemma 3, Gemma 4, Qwen3-MoE and hybrid
Qwen3.5 / Qwen3.5-MoE / Qwen3-Next (Gated DeltaNet) GGUFs, with every tensor stored as F32 so llama.cpp runs them without quantizing activations.

    python tools/make_llama_cpp_reference.py     # writes tests/data/llama_cpp_tiny.npz
    python tools/make_llama_cpp_reference.py --only qwen35 qwen35-moe qwen3next   # (re)computes these, keeps the rest

llama.cpp's CPU kernels depend on the build (e.g. -DGGML_NATIVE=ON): logits of another build differ by up to ~1e-3,
so --only adds a model without moving the arrays the other models' tests were checked against.

Our tiny Gemma 4 files are written as llama.cpp's convert_hf_to_gguf.py writes the real models; llama.cpp
computing the same logits as cupyllm (and as transformers, tests/test_forward_tiny.py) checks that reading
from the other side. For each model the npz holds the sha256 of the GGUF (the test writes the same file again
and stops with a clear message if it changed), the token ids and llama.cpp's logits of every position
(F32 K/V cache); and for the Gemma 4 tokenizer, llama.cpp's ids of TOKENIZER_TEXTS and 400 seeded random
strings (fuzz_texts), concatenated with their offsets.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))  # make_tiny_models

import make_tiny_models  # noqa: E402

ARCHES = ("gemma3", "gemma4", "gemma4-moe", "qwen3-moe") + make_tiny_models.HYBRID_ARCHES
N_TOKENS = 24
TOKENIZER_TEXTS = ["the water in the sea", "  there\n\nwas an  answer\n", "snow\n\n\nthe", "héllo wörld ⛵ 🙂",
                   "the<|turn>user\nhi<turn|>", "\n", "rent on the tower a the", "x" * 40]
FUZZ_PIECES = list("the water sin rowa\n\n  ") + ["é", "⛵", "🙂", "\t", "<|turn>", "<turn|>", "x", "Z", "\r"]


def fuzz_texts(n: int = 400, seed: int = 0) -> list[str]:
    """Random strings over the tiny Gemma 4 vocabulary's characters, merges, specials, runs of spaces and
    newlines, and characters only byte fallback spells."""
    rng = np.random.default_rng(seed)
    return ["".join(rng.choice(FUZZ_PIECES, rng.integers(0, 30))) for _ in range(n)]
OUT = ROOT / "tests" / "data" / "llama_cpp_tiny.npz"


def f32_spec(arch: str) -> make_tiny_models.TinySpec:
    return dataclasses.replace(make_tiny_models.tiny_spec(arch), types={})


def token_ids(arch: str) -> list[int]:
    vocab = {"gemma3": make_tiny_models.gemma_vocab, "gemma4": make_tiny_models.gemma4_vocab}.get(
        make_tiny_models.tiny_spec(arch).gguf_arch, make_tiny_models.qwen_vocab)()[0]
    return np.random.default_rng(11).integers(4, len(vocab), N_TOKENS).tolist()


def write_model(arch: str, directory: Path) -> tuple[Path, str]:
    path = directory / f"f32-{arch}.gguf"
    make_tiny_models.write_gguf(f32_spec(arch), path)
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--only", nargs="+", choices=ARCHES, help="compute these models; keep the others' arrays")
    args = parser.parse_args(argv)
    import llama_cpp

    arrays = {}
    if args.only:
        if not args.out.exists():
            parser.error(f"--only updates {args.out}, which does not exist: run without --only first")
        arrays = {k: v for k, v in np.load(args.out).items() if k != "llama_cpp_version"}
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.only or ARCHES:
            path, digest = write_model(arch, Path(tmp))
            llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=1,
                                  type_k=0, type_v=0)  # GGML_TYPE_F32 K and V
            ids = token_ids(arch)
            llm.eval(ids)
            key = arch.replace("-", "_")
            arrays[f"{key}_sha256"] = np.array(digest)
            arrays[f"{key}_ids"] = np.array(ids, np.int64)
            arrays[f"{key}_logits"] = np.array(llm.scores[:len(ids)], np.float32)
            if arch == "gemma4":
                pieces = [llm.tokenize(t.encode(), add_bos=False, special=True)
                          for t in TOKENIZER_TEXTS + fuzz_texts()]
                arrays["gemma4_text_ids"] = np.array([i for p in pieces for i in p], np.int64)
                arrays["gemma4_text_offsets"] = np.cumsum([0] + [len(p) for p in pieces])
            print(f"{arch}: {len(ids)} tokens, llama-cpp-python {llama_cpp.__version__}")
    np.savez_compressed(args.out, llama_cpp_version=np.array(llama_cpp.__version__), **arrays)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
