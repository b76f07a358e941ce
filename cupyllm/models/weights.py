"""Model weights as the engine holds them: quantized blocks left as the GGUF stores them."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ModelFileError
from ..files.gguf import GGUFFile, TensorInfo
from ..ops.matmul.reference import SUPPORTED_WEIGHT_TYPES, WeightFormat, dequantize, weight_format


@dataclass(frozen=True)
class Weight:
    """A matrix [n_out, n_in] in GGUF blocks (`data`: uint8 [n_out, row_bytes], NumPy or CuPy)."""

    name: str
    fmt: WeightFormat
    shape: tuple[int, ...]
    data: object

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


def _checked_format(gguf: GGUFFile, info: TensorInfo) -> WeightFormat:
    fmt = weight_format(info.type)
    if fmt is None:
        raise ModelFileError(f"{gguf.path}: tensor '{info.name}' has type {info.type.name}, which cupyllm does not "
                             f"run; supported weight types: {', '.join(SUPPORTED_WEIGHT_TYPES)}. "
                             "Use a GGUF quantized to one of them (e.g. Q4_K_M, Q8_0)")
    return fmt


def load_matrix(gguf: GGUFFile, name: str) -> Weight:
    info = gguf.tensor(name)
    return Weight(name, _checked_format(gguf, info), info.shape, info.data)


def load_vector(gguf: GGUFFile, name: str, optional: bool = False) -> np.ndarray | None:
    """Small tensors (norms, biases) as float32 arrays."""
    if optional and name not in gguf.tensors:
        return None
    info = gguf.tensor(name)
    _checked_format(gguf, info)
    return dequantize(info.data, info.type, info.shape[-1]).reshape(info.shape).astype(np.float32)
