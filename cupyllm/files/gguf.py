"""Read a GGUF file: metadata as Python values, tensors as memory-mapped block arrays.

The `gguf` package defines the format (value types, quantization types, block sizes) and writes our
test models. Its `GGUFReader` builds a NumPy view per array element, which takes about a minute on a
262k-entry vocabulary, so the header is parsed here with `struct` over one `mmap` and the tensor data
stays mapped in place: weights are never copied, only viewed.

Nothing in the header is trusted before it is checked, as llama.cpp's gguf.c checks it: every count and
length is bounded by the bytes left in the file before anything is read or allocated; keys and tensor names
are unique; a tensor has 1 to 4 dimensions, a known type, whole blocks per row, and its data starts exactly
where the previous tensor's (padded to `general.alignment`) ends, inside the file; the padding is zeros, and
the last tensor ends the file. What the tensors must be
for the architecture is checked against the hyperparameters by `config.config_from_gguf` (files/validate.py).
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
_U64 = struct.Struct("<Q")
_HEADER_BYTES = 24  # magic, version, tensor count, metadata count
# The fewest bytes one metadata entry (key length, type, a 1-byte value) and one tensor description (name
# length, dimension count, type, offset) can take: the counts in the header are bounded by them.
_MIN_KV_BYTES = 8 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME_BYTES = 63  # GGML_MAX_NAME less its terminating zero


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
    # tensors the architecture does not use, set aside (and reported) by config.config_from_gguf
    unused_tensors: dict[str, TensorInfo] = field(default_factory=dict)

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelFileError(f"{self.path}: tensor '{name}' is missing; the file is incomplete or "
                                 "is not a model of the architecture it claims") from None

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)


class _Cursor:
    """Sequential little-endian reads over a buffer; every length is checked against the bytes left before
    anything is read or allocated, so a corrupt count is one clear error, never a long read or a huge array."""

    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    @property
    def left(self) -> int:
        return len(self.buf) - self.pos

    def fail(self, what: str) -> ModelFileError:
        return ModelFileError(f"{self.path}: {what} (at byte {self.pos} of {len(self.buf)}); the file is corrupt "
                              "or truncated - download or convert it again")

    def need(self, n: int, what: str) -> None:
        if n > self.left:
            raise self.fail(f"{what} needs {n} bytes but only {self.left} are left")

    def scalar(self, fmt: str, what: str):
        size = struct.calcsize(fmt)
        self.need(size, what)
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def string(self, what: str) -> str:
        n = self.scalar("<Q", f"the length of {what}")
        self.need(n, f"{what} ({n} bytes)")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:  # GGUF strings are UTF-8; a tokenizer must not meet anything else
            raise self.fail(f"{what} is not UTF-8 ({exc.reason} at its byte {exc.start})") from None

    def value_type(self, what: str) -> GGUFValueType:
        raw = self.scalar("<I", f"the type of {what}")
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise self.fail(f"{what} has value type {raw}, which GGUF does not define") from None

    def value(self, vtype: GGUFValueType, what: str):
        if vtype == GGUFValueType.STRING:
            return self.string(what)
        if vtype != GGUFValueType.ARRAY:
            return self.scalar(_SCALAR_FORMATS[vtype], what)
        item_type = self.value_type(f"the items of {what}")
        if item_type == GGUFValueType.ARRAY:
            raise self.fail(f"{what} is an array of arrays, which GGUF does not allow")
        count = self.scalar("<Q", f"the length of {what}")
        if item_type in _NUMPY_DTYPES:  # numeric arrays in one read
            dtype = np.dtype(_NUMPY_DTYPES[item_type]).newbyteorder("<")
            self.need(count * dtype.itemsize, f"{what} ({count} {item_type.name} values)")
            arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
            self.pos += count * dtype.itemsize
            return arr
        self.need(count * 8, f"{what} ({count} strings)")  # each string takes at least its 8-byte length
        return self._strings(count, what)

    def _strings(self, count: int, what: str) -> list[str]:
        """`count` strings in one loop (a vocabulary has a few hundred thousand)."""
        buf, pos, size, length = self.buf, self.pos, len(self.buf), _U64.unpack_from
        items = []
        for i in range(count):
            if pos + 8 > size or pos + 8 + length(buf, pos)[0] > size:
                self.pos = pos
                raise self.fail(f"item {i} of {what} runs past the end of the file")
            n = length(buf, pos)[0]
            try:
                items.append(buf[pos + 8:pos + 8 + n].decode("utf-8"))
            except UnicodeDecodeError as exc:
                self.pos = pos
                raise self.fail(f"item {i} of {what} is not UTF-8 ({exc.reason} at its byte {exc.start})") from None
            pos += 8 + n
        self.pos = pos
        return items


def tensor_row_bytes(qtype: GGMLQuantizationType, n_per_row: int) -> int:
    block_values, block_bytes = GGML_QUANT_SIZES[qtype]
    return n_per_row // block_values * block_bytes


def _alignment(metadata: dict[str, Any], path: Path) -> int:
    value = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0 or value & (value - 1) or value > 1 << 30:
        raise ModelFileError(f"{path}: general.alignment is {value!r}, expected a power of two (default "
                             f"{GGUF_DEFAULT_ALIGNMENT}); the file is corrupt")
    return value


def _check_padding(mapped, start: int, end: int, path: Path, after: str) -> None:
    """GGUF writers (gguf.c, gguf-py) pad with zeros: a nonzero pad byte means the description before it does
    not match the data (a tensor read with a smaller type or shape than it was written with, whose padded size
    is the same)."""
    if end > start and any(mapped[start:end]):
        raise ModelFileError(f"{path}: the padding after {after} (bytes {start}..{end}) is not zero: the tensor "
                             "table does not match the data (a changed type, dimension or count); the file is corrupt")


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse a GGUF file's header and map its tensors. Raises ModelFileError with what to do."""
    path = Path(path)
    if not path.exists():
        raise ModelFileError(f"{path}: no such file; pass the path of a .gguf model with -m/--model")
    if path.is_dir():
        raise ModelFileError(f"{path}: is a directory; pass the path of a .gguf file")
    size = path.stat().st_size
    if size < _HEADER_BYTES:
        raise ModelFileError(f"{path}: only {size} bytes, not a GGUF model; the file is truncated or wrong")
    with open(path, "rb") as fh:
        mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    cur = _Cursor(mapped, path)
    if cur.scalar("<I", "the magic") != GGUF_MAGIC:
        raise ModelFileError(f"{path}: not a GGUF file (bad magic); cupyllm reads GGUF models as llama.cpp does")
    version = cur.scalar("<I", "the version")
    if version not in (2, 3):
        raise ModelFileError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
    n_tensors, n_kv = cur.scalar("<Q", "the tensor count"), cur.scalar("<Q", "the metadata count")
    if n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_INFO_BYTES > cur.left:
        raise cur.fail(f"the header declares {n_tensors} tensors and {n_kv} metadata entries, more than the "
                       f"{cur.left} bytes after it can hold")
    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        key = cur.string(f"the key of metadata entry {i}")
        if not key or key in metadata:
            raise cur.fail(f"metadata entry {i} has {'an empty' if not key else 'a repeated'} key {key!r}")
        metadata[key] = cur.value(cur.value_type(f"metadata '{key}'"), f"metadata '{key}'")
    alignment = _alignment(metadata, path)

    infos = []
    names: set[str] = set()
    for i in range(n_tensors):
        name = cur.string(f"the name of tensor {i}")
        if not name or name in names or len(name.encode("utf-8")) > MAX_NAME_BYTES:
            raise cur.fail(f"tensor {i} has {'a repeated' if name in names else 'an empty or over-long'} name "
                           f"{name[:80]!r} (names are unique, 1..{MAX_NAME_BYTES} bytes)")
        names.add(name)
        n_dims = cur.scalar("<I", f"the dimension count of tensor '{name}'")
        if not 1 <= n_dims <= MAX_DIMS:
            raise cur.fail(f"tensor '{name}' has {n_dims} dimensions, expected 1 to {MAX_DIMS}")
        dims = [cur.scalar("<Q", f"dimension {j} of tensor '{name}'") for j in range(n_dims)]
        raw_type = cur.scalar("<I", f"the type of tensor '{name}'")
        offset = cur.scalar("<Q", f"the data offset of tensor '{name}'")
        infos.append((name, dims, raw_type, offset))
    data_start = (cur.pos + alignment - 1) // alignment * alignment
    _check_padding(mapped, cur.pos, min(data_start, size), path, "the tensor table")

    tensors: dict[str, TensorInfo] = {}
    expected_offset, end = 0, data_start  # tensors follow one another, each padded to the alignment (gguf.c)
    previous = "the data section"
    for name, dims, raw_type, offset in infos:
        try:
            qtype = GGMLQuantizationType(raw_type)
            block_values, block_bytes = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise ModelFileError(f"{path}: tensor '{name}' has unknown type id {raw_type}; the file is corrupt "
                                 "or of a newer GGUF version") from None
        shape = tuple(int(d) for d in reversed(dims))  # GGUF lists the fastest dimension first
        n_elements = int(np.prod(shape, dtype=object))
        if not 0 < n_elements <= size * block_values:  # bounds the byte count below by the file's size
            raise ModelFileError(f"{path}: tensor '{name}' has dimensions {dims}, which no file of {size} bytes "
                                 "can hold; the file is corrupt")
        n_per_row = shape[-1]
        if n_per_row % block_values:
            raise ModelFileError(f"{path}: tensor '{name}' row of {n_per_row} values is not a whole "
                                 f"number of {qtype.name} blocks; the file is corrupt")
        n_rows = n_elements // n_per_row
        row_bytes = tensor_row_bytes(qtype, n_per_row)
        nbytes = n_rows * row_bytes
        if offset != expected_offset:
            raise ModelFileError(f"{path}: tensor '{name}' has data offset {offset}, expected {expected_offset} "
                                 f"(where {previous} ends, padded to {alignment} bytes); the tensor table is "
                                 "corrupt: an offset, or the type or dimensions of a tensor before it")
        start = data_start + offset
        end = start + nbytes
        if end > size:
            raise ModelFileError(f"{path}: tensor '{name}' needs bytes {start}..{end} but the file has "
                                 f"{size}; the file is truncated - download or assemble it again")
        expected_offset += (nbytes + alignment - 1) // alignment * alignment
        _check_padding(mapped, end, min(data_start + expected_offset, size), path, f"tensor '{name}'")
        data = np.frombuffer(mapped, dtype=np.uint8, count=nbytes, offset=start)
        tensors[name] = TensorInfo(name, qtype, shape, data.reshape(n_rows, row_bytes))
        previous = f"tensor '{name}' ({qtype.name} {list(shape)})"
    padded_end = data_start + expected_offset
    if size > max(end, padded_end):
        raise ModelFileError(f"{path}: {size - max(end, padded_end)} bytes follow the last tensor's data; the "
                             "tensor table does not describe the whole file, so it is corrupt")
    return GGUFFile(path=path, metadata=metadata, tensors=tensors, _mmap=mapped)
