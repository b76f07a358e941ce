"""CuPy launchers for the dense-model kernels: weight GEMV / dequantization / tensor-core matmul
(kernels_cu/weight_*.cu over weight_formats.cuh) and the row/element operations (kernels_cu/elementwise/elementwise.cu).

Every instantiation the engine may launch is declared by ``kernel_sets()`` (listed in
cupyllm/cuda/registry.py KERNEL_SET_PROVIDERS, so CI compiles them all for sm_80 and sm_90 without a GPU).
CuPy is imported only when a ``WeightKernels`` is built.

Weights on the device are uint8 ``[n_out, row_bytes]`` GGUF blocks in an allocation padded by
``WEIGHT_PAD_BYTES`` (the GEMV stages whole 16-byte lines and may read up to 15 bytes past the last row).
"""
from __future__ import annotations

import numpy as np

from ...cuda.launch import KernelLauncher, grid_stride_blocks
from ...cuda.registry import KernelRegistry, KernelSet
from ...errors import DeviceError
from ...models.weights import Weight
from ..elementwise.gpu import ACTIVATIONS

GEMV_FILE = "matmul/weight_gemv.cu"
DEQUANT_FILE = "matmul/weight_dequant.cu"
MMA_FILE = "matmul/weight_mma.cu"

# GGUF weight type name -> weight_formats.cuh struct, grouped by family (one compilation unit each).
WEIGHT_FAMILIES: dict[str, dict[str, str]] = {
    "float": {"F32": "cupyllm::WF32", "F16": "cupyllm::WF16", "BF16": "cupyllm::WBF16"},
    "q32": {"Q8_0": "cupyllm::WQ8_0", "Q4_0": "cupyllm::WQ4_0", "Q4_1": "cupyllm::WQ4_1",
            "Q5_0": "cupyllm::WQ5_0", "Q5_1": "cupyllm::WQ5_1"},
    "kquant": {"Q4_K": "cupyllm::WQ4_K", "Q5_K": "cupyllm::WQ5_K", "Q6_K": "cupyllm::WQ6_K"},
}
WEIGHT_TYPES: dict[str, str] = {name: cpp for family in WEIGHT_FAMILIES.values() for name, cpp in family.items()}
# values per (pseudo-)block of each kernel format: rows must hold whole blocks
KERNEL_BLOCK_VALUES = {name: (256 if family == "kquant" else 32)
                       for family, names in WEIGHT_FAMILIES.items() for name in names}

WEIGHT_PAD_BYTES = 16

# GEMV instantiations: (tokens, rows per warp). A call with n tokens uses the smallest tokens >= n.
GEMV_SHAPES = ((1, 2), (1, 4), (2, 2), (4, 1), (8, 1))
GEMV_MAX_TOKENS = max(t for t, _ in GEMV_SHAPES)
GEMV_WARPS = 4  # kGemvWarps in weight_gemv.cu
GEMV_GROUP = 3  # matrices one weight_gemv launch can take
GEMV_WIDE_ROWS = 8192  # from this many output rows, single-token GEMV gives each warp 4 rows (fewer x reloads)


def gated_rows(rows: int) -> int:
    """A gated GEMV's rows per matrix per warp for a plain shape's `rows`: half each for gate and up (at least
    one), so that a warp stages as many rows as a plain GEMV's warp does."""
    return max(1, rows // 2)


# gated GEMV (tokens, rows per matrix)
GEMV_GATED_SHAPES = tuple(dict.fromkeys((t, gated_rows(r)) for t, r in GEMV_SHAPES))

MMA_ROWS, MMA_TOKENS, MMA_DEPTH, MMA_THREADS = 64, 64, 128, 128  # weight_mma.cu tile

DEQUANT_OUTPUTS = {"float32": "float", "float16": "__half"}
DEQUANT_THREADS = 256



def _weight_cpp(fmt_name: str) -> str:
    try:
        return WEIGHT_TYPES[fmt_name]
    except KeyError:
        raise DeviceError(f"weight type {fmt_name} has no GPU kernel; supported: {', '.join(WEIGHT_TYPES)}") from None


def gemv_kernel_name(fmt_name: str, tokens: int, rows: int) -> str:
    return f"weight_gemv<{_weight_cpp(fmt_name)}, {tokens}, {rows}>"


def gemv_gated_kernel_name(fmt_name: str, tokens: int, rows: int, activation: str, up_matrix: bool) -> str:
    return (f"weight_gemv_gated<{_weight_cpp(fmt_name)}, {tokens}, {rows}, {ACTIVATIONS[activation]}, "
            f"{'true' if up_matrix else 'false'}>")


def gemv_gated_shape(n_tokens: int, n_out: int) -> tuple[int, int]:
    """The (tokens, rows per matrix per warp) of a gated GEMV (gated_rows of the plain GEMV's shape)."""
    tokens, rows = gemv_shape(n_tokens, n_out)
    return tokens, gated_rows(rows)


def dequant_kernel_name(fmt_name: str, out_dtype: str) -> str:
    return f"weight_dequant<{_weight_cpp(fmt_name)}, {DEQUANT_OUTPUTS[out_dtype]}>"


def mma_kernel_name(fmt_name: str) -> str:
    return f"weight_mma<{_weight_cpp(fmt_name)}>"


def kernel_sets() -> list[KernelSet]:
    """GEMVs one compilation unit per weight type (a model compiles only the types it stores), the
    dequantization and MMA kernels one unit per family."""
    gated = [(t, r, a, m) for t, r in GEMV_GATED_SHAPES for a in ACTIVATIONS for m in (True, False)]
    sets = [KernelSet(GEMV_FILE, (*(gemv_kernel_name(n, t, r) for t, r in GEMV_SHAPES),
                                  *(gemv_gated_kernel_name(n, *shape) for shape in gated)), label=n)
            for n in WEIGHT_TYPES]
    for family, names in WEIGHT_FAMILIES.items():
        sets.append(KernelSet(DEQUANT_FILE, tuple(dequant_kernel_name(n, o) for n in names for o in DEQUANT_OUTPUTS),
                              label=family))
        sets.append(KernelSet(MMA_FILE, tuple(mma_kernel_name(n) for n in names), label=family))
    return sets


def gemv_shape(n_tokens: int, n_out: int) -> tuple[int, int]:
    """The (tokens, rows per warp) instantiation for a call, or DeviceError above GEMV_MAX_TOKENS."""
    for tokens, rows in GEMV_SHAPES:
        if tokens >= n_tokens and (tokens > 1 or rows == (4 if n_out >= GEMV_WIDE_ROWS else 2)):
            return tokens, rows
    raise DeviceError(f"GEMV runs at most {GEMV_MAX_TOKENS} tokens, got {n_tokens}")


def forced_shape(shape: tuple[int, int], shapes: tuple, n_tokens: int, what: str) -> tuple[int, int]:
    """A (tokens, rows) instantiation a caller forces (tests, benchmarks), or DeviceError where `shapes` has no
    such instantiation or it takes fewer than n_tokens."""
    if shape not in shapes or n_tokens > shape[0]:
        raise DeviceError(f"{what} shape {shape} is not one of {shapes} for {n_tokens} tokens")
    return shape


def kernel_format_fits(fmt_name: str, n_in: int) -> bool:
    """Whether the block kernels can read rows of n_in values of this type (whole (pseudo-)blocks)."""
    return fmt_name in WEIGHT_TYPES and n_in % KERNEL_BLOCK_VALUES[fmt_name] == 0


def mma_fits(fmt_name: str, n_in: int) -> bool:
    return fmt_name in WEIGHT_TYPES and n_in % MMA_DEPTH == 0


class WeightKernels(KernelLauncher):
    """Launches the weight kernels on the current CUDA stream (inputs are CuPy arrays)."""

    def __init__(self, registry: KernelRegistry | None = None):
        super().__init__(registry)
        self._unused_i32 = self.cp.zeros(1, dtype=self.cp.int32)  # the row ids a full dequantization does not read

    def _bias_args(self, bias):
        if bias is None:
            return self._unused_f32, np.int32(0)
        return self.cp.ascontiguousarray(bias, dtype=self.cp.float32), np.int32(1)

    # --- weights ---------------------------------------------------------------------------------
    def upload(self, weight: Weight) -> Weight:
        """The weight's GGUF blocks on the device, once: uint8 [n_out, row_bytes] in a padded allocation."""
        cp = self.cp
        n_rows = int(np.prod(weight.shape[:-1])) if len(weight.shape) > 1 else 1
        host = np.ascontiguousarray(weight.data).view(np.uint8).reshape(n_rows, -1)
        buffer = cp.zeros(host.nbytes + WEIGHT_PAD_BYTES, dtype=cp.uint8)
        device = buffer[:host.nbytes].reshape(host.shape)
        if hasattr(device, "set"):  # CuPy: one host-to-device copy, no temporary device array
            device.set(host)
        else:
            device[...] = host
        return Weight(weight.name, weight.fmt, tuple(weight.shape), device)

    def gemv(self, weight: Weight, x, bias=None, out=None, shape: tuple[int, int] | None = None):
        """y [n, n_out] = x [n, n_in] @ W.T (+ bias), n <= GEMV_MAX_TOKENS, from the blocks.
        `shape` forces a (tokens, rows per warp) instantiation of GEMV_SHAPES (tests, benchmarks)."""
        return self.gemv_many([weight], x, [bias], outs=[out], shape=shape)[0]

    def gemv_many(self, weights, x, biases=None, outs=None, shape: tuple[int, int] | None = None) -> list:
        """[gemv(w, x, b) for w, b in zip(weights, biases)] for up to GEMV_GROUP matrices of one format and
        width, in one launch (weight_gemv.cu: blockIdx.y picks the matrix); the same sums as apart."""
        cp = self.cp
        n_in, fmt_name = weights[0].shape[-1], weights[0].fmt.name
        if len(weights) > GEMV_GROUP or any(w.fmt.name != fmt_name or w.shape[-1] != n_in for w in weights):
            raise DeviceError(f"one GEMV launch takes up to {GEMV_GROUP} matrices of one type and width")
        n_outs = [w.shape[0] for w in weights]
        n = x.shape[0]
        tokens, rows = gemv_shape(n, sum(n_outs)) if shape is None else forced_shape(shape, GEMV_SHAPES, n, "GEMV")
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        outs = [cp.empty((n, n_out), dtype=cp.float32) if out is None else out
                for n_out, out in zip(n_outs, outs or [None] * len(weights))]
        biases = list(biases or [None] * len(weights))
        has_bias = sum(1 << m for m, b in enumerate(biases) if b is not None)
        biases = [self._unused_f32 if b is None else cp.ascontiguousarray(b, dtype=cp.float32) for b in biases]
        pad = GEMV_GROUP - len(weights)  # (the unused matrices' arguments repeat the first's; never read)
        kernel = self._fn(gemv_kernel_name(fmt_name, tokens, rows))
        grid = (max(n_outs) + GEMV_WARPS * rows - 1) // (GEMV_WARPS * rows)
        kernel((grid, len(weights)), (32 * GEMV_WARPS,),
               (*[w.data for w in weights], *[weights[0].data] * pad, np.int64(weights[0].data.shape[1]),
                *[np.int32(v) for v in n_outs + [n_outs[0]] * pad], np.int32(n_in), x, np.int32(n),
                *biases, *biases[:1] * pad, np.int32(has_bias), *outs, *outs[:1] * pad))
        return outs

    def gemv_gated(self, gate: Weight, x, activation: str, up: Weight | None = None, up_given=None, out=None,
                   shape: tuple[int, int] | None = None):
        """act(x @ gate.T) * (x @ up.T), or * up_given [n, n_out], in one launch (weight_gemv_gated): each sum
        that of gemv(), bit for bit, the product gated_act's. gate and up of one type and shape. `shape` forces
        a (tokens, rows per matrix) instantiation (tests)."""
        cp = self.cp
        if (up is None) == (up_given is None):
            raise DeviceError("a gated GEMV takes either an up matrix or the up values")
        if up is not None and (up.fmt.name != gate.fmt.name or up.shape != gate.shape):
            raise DeviceError(f"a gated GEMV needs gate and up of one type and shape, got {gate.fmt.name} "
                              f"{tuple(gate.shape)} and {up.fmt.name} {tuple(up.shape)}")
        n_out, n_in = gate.shape
        n = x.shape[0]
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        if up_given is not None:
            up_given = cp.ascontiguousarray(up_given, dtype=cp.float32)
            if up_given.shape != (n, n_out):
                raise DeviceError(f"a gated GEMV's up values must be [{n}, {n_out}], got {tuple(up_given.shape)}")
        tokens, rows = (gemv_gated_shape(n, n_out) if shape is None
                        else forced_shape(shape, GEMV_GATED_SHAPES, n, "gated GEMV"))
        out = cp.empty((n, n_out), dtype=cp.float32) if out is None else out
        kernel = self._fn(gemv_gated_kernel_name(gate.fmt.name, tokens, rows, activation, up is not None))
        grid = (n_out + GEMV_WARPS * rows - 1) // (GEMV_WARPS * rows)
        kernel((grid,), (32 * GEMV_WARPS,),
               (gate.data, (gate if up is None else up).data, np.int64(gate.data.shape[1]), np.int32(n_out),
                np.int32(n_in), x, np.int32(n), self._unused_f32 if up_given is None else up_given, out))
        return out

    def dequantize(self, weight: Weight, rows=None, dtype: str = "float32", out=None):
        """float32 or float16 [n_rows, n_in]: all rows, or the rows of the int32 device array `rows`."""
        cp = self.cp
        n_in = weight.shape[-1]
        n_rows = weight.data.shape[0] if rows is None else int(rows.shape[0])
        if out is None:
            out = cp.empty((n_rows, n_in), dtype=dtype)
        if n_rows == 0:
            return out
        blocks = n_in // KERNEL_BLOCK_VALUES[weight.fmt.name]
        parts = n_rows * blocks * (16 if KERNEL_BLOCK_VALUES[weight.fmt.name] == 256 else 4)
        grid = grid_stride_blocks(parts, DEQUANT_THREADS)
        kernel = self._fn(dequant_kernel_name(weight.fmt.name, np.dtype(dtype).name))
        kernel((grid,), (DEQUANT_THREADS,),
               (weight.data, np.int64(weight.data.shape[1]), rows if rows is not None else self._unused_i32,
                np.int32(rows is not None), np.int32(n_rows), np.int32(n_in), out))
        return out

    def mma_matmul(self, weight: Weight, x16, bias=None, out=None):
        """y [n, n_out] float32 = f16(x) @ f16(W).T (+ bias) on the tensor cores, W dequantized per tile."""
        cp = self.cp
        n_out, n_in = weight.shape[0], weight.shape[-1]
        n = x16.shape[0]
        x16 = cp.ascontiguousarray(x16, dtype=cp.float16)
        if out is None:
            out = cp.empty((n, n_out), dtype=cp.float32)
        grid = ((n_out + MMA_ROWS - 1) // MMA_ROWS) * ((n + MMA_TOKENS - 1) // MMA_TOKENS)
        self._fn(mma_kernel_name(weight.fmt.name))(
            (grid,), (MMA_THREADS,),
            (weight.data, np.int64(weight.data.shape[1]), np.int32(n_out), np.int32(n_in), x16, np.int32(n),
             *self._bias_args(bias), out))
        return out
