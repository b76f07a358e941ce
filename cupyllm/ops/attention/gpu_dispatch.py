"""Attention over a layer's KV cache on the GPU: pick FA-VEC or MMA, split the keys, run the kernels.

``gpu_attention_lse(q, q_pos, layer_kv, scale=, window=, softcap=)`` -> (O, LSE) and ``gpu_attention(...)``
-> O compute exactly what ``cupyllm.ops.attention.reference.attend`` defines over the cache (causal /
sliding-window mask from the slot positions, -1 = empty slot, optional logit softcap, optional additive
mask), with

* ``q``: float32 or float16 [n_q, n_head, d] on the device; O comes back in q's dtype, LSE as float32
  [n_q, n_head] (natural log; -inf and O = 0 for a row that sees no key), so partial results over
  disjoint caches merge with ``reference.merge``;
* ``layer_kv``: a LayerKV-like object (cupyllm/kv/cache.py): ``k_format``, ``v_format``, ``n_kv``,
  ``head_dim``, ``v_head_dim``, ``k_data`` / ``v_data`` uint8 [n_slots, n_kv, row_bytes] device arrays,
  ``slot_pos`` [n_slots] (int32 on the device as kv/gpu_cache.py keeps it; anything else is converted
  per call), optionally ``n_used`` (slots past it are never read), ``ring`` (False: slot j holds position
  j, so keys past the last query position are skipped) and ``inputs`` (backend/gpu_inputs.DeviceInputs:
  turns host ``q_pos`` into its int32 device copy, pinned during CUDA-graph capture);
* ``q_pos``: the query positions [n_q], host or device ints.

Every launch is asynchronous and nothing is copied to the host, so a call can be captured in a CUDA graph
once the format tables are on the device (the first call uploads them).

Choice (``choose_kernel``): decode is at most ``VEC_MAX_QUERIES`` queries and ``VEC_MAX_ROWS`` rows per KV
head (rows = queries x GQA group: one block holds them all, so the KV is read once per group). It runs on
MMA's decode layout (one 16-row tile, warps splitting the keys, products on the tensor cores) for an f16 K
and V (fa_mma's f16 path: cache rows copied straight into the tiles) and for the block and rotated formats,
whose dequantizing would leave FA-VEC compute-bound; on FA-VEC (f32 arithmetic) for f32 and bf16 caches and
for the few block/rotated formats measured faster there (``VEC_DECODE_FORMATS``).
Everything else is prefill: MMA with 64-row tiles. Both kernels run for
every head dim in ``HEAD_DIMS`` and every pair of KV formats. The split over the keys (``plan_attention``)
fills the device: decode aims at ``DECODE_BLOCKS_PER_SM`` blocks per SM with at least ``DECODE_MIN_KEYS_PER_SPLIT``
keys each (flash-decoding); prefill splits only when its row tiles leave SMs idle.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ...cuda.registry import KernelRegistry, require_cupy
from ...errors import CupyllmError
from ..kv_formats.formats import KVFormat
from . import gpu as fk

VEC_MAX_QUERIES = 8
VEC_MAX_ROWS = 16
VEC_FORMATS = ("f32", "bf16")  # decode of these stays on fa_vec (see choose_kernel)
# Block/rotated formats whose decode was faster on fa_vec than on fa_mma at both 4k and 64k keys on an H200
# (bench/results/attention_gpu.json: 0.73-0.95x fa_mma's time at head dim 128, 0.67-0.97x for q5_1 at 256);
# the rest decode faster on fa_mma. A K / V pair takes fa_vec when both are listed for its head dim. The kernels
# have changed since that run (fa_mma's f16 dequantizing and ldmatrix): `python tools/dispatch_from_bench.py`
# after the next one gives this dict anew (tests/ops/test_attention_gpu_dispatch.py holds it to the committed JSON).
VEC_DECODE_FORMATS = {128: ("q5_0", "q5_1", "turbo3", "turbo3_tcq"), 256: ("q5_1",)}
# Decode blocks stream long key ranges through a cp.async pipeline: one wave of about two blocks per SM was
# fastest on an H200 for every shape swept (tools/attention_probe.py; 4k-64k keys, 1-8 KV heads); a second,
# partial wave and the combine's extra splits cost more than the idle SM slots.
DECODE_BLOCKS_PER_SM = 2
DECODE_MIN_KEYS_PER_SPLIT = 128   # below this the per-block setup and the combine traffic dominate
MMA_MIN_KEYS_PER_SPLIT = 1024
MMA_BLOCKS_PER_SM = 2


class AttentionArgumentError(CupyllmError, ValueError):
    """Arrays of the wrong shape, dtype or layout handed to the GPU attention."""


@dataclass(frozen=True)
class AttentionPlan:
    kernel: str          # "vec" or "mma"
    n_split: int         # splits over the keys (merged by fa_combine)
    keys_per_split: int  # a multiple of the kernel's key tile


def choose_kernel(n_q: int, n_head: int, n_kv: int, head_dim: int, k_format: str, v_format: str) -> str:
    """"vec" or "mma" for a call with n_q queries (see the module docstring)."""
    rows = n_q * (n_head // n_kv)
    if n_q > VEC_MAX_QUERIES or rows > VEC_MAX_ROWS:
        return "mma"
    # Decode. An f32 cache asks for exact values (fa_mma rounds K and V to f16), and its rows would overflow
    # the shared memory of fa_mma's decode tiles on an A100 at head dim 256/512: fa_vec.
    if "f32" in (k_format, v_format):
        return "vec"
    # fa_vec computes in f32 from the exact values; its per-value work (dequantize + one f32 FMA per row,
    # twice) left it instruction-bound on an H200 even for f16 (about 20% of HBM bandwidth). fa_mma's decode
    # layout moves the products to the tensor cores, and its f16 path copies f16 rows straight into the
    # tiles; bf16 stays on fa_vec (its range exceeds f16's).
    if k_format in VEC_FORMATS and v_format in VEC_FORMATS:
        return "vec"
    measured = VEC_DECODE_FORMATS.get(head_dim, ())
    return "vec" if k_format in measured and v_format in measured else "mma"


def plan_attention(n_q: int, n_head: int, n_kv: int, head_dim: int, n_keys: int, n_sm: int, kernel: str,
                   n_split: int | None = None) -> AttentionPlan:
    """How many splits over the keys, and how many keys each (a multiple of the key tile)."""
    rows = n_q * (n_head // n_kv)
    decode = kernel == "vec" or fk.mma_is_decode(rows)  # few rows: flash-decoding, many splits
    if kernel == "vec":
        tile = fk.VecGeometry(head_dim).tile
        base_blocks = -(-rows // fk.vec_rows_for(rows)) * n_kv
    else:
        geometry = fk.MmaGeometry(head_dim, fk.mma_is_decode(rows))
        tile = geometry.tile
        base_blocks = -(-rows // geometry.rows) * n_kv
    if decode:
        want = max(1, -(-DECODE_BLOCKS_PER_SM * n_sm // base_blocks))
        cap = max(1, n_keys // DECODE_MIN_KEYS_PER_SPLIT)
    else:
        want = max(1, -(-MMA_BLOCKS_PER_SM * n_sm // base_blocks))
        cap = max(1, n_keys // MMA_MIN_KEYS_PER_SPLIT)
    splits = n_split if n_split is not None else min(want, cap)
    splits = max(1, min(splits, -(-max(n_keys, 1) // tile)))
    keys_per_split = -(-max(n_keys, 1) // splits)
    keys_per_split = -(-keys_per_split // tile) * tile
    return AttentionPlan(kernel, -(-max(n_keys, 1) // keys_per_split), keys_per_split)


class GpuAttention:
    """Runs the flash-attention kernels; holds the kernel registry and the device copies of format tables."""

    def __init__(self, registry: KernelRegistry | None = None):
        self._cp = require_cupy()
        self.registry = registry if registry is not None else KernelRegistry()
        self._tables: dict[int, tuple[KVFormat, object]] = {}
        self._no_mask = self._cp.zeros(1, dtype=self._cp.float32)  # stands in for "no mask" (mask_stride 0)
        props = self._cp.cuda.runtime.getDeviceProperties(self._cp.cuda.Device().id)
        self.n_sm = int(props["multiProcessorCount"])
        self.smem_optin = int(props.get("sharedMemPerBlockOptin", 0)) or None

    def _table(self, fmt: KVFormat):
        """The format's table on the device, uploaded once per format object (the cache keeps its formats)."""
        cached = self._tables.get(id(fmt))
        if cached is None or cached[0] is not fmt:
            cached = (fmt, self._cp.asarray(fk.kernel_table(fmt)))
            self._tables[id(fmt)] = cached
        return cached[1]

    def attention_lse(self, q, q_pos, layer_kv, *, scale: float, window: int = 0, softcap: float = 0.0,
                      mask=None, kernel: str | None = None, n_split: int | None = None, dca=None,
                      dca_queries=()):
        """(O [n_q, n_head, d] in q's dtype, LSE float32 [n_q, n_head]); see the module docstring.

        `kernel` ("vec" / "mma") and `n_split` override the automatic choices (tests, benchmarks).
        Dual Chunk Attention (ops/attention/gpu_dca.py): `dca` (DCAConfig) with q the intra rotation and
        `dca_queries` the successive and inter ones; the same launches with the kernels' DCA instantiations."""
        cp = self._cp
        qs = [cp.ascontiguousarray(cp.asarray(x)) for x in (q, *dca_queries)]
        if any(x.shape != qs[0].shape or x.dtype != qs[0].dtype for x in qs[1:]):
            raise AttentionArgumentError("the DCA rotations must have one shape and dtype, got "
                                         + ", ".join(f"{x.dtype} {tuple(x.shape)}" for x in qs))
        if (dca is None) != (len(qs) == 1) or len(qs) not in (1, 3):
            raise AttentionArgumentError("DCA takes dca= and exactly two dca_queries (successive, inter)")
        q = qs[0]
        n_q, n_head, d, n_kv, n_slots, n_keys = _check(q, layer_kv)
        k_fmt, v_fmt = layer_kv.k_format, layer_kv.v_format
        k_rot = fk.rotation_group(k_fmt, d)
        v_rot = fk.rotation_group(v_fmt, d)
        fk.format_id(k_fmt), fk.format_id(v_fmt)
        q_dtype = np.dtype(q.dtype).name
        out = cp.empty((n_q, n_head, d), dtype=q.dtype)
        lse = cp.empty((n_q, n_head), dtype=cp.float32)
        if n_q == 0:
            return out, lse
        if n_keys == 0:
            out.fill(0)
            lse.fill(-np.inf)
            return out, lse
        kernel = kernel or choose_kernel(n_q, n_head, n_kv, d, k_fmt.name, v_fmt.name)
        if kernel not in ("vec", "mma"):
            raise AttentionArgumentError(f"kernel must be 'vec' or 'mma', got {kernel!r}")
        plan = plan_attention(n_q, n_head, n_kv, d, n_keys, self.n_sm, kernel, n_split)
        self._check_shared_memory(kernel, n_q * (n_head // n_kv), d, layer_kv, dca=dca is not None)

        # DCA: [3, n_q, n_head, d], the three rotations scaled (and rotated for rotated K formats) by one launch
        q_prepped = cp.empty(((len(qs),) if dca else ()) + q.shape, dtype=cp.float32 if kernel == "vec" else cp.float16)
        logit_scale = float(scale) * (dca.logit_scale if dca else 1.0)
        fk.launch_prep_q(self.registry, q, q_prepped, k_rot, logit_scale, more=qs[1:])
        direct = plan.n_split == 1 and v_rot == 0 and q_dtype == "float32"
        if direct:  # the main kernel writes the final O and LSE
            o_part, lse_part = out.reshape(1, n_q, n_head, d), lse.reshape(1, n_q, n_head)
        else:
            o_part = cp.empty((plan.n_split, n_q, n_head, d), dtype=cp.float32)
            lse_part = cp.empty((plan.n_split, n_q, n_head), dtype=cp.float32)
        launch = fk.AttentionLaunch(
            head_dim=d, q=q_prepped, k_cache=layer_kv.k_data, v_cache=layer_kv.v_data,
            slot_pos=_int32_device(cp, layer_kv.slot_pos), q_pos=_query_positions(cp, q_pos, layer_kv),
            mask=_mask(cp, mask, n_q, n_keys) if mask is not None else self._no_mask,
            k_table=self._table(k_fmt), v_table=self._table(v_fmt), o_part=o_part, lse_part=lse_part,
            n_q=n_q, n_head=n_head, n_kv=n_kv, n_slots=n_slots, n_keys=n_keys, keys_per_split=plan.keys_per_split,
            n_split=plan.n_split, window=int(window), softcap=float(softcap),
            slots_are_positions=not bool(getattr(layer_kv, "ring", True)), k_fmt=k_fmt, v_fmt=v_fmt,
            dca_chunk_len=int(dca.chunk_len) if dca else 0)
        if launch.q_pos.shape != (n_q,):
            raise AttentionArgumentError(f"q_pos must hold one position per query ({n_q}), got shape "
                                         f"{tuple(launch.q_pos.shape)}")
        (fk.launch_vec if kernel == "vec" else fk.launch_mma)(self.registry, launch)
        if not direct:
            fk.launch_combine(self.registry, o_part, lse_part, out, lse, v_rot)
        return out, lse

    def _check_shared_memory(self, kernel: str, rows: int, d: int, layer_kv, dca: bool = False) -> None:
        k_fmt, v_fmt = layer_kv.k_format, layer_kv.v_format
        row_bytes = (layer_kv.k_data.shape[2], layer_kv.v_data.shape[2])
        if kernel == "vec":
            need = fk.vec_smem_bytes(d, fk.vec_rows_for(rows, dca=dca), *row_bytes, fk.table_len(k_fmt),
                                     fk.table_len(v_fmt))
        else:  # what launch_mma will ask for
            need = fk.mma_launch_smem_bytes(d, fk.mma_is_decode(rows), k_fmt, v_fmt, *row_bytes)
        if self.smem_optin is not None and need > self.smem_optin:
            raise AttentionArgumentError(
                f"the {kernel} {'DCA' if dca else 'attention'} kernel needs {need} bytes of shared memory for K "
                f"{k_fmt.name!r} / V {v_fmt.name!r} at head_dim {d}, the device allows {self.smem_optin}; "
                "use kernel='vec'")

    def attention(self, q, q_pos, layer_kv, **kwargs):
        return self.attention_lse(q, q_pos, layer_kv, **kwargs)[0]


def _check(q, layer_kv) -> tuple[int, int, int, int, int, int]:
    if q.ndim != 3 or np.dtype(q.dtype).name not in fk.Q_TYPES:
        raise AttentionArgumentError(f"q must be float32 or float16 [n_q, n_head, d], got {q.dtype} {tuple(q.shape)}")
    n_q, n_head, d = (int(x) for x in q.shape)
    n_kv = int(layer_kv.n_kv)
    if d != layer_kv.head_dim or layer_kv.v_head_dim != d:
        raise AttentionArgumentError(
            f"q has head_dim {d}, the cache holds K {layer_kv.head_dim} / V {layer_kv.v_head_dim}; the GPU "
            "kernels need equal K and V head dims")
    if d not in fk.HEAD_DIMS:
        raise AttentionArgumentError(f"GPU attention kernels exist for head dims {fk.HEAD_DIMS}, not {d}")
    if n_kv <= 0 or n_head % n_kv:
        raise AttentionArgumentError(f"{n_head} query heads do not share {n_kv} KV heads evenly")
    caches = (("k_data", layer_kv.k_data, layer_kv.k_format), ("v_data", layer_kv.v_data, layer_kv.v_format))
    n_slots = int(layer_kv.k_data.shape[0])
    for name, data, fmt in caches:
        want = (n_slots, n_kv, fmt.row_bytes(d))
        if (np.dtype(data.dtype) != np.uint8 or tuple(data.shape) != want or not data.flags.c_contiguous
                or data.data.ptr % 16):
            raise AttentionArgumentError(
                f"layer_kv.{name} must be a C-contiguous, 16-byte aligned uint8 {want} device array (format "
                f"{fmt.name!r}), got {data.dtype} {tuple(data.shape)}")
    if tuple(layer_kv.slot_pos.shape) != (n_slots,):
        raise AttentionArgumentError(f"layer_kv.slot_pos must be [{n_slots}], got {tuple(layer_kv.slot_pos.shape)}")
    n_keys = int(min(getattr(layer_kv, "n_used", n_slots), n_slots))
    return n_q, n_head, d, n_kv, n_slots, n_keys


def _int32_device(cp, values):
    if isinstance(values, cp.ndarray) and values.dtype == np.int32 and values.flags.c_contiguous:
        return values
    return cp.ascontiguousarray(cp.asarray(values, dtype=cp.int32))


def _query_positions(cp, q_pos, layer_kv):
    inputs = getattr(layer_kv, "inputs", None)
    if inputs is not None:  # the engine's DeviceInputs: one upload per step, pinned under graph capture
        return inputs.int32(q_pos)
    return _int32_device(cp, q_pos)


def _mask(cp, mask, n_q: int, n_keys: int):
    mask = cp.ascontiguousarray(cp.asarray(mask, dtype=cp.float32))
    if mask.ndim != 2 or mask.shape[0] != n_q or mask.shape[1] < n_keys:
        raise AttentionArgumentError(
            f"the additive mask must be float32 [n_q={n_q}, >= {n_keys} slots], got {tuple(mask.shape)}")
    return mask


@functools.lru_cache(maxsize=1)
def default_gpu_attention() -> GpuAttention:
    """One GpuAttention per process for the module-level functions (compiled kernels are reused)."""
    return GpuAttention()


def gpu_attention_lse(q, q_pos, layer_kv, *, scale: float, window: int = 0, softcap: float = 0.0, mask=None,
                      kernel: str | None = None, n_split: int | None = None, runner: GpuAttention | None = None,
                      dca=None, dca_queries=()):
    """(O, LSE) of q over everything `layer_kv` caches; see the module docstring (DCA: GpuAttention.attention_lse)."""
    runner = runner or default_gpu_attention()
    return runner.attention_lse(q, q_pos, layer_kv, scale=scale, window=window, softcap=softcap, mask=mask,
                                kernel=kernel, n_split=n_split, dca=dca, dca_queries=dca_queries)


def gpu_attention(q, q_pos, layer_kv, *, scale: float, window: int = 0, softcap: float = 0.0, mask=None,
                  kernel: str | None = None, n_split: int | None = None, runner: GpuAttention | None = None,
                  dca=None, dca_queries=()):
    """O of q over everything `layer_kv` caches (gpu_attention_lse without the LSE)."""
    return gpu_attention_lse(q, q_pos, layer_kv, scale=scale, window=window, softcap=softcap, mask=mask,
                             kernel=kernel, n_split=n_split, runner=runner, dca=dca, dca_queries=dca_queries)[0]
