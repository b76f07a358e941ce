"""Reference outputs of HF transformers for the tiny random-weight models and the RoPE scalings, stored so the
test suite needs neither torch nor transformers.

    pip install -e ".[reference]"
    python tools/make_hf_tiny_reference.py      # writes tests/data/hf_reference_tiny.npz

For each tiny model of tests/support/make_tiny_models.py: the sha256 of its GGUF (the tests write the same file
again and stop with a clear message if it changed), the prefill token ids and HF's float32 logits at every
position, the same for the decode test's ids. For RoPE: transformers' inverse frequencies and attention factor
of linear and YaRN scaling. For the tiny Gemma 4 tokenizer: the ids HF `tokenizers` gives the test texts and
1000 seeded random strings.
tests/test_forward_tiny.py (`test_stored_reference_is_what_transformers_computes`) recomputes all of it where
torch is installed.
"""
from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))  # make_tiny_models

import make_tiny_models  # noqa: E402

OUT = ROOT / "tests" / "data" / "hf_reference_tiny.npz"
ARCHES = make_tiny_models.ARCHES + make_tiny_models.HYBRID_ARCHES
PREFILL_TOKENS, PREFILL_SEED = 29, 7
DECODE_TOKENS, DECODE_SEED = 20, 8
ROPE_CASES = {  # name -> (transformers rope type, its parameters); base 1e6, 128 rotated dims, 32768 positions
    "linear": ("linear", dict(factor=4.0)),
    "yarn": ("yarn", dict(factor=4.0, original_max_position_embeddings=32768, truncate=True)),
}
GEMMA4_TEXTS = ["the water in the sea", "  there\n\nwas an  answer\n", "snow\n\n\nthe", "héllo wörld ⛵ 🙂",
                "the<|turn>user\nhi<turn|>", "", "\n", "rent on the tower a the", "x" * 40]


def key(arch: str) -> str:
    return arch.replace("-", "_")


def token_ids(n_vocab: int, n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, n_vocab, n).tolist()


def write_model(arch: str, directory: Path) -> tuple[Path, str, dict]:
    """The tiny model's GGUF, its sha256 and its decoded float32 tensors."""
    spec = make_tiny_models.tiny_spec(arch)
    path = directory / f"tiny-{arch}.gguf"
    decoded = make_tiny_models.write_gguf(spec, path)
    return path, hashlib.sha256(path.read_bytes()).hexdigest(), decoded


def hf_logits(arch: str, decoded: dict, ids: list[int]) -> np.ndarray:
    import torch

    hf = make_tiny_models.hf_model(make_tiny_models.tiny_spec(arch), decoded)
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].numpy().astype(np.float32)


def hf_rope(rope_type: str, **params) -> tuple[np.ndarray, float]:
    from transformers import Qwen2Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = Qwen2Config(hidden_size=512, num_attention_heads=4, max_position_embeddings=32768,
                      rope_parameters={"rope_type": rope_type, "rope_theta": 1e6, **params})
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu")
    return inv_freq.double().numpy(), float(attention_factor)


def hf_gemma4_tokenizer(tokens: list[str], merges: list[str]):
    """The tiny Gemma 4 vocabulary in HF `tokenizers`, with the components a Gemma 4 tokenizer.json names: spaces
    replaced by U+2581, lines and newline runs split apart, BPE with byte fallback, specials as added tokens."""
    import tokenizers
    from tokenizers import Regex, models, normalizers, pre_tokenizers

    vocab = {t: i for i, t in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges], byte_fallback=True,
                     unk_token="<unk>", fuse_unk=False)
    tok = tokenizers.Tokenizer(bpe)
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[^\\n]+|[\\n]+"), behavior="isolated")
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in ("<|turn>", "<turn|>", "<bos>", "<eos>")])
    return tok


def compute(directory: Path, arches=ARCHES) -> dict[str, np.ndarray]:
    """Every array the npz holds, computed now with transformers."""
    arrays: dict[str, np.ndarray] = {}
    for arch in arches:
        _, digest, decoded = write_model(arch, directory)
        n_vocab = decoded["token_embd.weight"].shape[0]
        prefill_ids = token_ids(n_vocab, PREFILL_TOKENS, PREFILL_SEED)
        decode_ids = token_ids(n_vocab, DECODE_TOKENS, DECODE_SEED)
        arrays[f"{key(arch)}_sha256"] = np.array(digest)
        arrays[f"{key(arch)}_prefill_ids"] = np.array(prefill_ids, np.int64)
        arrays[f"{key(arch)}_prefill_logits"] = hf_logits(arch, decoded, prefill_ids)
        arrays[f"{key(arch)}_decode_ids"] = np.array(decode_ids, np.int64)
        arrays[f"{key(arch)}_decode_logits"] = hf_logits(arch, decoded, decode_ids)
    for name, (rope_type, params) in ROPE_CASES.items():
        inv_freq, factor = hf_rope(rope_type, **params)
        arrays[f"rope_{name}_inv_freq"] = inv_freq
        arrays[f"rope_{name}_attention_factor"] = np.array(factor)
    tokens, _, merges = make_tiny_models.gemma4_vocab()
    from cupyllm.files.tokenizer import Tokenizer  # the tokens as the GGUF stores them (padding included)

    path, _, _ = write_model("gemma4", directory)
    hf = hf_gemma4_tokenizer(Tokenizer.from_gguf(path).tokens, merges)
    for i, text in enumerate(GEMMA4_TEXTS):
        arrays[f"gemma4_tokenizer_ids_{i}"] = np.array(hf.encode(text, add_special_tokens=False).ids, np.int64)
    pieces = [hf.encode(text, add_special_tokens=False).ids for text in gemma4_fuzz_texts()]
    arrays["gemma4_fuzz_ids"] = np.array([i for ids in pieces for i in ids], np.int64)
    arrays["gemma4_fuzz_offsets"] = np.cumsum([0] + [len(ids) for ids in pieces]).astype(np.int64)
    return arrays


def gemma4_fuzz_texts() -> list[str]:
    """1000 seeded random strings over the tiny Gemma 4 vocabulary's pieces (other than llama.cpp's 400)."""
    sys.path.insert(0, str(ROOT / "tools"))
    import make_llama_cpp_reference

    return make_llama_cpp_reference.fuzz_texts(1000, seed=1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        arrays = compute(Path(tmp))
    np.savez_compressed(args.out, **arrays)
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes, {len(arrays)} arrays)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
