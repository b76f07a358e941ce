"""Read a GGUF file: metadata as Python values, tensors as memory-mapped block arrays.

The `gguf` package defines the format (value types, quantization types, block sizes) and writes our
test models. Its `GGUFReader` builds a NumPy view per array element, which takes about a minute on a
262k-entry vocabulary, so the header is parsed here with `struct` over one `mmap` and the tensor data
stays mapped in place: weights are never copied, only viewed.
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.constants import GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC

from ..errors import ModelFileError

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.FLOAT64: "<d",
    GGUFValueType.BOOL: "<?",
}
_NUMPY_DTYPES = {
    GGUFValueType.UINT8: np.uint8, GGUFValueType.INT8: np.int8,
    GGUFValueType.UINT16: np.uint16, GGUFValueType.INT16: np.int16,
    GGUFValueType.UINT32: np.uint32, GGUFValueType.INT32: np.int32,
    GGUFValueType.UINT64: np.uint64, GGUFValueType.INT64: np.int64,
    GGUFValueType.FLOAT32: np.float32, GGUFValueType.FLOAT64: np.float64,
    GGUFValueType.BOOL: np.bool_,
}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as GGUF stores it: `shape` is row-major (outermost first), `data` its raw blocks."""

    name: str
    type: GGMLQuantizationType
    shape: tuple[int, ...]  # row-major, e.g. (n_out, n_in) for a weight matrix
    data: np.ndarray  # uint8 [n_rows, row_bytes] view into the mapped file

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))


@dataclass
class GGUFFile:
    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    _mmap: mmap.mmap | None = field(default=None, repr=False)

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelFileError(f"{self.path}: tensor '{name}' is missing; the file is incomplete or "
                                 "is not a model of the architecture it claims") from None

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)


class _Cursor:
    """Sequential little-endian reads over a buffer, raising a clear error on truncation."""

    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def _need(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise ModelFileError(f"{self.path}: the GGUF header ends early at byte {self.pos} "
                                 f"(file is {len(self.buf)} bytes); the file is truncated - download it again")

    def scalar(self, fmt: str):
        size = struct.calcsize(fmt)
        self._need(size)
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        self._need(n)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="surrogateescape")

    def value(self, vtype: int):
        vtype = GGUFValueType(vtype)
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            item_type = GGUFValueType(self.scalar("<I"))
            count = self.scalar("<Q")
            if item_type in _NUMPY_DTYPES:  # numeric arrays in one read
                dtype = np.dtype(_NUMPY_DTYPES[item_type]).newbyteorder("<")
                self._need(count * dtype.itemsize)
                arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
                self.pos += count * dtype.itemsize
                return arr
            return [self.value(item_type) for _ in range(count)]
        return self.scalar(_SCALAR_FORMATS[vtype])


def tensor_row_bytes(qtype: GGMLQuantizationType, n_per_row: int) -> int:
    block_values, block_bytes = GGML_QUANT_SIZES[qtype]
    return n_per_row // block_values * block_bytes


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse a GGUF file's header and map its tensors. Raises ModelFileError with what to do."""
    path = Path(path)
    if not path.exists():
        raise ModelFileError(f"{path}: no such file; pass the path of a .gguf model with -m/--model")
    if path.is_dir():
        raise ModelFileError(f"{path}: is a directory; pass the path of a .gguf file")
    size = path.stat().st_size
    if size < 24:
        raise ModelFileError(f"{path}: only {size} bytes, not a GGUF model; the file is truncated or wrong")
    with open(path, "rb") as fh:
        mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    cur = _Cursor(mapped, path)
    if cur.scalar("<I") != GGUF_MAGIC:
        raise ModelFileError(f"{path}: not a GGUF file (bad magic); cupyllm reads GGUF models as llama.cpp does")
    version = cur.scalar("<I")
    if version not in (2, 3):
        raise ModelFileError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
    n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
    metadata: dict[str, Any] = {}
    try:
        for _ in range(n_kv):
            key = cur.string()
            metadata[key] = cur.value(cur.scalar("<I"))
    except ValueError as exc:  # an unknown value type: the header is corrupt
        raise ModelFileError(f"{path}: corrupt GGUF metadata ({exc}); download the file again") from None

    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.scalar("<I")
        dims = [cur.scalar("<Q") for _ in range(n_dims)]
        raw_type = cur.scalar("<I")
        offset = cur.scalar("<Q")
        infos.append((name, dims, raw_type, offset))
    alignment = int(metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
    data_start = (cur.pos + alignment - 1) // alignment * alignment

    tensors: dict[str, TensorInfo] = {}
    for name, dims, raw_type, offset in infos:
        try:
            qtype = GGMLQuantizationType(raw_type)
        except ValueError:
            raise ModelFileError(f"{path}: tensor '{name}' has unknown type id {raw_type}") from None
        shape = tuple(int(d) for d in reversed(dims))  # GGUF lists the fastest dimension first
        n_per_row = shape[-1]
        n_rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        block_values, _ = GGML_QUANT_SIZES[qtype]
        if n_per_row % block_values:
            raise ModelFileError(f"{path}: tensor '{name}' row of {n_per_row} values is not a whole "
                                 f"number of {qtype.name} blocks; the file is corrupt")
        row_bytes = tensor_row_bytes(qtype, n_per_row)
        start = data_start + offset
        end = start + n_rows * row_bytes
        if end > size:
            raise ModelFileError(f"{path}: tensor '{name}' needs bytes {start}..{end} but the file has "
                                 f"{size}; the file is truncated - download or assemble it again")
        data = np.frombuffer(mapped, dtype=np.uint8, count=n_rows * row_bytes, offset=start)
        tensors[name] = TensorInfo(name, qtype, shape, data.reshape(n_rows, row_bytes))
    return GGUFFile(path=path, metadata=metadata, tensors=tensors, _mmap=mapped)
