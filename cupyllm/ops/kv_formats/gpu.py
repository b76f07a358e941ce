"""KV-cache encode/decode on the GPU: CuPy launchers for kernels_cu/kv_formats/kv_encode.cu and kv_decode.cu.

Cache layout (per layer, K and V alike): uint8 ``[n_slots, n_kv_heads, row_bytes]`` with
``row_bytes = fmt.row_bytes(head_dim)``, each head row holding the format's blocks back to back, byte for
byte what ``fmt.encode`` (cupyllm/kv) returns for that row.

``GpuKVCodec(fmt, head_dim, n_kv_heads).encode(src, slots, cache)`` quantizes ``src [n_new, n_kv_heads,
head_dim]`` (float32 or float16) into ``cache[slots]``; ``decode(cache, row_start, n_rows)`` returns float16
``[n_rows, n_kv_heads, head_dim]``. ``encode_kv`` writes a layer's K and V at token positions (the ring rule
of sliding-window layers and the cache's position table included) in one launch. The kernels reproduce the NumPy references bit for bit (the f16 decode
output is the reference's float32 rounded once). Unlike the references, the kernels cannot raise: NaN/inf
values and rotated groups whose norm overflows fp16 are stored as whatever the arithmetic gives (the
engine checks its activations), and the f32 arithmetic runs with CuPy's -ftz=true, which only matters
for subnormal intermediates (|x| < 1.2e-38), far below any K/V value.

This module declares every kernel instantiation (``kernel_sets()``) and does not import CuPy until a
codec is built, so the compile check and the CPU engine run without it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...cuda.registry import KernelRegistry, KernelSet, require_cupy
from .formats import KVFormat, KVFormatError, list_formats, is_rotated

ENCODE_FILE = "kv_formats/kv_encode.cu"
DECODE_FILE = "kv_formats/kv_decode.cu"

# Source element types the encoder accepts: NumPy dtype name -> C++ type.
SOURCE_TYPES = {"float32": "float", "float16": "__half"}

# Group sizes with compiled kernels: G = min(128, head_dim) for head_dim 64 (Qwen2.5-0.5B) and
# head_dim >= 128 (128 for most models, 256 for Gemma 3 as two groups).
GROUP_SIZES = (64, 128)

# turbo.stored_norm modes -> kv_encode.cu NormMode
NORM_MODE_IDS = {"raw": 0, "lsq": 1, "corrected": 2}

_SCALAR_TYPES = {
    "f32": "cupyllm::FmtF32", "f16": "cupyllm::FmtF16", "bf16": "cupyllm::FmtBF16",
    "q8_0": "cupyllm::FmtQ8_0", "q6_0": "cupyllm::FmtQ6_0", "q5_1": "cupyllm::FmtQ5_1",
    "q5_0": "cupyllm::FmtQ5_0", "q4_1": "cupyllm::FmtQ4_1", "q4_0": "cupyllm::FmtQ4_0",
}
_FLOAT_NAMES = ("f32", "f16", "bf16")


def _turbo_bits() -> dict[str, int]:
    from .turbo import TURBO_BITS
    return dict(TURBO_BITS)


def _tcq_params() -> dict[str, tuple[int, int]]:
    from .tcq import TCQ_PARAMS
    return dict(TCQ_PARAMS)


def cpp_format_type(name: str, group_values: int | None = None) -> str:
    """The kv_formats.cuh type of format `name` (rotated formats need their group size)."""
    if name in _SCALAR_TYPES:
        return _SCALAR_TYPES[name]
    _check_group(name, group_values)
    turbo_bits = _turbo_bits()
    if name in turbo_bits:
        return f"cupyllm::FmtTurbo<{turbo_bits[name]}, {group_values}>"
    tcq = _tcq_params()
    if name in tcq:
        k, L = tcq[name]
        return f"cupyllm::FmtTcq<{k}, {L}, {group_values}>"
    raise KVFormatError(f"unknown KV format {name!r}; choose one of: {', '.join(list_formats())}")


def _check_group(name: str, group_values: int | None) -> None:
    if group_values not in GROUP_SIZES:
        raise KVFormatError(
            f"GPU kernels for {name!r} exist for groups of {GROUP_SIZES} values, not {group_values}; "
            "use a head_dim of 64 or a multiple of 128, or a scalar KV format (q8_0, q4_0, ...)")


def cpp_type_of(fmt: KVFormat) -> str:
    """cpp_format_type of a format object; a TCQ format of any trellis (tcq.trellis_format) by its own k and L."""
    from .tcq import TCQFormat
    if isinstance(fmt, TCQFormat):
        _check_group(fmt.name, fmt.group_values)
        return f"cupyllm::FmtTcq<{fmt.k}, {fmt.L}, {fmt.group_values}>"
    return cpp_format_type(fmt.name, fmt.block_values if _rotated(fmt) else None)


def _rotated(fmt: KVFormat) -> bool:
    from .turbo import RotatedFormat
    return isinstance(fmt, RotatedFormat)


def _encode_kernel(cpp_type: str, rotated: bool, src_dtype: str, norm_mode: str) -> str:
    if src_dtype not in SOURCE_TYPES:
        raise KVFormatError(f"KV encode on the GPU takes {sorted(SOURCE_TYPES)} sources, got {src_dtype}")
    mode = NORM_MODE_IDS[norm_mode] if rotated else 0
    return f"kv_encode<{cpp_type}, {SOURCE_TYPES[src_dtype]}, {mode}>"


def _decode_kernel(cpp_type: str, rotated: bool, unrotate: bool) -> str:
    return f"kv_decode<{cpp_type}, {'true' if (unrotate and rotated) else 'false'}>"


def encode_kernel_name(name: str, src_dtype: str, group_values: int | None = None,
                       norm_mode: str = "raw") -> str:
    return _encode_kernel(cpp_format_type(name, group_values), is_rotated(name), src_dtype, norm_mode)


def decode_kernel_name(name: str, group_values: int | None = None, unrotate: bool = True) -> str:
    return _decode_kernel(cpp_format_type(name, group_values), is_rotated(name), unrotate)


def _family(name: str) -> str:
    if name in _FLOAT_NAMES:
        return "float"
    if not is_rotated(name):
        return "block"
    return "tcq" if name in _tcq_params() else "turbo"


def _family_of(fmt: KVFormat) -> str:
    """_family of a format object (a TCQ format of another trellis size included)."""
    from .tcq import TCQFormat
    if not _rotated(fmt):
        return _family(fmt.name)
    return "tcq" if isinstance(fmt, TCQFormat) else "turbo"


def kernel_sets() -> list[KernelSet]:
    """Every kv_encode / kv_decode instantiation, grouped into compilation units by format family."""
    from .turbo import NORM_MODES
    by_family: dict[str, list[str]] = {}
    decode: list[str] = []
    for name in list_formats():
        family = _family(name)
        groups = GROUP_SIZES if is_rotated(name) else (None,)
        modes = NORM_MODES if is_rotated(name) else ("raw",)
        for g in groups:
            for src in SOURCE_TYPES:
                for mode in modes:
                    by_family.setdefault(family, []).append(encode_kernel_name(name, src, g, mode))
            decode.append(decode_kernel_name(name, g, unrotate=True))
            if is_rotated(name):
                decode.append(decode_kernel_name(name, g, unrotate=False))
    sets = [KernelSet(ENCODE_FILE, tuple(names), label=family) for family, names in by_family.items()]
    sets.append(KernelSet(DECODE_FILE, tuple(decode)))
    return sets


@dataclass(frozen=True)
class LaunchGeometry:
    """How a kernel maps work to threads: `unit_values` values per unit, `unit_threads` threads per
    unit, `units_per_cta` units per thread block. Mirrors Encoder / Decoder in the .cu files."""
    unit_values: int
    unit_threads: int
    units_per_cta: int

    @property
    def cta_threads(self) -> int:
        return self.unit_threads * self.units_per_cta

    def grid(self, n_units: int) -> int:
        return (n_units + self.units_per_cta - 1) // self.units_per_cta


def encode_geometry(fmt: KVFormat) -> LaunchGeometry:
    family = _family_of(fmt)
    if family == "float":
        return LaunchGeometry(1, 1, 256)
    if family == "block":
        return LaunchGeometry(fmt.block_values, 32, 8)
    if family == "turbo":
        return LaunchGeometry(fmt.block_values, 32, 4)
    return tcq_geometry(fmt.k, fmt.L, fmt.block_values)


def tcq_geometry(k: int, L: int, group_values: int) -> LaunchGeometry:
    """One thread per predecessor set; trellises of fewer than 32 sets share a warp's CTA (kv_encode.cu)."""
    sets = 1 << (L - k)
    return LaunchGeometry(group_values, sets, max(1, 32 // sets))


def decode_geometry(fmt: KVFormat) -> LaunchGeometry:
    if _rotated(fmt):
        return LaunchGeometry(fmt.block_values, 32, 4)
    return LaunchGeometry(1, 1, 256)


def format_table(fmt: KVFormat) -> np.ndarray | None:
    """The float32 table the kernels read (kv_formats.cuh): turbo LEVELS + BOUNDS, the TCQ codebook."""
    family = _family_of(fmt)
    if family == "turbo":
        return np.concatenate([fmt.levels, fmt.boundaries]).astype(np.float32)
    if family == "tcq":
        return np.ascontiguousarray(fmt.codebook, dtype=np.float32)
    return None


def encode_table(fmt: KVFormat) -> np.ndarray | None:
    """What kv_encode reads: format_table, and for TCQ after the codebook the search's integer metric
    (tcq.TrellisMetric: centroid, square as int32 bits, then the float scale -2^(Fx+1) and the |X| clamp)."""
    table = format_table(fmt)
    if _family_of(fmt) != "tcq":
        return table
    from .tcq import metric_for
    metric = metric_for(fmt.codebook, fmt.block_values, fmt.k)
    scalars = np.array([-(1 << (metric.z_bits + 1)), metric.x_limit], dtype=np.float32)
    return np.concatenate([table, metric.centroid.view(np.float32), metric.square.view(np.float32), scalars])


class GpuKVCodec:
    """Encode/decode one KV format on the current CUDA device for heads of `head_dim` values."""

    def __init__(self, fmt: KVFormat, head_dim: int, n_kv_heads: int,
                 registry: KernelRegistry | None = None):
        self.fmt = fmt
        self.head_dim = int(head_dim)
        self.n_kv_heads = int(n_kv_heads)
        self.row_bytes = fmt.row_bytes(self.head_dim)  # checks head_dim % block_values
        self._rotated = _rotated(fmt)
        self._norm_mode = getattr(fmt, "norm_mode", "raw")
        self._cpp_type = cpp_type_of(fmt)  # an unsupported group size: a clear error now
        self._cp = require_cupy()
        self._registry = registry if registry is not None else KernelRegistry()
        # scalar formats ignore the tables; a 1-element array stands in for nullptr
        self._table, self._encode_table = (
            self._cp.asarray(table if table is not None else np.zeros(1, np.float32))
            for table in (format_table(fmt), encode_table(fmt)))

    @property
    def cache_row_shape(self) -> tuple[int, int]:
        return (self.n_kv_heads, self.row_bytes)

    def allocate(self, n_slots: int):
        """A zeroed cache [n_slots, n_kv_heads, row_bytes] uint8."""
        return self._cp.zeros((int(n_slots), *self.cache_row_shape), dtype=self._cp.uint8)

    def encode(self, src, slots, cache) -> None:
        """Quantize src [n_new, n_kv_heads, head_dim] into cache[slots[i]] (in place, on the current
        stream). Slots outside [0, n_slots) are skipped."""
        encode_kv(self, src, cache, slots)

    def encoder_name(self, src) -> str:
        """The kv_encode instantiation for `src` (checked: [n_new, n_kv_heads, head_dim], f32 or f16)."""
        src_dtype = np.dtype(src.dtype).name
        if src.ndim != 3 or src.shape[1:] != (self.n_kv_heads, self.head_dim):
            raise KVFormatError(
                f"KV encode takes src [n_new, {self.n_kv_heads}, {self.head_dim}], got {tuple(src.shape)}")
        if src_dtype not in SOURCE_TYPES:
            raise KVFormatError(f"KV encode takes float32 or float16 src, got {src_dtype}; cast it first")
        return _encode_kernel(self._cpp_type, self._rotated, src_dtype, self._norm_mode)

    def decode(self, cache, row_start: int, n_rows: int, out=None, unrotate: bool = True):
        """float16 [n_rows, n_kv_heads, head_dim] of cache rows row_start .. row_start + n_rows - 1.

        Rotated formats give original-domain values, or the rotated-domain values with unrotate=False.
        """
        cp = self._cp
        self._check_cache(cache)
        if row_start < 0 or n_rows < 0 or row_start + n_rows > cache.shape[0]:
            raise KVFormatError(
                f"KV decode of rows {row_start}..{row_start + n_rows - 1} is outside the cache's "
                f"{cache.shape[0]} rows")
        shape = (n_rows, self.n_kv_heads, self.head_dim)
        if out is None:
            out = cp.empty(shape, dtype=cp.float16)
        elif out.dtype != np.float16 or tuple(out.shape) != shape or not out.flags.c_contiguous:
            raise KVFormatError(f"KV decode writes a C-contiguous float16 {shape} array, got "
                                f"{out.dtype} {tuple(out.shape)}")
        if n_rows == 0:
            return out
        kernel = self._registry.function(_decode_kernel(self._cpp_type, self._rotated, unrotate))
        geometry = decode_geometry(self.fmt)
        n_units = n_rows * self.n_kv_heads * (self.head_dim // geometry.unit_values)
        kernel((geometry.grid(n_units),), (geometry.cta_threads,),
               (cache, np.int32(row_start), np.int32(n_rows), np.int32(self.n_kv_heads),
                np.int32(self.head_dim), self._table, out))
        return out

    def _check_cache(self, cache) -> None:
        if (cache.dtype != np.uint8 or cache.ndim != 3 or tuple(cache.shape[1:]) != self.cache_row_shape
                or not cache.flags.c_contiguous):
            raise KVFormatError(
                f"KV cache for {self.fmt.name!r} must be C-contiguous uint8 [n_slots, {self.n_kv_heads}, "
                f"{self.row_bytes}], got {cache.dtype} {tuple(cache.shape)}; allocate it with codec.allocate()")


def encode_kv(k_codec: GpuKVCodec, k, k_cache, positions, v_codec: GpuKVCodec | None = None, v=None,
              v_cache=None, slot_pos=None, ring: bool = False) -> None:
    """Quantize k [n_new, n_kv, head_dim] into k_cache and, with v_codec, v into v_cache, at the slots of
    `positions` (int32 [n_new]: the slot is the position, or with `ring` the position mod the cache's rows;
    slots outside the cache are skipped), writing each position into slot_pos [n_slots] when given. One
    launch when K and V share an encoder (same format and group, same source dtype), else two."""
    cp = k_codec._cp
    n_new = int(k.shape[0])
    tensors = [(k_codec, k, k_cache)] + ([(v_codec, v, v_cache)] if v_codec is not None else [])
    names = [codec.encoder_name(src) for codec, src, _ in tensors]
    if positions.dtype != np.int32 or positions.shape != (n_new,):
        raise KVFormatError(f"KV encode takes int32 slots [{n_new}], got {positions.dtype} {tuple(positions.shape)}")
    for (codec, src, cache) in tensors:
        codec._check_cache(cache)
        if src.shape[0] != n_new or cache.shape[0] != k_cache.shape[0]:
            raise KVFormatError(f"K and V encode the same {n_new} tokens into caches of one length, got "
                                f"{src.shape[0]} tokens and {cache.shape[0]} rows")
    if n_new == 0:
        return
    positions = cp.ascontiguousarray(positions)
    record = slot_pos is not None
    tensors = [(codec, cp.ascontiguousarray(src), cache, name) for (codec, src, cache), name in zip(tensors, names)]
    launches = [tensors] if len(tensors) == 2 and names[0] == names[1] else [[t] for t in tensors]
    for i, launch in enumerate(launches):
        (codec, first_src, first_cache, name), (second_codec, second_src, second_cache, _) = launch[0], launch[-1]
        geometry = encode_geometry(codec.fmt)
        units = n_new * codec.n_kv_heads * max(t[0].head_dim for t in launch) // geometry.unit_values
        codec._registry.function(name)(
            (geometry.grid(units), len(launch)), (geometry.cta_threads,),
            (first_src, second_src, positions, first_cache, second_cache, slot_pos if record else positions,
             np.int32(record and i == 0), np.int32(n_new), np.int32(k_cache.shape[0]), np.int32(ring),
             np.int32(codec.n_kv_heads), np.int32(codec.head_dim), np.int32(second_codec.head_dim),
             codec._encode_table))


# --- other trellis sizes: the TCQ encoder at (k, L) pairs no format names, to time and check a smaller search ----

def trellis_encode_kernel(fmt, src_dtype: str = "float32") -> str:
    """The kv_encode instantiation GpuKVCodec(fmt).encode asks for, for a tcq.trellis_format `fmt` (kv_formats.cuh
    FmtTcq<k, L, G>; the formats are (3, 9) and (2, 8)): 2^(L-k) = 4 .. 1024 threads per group, L >= 2k."""
    k, L = fmt.k, fmt.L
    if not (2 <= L - k <= 10 and L >= 2 * k and 2 <= k <= 4):
        raise KVFormatError(f"the GPU TCQ encoder runs 2^(L-k) = 4 .. 1024 threads per group with L >= 2k; "
                            f"k={k}, L={L} is outside that")
    return _encode_kernel(cpp_type_of(fmt), True, src_dtype, fmt.norm_mode)


def trellis_registry(kernel_names: list[str]) -> KernelRegistry:
    """A registry that compiles just these trellis_encode_kernel instantiations (one kv_encode.cu module): pass it
    to GpuKVCodec."""
    return KernelRegistry(sets=[KernelSet(ENCODE_FILE, tuple(kernel_names), label="tcq trellis sizes")])
