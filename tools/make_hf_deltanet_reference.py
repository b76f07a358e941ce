"""HF transformers' outputs of the Gated DeltaNet pieces (transformers/models/qwen3_next/modeling_qwen3_next.py,
the same functions as qwen3_5's) for seeded random inputs, stored so the test suite needs neither torch nor
transformers.

    pip install -e ".[reference]"
    python tools/make_hf_deltanet_reference.py      # writes tests/data/hf_reference_deltanet.npz

Stored, token-major as cupyllm/ops/deltanet/reference.py takes them (HF's [batch, channels, T] conv layout and
[batch, heads, ...] states without the batch axis): the inputs, then HF's float32 outputs of
- `torch_chunk_gated_delta_rule` (chunk 64, a length not a multiple of it, an initial state, q / k L2 norm, two
  value heads per key head) and `torch_recurrent_gated_delta_rule` on a shorter prompt, both with their final
  states, and the model's gate formulas (g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b));
- `causal_conv1d_fn` (a prompt from an empty state) and `causal_conv1d_update` (one token, HF's K-column state);
- `Qwen3NextRMSNormGated`.
tests/ops/test_deltanet.py (`test_stored_reference_is_what_transformers_computes`) recomputes it where torch is
installed.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "hf_reference_deltanet.npz"
SEED = 32
N_K_HEADS, N_V_HEADS, K_DIM, V_DIM, CONV_WIDTH = 2, 4, 32, 32, 4  # V_DIM: a multiple of the CPU tile, 16
CHUNK_TOKENS, RECURRENT_TOKENS, CONV_TOKENS = 150, 37, 9


def make_inputs(seed: int = SEED) -> dict[str, np.ndarray]:
    """Seeded float32 inputs at a small GQA shape; a, b, A_log, dt_bias give realistic gates."""
    rng = np.random.default_rng(seed)
    f32 = np.float32

    def normal(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(f32)
    channels = 2 * N_K_HEADS * K_DIM + N_V_HEADS * V_DIM
    inputs = {}
    for name, n in (("chunk", CHUNK_TOKENS), ("recurrent", RECURRENT_TOKENS)):
        inputs[f"{name}_q"] = normal(n, N_K_HEADS, K_DIM)
        inputs[f"{name}_k"] = normal(n, N_K_HEADS, K_DIM)
        inputs[f"{name}_v"] = normal(n, N_V_HEADS, V_DIM)
        inputs[f"{name}_a"] = normal(n, N_V_HEADS)
        inputs[f"{name}_b"] = normal(n, N_V_HEADS)
        inputs[f"{name}_state"] = normal(N_V_HEADS, K_DIM, V_DIM, scale=0.5)
    inputs["a_log"] = np.log(rng.uniform(0.5, 16, N_V_HEADS)).astype(f32)
    inputs["dt_bias"] = normal(N_V_HEADS)
    inputs["conv_x"] = normal(CONV_TOKENS, channels)
    inputs["conv_weight"] = normal(channels, CONV_WIDTH, scale=0.5)
    inputs["conv_token"] = normal(1, channels)
    inputs["conv_hf_state"] = normal(channels, CONV_WIDTH)  # HF keeps K columns; the oldest is never read
    inputs["norm_x"] = normal(CONV_TOKENS, N_V_HEADS, V_DIM)
    inputs["norm_z"] = normal(CONV_TOKENS, N_V_HEADS, V_DIM)
    inputs["norm_weight"] = (1.0 + normal(V_DIM, scale=0.1)).astype(f32)
    return inputs


def hf_outputs(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """transformers' float32 outputs for `inputs` (torch's CPU build)."""
    import torch
    import torch.nn.functional as F
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    def t(name):
        return torch.from_numpy(np.ascontiguousarray(inputs[name]))

    def np32(x):
        return x.detach().numpy().astype(np.float32)
    out = {}
    a_log, dt_bias = t("a_log"), t("dt_bias")
    with torch.no_grad():
        for name, rule in (("chunk", hf.torch_chunk_gated_delta_rule),
                           ("recurrent", hf.torch_recurrent_gated_delta_rule)):
            g = -a_log.float().exp() * F.softplus(t(f"{name}_a").float() + dt_bias)  # Qwen3NextGatedDeltaNet
            beta = t(f"{name}_b").sigmoid()
            o, state = rule(t(f"{name}_q")[None], t(f"{name}_k")[None], t(f"{name}_v")[None], g=g[None],
                            beta=beta[None], initial_state=t(f"{name}_state")[None], output_final_state=True,
                            use_qk_l2norm_in_kernel=True)
            out[f"{name}_g"], out[f"{name}_beta"] = np32(g), np32(beta)
            out[f"{name}_out"], out[f"{name}_final_state"] = np32(o[0]), np32(state[0])
        weight = t("conv_weight")
        x = t("conv_x").T[None].contiguous()  # [1, C, T]
        out["conv_prefill_out"] = np32(hf.causal_conv1d_fn(x, weight, None, activation="silu")[0].T)
        hf_state = t("conv_hf_state")[None].clone()
        y = hf.causal_conv1d_update(t("conv_token").T[None].contiguous(), hf_state, weight, None, activation="silu")
        out["conv_update_out"] = np32(y[0].T)
        out["conv_update_hf_state"] = np32(hf_state[0])
        norm = hf.Qwen3NextRMSNormGated(V_DIM, eps=1e-6)
        norm.weight.copy_(t("norm_weight"))
        out["norm_out"] = np32(norm(t("norm_x").reshape(-1, V_DIM), t("norm_z").reshape(-1, V_DIM))
                               .reshape(inputs["norm_x"].shape))
    return out


def compute() -> dict[str, np.ndarray]:
    import transformers
    inputs = make_inputs()
    return {**inputs, **hf_outputs(inputs), "transformers_version": np.array(transformers.__version__)}


def main() -> None:
    arrays = compute()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT, **arrays)
    print(f"wrote {OUT} ({OUT.stat().st_size / 1024:.0f} KiB, transformers {arrays['transformers_version']})")


if __name__ == "__main__":
    main()
