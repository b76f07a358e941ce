"""The GPU backend: CuPy arrays, our CUDA kernels (kernels_cu/), weights kept in their GGUF blocks on the
device, the KV cache encoded on the device.

Same operations and semantics as backend/cpu.py, so the model code (models/*.py) runs unchanged:
- linear: up to GEMV_MAX_TOKENS tokens, a GEMV that dequantizes the blocks in registers (weight_gemv.cu);
  more tokens (prefill), either cuBLAS on an f16 copy of the matrix dequantized on the fly
  (prefill="cublas", weight_dequant.cu + GemmEx) or our tensor-core kernel dequantizing tile by tile
  (prefill="mma", weight_mma.cu); prefill="auto" (the default) picks by matrix size (prefill_path). Both
  round W and x to f16 and accumulate in float32.
- embed: the token rows dequantized from their blocks (weight_dequant.cu with row ids).
- rms_norm, silu, gelu_tanh, rope, softcap: elementwise.cu (RoPE angles from ops/elementwise/reference.py's
  inverse_frequencies, computed in float64 on the device exactly like its rope_tables on the host).
- attention: cupyllm.ops.attention.gpu_dispatch.gpu_attention (FA-VEC / FA-MMA reading the quantized cache in-register);
  for caches it has no kernels for (e.g. head dims outside its list), or with attention="decode",
  ops/attention/gpu_decoded.py (decode the cache to f16, CuPy matmuls). dca_attention (Dual Chunk Attention):
  cupyllm.ops.attention.gpu_dca (the same kernels' DCA instantiations), with the same kind of fallback.
- the KV cache: new_cache() -> KVCache of DeviceLayerKV (kv/gpu_cache.py), written by kv_encode.cu.

Importing this module does not import CuPy; building a GPUBackend does (DeviceError without it).
"""
from __future__ import annotations

import contextlib

import numpy as np

from ..cuda.registry import KernelRegistry, require_cupy
from ..errors import CupyllmError, DeviceError
from ..kv.cache import KVCache, KVSpec, RecurrentState
from ..ops.matmul.reference import WEIGHT_FORMATS, dequantize
from ..ops.elementwise.reference import inverse_frequencies
from ..models.weights import Weight
from ..ops.attention.gpu_decoded import attend_decoded
from ..ops.attention.reference import merge
from ..ops.matmul.gpu_blas import matmul_f16_f32
from ..kv.gpu_cache import DeviceRecurrentState, device_layer_factory
from ..ops.deltanet.gpu import CONV_WIDTHS, KEY_HEAD_DIMS, DeltaNetKernels
from .gpu_inputs import DeviceInputs
from ..ops.elementwise.gpu import ElementwiseKernels
from ..ops.matmul.gpu import GEMV_GROUP, GEMV_MAX_TOKENS, WeightKernels, kernel_format_fits, mma_fits

PREFILL_PATHS = ("auto", "cublas", "mma")
DEFAULT_PREFILL = "auto"
# "auto": our tensor-core tiles for matrices below this many elements, cuBLAS on an f16 copy above. On an H200
# (bench/results/e2e_gpu.json "prefill_paths", 512-token prompt) the tiles won for Gemma 3 270M and
# Qwen2.5-0.5B (36.3k vs 25.4k and 30.0k vs 19.4k tok/s; matrices up to 4.4M elements), cuBLAS for the
# Qwen2.5-7B shape (9.1k vs 5.2k tok/s; its large matrices hold 12.8M-68M elements).
MMA_PREFILL_MAX_ELEMENTS = 8 << 20


def prefill_path(prefill: str, n_out: int, n_in: int) -> str:
    """"mma" or "cublas" for a prefill product with an [n_out, n_in] weight under the backend's setting."""
    if prefill != "auto":
        return prefill
    return "mma" if n_out * n_in < MMA_PREFILL_MAX_ELEMENTS else "cublas"


def _dispatch_attention():
    """The in-register flash attention (ops/attention/gpu_dispatch.py) and the error it raises for shapes it has no
    kernels for, or (None, None) when that module is absent."""
    try:
        from ..ops.attention.gpu_dispatch import AttentionArgumentError, gpu_attention
    except ImportError:
        return None, None
    return gpu_attention, AttentionArgumentError


class GPUBackend:
    name = "gpu"
    can_mirror_kv = False  # attention reads the encoded cache; there is no float copy
    rows_independent_from = None  # (cuBLAS and the tiled kernels pick their tiling by the row count)

    @staticmethod
    def running_on(threads: int | None):
        """(CPUBackend.running_on: the CPU thread count; the work here is the device's)"""
        return contextlib.nullcontext()

    def __init__(self, registry: KernelRegistry | None = None, prefill: str = DEFAULT_PREFILL,
                 attention: str = "auto"):
        if prefill not in PREFILL_PATHS:
            raise CupyllmError(f"prefill path must be one of {PREFILL_PATHS}, got {prefill!r}")
        if attention not in ("auto", "dispatch", "decode"):
            raise CupyllmError(f"attention must be 'auto', 'dispatch' or 'decode', got {attention!r}")
        self.cp = require_cupy()
        self.xp = self.cp
        self.registry = registry if registry is not None else KernelRegistry()
        self.kernels = WeightKernels(self.registry)
        self.elementwise = ElementwiseKernels(self.registry)
        self.inputs = DeviceInputs(self.cp)
        self.prefill = prefill
        self._attention_mode = attention
        self._gpu_attention, self._dispatch_refusal = (None, None) if attention == "decode" else _dispatch_attention()
        self._no_dispatch: dict[tuple, str] = {}  # cache shapes the flash kernels refused, with the reason
        if attention == "dispatch" and self._gpu_attention is None:
            raise DeviceError("attention='dispatch' needs cupyllm.ops.attention.gpu_dispatch.gpu_attention, which is "
                              "not installed")
        self._rope_tables: dict = {}
        self._deltanet = DeltaNetKernels(self.registry)
        self._uploads: dict[int, tuple] = {}  # id(host blocks) -> (host blocks, device Weight)

    # --- arrays -----------------------------------------------------------------------------------
    def asarray(self, x, dtype=None):
        return self.cp.asarray(x, dtype=dtype)

    def to_numpy(self, x) -> np.ndarray:
        return self.cp.asnumpy(x)

    def upload(self, weight: Weight) -> Weight:
        """GGUF blocks to the device once (a tied output head shares the embedding's copy). Rows our block
        kernels cannot read (float rows whose length is not a multiple of 32) are stored as F32 rows and
        multiplied by CuPy."""
        done = self._uploads.get(id(weight.data))
        if done is not None and done[0] is weight.data:
            return done[1]
        host = weight.data
        if not kernel_format_fits(weight.fmt.name, weight.shape[-1]):
            values = dequantize(np.asarray(weight.data), weight.fmt.qtype, weight.shape[-1]).astype(np.float32)
            f32 = next(f for f in WEIGHT_FORMATS.values() if f.name == "F32")
            weight = Weight(weight.name, f32, tuple(weight.shape), values.reshape(-1, weight.shape[-1]).view(np.uint8))
        on_device = self.kernels.upload(weight)
        self._uploads[id(host)] = (host, on_device)  # holding `host` keeps its id from being reused
        return on_device

    def memory_available(self) -> float:
        """Device memory free now (after the weights are uploaded), plus what CuPy's pool holds unused."""
        pool = self.cp.get_default_memory_pool()
        return float(self.cp.cuda.Device().mem_info[0] + pool.free_bytes())

    def new_cache(self, cfg, spec: KVSpec) -> KVCache:
        """A KV cache whose layers live on this device (encoded with kv_encode.cu)."""
        problem = deltanet_problem(cfg)
        if problem is not None:
            raise DeviceError(f"{problem}: load the model with device='cpu' (--device cpu)")
        if cfg.ssm is not None and spec.spilled:
            raise CupyllmError("kv_spill (--kv-spill) is not implemented for the Qwen3.5 hybrids on the GPU: drop "
                               "it (their linear-attention layers keep a fixed-size state; only the full-attention "
                               "layers have a KV cache)")
        from ..ops.kv_formats.formats import get_format
        from ..ops.kv_formats.gpu import GpuKVCodec

        def codec(fmt, head_dim, n_kv):
            return GpuKVCodec(fmt, head_dim, n_kv, registry=self.registry)

        cache = KVCache.for_model(cfg, spec, mirror=False, make_layer=device_layer_factory(codec, self.inputs))
        for il, layer in enumerate(cache.layers):  # linear-attention layers: their float32 states on the device
            if isinstance(layer, RecurrentState):
                cache.layers[il] = DeviceRecurrentState.from_host(layer, self.cp)
        if spec.spilled:  # global layers: the device ring of the window, older positions on the host
            from ..kv.gpu_spill import SpilledLayerKV
            spilled: dict[int, SpilledLayerKV] = {}
            for il, layer in enumerate(cache.layers):
                if not cfg.is_sliding(il):
                    if id(layer) not in spilled:
                        tail = None if not spec.has_tail else (  # the host part is the tail (kv/window.py)
                            get_format(spec.tail_type_k, head_dim=layer.head_dim),
                            get_format(spec.tail_type_v, head_dim=layer.v_head_dim))
                        spilled[id(layer)] = SpilledLayerKV(layer, host_capacity=spec.ctx - spec.device_window,
                                                            tail_formats=tail)
                    cache.layers[il] = spilled[id(layer)]
        return cache

    # --- linear algebra ---------------------------------------------------------------------------
    def linear(self, x, weight: Weight, bias=None):
        cp = self.cp
        n_in = weight.shape[-1]
        x2 = x.reshape(-1, n_in)
        n = x2.shape[0]
        if not kernel_format_fits(weight.fmt.name, n_in):  # dense float32 rows (see upload)
            y = cp.matmul(x2.astype(cp.float32), weight.data.view(cp.float32).T)
            return y + bias if bias is not None else y
        if n <= GEMV_MAX_TOKENS:
            return self.kernels.gemv(weight, x2, bias)
        x16 = x2.astype(cp.float16)
        if prefill_path(self.prefill, weight.shape[0], n_in) == "mma" and mma_fits(weight.fmt.name, n_in):
            return self.kernels.mma_matmul(weight, x16, bias)
        w16 = self.kernels.dequantize(weight, dtype="float16")
        y = matmul_f16_f32(cp, x16, w16)
        return y + bias if bias is not None else y

    def linear_each(self, xs, weights, x_of):
        """linear weight by weight, as the experts ran before this op (a grouped GPU launch is not written)."""
        return self.cp.stack([self.linear(xs[int(r):int(r) + 1], w)[0] for w, r in zip(weights, x_of)])

    def linear_grouped(self, xs, groups, bounds):
        """Group by group through linear_many (a grouped GPU launch is not written), the outputs stacked."""
        parts = [self.linear_many(xs[int(a):int(b)], weights) for weights, a, b in zip(groups, bounds, bounds[1:])]
        return [self.cp.concatenate([ys[j] for ys in parts]) for j in range(len(groups[0]))]

    def linear_many(self, x, weights, biases=None):
        """[linear(x, w, b) for w, b in zip(weights, biases)]; for a few tokens the matrices of one type and
        width share a GEMV launch (q / k / v, gate / up)."""
        biases = biases or (None,) * len(weights)
        n_in = weights[0].shape[-1]
        x2 = x.reshape(-1, n_in)
        if x2.shape[0] > GEMV_MAX_TOKENS:
            return [self.linear(x, w, b) for w, b in zip(weights, biases)]
        out: list = [None] * len(weights)
        groups: dict = {}
        for i, w in enumerate(weights):
            if kernel_format_fits(w.fmt.name, w.shape[-1]) and w.shape[-1] == n_in:
                groups.setdefault(w.fmt.name, []).append(i)
            else:
                out[i] = self.linear(x, w, biases[i])
        for members in groups.values():
            for start in range(0, len(members), GEMV_GROUP):
                chunk = members[start:start + GEMV_GROUP]
                ys = self.kernels.gemv_many([weights[i] for i in chunk], x2, [biases[i] for i in chunk])
                for i, y in zip(chunk, ys):
                    out[i] = y
        return out

    def embed(self, weight: Weight, ids):
        host = self.inputs.host_values(ids)
        n_vocab = weight.shape[0]
        if host is not None and len(host) and (int(np.min(host)) < 0 or int(np.max(host)) >= n_vocab):
            raise CupyllmError(f"token ids must be in [0, {n_vocab}), got {int(np.min(host))}..{int(np.max(host))}")
        rows = self.inputs.int32(ids)
        if not kernel_format_fits(weight.fmt.name, weight.shape[-1]):
            return weight.data.view(self.cp.float32)[rows]
        return self.kernels.dequantize(weight, rows=rows)

    # --- elementwise ------------------------------------------------------------------------------
    def rms_norm(self, x, weight, eps: float):
        return self.elementwise.rms_norm(x, weight, eps)

    def rms_norm_residual(self, x, residual, weight, eps: float):
        """(x + residual, rms_norm(x + residual)) in one pass."""
        return self.elementwise.rms_norm(x, weight, eps, residual=residual)

    def add_rms_norm(self, residual, x, weight, eps: float, out_scale=None):
        """(residual + rms_norm(x)) * out_scale (when given), in one pass."""
        return self.elementwise.rms_norm(x, weight, eps, residual=residual, add_after=True, out_scale=out_scale)

    def add_rms_norm_and_norm(self, residual, x, weight, eps: float, next_weight, out_scale=None):
        """(h, rms_norm(h, next_weight)) with h = add_rms_norm(residual, x, weight, eps, out_scale), in one pass."""
        return self.elementwise.rms_norm(x, weight, eps, residual=residual, add_after=True, next_weight=next_weight,
                                         out_scale=out_scale)

    def silu(self, x):
        return self.elementwise.act(x, "silu")

    def gelu_tanh(self, x):
        return self.elementwise.act(x, "gelu_tanh")

    def gated_act(self, gate, up, activation: str):
        """act(gate) * up in one pass (activation: silu | gelu_tanh)."""
        return self.elementwise.gated_act(gate, up, activation)

    def gated_linear(self, x, w_gate: Weight, activation: str, w_up: Weight | None = None, up=None):
        """act(x @ w_gate.T) * (x @ w_up.T), or * up: a gated MLP's hidden values; for a few tokens one GEMV
        launch computes both sums of each row and their product (the CPU backend's values: the same sums as
        apart, bit for bit)."""
        n_out, n_in = w_gate.shape
        x2 = x.reshape(-1, n_in)
        if (x2.shape[0] <= GEMV_MAX_TOKENS and kernel_format_fits(w_gate.fmt.name, n_in)
                and (w_up is None or (w_up.fmt.name == w_gate.fmt.name and w_up.shape == w_gate.shape))):
            return self.kernels.gemv_gated(w_gate, x2, activation, up=w_up,
                                           up_given=None if up is None else up.reshape(-1, n_out))
        gate, up = self.linear_many(x, (w_gate, w_up)) if w_up is not None else (self.linear(x, w_gate), up)
        return self.gated_act(gate, up, activation)

    def softcap(self, x, cap: float):
        return self.elementwise.softcap(x, cap)

    def rope(self, x, rope_cfg, positions):
        return self.rope_qk(x, None, rope_cfg, positions)[0]

    def rope_qk(self, q, k, rope_cfg, q_positions, k_positions=None, q_norm=None, k_norm=None, eps: float = 0.0):
        """(rope(rms_norm(q)), rope(rms_norm(k))) in one launch: each norm only where its weight is given, k
        may be None (q alone), k_positions default to q's."""
        table = self._rope_tables.get(rope_cfg)
        if table is None:  # ops/elementwise/reference.py's inverse frequencies, once per configuration
            inv_freq, mscale = inverse_frequencies(rope_cfg)
            table = self._rope_tables[rope_cfg] = (self.cp.asarray(np.asarray(inv_freq, np.float64)), float(mscale))
        inv_freq, mscale = table
        q_pos = self.inputs.int32(q_positions)
        k_pos = q_pos if k_positions is None else self.inputs.int32(k_positions)
        return self.elementwise.rope(q, k, q_pos, k_pos, inv_freq, mscale, rope_cfg.neox, rope_cfg.n_rot,
                                     q_norm=q_norm, k_norm=k_norm, eps=eps)

    # --- attention --------------------------------------------------------------------------------
    def attention(self, q, q_pos, layer_kv, *, scale: float, window: int = 0, softcap: float = 0.0):
        """Causal (optionally sliding-window) attention of q [n, n_head, d] over everything the layer caches."""
        return self._attend(q, q_pos, layer_kv, scale=scale, window=window, softcap=softcap)

    def dca_attention(self, q_intra, q_successive, q_inter, q_pos, layer_kv, dca, *, scale: float,
                      softcap: float = 0.0):
        """Dual Chunk Attention over the layer's cache (K cached at its in-chunk rope positions): the flash
        kernels' fused DCA instantiations (ops/attention/gpu_dca.py)."""
        return self._attend(q_intra, q_pos, layer_kv, scale=scale, softcap=softcap, dca=dca,
                            dca_queries=(q_successive, q_inter))

    # Gated DeltaNet: kernels_cu/deltanet/deltanet.cu through ops/deltanet/gpu.py, states in place
    def causal_conv1d_silu(self, x, weight, conv_state):
        return self._deltanet.conv1d_silu(x, weight, conv_state)

    def gated_delta_rule(self, q, k, v, g, beta, state):
        """(base.py) The kernel reads key head h // (Hv / Hk); the contract's value head h reads key head
        h % Hk, so the key heads are tiled to one per value head first, as the CPU backend does."""
        n_rep = v.shape[1] // q.shape[1]
        if n_rep > 1:
            q, k = self.cp.tile(q, (1, n_rep, 1)), self.cp.tile(k, (1, n_rep, 1))
        return self._deltanet.gated_delta_rule(q, k, v, g, beta, state)

    def gated_rms_norm(self, x, z, weight, eps: float):
        return self._deltanet.gated_rms_norm(x, z, weight, eps)

    def _attend(self, q, q_pos, layer_kv, **options):
        """The in-register flash kernels, or, for caches they have no kernels for (e.g. head dims outside their
        list) or with attention="decode", the decoding fallback (ops/attention/gpu_decoded.py)."""
        shape = (layer_kv.head_dim, layer_kv.v_head_dim, layer_kv.k_format.name, layer_kv.v_format.name)
        # Normalised K (gpu_cache.py): the flash kernels read (K - offset) / scale, so Q is scaled by `scale`; their
        # plain softmax does not see the offset, a soft-capped or DCA score would: those take the decoding path,
        # which undoes the normalisation.
        normalized = layer_kv.k_scale is not None
        offset_matters = normalized and (options.get("softcap", 0.0) > 0.0 or options.get("dca") is not None)
        if getattr(layer_kv, "windowed", False):  # mixed types by position (kv/window.py): each part, merged by LSE
            out = lse = None
            for part, window in layer_kv.parts():
                result = self._attend_lse(q, q_pos, part, offset_matters, **{**options, "window": window})
                out, lse = result if out is None else merge(out, lse, *result)
            return out.astype(q.dtype)
        if layer_kv.spilled:
            return self._attend_spilled(q, q_pos, layer_kv, normalized, offset_matters, **options)
        if self._gpu_attention is not None and shape not in self._no_dispatch and not offset_matters:
            try:
                q_read = q * layer_kv.query_scale(q.shape[1]) if normalized else q
                return self._gpu_attention(q_read, q_pos, layer_kv, **options)
            except self._dispatch_refusal as exc:  # checked before any launch
                if self._attention_mode == "dispatch":
                    raise
                self._no_dispatch[shape] = str(exc)
        return attend_decoded(q, self.inputs.int32(q_pos), layer_kv, **options)

    def _attend_lse(self, q, q_pos, layer_kv, offset_matters: bool, **options):
        """(O float32, LSE) of `_attend`'s kernels over one part of a windowed layer."""
        if self._gpu_attention is not None and not offset_matters and \
                (layer_kv.head_dim, layer_kv.v_head_dim, layer_kv.k_format.name, layer_kv.v_format.name) \
                not in self._no_dispatch:
            from ..ops.attention.gpu_dispatch import gpu_attention_lse
            q_read = q * layer_kv.query_scale(q.shape[1]) if layer_kv.k_scale is not None else q
            try:
                out, lse = gpu_attention_lse(q_read, q_pos, layer_kv, **options)
                return out.astype(self.cp.float32), lse
            except self._dispatch_refusal:  # checked before any launch
                if self._attention_mode == "dispatch":
                    raise
        return attend_decoded(q, self.inputs.int32(q_pos), layer_kv, with_lse=True, **options)

    def _attend_spilled(self, q, q_pos, layer_kv, normalized: bool, offset_matters: bool, **options):
        """Device window and host rows through the flash kernels, merged by LSE (kv/gpu_spill.py)."""
        if self._gpu_attention is None or offset_matters:
            why = ("the flash kernels are not available" if self._gpu_attention is None else
                   "normalised K with a soft-capped or DCA score needs the decoding path")
            raise CupyllmError(f"a spilled KV cache is read by the flash kernels only, and here {why}; drop "
                               "--kv-spill (kv_spill=) or pass --no-cache-normalize-k")
        from ..ops.attention.gpu_dispatch import gpu_attention_lse
        q_read = q * layer_kv.query_scale(q.shape[1]) if normalized else q
        return layer_kv.attention_lse(gpu_attention_lse, q_read, q_pos, **options)[0]

    # --- decode loop ------------------------------------------------------------------------------
    def decode_forward(self, forward, min_bucket: int = 256):
        """`forward` (Transformer.forward's signature) with one-token steps replayed as CUDA graphs."""
        from .gpu_graph import DecodeGraphs
        return DecodeGraphs(forward, self, min_bucket=min_bucket)


def deltanet_problem(cfg) -> str | None:
    """Why the GPU DeltaNet kernels cannot run `cfg`'s linear-attention layers, or None (also None for a model
    without them). Needs no device."""
    if cfg.ssm is None:
        return None
    s = cfg.ssm
    if s.k_head_dim not in KEY_HEAD_DIMS:
        return (f"the GPU Gated DeltaNet kernels take key head dims {KEY_HEAD_DIMS}, and this model's is "
                f"{s.k_head_dim}")
    if s.conv_kernel not in CONV_WIDTHS:
        return f"the GPU Gated DeltaNet kernels take conv widths {CONV_WIDTHS}, and this model's is {s.conv_kernel}"
    return None
