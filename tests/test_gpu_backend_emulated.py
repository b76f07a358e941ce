"""CI without a GPU: the GPU op tests of tests/ops/ and a whole tiny model on the CPU emulator (tests/support/cuda_emu), in
a subprocess with CUPYLLM_EMULATE=1 (the NumPy-backed `cupy` must be imported before anything imports a real one).

Run whole: the weight kernels (tests/ops/test_matmul_gpu.py: dequantization, every GEMV instantiation, the gated
GEMV, the tensor-core prefill kernel, for every weight type), the elementwise kernels (test_elementwise_gpu.py) and the
Gated DeltaNet kernels (test_deltanet_gpu.py).
Of the KV and attention files (whose format sweeps tests/test_emulated_kernels.py runs): the device cache's bytes and
the backend's decoding attention path. Then the whole tiny Qwen2 model against the CPU engine. About 2.5 minutes
on 2 cores with the emulator's build cache warm.
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

OP_FILES = ["tests/ops/test_matmul_gpu.py", "tests/ops/test_elementwise_gpu.py", "tests/ops/test_kv_formats_gpu.py",
            "tests/ops/test_attention_gpu.py", "tests/test_gpu_backend.py", "tests/ops/test_deltanet_gpu.py"]
SUBSET = ("test_matmul_gpu or test_elementwise_gpu or test_deltanet_gpu or test_device_cache_holds_the_cpu_cache_bytes "
          "or test_decode_attention_matches_reference or test_normalized_cache_attention "
          "or test_tiny_model_logits_match_the_cpu_engine and qwen2")


def test_gpu_ops_and_a_tiny_model_pass_on_the_emulator():
    env = {**os.environ, "CUPYLLM_EMULATE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *OP_FILES, "-k", SUBSET]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert re.search(r"\b81 passed", result.stdout), result.stdout[-2000:]


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
