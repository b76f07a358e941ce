"""Dual Chunk Attention on the GPU: one fused flash-attention pass over a layer's cache.

``gpu_dca_attention_lse(q_intra, q_successive, q_inter, q_pos, layer_kv, dca, scale=, softcap=)`` -> (O, LSE)
computes exactly what ``cupyllm.ops.attention.dca.attend_dca`` defines over everything the layer caches (and
``cupyllm.ops.attention.cpu.dca_few`` on the CPU): key j is scored against query i with the rotation of
its regime ``min(chunk(pos_i) - chunk(pos_j), 2)`` (intra / successive / inter; chunk(p) = p // chunk_len,
true positions from ``layer_kv.slot_pos``), causal mask, logit scale ``scale * dca.logit_scale``, optional
softcap, and ONE softmax over all visible keys. The kernels are the DCA instantiations of FA-VEC / FA-MMA
(``fa_vec<D, 8, true>``, ``fa_mma<D, kDecode, true>``, kernels_cu/attention/fa_common.cuh): the three rotations are
prepared by one fa_prep_q launch (scaled, rotated for rotated K formats), the cache is read once in its
encoded format, split-KV results merge in fa_combine. A query row that sees no key gets O = 0, LSE = -inf.

Arguments as ``cupyllm.ops.attention.gpu_dispatch.gpu_attention_lse`` (the three q arrays alike: float32 or float16
[n_q, n_head, d] on the device), plus ``dca`` (DCAConfig). ``kernel`` / ``n_split`` override the automatic
choices (tests, benchmarks). Everything is launched asynchronously (CUDA-graph capturable).

``attend_dca_decoded`` is the fallback for caches the flash kernels have no instantiation for:
backend/gpu_attention.attend_decoded with dca= (the cache decoded chunk by chunk, the three score matrices
by CuPy matmuls, the regime picked per (query, key), one online softmax).
"""
from __future__ import annotations

from .dca import DCAConfig
from .gpu_dispatch import GpuAttention, gpu_attention_lse

KEY_CHUNK = 4096  # cache slots the fallback decodes at a time


def gpu_dca_attention_lse(q_intra, q_successive, q_inter, q_pos, layer_kv, dca: DCAConfig, *, scale: float,
                          softcap: float = 0.0, kernel: str | None = None, n_split: int | None = None,
                          runner: GpuAttention | None = None):
    """(O [n_q, n_head, d] in q's dtype, LSE float32 [n_q, n_head]); see the module docstring."""
    return gpu_attention_lse(q_intra, q_pos, layer_kv, scale=scale, softcap=softcap, kernel=kernel, n_split=n_split,
                             runner=runner, dca=dca, dca_queries=(q_successive, q_inter))


def gpu_dca_attention(q_intra, q_successive, q_inter, q_pos, layer_kv, dca: DCAConfig, *, scale: float,
                      softcap: float = 0.0, kernel: str | None = None, n_split: int | None = None,
                      runner: GpuAttention | None = None):
    """O of the fused DCA (gpu_dca_attention_lse without the LSE)."""
    return gpu_dca_attention_lse(q_intra, q_successive, q_inter, q_pos, layer_kv, dca, scale=scale, softcap=softcap,
                                 kernel=kernel, n_split=n_split, runner=runner)[0]


def attend_dca_decoded(q_intra, q_successive, q_inter, q_pos, layer_kv, dca: DCAConfig, *, scale: float,
                       softcap: float = 0.0, key_chunk: int = KEY_CHUNK):
    """out [n_q, n_head, dv] float32 by decoding the cache (f16) and CuPy matmuls; q_pos int32 on the device."""
    from .gpu_decoded import attend_decoded
    return attend_decoded(q_intra, q_pos, layer_kv, scale=scale, softcap=softcap, key_chunk=key_chunk, dca=dca,
                          dca_queries=(q_successive, q_inter))
