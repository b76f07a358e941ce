"""CI without a GPU: the GPU benchmarks tools/gpu_check.sh runs on the device, run tiny on the CUDA emulator, so a
script that would crash (an API it calls changed, an argument it passes) fails here and not in the device's
few minutes. Their timings mean nothing here; what is checked is that each runs to its end and writes the JSON
it writes on the device, every row measured (no recorded error). tools/profile_decode_gpu.py is left out: it is
torch.profiler over CUDA, which the emulator does not have (the decode path it times runs in
tests/test_gpu_backend.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "support" / "cuda_emu"))

import emulator  # noqa: E402

_CXX_OK, _CXX_WHY = emulator.cxx20_support()
pytestmark = pytest.mark.skipif(not _CXX_OK, reason=f"the CUDA emulator needs a C++20 compiler: {_CXX_WHY}")


def _run(args: list[str], results: Path) -> str:
    env = {**os.environ, "CUPYLLM_EMULATE": "1", "CUPYLLM_BENCH_RESULTS": str(results),
           "PYTHONPATH": str(REPO / "tests" / "support" / "cuda_emu" / "fakecupy")}
    env.pop("OUT", None)
    result = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"{' '.join(args)}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result.stdout


def _rows(path: Path, key: str = "results") -> list[dict]:
    rows = json.loads(path.read_text())[key]
    assert rows, f"{path.name}: no rows"
    errors = [r for r in rows if "error" in json.dumps(r) or "skipped" in r]
    assert not errors, f"{path.name}: {errors[:2]}"
    return rows


def test_attention_and_dca_benchmarks(tmp_path):
    _run(["bench/attention_gpu.py", "--smoke"], tmp_path)
    rows = _rows(tmp_path / "attention_gpu.json")
    assert {r["k_format"] for r in rows} == {"q8_0", "turbo3"}
    assert all("seconds" in r["vec"] and "seconds" in r["mma"] for r in rows)
    _run(["bench/dca_gpu.py", "--smoke"], tmp_path)
    rows = _rows(tmp_path / "dca_gpu.json")
    assert {r["mode"] for r in rows} == {"decode", "prefill"} and all("dca_over_plain" in r for r in rows)


def test_dequant_and_kv_encode_benchmarks(tmp_path):
    _run(["bench/dequant_gpu.py", "--smoke"], tmp_path)
    rows = _rows(tmp_path / "dequant_gpu.json")
    assert all(r["checksums_equal"] for r in rows) and len(rows) >= 10
    _run(["bench/kv_encode.py", "--device", "gpu", "--gpu-tokens", "4", "--gpu-repeats", "1",
          "--formats", "q8_0,turbo3_tcq", "--smoke", "--engine-tokens", "24", "--engine-repeats", "1"], tmp_path)
    report = json.loads((tmp_path / "kv_encode_gpu.json").read_text())
    assert {r["format"] for r in _rows(tmp_path / "kv_encode_gpu.json")} == {"q8_0", "turbo3_tcq"}
    assert len(report["tcq_trellis_sizes"]) >= 4 and report["prefill_layer"]["seconds_per_layer"] > 0
    engine = {r["format"]: r for r in report["engine_prefill"]["rows"]}
    assert set(engine) == {"f16", "turbo3", "turbo3_tcq", "turbo2_tcq"}
    assert all(r["seconds_per_layer"] > 0 for r in engine.values()) and engine["turbo3"]["over_turbo3"] == 0
    assert engine["turbo3_tcq"]["encode_share_of_step"] > 0  # (its encode row was timed above)


def test_end_to_end_and_prompt_cache_benchmarks(tmp_path):
    out = _run(["bench/e2e_gpu.py", "--smoke", "--out", str(tmp_path / "e2e_gpu.json")], tmp_path)
    results = json.loads((tmp_path / "e2e_gpu.json").read_text())["results"]
    assert set(results) == {"tiny-gemma3", "tiny-qwen2", "tiny-gemma4"}, out[-2000:]
    assert all(r["cupyllm"]["decode_tps_graph"] > 0 and r["cupyllm"]["prefill_paths"] for r in results.values())
    gated = results["tiny-gemma4"]["cupyllm"]["gated_mlp"]  # (the other tiny models' gate and up differ in type)
    assert gated and all(x["fused_us"] > 0 and x["apart_us"] > 0 for x in gated), gated
    assert {x["up"] for x in gated} >= {"given"}  # its per-layer gate
    sys.path.insert(0, str(REPO / "tests" / "support"))  # make_tiny_models
    from make_tiny_models import tiny_spec, write_gguf
    model = tmp_path / "tiny-gemma3.gguf"
    write_gguf(tiny_spec("gemma3"), model)
    _run(["bench/prompt_cache.py", "--device", "gpu", "--model", str(model), "--doc-tokens", "64",
          "--answer-tokens", "2", "--out", str(tmp_path / "prompt_cache_gpu.json")], tmp_path)
    rows = _rows(tmp_path / "prompt_cache_gpu.json", "rows")
    assert all(r["cached_prefill_tokens"] < r["fresh_prefill_tokens"] for r in rows)


def test_niah_on_the_device_path(tmp_path):
    """tools/gpu_niah.sh's runs (tools/niah.py --device gpu, DCA and plain, every task) on a tiny model. Its
    small vocabulary spends more tokens on needles and questions than Gemma's: fit_sample cuts the haystack to
    fit the context (Gemma's samples fit as they are and stay make_sample's own)."""
    sys.path.insert(0, str(REPO / "tests" / "support"))  # make_tiny_models
    from make_tiny_models import tiny_spec, write_gguf
    model = tmp_path / "tiny-gemma3.gguf"
    write_gguf(tiny_spec("gemma3"), model)
    _run(["tools/niah.py", "-m", str(model), "--device", "gpu", "--lengths", "1024", "--depths", "0.5",
          "--modes", "dca", "plain", "--tasks", "single", "multikey", "multivalue", "vartrack",
          "--dca-chunk-size", "512", "--max-tokens", "2", "--out", str(tmp_path / "niah.json")], tmp_path)
    report = json.loads((tmp_path / "niah.json").read_text())
    rows = report["rows"]
    assert report["device"] == "gpu" and len(rows) == 8
    assert {r["mode"] for r in rows} == {"dca", "plain"}
    assert all(1024 - 200 <= r["prompt_tokens"] <= 1024 + 64 - 2 - 1 for r in rows)


def test_decode_benchmark(tmp_path):
    """bench/decode_gpu.py: batched decode, n-gram drafting and the hybrid's decode, each against its roofline."""
    out = _run(["bench/decode_gpu.py", "--smoke", "--out", str(tmp_path / "decode_gpu.json")], tmp_path)
    results = json.loads((tmp_path / "decode_gpu.json").read_text())["results"]
    dense, hybrid = results["qwen2.5-7b"], results["qwen3.6-35b-a3b-8l"]
    assert [r["sequences"] for r in dense["batched_decode"]] == [1, 3], out[-2000:]
    assert all(r["aggregate_tok_s"] > 0 and 0 < r["fraction_of_roofline"] for r in dense["batched_decode"])
    assert dense["ngram"]["speedup"] > 0 and dense["ngram"]["ngram"]["drafted"] >= 0
    assert hybrid["decode"]["decode_tps"] > 0 and hybrid["decode"]["token_bytes"] > 0
