"""Shared fixtures: tiny random-weight GGUF models written by tests/support/make_tiny_models.py (with their HF twins)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))  # the tools some tests check (kv_quality, niah, device_model, ...)
sys.path.insert(0, str(ROOT / "tests" / "support"))  # make_tiny_models
sys.path.insert(0, str(ROOT / "tests"))

# CUPYLLM_EMULATE=1 runs the GPU tests on the CPU emulator (tests/support/cuda_emu/README.md): its NumPy-backed
# `cupy` must shadow a real CuPy before any test module imports one. Never active otherwise.
if os.environ.get("CUPYLLM_EMULATE") == "1":
    if "cupy" in sys.modules and not getattr(sys.modules["cupy"], "__cupyllm_emulated__", False):
        raise RuntimeError("CUPYLLM_EMULATE=1 but the real cupy was imported before tests/conftest.py")
    sys.path.insert(0, str(ROOT / "tests" / "support" / "cuda_emu" / "fakecupy"))

import make_tiny_models  # noqa: E402


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny_models")


@pytest.fixture(scope="session")
def tiny_model(tiny_dir):
    """tiny_model(arch) -> (path, TinySpec, decoded float32 tensors); each written once per session."""
    made = {}

    def make(arch: str):
        if arch not in made:
            spec = make_tiny_models.tiny_spec(arch)
            path = tiny_dir / f"tiny-{arch}.gguf"
            made[arch] = (path, spec, make_tiny_models.write_gguf(spec, path))
        return made[arch]

    return make


# A CUDA fault (illegal address, misaligned access, trap) is sticky: every later CUDA call in the process fails
# with it. Under pytest-xdist (tools/gpu_check.sh runs `-n`) the worker exits once the faulting test's report
# is sent, so xdist starts a fresh one and the remaining tests report their own result, not the fault.
_STICKY_CUDA_FAULTS = ("IllegalAddress", "ILLEGAL_ADDRESS", "Misaligned", "MISALIGNED", "LaunchFailure",
                       "LAUNCH_FAILED", "IllegalInstruction", "ILLEGAL_INSTRUCTION", "cudaErrorAssert", "CUDA_ERROR_ASSERT",
                       "HardwareStackError", "HARDWARE_STACK_ERROR", "cudaErrorLaunchTimeout")


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report):
    if not os.environ.get("PYTEST_XDIST_WORKER") or not report.failed:
        return
    text = report.longreprtext
    if any(fault in text for fault in _STICKY_CUDA_FAULTS) and "cuda" in text.lower():
        sys.stderr.write(f"sticky CUDA fault in {report.nodeid}: restarting this worker\n")
        os._exit(70)
