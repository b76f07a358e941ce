"""Our fast GGUF reader against the `gguf` package's GGUFReader, and the clear errors for bad files."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader

import make_tiny_models
from cupyllm.files.config import config_from_gguf
from cupyllm.errors import ModelFileError
from cupyllm.files.gguf import read_gguf


def test_reader_matches_gguf_package(tiny_model):
    path, _, _ = tiny_model("qwen2")
    ours = read_gguf(path)
    theirs = GGUFReader(path)
    assert len(ours.tensors) == len(theirs.tensors)
    for tensor in theirs.tensors:
        mine = ours.tensors[tensor.name]
        assert mine.type == tensor.tensor_type
        assert mine.shape == tuple(int(d) for d in reversed(tensor.shape))
        np.testing.assert_array_equal(mine.data.reshape(-1), np.asarray(tensor.data).view(np.uint8).reshape(-1))
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        mine = ours.metadata[key]
        if isinstance(mine, np.ndarray):
            np.testing.assert_array_equal(mine, np.asarray(value))
        else:
            assert mine == value, key


def test_missing_file(tmp_path):
    with pytest.raises(ModelFileError, match="no such file"):
        read_gguf(tmp_path / "absent.gguf")


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"this is not a model file at all, just text" * 4)
    with pytest.raises(ModelFileError, match="not a GGUF"):
        read_gguf(bad)


@pytest.mark.parametrize("keep", [30, 2000, -100])
def test_truncated_file(tiny_model, tmp_path, keep):
    path, _, _ = tiny_model("gemma3")
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:keep])
    with pytest.raises(ModelFileError, match="truncated") as info:
        read_gguf(cut)
    assert str(cut) in str(info.value)


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "llama.gguf"
    make_tiny_models.write_gguf(make_tiny_models.TinySpec("qwen2"), path, arch_name="llama")
    supported = "qwen2, qwen3, qwen3moe, gemma3, gemma4"
    with pytest.raises(ModelFileError, match=f"architecture .llama. is not supported.*{supported}"):
        config_from_gguf(read_gguf(path))


def test_unsupported_tensor_type(tmp_path):
    import cupyllm

    path = tmp_path / "iq4nl.gguf"
    make_tiny_models.write_gguf(make_tiny_models.TinySpec("qwen2"), path,
                                override_types={"blk.1.ffn_up.weight": T.IQ4_NL})
    with pytest.raises(ModelFileError, match=r"blk\.1\.ffn_up\.weight.*IQ4_NL.*supported weight types: F32, F16"):
        cupyllm.load(path, device="cpu", progress=False)
