"""CI without a GPU: a subset of tests/test_gpu_backend.py on the CPU emulator (tests/support/cuda_emu), in a subprocess
with CUPYLLM_EMULATE=1 (the NumPy-backed `cupy` must be imported before anything imports a real one).

The subset runs every dense-model kernel file once: dequantization (Q6_K), every GEMV instantiation (Q4_K),
the tensor-core prefill kernel (Q5_0), RoPE with YaRN, and the whole tiny Qwen2 model against the CPU engine
(its GEMVs, both prefill paths, RMSNorm, activations, the device KV cache). About 2 minutes cold on 2 cores,
30 s with the emulator's build cache warm. The whole file: `CUPYLLM_EMULATE=1 python -m pytest
tests/test_gpu_backend.py` (about 3 minutes warm).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "support" / "cuda_emu"))

import emulator  # noqa: E402

_CXX_OK, _CXX_WHY = emulator.cxx20_support()
pytestmark = pytest.mark.skipif(not _CXX_OK, reason=f"the CUDA emulator needs a C++20 compiler: {_CXX_WHY}")

SUBSET = ("test_tiny_model_logits_match_the_cpu_engine and qwen2 or test_rope_variants and yarn "
          "or test_gemv_every_instantiation and Q4_K or test_dequantize_rows_bit_exact and Q6_K "
          "or test_mma_matmul and Q5_0")


def test_gpu_backend_subset_passes_on_the_emulator():
    env = {**os.environ, "CUPYLLM_EMULATE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_gpu_backend.py", "-k", SUBSET]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert re.search(r"\b5 passed", result.stdout), result.stdout[-2000:]


def test_spilled_cache_passes_on_the_emulator():
    """tests/test_gpu_spill.py (device window + pinned host tail, merged by LSE) on the CUDA emulator, and the
    spill benchmark's smoke run (the script itself; its timings mean nothing there)."""
    env = {**os.environ, "CUPYLLM_EMULATE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_gpu_spill.py"]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert re.search(r"\b8 passed", result.stdout), result.stdout[-2000:]
    bench = subprocess.run([sys.executable, "bench/spill_gpu.py", "--smoke", "--formats", "f16"], cwd=REPO,
                           env={**env, "PYTHONPATH": str(REPO / "tests" / "support" / "cuda_emu" / "fakecupy")},
                           capture_output=True, text=True, timeout=600)
    assert bench.returncode == 0 and "of whole-device" in bench.stdout, bench.stdout[-2000:] + bench.stderr[-2000:]


def test_backend_ops_sweep_passes_on_the_emulator():
    """tests/ops/test_backend_ops.py with the GPU backend on the CUDA emulator: every elementwise operation of the
    contract on both backends against the float64 reference."""
    env = {**os.environ, "CUPYLLM_EMULATE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/ops/test_backend_ops.py"]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert re.search(r"\b40 passed", result.stdout), result.stdout[-2000:]
