"""Shared fixtures: tiny random-weight GGUF models written by tools/make_tiny_models.py (with their HF twins)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "tests"))

import make_tiny_models  # noqa: E402


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny_models")


@pytest.fixture(scope="session")
def tiny_model(tiny_dir):
    """tiny_model(arch) -> (path, TinySpec, decoded float32 tensors); each written once per session."""
    made = {}

    def make(arch: str):
        if arch not in made:
            spec = make_tiny_models.TinySpec(arch)
            path = tiny_dir / f"tiny-{arch}.gguf"
            made[arch] = (path, spec, make_tiny_models.write_gguf(spec, path))
        return made[arch]

    return make
