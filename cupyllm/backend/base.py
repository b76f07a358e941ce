"""The contract every backend implements: the operations the model code calls (cupyllm/models/) and what the
engine (api.py, generate.py) asks of a device. backend/cpu.py and backend/gpu.py implement it;
tests/test_backend_contract.py checks both, name by name and parameter by parameter.

Each operation has one fixed signature and one result shape, fused or not: whether a backend runs an add and
a norm as one pass is its own choice, never the model's. `Array` is a NumPy array on the CPU and a CuPy array on
the GPU; every operation takes and returns the backend's own arrays (`asarray` / `to_numpy` cross over).
"""
from __future__ import annotations

from typing import Any, Callable, ContextManager, Protocol, Sequence, runtime_checkable

import numpy as np

Array = Any  # numpy.ndarray (CPUBackend) or cupy.ndarray (GPUBackend)


@runtime_checkable
class Backend(Protocol):
    name: str  # "cpu" or "gpu"
    xp: Any  # the array module: numpy or cupy
    can_mirror_kv: bool  # whether a float32 copy of the decoded KV cache may sit beside it (--kv-mirror)
    # From this many rows on, a matmul computes each row as it would among any other rows of that count or more
    # (None: no such count): several prompts then prefill in one forward with each one's own values.
    rows_independent_from: int | None

    # --- arrays, weights, memory -----------------------------------------------------------------
    def asarray(self, x, dtype=None) -> Array:
        """x as this backend's array."""

    def to_numpy(self, x: Array) -> np.ndarray:
        """x as a host NumPy array."""

    def upload(self, weight) -> Any:
        """A `models.weights.Weight` whose blocks live on this backend's device (the CPU: the same Weight)."""

    def memory_available(self) -> float:
        """Bytes free for a KV cache on this device."""

    def new_cache(self, cfg, spec) -> Any:
        """A `kv.cache.KVCache` for `cfg` as `spec` asks (KV types, context, spill), on this device."""

    def running_on(self, threads: int | None) -> ContextManager:
        """A context in which this backend's host work uses `threads` CPU threads (None: as it is)."""

    def decode_forward(self, forward: Callable) -> Callable:
        """`forward` (Transformer.forward's signature), sped up for one-token steps where the device can
        (the GPU replays them as CUDA graphs); the same results."""

    # --- linear algebra ------------------------------------------------------------------------
    def embed(self, weight, ids) -> Array:
        """The rows `ids` of an embedding table [n_vocab, d], float32 [len(ids), d]."""

    def linear(self, x: Array, weight, bias: Array | None = None) -> Array:
        """x @ weight.T (+ bias), weight kept in its GGUF blocks."""

    def linear_many(self, x: Array, weights: Sequence, biases: Sequence | None = None) -> list[Array]:
        """[linear(x, w, b) for w, b in zip(weights, biases)]: q, k and v from one input."""

    def linear_each(self, xs: Array, weights: Sequence, x_of) -> Array:
        """Rows [linear(xs[x_of[i]], w_i) for each weight w_i] (x_of: host ints; weights of one shape): a decode
        step's chosen experts, each reading its own row."""

    def linear_grouped(self, xs: Array, groups: Sequence[Sequence], bounds) -> list[Array]:
        """[W_j applied to each group's rows]: for group i its rows xs[bounds[i]:bounds[i + 1]] times each weight
        of groups[i] (a tuple of weights, as many in every group), the j-th weights' products stacked in the
        rows' order as the j-th array [len(xs), n_out_j] (bounds: host ints, ascending, bounds[0] = 0,
        bounds[-1] = len(xs)): a prefill's experts, each multiplying the tokens routed to it. Each row's values
        are linear_many's for the group's rows."""

    def gated_linear(self, x: Array, w_gate, activation: str, w_up=None, up: Array | None = None) -> Array:
        """act(x @ w_gate.T) * (x @ w_up.T), or * up when the up values are given (activation: silu | gelu_tanh)."""

    # --- elementwise ---------------------------------------------------------------------------
    def rms_norm(self, x: Array, weight: Array, eps: float) -> Array:
        """x / sqrt(mean(x^2) + eps) * weight over the last axis."""

    def rms_norm_residual(self, x: Array, residual: Array, weight: Array, eps: float) -> tuple[Array, Array]:
        """(h, rms_norm(h)) with h = x + residual: a pre-norm block's residual add and the next norm."""

    def add_rms_norm(self, residual: Array, x: Array, weight: Array, eps: float,
                     out_scale: Array | None = None) -> Array:
        """(residual + rms_norm(x)) * out_scale (when given): a sandwich block's post-norm and residual add."""

    def add_rms_norm_and_norm(self, residual: Array, x: Array, weight: Array, eps: float, next_weight: Array,
                              out_scale: Array | None = None) -> tuple[Array, Array]:
        """(h, rms_norm(h, next_weight)) with h = add_rms_norm(residual, x, weight, eps, out_scale)."""

    def gated_act(self, gate: Array, up: Array, activation: str) -> Array:
        """act(gate) * up (activation: silu | gelu_tanh)."""

    def softcap(self, x: Array, cap: float) -> Array:
        """cap * tanh(x / cap)."""

    def rope_qk(self, q: Array, k: Array | None, rope_cfg, q_positions, k_positions=None, q_norm=None,
                k_norm=None, eps: float = 0.0) -> tuple[Array, Array | None]:
        """(rope(rms_norm(q)), rope(rms_norm(k))): each norm only where its weight is given; k may be None (q
        alone), k_positions default to q's."""

    # --- attention -----------------------------------------------------------------------------
    def attention(self, q: Array, q_pos, layer_kv, *, scale: float, window: int = 0, softcap: float = 0.0) -> Array:
        """Causal (optionally sliding-window) attention of q [n, n_head, d] over everything `layer_kv` caches."""

    def dca_attention(self, q_intra: Array, q_successive: Array, q_inter: Array, q_pos, layer_kv, dca, *,
                      scale: float, softcap: float = 0.0) -> Array:
        """Dual Chunk Attention over `layer_kv` (keys cached at their in-chunk rope positions)."""

    # --- Gated DeltaNet (Qwen3.5's linear-attention layers; ops/deltanet/reference.py defines them) --------
    def causal_conv1d_silu(self, x: Array, weight: Array, conv_state: Array) -> Array:
        """silu(causal depthwise conv of x [T, C] with weight [C, K]), conv_state [K - 1, C] holding the inputs
        before x; conv_state advances in place to the last K - 1 inputs."""

    def gated_delta_rule(self, q: Array, k: Array, v: Array, g: Array, beta: Array, state: Array) -> Array:
        """The gated delta rule over T tokens: q, k [T, Hk, Dk] (L2-normalised here, q also by 1/sqrt(Dk)),
        v [T, Hv, Dv], log decay g and write strength beta [T, Hv]; value head h reads key head h % Hk
        (llama.cpp's tiled head order). state [Hv, Dk, Dv] float32 advances in place; returns o [T, Hv, Dv]."""

    def gated_rms_norm(self, x: Array, z: Array, weight: Array, eps: float) -> Array:
        """rms_norm(x, weight, eps) * silu(z) over the last axis."""


def contract_operations() -> list[str]:
    """The names of every method of the contract."""
    return [name for name, value in vars(Backend).items() if callable(value) and not name.startswith("_")]
