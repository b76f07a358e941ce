"""Our fast GGUF reader against the `gguf` package's GGUFReader, and the clear errors for bad files."""
from __future__ import annotations

import re
import struct

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader

import fuzz_gguf
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


# --- a corrupt header is refused, never trusted (issue 31's cases, one byte or field each) ----------------------


def _patched(path, tmp_path, patches, name="mutant.gguf"):
    """A copy of `path` with (offset, bytes) patches."""
    data = bytearray(path.read_bytes())
    for offset, raw in patches:
        data[offset:offset + len(raw)] = raw
    out = tmp_path / name
    out.write_bytes(bytes(data))
    return out


def _field(path, kind, owner):
    fields, _ = fuzz_gguf.parse_layout(path.read_bytes())
    return next(f for f in fields if f.kind == kind and f.owner == owner)


def _set_value(path, tmp_path, key, value):
    """The file with metadata `key`'s scalar value replaced (same value type)."""
    f = _field(path, "value", key)
    return _patched(path, tmp_path, [(f.start, struct.pack(fuzz_gguf._VALUE_FORMATS[f.vtype], value))])


def _rename(path, tmp_path, kind, old, new):
    f = _field(path, kind, old)
    assert len(new) == len(old)
    return _patched(path, tmp_path, [(f.start, new.encode())])


def _load(path):
    import cupyllm

    return cupyllm.load(path, device="cpu", ctx=32, threads=1, progress=False)


@pytest.mark.parametrize("n_layer", [2**27 + 18, 2**31, 4])
def test_block_count_must_match_the_blocks_present(tiny_model, tmp_path, n_layer):
    path, _, _ = tiny_model("gemma3")
    bad = _set_value(path, tmp_path, "gemma3.block_count", n_layer)
    with pytest.raises(ModelFileError, match=rf"'gemma3.block_count' is {n_layer} but the file holds tensors of "
                                             r"blocks 0..2") as info:
        config_from_gguf(read_gguf(bad))
    assert str(bad) in str(info.value)


def test_dimension_count_is_bounded(tiny_model, tmp_path):
    path, _, _ = tiny_model("gemma3")
    f = _field(path, "n-dims", "blk.0.attn_q.weight")
    bad = _patched(path, tmp_path, [(f.start, struct.pack("<I", 2**24 + 2))])
    with pytest.raises(ModelFileError, match=r"'blk.0.attn_q.weight' has 16777218 dimensions, expected 1 to 4"):
        read_gguf(bad)


@pytest.mark.parametrize("count", ["tensor-count", "kv-count"])
def test_header_counts_are_bounded_by_the_file(tiny_model, tmp_path, count):
    path, _, _ = tiny_model("qwen2")
    f = _field(path, count, "")
    bad = _patched(path, tmp_path, [(f.start, struct.pack("<Q", 2**40))])
    with pytest.raises(ModelFileError, match="more than the .* bytes after it can hold"):
        read_gguf(bad)


@pytest.mark.parametrize("key, value, expected", [
    ("gemma3.attention.head_count", 0, "an integer >= 1"),
    ("gemma3.attention.key_length", 0, "a head dim >= 1"),
    ("gemma3.attention.head_count_kv", 3, "a divisor of the 4 query heads"),
    ("gemma3.attention.layer_norm_rms_epsilon", float("nan"), "a finite float > 0"),
    ("gemma3.rope.freq_base", -1.0, "a finite float > 0"),
    ("gemma3.attention.sliding_window", 0, "an integer >= 1"),
    ("tokenizer.ggml.bos_token_id", 283, r"a token id in 0..282"),
])
def test_hyperparameters_out_of_range(tiny_model, tmp_path, key, value, expected):
    path, _, _ = tiny_model("gemma3")
    with pytest.raises(ModelFileError, match=rf"metadata '{re.escape(key)}' is .*, expected {expected}"):
        config_from_gguf(read_gguf(_set_value(path, tmp_path, key, value)))


@pytest.mark.parametrize("arch, key, value, tensor", [
    ("gemma3", "gemma3.attention.key_length", 16, "blk.0.attn_q.weight"),      # head size vs the projections
    ("gemma3", "gemma3.attention.head_count", 2, "blk.0.attn_q.weight"),
    ("gemma3", "gemma3.embedding_length", 32, "token_embd.weight"),
    ("qwen2", "qwen2.attention.head_count_kv", 1, "blk.0.attn_k.weight"),
    ("qwen2", "qwen2.feed_forward_length", 64, "blk.0.ffn_gate.weight"),
    ("qwen3-moe", "qwen3moe.expert_count", 8, "blk.0.ffn_gate_inp.weight"),
    ("qwen3-moe", "qwen3moe.expert_feed_forward_length", 16, "blk.0.ffn_gate_exps.weight"),
])
def test_hyperparameters_must_agree_with_the_tensors(tiny_model, tmp_path, arch, key, value, tensor):
    path, _, _ = tiny_model(arch)
    with pytest.raises(ModelFileError, match=rf"tensor '{re.escape(tensor)}' has shape .*, expected .* from the "
                                             "hyperparameters"):
        config_from_gguf(read_gguf(_set_value(path, tmp_path, key, value)))


@pytest.mark.parametrize("arch, old, new", [
    ("gemma3", "blk.1.post_ffw_norm.weight", "blk.1.post_ffw_xorm.weight"),
    ("gemma3", "blk.2.attn_k_norm.weight", "blk.2.attn_k_xorm.weight"),
    ("qwen2", "blk.0.attn_v.bias", "blk.0.attn_v.bixs"),
])
def test_a_renamed_required_tensor_is_missing(tiny_model, tmp_path, arch, old, new):
    path, _, _ = tiny_model(arch)
    with pytest.raises(ModelFileError, match=rf"tensor '{re.escape(old)}' \(shape \[.*\]\) is missing"):
        config_from_gguf(read_gguf(_rename(path, tmp_path, "name", old, new)))


def test_a_tensor_the_hyperparameters_rule_out(tiny_model, tmp_path):
    path, _, _ = tiny_model("gemma4")  # layers 5 and 6 read earlier layers' caches: no K of their own
    bad = _rename(path, tmp_path, "name", "blk.5.attn_q.weight", "blk.5.attn_k.weight")
    with pytest.raises(ModelFileError, match=r"'blk.5.attn_k.weight' does not belong .*: layer 5 reads layer 3's "
                                             "KV cache"):
        config_from_gguf(read_gguf(bad))


def test_an_unknown_tensor_is_reported_and_ignored(tiny_model, tmp_path):
    from cupyllm.errors import ModelFileWarning

    path, _, _ = tiny_model("qwen2")
    bad = _rename(path, tmp_path, "name", "output.weight", "outpux.weight")
    gguf = read_gguf(bad)
    with pytest.warns(ModelFileWarning, match="1 tensor.* cupyllm does not use for qwen2, ignored: 'outpux.weight'"):
        cfg = config_from_gguf(gguf)
    assert cfg.tied_output and "outpux.weight" in gguf.unused_tensors and "outpux.weight" not in gguf.tensors


@pytest.mark.parametrize("kind, change", [
    ("tensor-type", lambda v: struct.pack("<I", T.F16)),           # F32 -> F16: half the bytes
    ("offset", lambda v: struct.pack("<Q", v + 32)),                # moved by one alignment
    ("offset", lambda v: struct.pack("<Q", v + 1)),                 # misaligned
    ("dim", lambda v: struct.pack("<Q", v * 2)),
])
def test_tensor_descriptions_must_tile_the_data(tiny_model, tmp_path, kind, change):
    path, _, _ = tiny_model("gemma3")
    f = _field(path, kind, "blk.1.ffn_norm.weight")
    with pytest.raises(ModelFileError, match="has data offset .*, expected|needs bytes"):
        read_gguf(_patched(path, tmp_path, [(f.start, change(f.value))]))


def test_bytes_after_the_last_tensor(tiny_model, tmp_path):
    path, _, _ = tiny_model("qwen3")
    bad = tmp_path / "long.gguf"
    bad.write_bytes(path.read_bytes() + bytes(64))
    with pytest.raises(ModelFileError, match="64 bytes follow the last tensor's data"):
        read_gguf(bad)


def test_a_refused_file_is_refused_by_load_and_info(tiny_model, tmp_path):
    from cupyllm.report import model_report

    path, _, _ = tiny_model("gemma3")
    bad = _set_value(path, tmp_path, "gemma3.attention.key_length", 64)
    for reader in (_load, model_report):
        with pytest.raises(ModelFileError, match="blk.0.attn_q.weight' has shape"):
            reader(bad)
    assert _load(path).cfg.head_dim == 32


@pytest.mark.parametrize("corrupt", ["header", "hyperparameter", "tensor shape", "renamed tensor"])
def test_a_corrupt_file_is_refused_before_a_gpu_backend_is_made(tiny_model, tmp_path, monkeypatch, corrupt):
    """With device="gpu" (--device gpu) the file's checks run before the backend is made: nothing of a corrupt
    file reaches the GPU, and a machine without one says what is wrong with the file, not with the device."""
    import cupyllm
    from cupyllm import api

    def no_backend(*args, **kwargs):
        raise AssertionError("a backend was made for a file that was not checked yet")
    monkeypatch.setattr(api, "select_backend", no_backend)
    path, _, _ = tiny_model("qwen2")
    bad = {"header": lambda: _patched(path, tmp_path, [(_field(path, "tensor-count", "").start,
                                                        struct.pack("<Q", 2**40))]),
           "hyperparameter": lambda: _set_value(path, tmp_path, "qwen2.attention.head_count_kv", 1),
           "tensor shape": lambda: _patched(path, tmp_path, [(_field(path, "n-dims", "blk.0.attn_q.weight").start,
                                                              struct.pack("<I", 3))]),
           "renamed tensor": lambda: _rename(path, tmp_path, "name", "blk.0.attn_v.bias", "blk.0.attn_v.bixs")}
    with pytest.raises(ModelFileError, match=str(tmp_path)):
        cupyllm.load(bad[corrupt](), device="gpu", ctx=32, progress=False)
