"""tools/device_model.py: a file split into parts, stashed part by part and joined back byte for byte; a missing
part or a corrupted one is refused with a message that says what to do."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import device_model  # noqa: E402
from cupyllm.errors import ModelFileError  # noqa: E402


def _model(tmp_path: Path) -> Path:
    model = tmp_path / "m.gguf"
    model.write_bytes(np.random.default_rng(0).integers(0, 256, (5 << 20) + 123, dtype=np.uint8).tobytes())
    return model


def test_split_stash_join_round_trip(tmp_path):
    model = _model(tmp_path)
    parts = device_model.split(model, tmp_path / "carry", part_mib=2)
    assert [p.stat().st_size for p in parts] == [2 << 20, 2 << 20, (1 << 20) + 123]
    stash = tmp_path / "stash"
    for part in parts:  # one call per part: each carries only its own part and the manifest
        call = tmp_path / f"call_{part.name}"
        call.mkdir()
        (call / part.name).write_bytes(part.read_bytes())
        (call / "m.gguf.manifest.json").write_bytes((tmp_path / "carry" / "m.gguf.manifest.json").read_bytes())
        device_model.stash(call, stash)
    joined = device_model.join(stash, tmp_path / "out" / "m.gguf")
    assert joined.read_bytes() == model.read_bytes()


def test_join_refuses_missing_or_corrupt_parts(tmp_path):
    model = _model(tmp_path)
    device_model.split(model, tmp_path / "carry", part_mib=2)
    (tmp_path / "carry" / "m.gguf.part1").unlink()
    with pytest.raises(ModelFileError, match="part1.*carry them again"):
        device_model.join(tmp_path / "carry", tmp_path / "out" / "m.gguf")
    device_model.split(model, tmp_path / "carry", part_mib=2)
    with (tmp_path / "carry" / "m.gguf.part2").open("r+b") as f:
        f.write(b"\x00\x01")
    with pytest.raises(ModelFileError, match="sha256"):
        device_model.join(tmp_path / "carry", tmp_path / "out" / "m.gguf")
    assert not (tmp_path / "out" / "m.gguf").exists()
