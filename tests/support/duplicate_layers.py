"""A GGUF rebuilt with stored layers physically repeated: what a layer plan (cupyllm/models/layer_plan.py) must
compute without copying a weight. Read with gguf-py's reader and written with its writer (as llama.cpp's
gguf_new_metadata.py copies a file), independently of cupyllm's loader: the block count becomes the new stack's,
every per-layer metadata array and every `blk.N.*` tensor follow `order`, and Gemma 4's per-layer embeddings
(one slice per layer inside two tensors) are re-sliced the same way."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

import gguf
import numpy as np

_BLOCK_TENSOR = re.compile(r"^blk\.(\d+)\.(.+)$")


def write_with_layers(src: Path, dst: Path, order: Sequence[int]) -> None:
    """Write `dst`: `src` whose layer l is `src`'s layer order[l]."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    n_layer = int(reader.fields[f"{arch}.block_count"].contents())
    writer = gguf.GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if field.name == f"{arch}.block_count":
            value = len(order)
        elif (sub_type is not None and field.name.startswith(arch + ".") and len(value) == n_layer
              and ".rope." not in field.name):  # (M-RoPE's 4 sections are not per layer, whatever the count)
            value = [value[s] for s in order]  # one entry per layer (sliding pattern, KV heads, FFN widths)
        writer.add_key_value(field.name, value, vtype, sub_type=sub_type)
    for tensor in reader.tensors:
        found = _BLOCK_TENSOR.match(tensor.name)
        data = np.asarray(tensor.data)
        if found is None:
            if tensor.name.startswith("per_layer_"):
                data = _per_layer_slices(tensor, data, n_layer, order)
            writer.add_tensor(tensor.name, data, raw_dtype=tensor.tensor_type)
            continue
        stored, rest = int(found.group(1)), found.group(2)
        for layer, source in enumerate(order):
            if source == stored:
                writer.add_tensor(f"blk.{layer}.{rest}", data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _per_layer_slices(tensor, data: np.ndarray, n_layer: int, order: Sequence[int]) -> np.ndarray:
    """Gemma 4's per_layer_token_embd [vocab, n_layer * width] (slices along a row) and per_layer_model_proj
    [n_layer * width, d] (slices of rows) with their layer slices in `order`; other per_layer_* tensors (the
    norm, one width wide) as they are."""
    if tensor.name == "per_layer_model_proj.weight":
        rows = data.reshape(n_layer, -1, data.shape[-1])
        return np.ascontiguousarray(rows[list(order)].reshape(-1, data.shape[-1]))
    if tensor.name == "per_layer_token_embd.weight":
        block, _ = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
        width = int(tensor.shape[0]) // n_layer  # (gguf-py shapes list the row length first)
        assert width % block == 0, "each layer's slice must hold whole quantization blocks"
        cols = data.reshape(data.shape[0], n_layer, -1)
        return np.ascontiguousarray(cols[:, list(order)].reshape(data.shape[0], -1))
    return data
