"""The CPU backend: NumPy for the elementwise ops, numba block kernels for the quantized matmuls, and the
reference attention streamed over the cache in chunks (memory stays O(chunk), never O(n^2))."""
from __future__ import annotations

import contextlib
import time

import numpy as np
from gguf import GGMLQuantizationType as T
from threadpoolctl import ThreadpoolController
from tqdm.auto import tqdm

from ..ops.attention.cpu import MAX_QUERIES, attend_block, attend_encoded, attend_few, dca_few
from ..ops.attention.dca import attend_dca
from ..ops.attention.reference import causal_mask, merge, nothing_seen
from ..kv.cache import KVCache, LayerKV, host_bytes_available
from . import compile_notice, precompile
from .cpu_memory import keep_freed_memory, release_mapped_pages
from ..ops.elementwise.cpu import gelu_tanh_times, rms_norm_rows, rope_rows, silu_times
from ..ops.deltanet.cpu import conv1d_silu_rows, gated_delta_tokens, gated_rms_norm_rows
from .cpu_threads import RowThreads
from ..errors import CupyllmError
from ..ops.matmul.cpu import TOKENS_PER_GEMV, TOKENS_PER_X16_GEMV, matmul, matmul_each, matmul_grouped, matmul_many
from ..ops.matmul.cpu_gemv import dequantize_ids
from ..ops.matmul.cpu_interleaved import interleave_rows, interleaved_layout
from ..ops.elementwise.reference import apply_rope, rope_tables, softcap
from ..models.weights import Weight

NARROW_F32_ROWS = 1024  # float32 weights this narrow run BLAS on one thread in a prefill too (cheap there)
# a model's first forward interleaves its weights' rows (about 1.5 GB/s on 2 cores from the page cache, the
# disk's pace before): a bar shows it where it takes longer than this, not for the small ones
INTERLEAVE_BAR_DELAY_S = 1.0
INTERLEAVE_CHUNK_BYTES = 32 << 20  # a weight is interleaved this much at a time, each part's GGUF pages then released

KEY_CHUNK = 4096  # cache slots decoded and scored at a time


class CPUBackend:
    name = "cpu"
    xp = np
    can_mirror_kv = True  # on request (--kv-mirror) a float32 copy of the decoded cache beside the encoded rows
    # past TOKENS_PER_X16_GEMV rows (TOKENS_PER_GEMV where rows are not interleaved) every quantized matmul is the
    # GEMM, whose rows do not depend on one another (tested); a forward of several sequences multiplies float32
    # weights sequence by sequence (models/batch.py)
    rows_independent_from = TOKENS_PER_X16_GEMV + 1

    def __init__(self, threads: int | None = None):
        self._rope_tables = {}
        self._threads = RowThreads(threads)
        self._blas = None  # threadpoolctl's handle on BLAS, found on the first float32 decode matmul
        self._x16: dict[int, tuple] = {}  # id(weight blocks) -> (blocks, their rows interleaved or None)
        self._x16_bar = None  # the bar of the interleaving under way (the first forward's) once it is slow
        self._x16_run = None  # (seconds spent, bytes done) of the interleaving under way, or None
        self._x16_clock = 0.0  # when the interleaving's last chunk (or weight) began
        precompile.ensure_compiled()  # once per machine: every kernel into numba's cache, with a progress bar
        compile_notice.install()  # a kernel that compiles all the same (types the precompile missed) says so
        keep_freed_memory()  # a prefill's arrays reuse freed memory instead of page-faulting in new (cpu_memory.py)

    def running_on(self, threads: int | None):
        """A context in which the numba kernels and BLAS use `threads` threads (None: as they are); numba's
        setting is per calling thread, so each forward pass takes it anew."""
        return self._threads.limited(threads)

    def asarray(self, x, dtype=None):
        return np.asarray(x, dtype=dtype)

    def to_numpy(self, x) -> np.ndarray:
        return np.asarray(x)

    @staticmethod
    def memory_available() -> float:
        """Host memory free for a KV cache (MemAvailable)."""
        return host_bytes_available()

    @staticmethod
    def new_cache(cfg, spec) -> KVCache:
        """A host cache of the KV format's bytes: decode steps read the encoded rows (ops/attention/cpu.py) and
        prefill decodes them chunk by chunk; with spec.float_mirror, also a float32 copy of them."""
        if spec.spilled:
            raise CupyllmError("spilling the KV cache to host memory is for the GPU backend; on the CPU the whole "
                               "cache is in host memory already (drop --kv-spill / kv_spill=)")
        return KVCache.for_model(cfg, spec, mirror=bool(spec.float_mirror))

    @staticmethod
    def decode_forward(forward):
        return forward  # no graph capture on the CPU

    def upload(self, weight: Weight) -> Weight:
        return weight  # weights stay memory-mapped in their GGUF blocks

    # --- linear algebra ---------------------------------------------------------------------------
    def _one_blas_thread_for(self, x: np.ndarray, weights):
        """BLAS on one thread for a prefill's narrow float32 weights (a router, DeltaNet's alpha / beta: up to
        NARROW_F32_ROWS rows; a decode step's go through the GEMV): woken, its workers spin on after the call and
        take the cores from numba's GEMMs (measured: a Qwen3.5-0.8B prefill took twice as long beside its
        [16, 1024] alpha / beta on two BLAS threads; a Qwen3.6-35B-A3B decode's [256, 2048] router on BLAS made
        the expert GEMVs after it x4 slower)."""
        f32 = [w for w in weights if w.fmt.qtype == T.F32]
        if not f32 or x.shape[0] <= TOKENS_PER_GEMV or any(w.shape[0] > NARROW_F32_ROWS for w in f32):
            return contextlib.nullcontext()
        if self._blas is None:  # (finding the loaded BLAS libraries takes milliseconds: once)
            self._blas = ThreadpoolController()
        return self._blas.limit(limits=1, user_api="blas")

    def _interleaved(self, weight: Weight) -> tuple | None:
        """The weight's rows interleaved ((array, layout): ops/matmul/cpu_interleaved.py; the GEMV reads a batched
        decode's several tokens at the memory's pace, the GEMM as fast as the GGUF's rows or faster), made on the
        weight's first matmul, so that an embedding table that is only looked up (Gemma 4's per-layer one) is
        never copied; then the GGUF's pages of it leave this process's memory (the matmuls read the copy, a
        lookup of a tied embedding faults its few rows back in). None where the rows do not interleave, or where
        host memory has less than four times the copy's bytes free (the matmuls then read the GGUF's)."""
        data = weight.data
        known = self._x16.get(id(data))
        if known is None or known[0] is not data:
            layout, x16 = interleaved_layout(data, weight.fmt.name), None
            if layout is not None and 4 * data.nbytes <= host_bytes_available():
                self._x16_clock = time.monotonic()
                x16 = (interleave_rows(data, layout, INTERLEAVE_CHUNK_BYTES, self._interleaved_chunk), layout)
            known = self._x16[id(data)] = (data, x16)  # (holding `data` keeps its id from being reused)
        return known[1]

    def _interleaved_chunk(self, rows: np.ndarray) -> None:
        """Rows copied: their GGUF pages released; counted, and once the interleaving has taken
        INTERLEAVE_BAR_DELAY_S (its own time, not the forward's between weights), a bar of the bytes done (made
        only then: an open tqdm bar, even one not shown yet, moves the bars that start after it)."""
        release_mapped_pages(rows)
        now = time.monotonic()
        spent, done = self._x16_run or (0.0, 0)
        spent += now - self._x16_clock
        self._x16_run, self._x16_clock = (spent, done + rows.nbytes), now
        if self._x16_bar is None and spent > INTERLEAVE_BAR_DELAY_S:
            self._x16_bar = tqdm(desc="cupyllm: interleaving the weights' rows (once)", unit="B",
                                 unit_scale=True, initial=done, leave=False)
        if self._x16_bar is not None:
            self._x16_bar.update(rows.nbytes)

    def _interleaved_rows(self, weights) -> list:
        """Each weight's interleaved rows (or None). A call that finds every weight known closes the
        interleaving's bar (the first forward is over)."""
        if self._x16_run is not None and all(self._x16.get(id(w.data), (None,))[0] is w.data for w in weights):
            if self._x16_bar is not None:
                self._x16_bar.close()
            self._x16_bar = self._x16_run = None
        return [self._interleaved(w) for w in weights]

    def linear(self, x: np.ndarray, weight: Weight, bias: np.ndarray | None = None) -> np.ndarray:
        with self._one_blas_thread_for(x, (weight,)):
            y = matmul(x, weight.data, weight.fmt, weight.shape[-1], self._interleaved_rows((weight,))[0])
        if bias is not None:
            y += bias
        return y

    def linear_many(self, x: np.ndarray, weights, biases=None) -> list[np.ndarray]:
        """[linear(x, w, b) for w, b in zip(weights, biases)]; for a decode step one parallel GEMV for all."""
        n_in = weights[0].shape[-1]
        with self._one_blas_thread_for(x, weights):
            ys = matmul_many(x, [(w.data, w.fmt) for w in weights], n_in, self._interleaved_rows(weights))
        for y, bias in zip(ys, biases or ()):
            if bias is not None:
                y += bias
        return ys

    def linear_each(self, xs: np.ndarray, weights, x_of) -> np.ndarray:
        """[linear(xs[x_of[i]], w_i) for each i] as rows [len(weights), n_out]: one parallel GEMV for all."""
        return np.stack(matmul_each(xs, [(w.data, w.fmt) for w in weights], x_of, weights[0].shape[-1]))

    def linear_grouped(self, xs: np.ndarray, groups, bounds) -> list[np.ndarray]:
        """Each group's rows through its weights (matmul_grouped), the outputs stacked in the rows' order."""
        with self._one_blas_thread_for(xs, groups[0]):
            return matmul_grouped(xs, [[(w.data, w.fmt) for w in weights] for weights in groups], bounds,
                                  groups[0][0].shape[-1])

    def embed(self, weight: Weight, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        n_vocab = weight.shape[0]
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= n_vocab):
            raise CupyllmError(f"token ids must be in [0, {n_vocab}), got {int(ids.min())}..{int(ids.max())}")
        return dequantize_ids(weight.data, weight.fmt, weight.shape[-1], ids)  # just the rows asked for

    # --- elementwise ------------------------------------------------------------------------------
    @staticmethod
    def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        rows = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, weight.shape[-1])
        out = np.empty_like(rows)
        rms_norm_rows(rows, weight, np.float32(eps), out)
        return out.reshape(x.shape)

    def rms_norm_residual(self, x: np.ndarray, residual: np.ndarray, weight: np.ndarray, eps: float):
        """(x + residual, rms_norm(x + residual)): a pre-norm block's residual add and the next norm."""
        total = x + residual
        return total, self.rms_norm(total, weight, eps)

    def add_rms_norm(self, residual: np.ndarray, x: np.ndarray, weight: np.ndarray, eps: float,
                     out_scale: np.ndarray | None = None) -> np.ndarray:
        """(residual + rms_norm(x)) * out_scale (when given): a sandwich block's post-norm and residual add."""
        total = residual + self.rms_norm(x, weight, eps)
        return total if out_scale is None else total * out_scale

    def add_rms_norm_and_norm(self, residual: np.ndarray, x: np.ndarray, weight: np.ndarray, eps: float,
                              next_weight: np.ndarray, out_scale: np.ndarray | None = None):
        """(h, rms_norm(h, next_weight)) with h = add_rms_norm(residual, x, weight, eps, out_scale)."""
        total = self.add_rms_norm(residual, x, weight, eps, out_scale)
        return total, self.rms_norm(total, next_weight, eps)

    def gated_act(self, gate: np.ndarray, up: np.ndarray, activation: str) -> np.ndarray:
        """act(gate) * up (activation: silu | gelu_tanh), row blocks on the threads."""
        return self._threads.rows(silu_times if activation == "silu" else gelu_tanh_times, gate, up)

    def gated_linear(self, x: np.ndarray, w_gate: Weight, activation: str, w_up: Weight | None = None,
                     up: np.ndarray | None = None) -> np.ndarray:
        """act(x @ w_gate.T) * (x @ w_up.T), or * up: a gated MLP's hidden values."""
        gate, up = self.linear_many(x, (w_gate, w_up)) if w_up is not None else (self.linear(x, w_gate), up)
        return self.gated_act(gate, up, activation)

    @staticmethod
    def softcap(x: np.ndarray, cap: float) -> np.ndarray:
        """cap * tanh(x / cap)."""
        return softcap(x, cap)

    def rope(self, x: np.ndarray, rope_cfg, positions: np.ndarray) -> np.ndarray:
        key = (rope_cfg, np.asarray(positions).tobytes())
        table = self._rope_tables.get(key)
        if table is None:  # the layers of a step share positions: build each table once per step
            if len(self._rope_tables) >= 8:
                self._rope_tables.clear()
            table = self._rope_tables[key] = rope_tables(rope_cfg, positions)
        if x.dtype != np.float32 or x.ndim != 3:
            return apply_rope(x, *table, rope_cfg.neox)
        out = np.empty_like(x)
        rope_rows(np.ascontiguousarray(x), *table, rope_cfg.neox, out)  # apply_rope's values, one call
        return out

    def rope_qk(self, q, k, rope_cfg, q_positions, k_positions=None, q_norm=None, k_norm=None, eps: float = 0.0):
        """(rope(rms_norm(q)), rope(rms_norm(k))): each norm only where its weight is given, k may be None
        (q alone), k_positions default to q's. The GPU runs it as one launch."""
        if q_norm is not None:
            q = self.rms_norm(q, q_norm, eps)
        q = self.rope(q, rope_cfg, q_positions)
        if k is None:
            return q, None
        if k_norm is not None:
            k = self.rms_norm(k, k_norm, eps)
        return q, self.rope(k, rope_cfg, q_positions if k_positions is None else k_positions)

    # --- attention --------------------------------------------------------------------------------
    def attention(self, q: np.ndarray, q_pos: np.ndarray, layer_kv: LayerKV, *, scale: float, window: int = 0,
                  softcap: float = 0.0) -> np.ndarray:
        """Causal (optionally sliding-window) attention of q [n, n_head, d] over everything the layer caches."""
        return _over_parts(layer_kv, window, lambda part, part_window: self._attention_lse(
            q, q_pos, part, scale=scale, window=part_window, softcap=softcap))

    def _attention_lse(self, q, q_pos, layer_kv: LayerKV, *, scale: float, window: int, softcap: float):
        if q.shape[0] <= MAX_QUERIES:  # decode: one numba pass over the float32 mirror, or the encoded rows
            if not layer_kv.mirror:
                return attend_encoded(q, q_pos, layer_kv, scale=scale, window=window, softcap=softcap)
            k, v, k_pos = layer_kv.decode(0, layer_kv.n_used)
            return attend_few(q, k, v, q_pos, k_pos, scale=scale, window=window, softcap=softcap)

        def block(start, stop, k, v, k_pos):
            allowed = causal_mask(q_pos[start:stop], k_pos, window)
            if not allowed.any():
                return nothing_seen(stop - start, q.shape[1], layer_kv.v_head_dim)
            return attend_block(q[start:stop], k, v, allowed, scale=scale, softcap=softcap)
        return self._stream_keys(q.shape[0], layer_kv, block)

    def dca_attention(self, q_intra, q_successive, q_inter, q_pos: np.ndarray, layer_kv: LayerKV, dca, *,
                      scale: float, softcap: float = 0.0) -> np.ndarray:
        """Dual Chunk Attention over the layer's cache (keys cached at their in-chunk rope positions)."""
        return _over_parts(layer_kv, 0, lambda part, part_window: self._dca_attention_lse(
            q_intra, q_successive, q_inter, q_pos, part, dca, scale=scale, softcap=softcap, window=part_window))

    def _dca_attention_lse(self, q_intra, q_successive, q_inter, q_pos, layer_kv, dca, *, scale, softcap, window):
        if q_intra.shape[0] <= MAX_QUERIES and not layer_kv.mirror:
            return attend_encoded(np.stack([q_intra, q_successive, q_inter]), q_pos, layer_kv, window=window,
                                  scale=scale * dca.logit_scale, softcap=softcap, chunk_len=dca.chunk_len)
        if q_intra.shape[0] <= MAX_QUERIES and window == 0:
            k, v, k_pos = layer_kv.decode(0, layer_kv.n_used)
            return dca_few(q_intra, q_successive, q_inter, k, v, q_pos, k_pos, dca, scale=scale, softcap=softcap)

        def block(start, stop, k, v, k_pos):
            return attend_dca(q_intra[start:stop], q_successive[start:stop], q_inter[start:stop], k, v,
                              q_pos[start:stop], k_pos, dca, scale=scale, softcap=softcap, window=window)
        return self._stream_keys(q_intra.shape[0], layer_kv, block)

    # --- Gated DeltaNet ----------------------------------------------------------------------------
    @staticmethod
    def causal_conv1d_silu(x: np.ndarray, weight: np.ndarray, conv_state: np.ndarray) -> np.ndarray:
        """silu(causal depthwise conv of x [T, C] with weight [C, K]) over conv_state, advanced in place."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        return conv1d_silu_rows(x, weight, conv_state, np.empty_like(x))

    @staticmethod
    def gated_delta_rule(q, k, v, g, beta, state: np.ndarray) -> np.ndarray:
        """The gated delta rule over T tokens (value head h reads key head h % Hk), state advanced in place."""
        n_rep = v.shape[1] // q.shape[1]
        if n_rep > 1:  # the kernel reads key head h // n_rep: tile the key heads to llama.cpp's order instead
            q, k = np.tile(q, (1, n_rep, 1)), np.tile(k, (1, n_rep, 1))
        f32 = (np.ascontiguousarray(a, dtype=np.float32) for a in (q, k, v, g, beta))
        out = np.empty(v.shape, np.float32)
        gated_delta_tokens(*f32, state, out)
        return out

    @staticmethod
    def gated_rms_norm(x: np.ndarray, z: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        """rms_norm(x, weight, eps) * silu(z) over the last axis."""
        rows = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, weight.shape[-1])
        out = np.empty_like(rows)
        gated_rms_norm_rows(rows, np.ascontiguousarray(z, dtype=np.float32).reshape(rows.shape), weight,
                            np.float32(eps), out)
        return out.reshape(x.shape)

    def _stream_keys(self, n_rows: int, layer_kv: LayerKV, attend_block) -> tuple[np.ndarray, np.ndarray]:
        """The attention (O, LSE) of n_rows queries over the layer's cache, KEY_CHUNK slots at a time: each chunk
        decoded once (without the float32 mirror, the costly part), its query rows attended on the threads by
        attend_block(start, stop, k, v, k_pos) -> (O, LSE), the chunks merged by LSE. Memory: one chunk, never
        the O(n^2) scores."""
        out = lse = None
        for k, v, k_pos in layer_kv.chunks(KEY_CHUNK):
            parts = self._threads.map_rows(lambda start, stop: attend_block(start, stop, k, v, k_pos), n_rows)
            part = tuple(np.concatenate(halves) for halves in zip(*parts))
            out, lse = part if out is None else merge(out, lse, *part)
        return out, lse


def _over_parts(layer_kv, window: int, attend_lse) -> np.ndarray:
    """O of attend_lse(part, window) over a layer cache: one call, or for a mixed-type cache (kv/window.py) one
    per part with its mask, merged by LSE."""
    if not getattr(layer_kv, "windowed", False):
        return attend_lse(layer_kv, window)[0]
    out = lse = None
    for part, part_window in layer_kv.parts():
        result = attend_lse(part, part_window)
        out, lse = result if out is None else merge(out, lse, *result)
    return out
