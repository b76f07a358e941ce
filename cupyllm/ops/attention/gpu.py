"""Flash attention on the GPU: declarations, launch geometry and launchers of kernels_cu/fa_*.cu.

Kernels (fa_common.cuh has the shared semantics and layouts):

* ``fa_vec<D, R>`` (fa_vec.cu): few query rows per KV head (decode), R = 4 or 8 rows per block; split over
  the keys, raw K/V rows staged in shared memory with cp.async, dequantized in registers.
* ``fa_mma<D, kDecode>`` (fa_mma.cu): tensor cores (mma.sync m16n8k16, f16 in, f32 accumulate); warps split
  64 rows per block (prefill) or the keys of one 16-row tile (decode of f16 and quantized formats, where the f32
  arithmetic of fa_vec, not the memory, would be the limit). ``fa_mma<D, true, kDca, true>``: the decode
  layout's f16 path (K and V f16: rows copied by cp.async straight into double-buffered tiles).
* ``fa_prep_q<G, QT, OT>``: Q * scale, WHT-rotated per group when the K format is rotated.
* ``fa_combine<G, OT>``: merge split results by LSE, unrotate O when the V format is rotated.
* ``fa_chunk_check<G>``: test aid, the kernels' chunk reader next to kv_formats.cuh's per-value one.
* ``fa_dequant_bench<D, Reader>``: benchmark aid, fa_mma's dequantizing pass with the Half8 readers or
  with the definition they replace (bench/dequant_gpu.py).
* ``fa_vec<D, R, true>``, ``fa_mma<D, kDecode, true>`` (dca_fused.cu): Dual Chunk Attention (fa_common.cuh): Q in three
  rotations, the rotation of each (query, key) pair picked by its chunk regime, one online softmax
  (cupyllm/ops/attention/gpu_dca.py runs them).

The K and V formats are runtime ids (``FORMAT_IDS``), so one kernel per head dim serves every (K, V)
pair; this module mirrors the kernels' shared-memory layouts (``vec_smem_bytes``, ``mma_smem_bytes``;
``mma_f16_smem_bytes``; the kernels trap when given less). It imports CuPy only when a launcher runs.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..kv_formats.gpu import GROUP_SIZES, format_table
from ...cuda.registry import KernelRegistry, KernelSet
from ..kv_formats.formats import KVFormat, KVFormatError, group_values_for, is_rotated, list_formats

VEC_FILE = "attention/fa_vec.cu"
MMA_FILE = "attention/fa_mma.cu"
DCA_FILE = "attention/dca_fused.cu"          # the DCA instantiations of both templates
AUX_FILE = "attention/fa_combine.cu"

HEAD_DIMS = (64, 128, 256, 512)
THREADS = 128                     # every flash-attention block (kFaThreads)
VEC_ROW_OPTIONS = (4, 8)          # VecConfig::kRows: query rows per fa_vec block (registers scale with it)
DCA_VEC_ROWS = 8                  # the one fa_vec DCA instantiation per head dim (NVRTC time: ~5 s per kernel)
DEFAULT_SMEM_LIMIT = 48 * 1024    # above this a kernel needs max_dynamic_shared_size_bytes raised

# Runtime format ids of the kernels (enum FaFormatId in fa_common.cuh): list_formats() order.
FORMAT_IDS = {name: i for i, name in enumerate(list_formats())}
Q_TYPES = {"float32": "float", "float16": "__half"}


# ---- geometry (mirrors VecConfig / MmaConfig / the layouts in the .cu files) ------------------------------

@dataclass(frozen=True)
class VecGeometry:
    head_dim: int
    rows: int = 8

    @property
    def tile(self) -> int:  # keys per tile
        return 32 if self.head_dim <= 128 else 4096 // self.head_dim

    @property
    def key_slots(self) -> int:  # keys handled side by side
        return THREADS // (self.head_dim // 8)

    @property
    def score_parts(self) -> int:  # warps one key's dims span
        return max(1, self.head_dim // 8 // 32)


def vec_rows_for(rows: int, dca: bool = False) -> int:
    """The fa_vec instantiation (rows per block) for `rows` query rows per KV head."""
    return DCA_VEC_ROWS if dca else 4 if rows <= 4 else 8


@dataclass(frozen=True)
class MmaGeometry:
    head_dim: int
    decode: bool = False  # one 16-row tile, warps splitting the keys

    @property
    def col_split(self) -> int:
        return 2 if self.head_dim == 512 else 1

    @property
    def key_parts(self) -> int:
        return 4 // self.col_split if self.decode else 1

    @property
    def rows(self) -> int:  # query rows per block
        return 16 * (4 // self.col_split // self.key_parts)

    @property
    def tile(self) -> int:
        if self.decode:
            return 16 * self.key_parts
        return 64 if self.head_dim <= 128 else 8192 // self.head_dim


MMA_DECODE_MAX_ROWS = 16  # rows per KV head that one decode tile holds


def staged_slot_bytes(row_bytes: int) -> int:
    """StagedRows::slot_bytes: shared-memory bytes one raw cache row takes in fa_vec."""
    align = 16 if row_bytes % 16 == 0 else 8 if row_bytes % 8 == 0 else 4 if row_bytes % 4 == 0 else 2
    word = max(align, 4)
    words = row_bytes // word if align >= 4 else (row_bytes + 2) // 4
    slot = (words * word + 15) // 16 * 16
    return slot + 16 if slot % 128 == 0 else slot


def _table_bytes(n: int) -> int:
    return (n + 3) // 4 * 16


def vec_smem_bytes(head_dim: int, rows: int, k_row_bytes: int, v_row_bytes: int, k_table_len: int,
                   v_table_len: int) -> int:
    """VecLayout::bytes of fa_vec<head_dim, rows>."""
    g = VecGeometry(head_dim, rows)
    raw = 2 * g.tile * (staged_slot_bytes(k_row_bytes) + staged_slot_bytes(v_row_bytes))
    reduce = g.key_slots * rows * head_dim * 4
    scores = max(raw, reduce) + 2 * g.tile * 4
    k_table = scores + g.score_parts * rows * g.tile * 4
    return k_table + _table_bytes(k_table_len) + _table_bytes(v_table_len)


def mma_f16_smem_bytes(head_dim: int) -> int:
    """MmaF16Layout::kBytes of fa_mma<head_dim, true, false, true>."""
    g = MmaGeometry(head_dim, True)
    stride = head_dim + 8
    stages = 2 if head_dim <= 128 else 1
    stage = 2 * g.tile * stride * 2 + g.tile * 4
    merge = g.key_parts * 16 * head_dim * 4 if g.key_parts > 1 else 0
    return max(g.rows * stride * 2 + stages * stage, merge)


def mma_smem_bytes(head_dim: int, decode: bool, k_row_bytes: int, v_row_bytes: int, k_table_len: int,
                   v_table_len: int) -> int:
    """MmaLayout::bytes of fa_mma<head_dim, decode>."""
    g = MmaGeometry(head_dim, decode)
    stride = head_dim + 8
    q = g.rows * stride * 2
    k = g.tile * stride * 2
    vt = head_dim * (g.tile + 8) * 2
    positions = 2 * g.tile * 4
    raw = g.tile * (staged_slot_bytes(k_row_bytes) + staged_slot_bytes(v_row_bytes))
    merge = g.key_parts * 16 * head_dim * 4 if g.key_parts > 1 else 0
    return max(q + k + vt + positions + raw + _table_bytes(k_table_len) + _table_bytes(v_table_len), merge)


# ---- kernel names and declarations --------------------------------------------------------------------

def vec_kernel_name(head_dim: int, rows: int, dca: bool = False) -> str:
    return f"fa_vec<{head_dim}, {rows}, true>" if dca else f"fa_vec<{head_dim}, {rows}>"


def mma_launch_smem_bytes(head_dim: int, decode: bool, k_fmt: KVFormat, v_fmt: KVFormat, k_row_bytes: int,
                          v_row_bytes: int) -> int:
    """The dynamic shared memory launch_mma gives fa_mma: its f16 path's layout or the staged one."""
    if mma_f16_direct(decode, k_fmt, v_fmt):
        return mma_f16_smem_bytes(head_dim)
    return mma_smem_bytes(head_dim, decode, k_row_bytes, v_row_bytes, table_len(k_fmt), table_len(v_fmt))


def mma_kernel_name(head_dim: int, decode: bool, dca: bool = False, f16: bool = False) -> str:
    if f16:  # K and V f16, decode: copied straight into the tiles (fa_mma.cuh, MmaF16Layout)
        return f"fa_mma<{head_dim}, true, {'true' if dca else 'false'}, true>"
    return f"fa_mma<{head_dim}, {'true' if decode else 'false'}{', true' if dca else ''}>"


def mma_f16_direct(decode: bool, k_fmt: KVFormat, v_fmt: KVFormat) -> bool:
    """Whether fa_mma takes its f16 path: decode (plain or DCA) over an f16 K and V."""
    return decode and k_fmt.name == "f16" and v_fmt.name == "f16"


def prep_kernel_name(rot_group: int, q_dtype: str, out_dtype: str) -> str:
    return f"fa_prep_q<{rot_group}, {Q_TYPES[q_dtype]}, {Q_TYPES[out_dtype]}>"


def combine_kernel_name(rot_group: int, out_dtype: str) -> str:
    return f"fa_combine<{rot_group}, {Q_TYPES[out_dtype]}>"


def chunk_check_kernel_name(group: int) -> str:
    return f"fa_chunk_check<{group}>"


DEQUANT_BENCH_TILE = 64  # rows per tile of fa_dequant_bench


def dequant_bench_kernel_name(head_dim: int, from_floats: bool) -> str:
    return f"fa_dequant_bench<{head_dim}, cupyllm::{'Half8FromFloats' if from_floats else 'Half8'}>"


def dequant_bench_smem_bytes(head_dim: int, row_bytes: int, n_table: int) -> int:
    """fa_dequant_bench's dynamic shared memory: the K tile, the V^T tile, one staged tile, then the table."""
    tile = DEQUANT_BENCH_TILE
    k_tile, v_tile = tile * (head_dim + 8) * 2, head_dim * (tile + 8) * 2
    return k_tile + v_tile + tile * staged_slot_bytes(row_bytes) + _table_bytes(n_table)


def kernel_sets() -> list[KernelSet]:
    """Every flash-attention instantiation: one set per main kernel (each is large), one for the rest."""
    sets = [KernelSet(VEC_FILE, (vec_kernel_name(d, r),), label=f"d{d} r{r}") for d in HEAD_DIMS for r in VEC_ROW_OPTIONS]
    sets += [KernelSet(MMA_FILE, (mma_kernel_name(d, dec),), label=f"d{d}{' decode' if dec else ''}")
             for d in HEAD_DIMS for dec in (False, True)]
    sets += [KernelSet(MMA_FILE, (mma_kernel_name(d, True, f16=True),), label=f"d{d} decode f16") for d in HEAD_DIMS]
    sets += [KernelSet(DCA_FILE, (vec_kernel_name(d, DCA_VEC_ROWS, dca=True),), label=f"d{d} r{DCA_VEC_ROWS} dca")
             for d in HEAD_DIMS]
    sets += [KernelSet(DCA_FILE, (mma_kernel_name(d, dec, dca=True),), label=f"d{d}{' decode' if dec else ''} dca")
             for d in HEAD_DIMS for dec in (False, True)]
    sets += [KernelSet(DCA_FILE, (mma_kernel_name(d, True, dca=True, f16=True),), label=f"d{d} decode f16 dca")
             for d in HEAD_DIMS]
    aux = []
    for g in (0, *GROUP_SIZES):
        for q_dtype in Q_TYPES:
            for out_dtype in Q_TYPES:
                aux.append(prep_kernel_name(g, q_dtype, out_dtype))
        for out_dtype in Q_TYPES:
            aux.append(combine_kernel_name(g, out_dtype))
    aux += [chunk_check_kernel_name(g) for g in GROUP_SIZES]
    sets.append(KernelSet(AUX_FILE, tuple(aux)))
    sets.append(KernelSet(AUX_FILE, tuple(dequant_bench_kernel_name(d, f) for d in (64, 128) for f in (False, True)),
                          label="dequant bench"))
    return sets


# ---- format information ---------------------------------------------------------------------------------

def rotation_group(fmt: KVFormat, head_dim: int) -> int:
    """0 for scalar formats, else the group size the kernels rotate (G = min(128, head_dim))."""
    if not is_rotated(fmt.name):
        return 0
    group = group_values_for(head_dim)
    if fmt.block_values != group or group not in GROUP_SIZES:
        raise KVFormatError(
            f"KV format {fmt.name!r} with {fmt.block_values}-value groups has no GPU attention kernel for "
            f"head_dim {head_dim} (groups of min(128, head_dim) = {group} only)")
    return group


def format_id(fmt: KVFormat) -> int:
    try:
        return FORMAT_IDS[fmt.name]
    except KeyError:
        raise KVFormatError(f"KV format {fmt.name!r} has no GPU attention kernel; choose one of "
                            f"{', '.join(FORMAT_IDS)}") from None


def kernel_table(fmt: KVFormat) -> np.ndarray:
    """The float table the flash-attention kernels read for `fmt` (copied whole into shared memory): TCQ's
    CODEBOOK; turbo's LEVELS followed by the pair table PAIRS[c1 * 2^b + c0] = (LEVELS[c0], LEVELS[c1]), which
    Chunk8 reads two codes at a time (fa_common.cuh); a dummy for the rest."""
    table = format_table(fmt)
    if table is None:
        return np.zeros(1, np.float32)
    if fmt.name in ("turbo4", "turbo3", "turbo2"):
        levels = np.asarray(table[: 1 << fmt.bits], dtype=np.float32)
        n = len(levels)
        pairs = np.stack([np.tile(levels, n), np.repeat(levels, n)], axis=-1)  # row c1 * n + c0
        return np.ascontiguousarray(np.concatenate([levels, pairs.reshape(-1)]), dtype=np.float32)
    return np.ascontiguousarray(table, dtype=np.float32)


def table_len(fmt: KVFormat) -> int:
    return 0 if format_table(fmt) is None else int(kernel_table(fmt).size)


# ---- launchers --------------------------------------------------------------------------------------------

@dataclass
class AttentionLaunch:
    """Everything one main-kernel launch needs, already on the device."""
    head_dim: int
    q: object               # prepared Q: float32 (VEC) or float16 (MMA) [n_q, n_head, D]
    k_cache: object
    v_cache: object
    slot_pos: object        # int32 [n_slots]
    q_pos: object           # int32 [n_q]
    mask: object            # float32 [n_q, mask_stride], or a 1-element array: no mask (mask_stride 0)
    k_table: object
    v_table: object
    o_part: object          # float32 [n_split, n_q, n_head, D]
    lse_part: object        # float32 [n_split, n_q, n_head]
    n_q: int
    n_head: int
    n_kv: int
    n_slots: int
    n_keys: int
    keys_per_split: int
    n_split: int
    window: int
    softcap: float
    slots_are_positions: bool
    k_fmt: KVFormat
    v_fmt: KVFormat
    dca_chunk_len: int = 0  # > 0: Dual Chunk Attention, q holds [3, n_q, n_head, D] (intra, successive, inter)

    @property
    def dca(self) -> bool:
        return self.dca_chunk_len > 0


def _args(a: AttentionLaunch) -> tuple:
    mask_stride = a.mask.shape[1] if a.mask.ndim == 2 else 0  # 0: the kernels read no mask
    return (a.q, a.k_cache, a.v_cache, a.slot_pos, a.q_pos, a.mask, np.int64(mask_stride), a.k_table, a.v_table,
            a.o_part, a.lse_part, np.int32(a.n_q), np.int32(a.n_head), np.int32(a.n_kv), np.int32(a.n_slots),
            np.int32(a.n_keys), np.int32(a.keys_per_split), np.int32(a.window), np.float32(a.softcap),
            np.int32(1 if a.slots_are_positions else 0), np.int32(format_id(a.k_fmt)), np.int32(format_id(a.v_fmt)),
            np.int32(a.k_cache.shape[2]), np.int32(a.v_cache.shape[2]), np.int32(table_len(a.k_fmt)),
            np.int32(table_len(a.v_fmt)), np.int32(a.dca_chunk_len))


def _with_smem(kernel, smem: int):
    if smem > DEFAULT_SMEM_LIMIT and getattr(kernel, "max_dynamic_shared_size_bytes", 0) < smem:
        kernel.max_dynamic_shared_size_bytes = smem
    return kernel


def launch_vec(registry: KernelRegistry, a: AttentionLaunch) -> None:
    group = a.n_head // a.n_kv
    rows = vec_rows_for(a.n_q * group, a.dca)
    smem = vec_smem_bytes(a.head_dim, rows, a.k_cache.shape[2], a.v_cache.shape[2], table_len(a.k_fmt),
                          table_len(a.v_fmt))
    kernel = _with_smem(registry.function(vec_kernel_name(a.head_dim, rows, a.dca)), smem)
    grid = (-(-(a.n_q * group) // rows), a.n_split, a.n_kv)
    kernel(grid, (THREADS,), _args(a), shared_mem=smem)


def mma_is_decode(rows: int) -> bool:
    """fa_mma's decode layout (one 16-row tile, warps split the keys) for at most 16 rows per KV head."""
    return rows <= MMA_DECODE_MAX_ROWS


def launch_mma(registry: KernelRegistry, a: AttentionLaunch) -> None:
    group = a.n_head // a.n_kv
    decode = mma_is_decode(a.n_q * group)
    f16 = mma_f16_direct(decode, a.k_fmt, a.v_fmt)
    smem = mma_launch_smem_bytes(a.head_dim, decode, a.k_fmt, a.v_fmt, a.k_cache.shape[2], a.v_cache.shape[2])
    kernel = _with_smem(registry.function(mma_kernel_name(a.head_dim, decode, a.dca, f16)), smem)
    grid = (-(-(a.n_q * group) // MmaGeometry(a.head_dim, decode).rows), a.n_split, a.n_kv)
    kernel(grid, (THREADS,), _args(a), shared_mem=smem)


def launch_prep_q(registry: KernelRegistry, q, out, rot_group: int, scale: float, more=()) -> None:
    """out = scale * q (rotated per group when rot_group > 0); with `more` (up to two arrays shaped like q, e.g.
    DCA's other rotations) out is [1 + len(more), *q.shape], every part prepared by the same launch."""
    n_rows = q.shape[0] * q.shape[1]
    d = q.shape[2]
    parts = (q, *more)
    if len(parts) > 3 or any(p.shape != q.shape or p.dtype != q.dtype for p in parts):
        raise ValueError("fa_prep_q takes one to three Q arrays of one shape and dtype")
    kernel = registry.function(prep_kernel_name(rot_group, np.dtype(q.dtype).name, np.dtype(out.dtype).name))
    group = rot_group or 32
    n_items = len(parts) * n_rows * (d // group)
    padded = parts + (q,) * (3 - len(parts))  # unread
    kernel((-(-n_items // (THREADS // 32)),), (THREADS,),
           (*padded, out, np.int32(n_rows), np.int32(len(parts)), np.int32(d), np.float32(scale)))


def launch_combine(registry: KernelRegistry, o_part, lse_part, out, lse_out, rot_group: int) -> None:
    n_split = o_part.shape[0]
    n_rows = o_part.shape[1] * o_part.shape[2]
    d = o_part.shape[3]
    kernel = registry.function(combine_kernel_name(rot_group, np.dtype(out.dtype).name))
    kernel((n_rows,), (THREADS,),  # one block per row (fa_combine.cu)
           (o_part, lse_part, out, lse_out, np.int32(n_split), np.int32(n_rows), np.int32(d)))
