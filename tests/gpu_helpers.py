"""Helpers shared by the GPU test files (tests/ops/test_*_gpu.py, tests/test_gpu_backend.py)."""
from __future__ import annotations

import numpy as np
import pytest

from cupyllm.cuda import gpu_count

# every GPU test module: `pytestmark = GPU_TEST_MARKS` (selected by -m gpu; skipped without a device)
GPU_TEST_MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(gpu_count() == 0, reason="needs a CUDA device (cupy.cuda.runtime.getDeviceCount() is 0 or fails)"),
]

# flash-attention tolerances (test_attention_gpu, test_attention_dca_gpu)
VEC_TOL = 2e-5     # |dO| / max|V| for FA-VEC (f32 arithmetic on the exact decoded values); |dLSE| <= 10x
MMA_TOL_O = 2e-3   # |dO| / max|V| for MMA against the f16-rounded reference (P is rounded to f16)
MMA_TOL_LSE = 2e-4


def emulated() -> bool:
    """True when `cupy` is tests/support/cuda_emu's fake (CUPYLLM_EMULATE=1): smaller shapes, no stream capture."""
    import cupy
    return bool(getattr(cupy, "__cupyllm_emulated__", False))


def get_test_format(name: str, head_dim: int):
    """The engine's format; a TCQ format whose codebook file is absent falls back to the QTIP-style
    initial codebook (the kernels take the codebook as an argument, so parity does not depend on it)."""
    from cupyllm.ops.kv_formats import formats, tcq
    try:
        return formats.get_format(name, head_dim=head_dim)
    except formats.KVFormatError:
        if name not in tcq.TCQ_PARAMS:
            raise
        _, L = tcq.TCQ_PARAMS[name]
        return tcq.make_format(name, formats.group_values_for(head_dim), codebook=tcq.initial_codebook(L))


def rounded_f16(x, fmt):
    """Rows x (original domain) with their values in fmt's storage domain (rotated for the rotated formats)
    rounded to f16, back in the original domain: what fa_mma stages for K / V, and, for Q (scaled first),
    what fa_prep_q writes for it."""
    from cupyllm.ops.kv_formats.formats import is_rotated
    flat = x.astype(np.float32).reshape(-1, x.shape[-1])
    if is_rotated(fmt.name):
        return fmt.unrotate(fmt.rotate(flat).astype(np.float16).astype(np.float32)).reshape(x.shape)
    return flat.astype(np.float16).astype(np.float32).reshape(x.shape)


def rounded_f16_query(q, k_format, scale):
    """q * scale rounded to f16 in K's storage domain (fa_prep_q for fa_mma), back in the original domain."""
    return rounded_f16(q.astype(np.float32) * np.float32(scale), k_format)


def mma_lacks_shared_memory(runner, layer, n_q: int, n_head: int, head_dim: int) -> bool:
    """Whether fa_mma's tiles for this call need more shared memory than the device gives a block (an A100's
    163 KB: an f32 cache at head dim 512). The engine never asks for them (dispatch.choose_kernel sends f32 decode
    to fa_vec; checked here); an explicit kernel="mma" gets AttentionArgumentError, which the caller checks."""
    from cupyllm.ops.attention import gpu as fk
    from cupyllm.ops.attention.gpu_dispatch import choose_kernel
    n_kv = layer.k_data.shape[1]
    rows = n_q * (n_head // n_kv)
    need = fk.mma_launch_smem_bytes(head_dim, fk.mma_is_decode(rows), layer.k_format, layer.v_format,
                                    layer.k_data.shape[2], layer.v_data.shape[2])
    if runner.smem_optin is None or need <= runner.smem_optin:
        return False
    assert choose_kernel(n_q, n_head, n_kv, head_dim, layer.k_format.name, layer.v_format.name) == "vec", (
        f"the engine would pick fa_mma for K {layer.k_format.name} / V {layer.v_format.name} at head dim {head_dim}, "
        f"which needs {need} bytes of shared memory, more than the device's {runner.smem_optin}")
    return True


@pytest.fixture(scope="module")
def backend():
    """The GPU backend with the decoding attention path (the op tests call its kernels one by one)."""
    from cupyllm.backend.gpu import GPUBackend
    return GPUBackend(attention="decode")


@pytest.fixture(scope="module")
def cp():
    import cupy
    return cupy


def layer_pair(backend, kv_type: str, head_dim: int = 64, n_kv: int = 2, capacity: int = 40, ring: bool = False,
                window: int = 0, v_type: str | None = None, v_head_dim: int | None = None):
    from cupyllm.kv.gpu_cache import device_layer_factory
    from cupyllm.ops.kv_formats.gpu import GpuKVCodec
    from cupyllm.kv.cache import LayerKV
    from cupyllm.ops.kv_formats.formats import get_format
    v_head_dim = v_head_dim or head_dim
    fmt, v_fmt = get_format(kv_type, head_dim=head_dim), get_format(v_type or kv_type, head_dim=v_head_dim)
    make = device_layer_factory(lambda f, d, n: GpuKVCodec(f, d, n, registry=backend.registry), backend.inputs)
    args = (fmt, v_fmt, n_kv, head_dim, v_head_dim)
    options = dict(capacity=capacity, ring=ring, window=window)
    return LayerKV(*args, **options), make(*args, **options)
