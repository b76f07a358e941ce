"""Cost-aware auto tiers for spilled caches (kv/spill_cost.py): the predicted step against the formula worked by
hand, the choice against every tier weighed one by one, the flag's errors, and (on a GPU or the CUDA emulator,
-m gpu) the measurement and the load that uses it."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

import cupyllm
from cupyllm.cli import main as cli_main
from cupyllm.errors import BudgetError, InputError
from cupyllm.files.config import config_from_gguf
from cupyllm.files.gguf import read_gguf
from cupyllm.kv.cache import KVSpec, kv_bytes
from cupyllm.kv.gpu_spill import STAGE_TOKENS
from cupyllm.kv.plan import TIERS, plan_kv, plan_spill
from cupyllm.kv.spill_cost import (SpillRates, check_max_slowdown, plan_spill_tier, predict_step, rates_from)
from cupyllm.ops.kv_formats.formats import get_format

from gpu_helpers import GPU_TEST_MARKS

# rates of the size an H100/H200 gives (GB/s over PCIe, ns per position), round numbers for the worked sums
RATES = SpillRates(h2d_bytes_per_s=25e9, attention_s_per_position=1e-9, probe_values=2 * (64 + 64),
                   stream_chunk_s=50e-6, evict_s=30e-6, eager_step_s=4e-3, graph_step_s=1e-3)


def _cfg(tiny_model, arch):
    return config_from_gguf(read_gguf(tiny_model(arch)[0]))


def _row_bytes(kv_type: str, head_dim: int) -> int:
    return get_format(kv_type, head_dim=head_dim).row_bytes(head_dim)


def test_predicted_step_is_the_formula_worked_by_hand(tiny_model):
    """qwen2 tiny: every layer global, its own cache; each term summed here layer by layer from the shapes."""
    cfg = _cfg(tiny_model, "qwen2")
    spec = KVSpec(ctx=20000, kv_type_k="q8_0", kv_type_v="f16", device_window=3000)
    host = 20000 - 3000
    attention, streamed = 0.0, 0
    for il in range(cfg.n_layer):
        n_kv, k_dim, v_dim = cfg.n_kv_head_of(il), cfg.head_dim_of(il), cfg.v_head_dim_of(il)
        attention += 1e-9 * 20000 * n_kv * (k_dim + v_dim) / (2 * 128)
        streamed += host * n_kv * (_row_bytes("q8_0", k_dim) + _row_bytes("f16", v_dim))
    chunks = cfg.n_layer * math.ceil(host / STAGE_TOKENS)  # 17000 host rows: 3 staged chunks per layer
    whole_s, step_s, got_streamed, got_chunks = predict_step(cfg, spec, RATES)
    assert (got_streamed, got_chunks) == (streamed, chunks) and chunks == 3 * cfg.n_layer
    assert whole_s == pytest.approx(1e-3 + attention, rel=1e-12)
    assert step_s == pytest.approx(4e-3 + attention + streamed / 25e9 + chunks * 50e-6 + cfg.n_layer * 30e-6,
                                   rel=1e-12)
    # without KV sharing the streamed rows are exactly plan_spill's host part (kv_bytes' count of the cache)
    plan = plan_spill(cfg, dataclasses.replace(spec, device_window=0), kv_bytes(cfg, spec))
    assert plan.spec.device_window == 3000 and plan.host_bytes == streamed
    # whole on the device: the graph step and attention only
    assert predict_step(cfg, dataclasses.replace(spec, device_window=0), RATES) == (whole_s, whole_s, 0, 0)


def test_shared_and_sliding_layers_in_the_prediction(tiny_model):
    """gemma4 tiny: sliding layers stay on the device and attend over their window; a KV-shared global layer
    streams its source's host rows again, so more bytes move per step than the host part holds."""
    cfg = _cfg(tiny_model, "gemma4")
    ctx = 4096
    spec = KVSpec(ctx=ctx, max_chunk=64)
    plan = plan_spill(cfg, spec, kv_bytes(cfg, dataclasses.replace(spec, device_window=1000)))
    host = ctx - plan.spec.device_window
    readers = [il for il in range(cfg.n_layer) if not cfg.is_sliding(cfg.kv_source(il))]
    owners = {cfg.kv_source(il) for il in readers}
    assert len(readers) > len(owners)  # (the tiny model has a shared global layer: the case under test)
    per_position = {il: cfg.n_kv_head_of(il) * (_row_bytes("f16", cfg.head_dim_of(il))
                                               + _row_bytes("f16", cfg.v_head_dim_of(il))) for il in owners}
    _, _, streamed, chunks = predict_step(cfg, plan.spec, RATES)
    assert streamed == host * sum(per_position[cfg.kv_source(il)] for il in readers) > plan.host_bytes
    assert plan.host_bytes == host * sum(per_position.values())
    assert chunks == len(readers) * math.ceil(host / STAGE_TOKENS)
    # each own global cache evicts a row per step; the shared reader does not
    with_evictions = predict_step(cfg, plan.spec, RATES)[1]
    assert with_evictions - predict_step(cfg, plan.spec, dataclasses.replace(RATES, evict_s=0.0))[1] == \
        pytest.approx(len(owners) * 30e-6, rel=1e-9)
    # attention: global layers over the context, sliding ones over their window
    no_graph = dataclasses.replace(RATES, graph_step_s=0.0)
    keys = sum((min(ctx, cfg.sliding_window) if cfg.is_sliding(cfg.kv_source(il)) else ctx)
               * cfg.n_kv_head_of(cfg.kv_source(il)) * (cfg.head_dim_of(cfg.kv_source(il))
                                                        + cfg.v_head_dim_of(cfg.kv_source(il)))
               for il in range(cfg.n_layer))
    assert predict_step(cfg, spec, no_graph)[0] == pytest.approx(1e-9 * keys / RATES.probe_values, rel=1e-12)


def _slowdown_by_hand(cfg, ctx, budget, tier, rates, max_chunk):
    """One tier's predicted slowdown, planned on its own (None: cannot spill within the budget)."""
    spec = KVSpec(ctx=ctx, kv_type_k=tier.kv_type_k, kv_type_v=tier.kv_type_v, max_chunk=max_chunk)
    if kv_bytes(cfg, spec) <= budget:
        return 0.0
    try:
        spec = plan_spill(cfg, spec, budget).spec
    except BudgetError:
        return None
    whole_s, step_s, _, _ = predict_step(cfg, spec, rates)
    return step_s / whole_s - 1


@pytest.mark.parametrize("max_slowdown", [0.0, 0.02, 0.2, 1.0, 5.0, 1e9])
@pytest.mark.parametrize("h2d", [1e9, 25e9, 1e12])
def test_the_choice_is_the_best_tier_within_the_limit(tiny_model, max_slowdown, h2d):
    """Budgets where every tier down to q5_0 must spill: the chosen tier is the first of TIERS whose slowdown,
    planned tier by tier here, is within the limit, and the tiers weighed end at the first that fits whole."""
    cfg = _cfg(tiny_model, "qwen2")
    ctx, max_chunk = 8192, 64
    rates = dataclasses.replace(RATES, h2d_bytes_per_s=h2d)
    budget = kv_bytes(cfg, KVSpec(ctx=ctx, kv_type_k="turbo4", kv_type_v="turbo4", max_chunk=max_chunk))
    choice = plan_spill_tier(cfg, ctx, budget, rates, max_slowdown, max_chunk=max_chunk)
    by_hand = [(tier, _slowdown_by_hand(cfg, ctx, budget, tier, rates, max_chunk)) for tier in TIERS]
    first_whole = next(j for j, (_, s) in enumerate(by_hand) if s == 0.0)
    weighed = [(tier, s) for tier, s in by_hand[:first_whole + 1] if s is not None]
    assert [c.tier for c in choice.costs] == [tier for tier, _ in weighed]
    for cost, (_, slowdown) in zip(choice.costs, weighed):
        assert cost.slowdown == pytest.approx(slowdown, rel=1e-12)
    want = next(tier for tier, s in weighed if s <= max_slowdown)  # (the whole-fitting tier always is)
    assert choice.chosen.tier == want
    assert choice.chosen.spills == (want != weighed[-1][0])
    if max_slowdown == 0.0:  # no spill allowed: plan_kv's first tier that fits
        assert choice.chosen.tier == plan_kv(cfg, ctx, budget, max_chunk=max_chunk).tier
    if max_slowdown == 1e9:
        assert choice.chosen.tier == TIERS[0] and choice.chosen.spills


def test_the_host_part_in_its_tail_types(tiny_model):
    """host_types (api: kv/plan.py floor_tail) stores a spilled tier's host part in q4_0: the streamed bytes are
    q4_0 rows, so the same spill costs less than in f16."""
    from cupyllm.kv.plan import floor_tail
    cfg = _cfg(tiny_model, "qwen2")
    ctx, max_chunk = 8192, 64
    budget = kv_bytes(cfg, KVSpec(ctx=ctx, kv_type_k="q8_0", kv_type_v="q8_0", max_chunk=max_chunk))
    plain = plan_spill_tier(cfg, ctx, budget, RATES, 1e9, max_chunk=max_chunk)
    floored = plan_spill_tier(cfg, ctx, budget, RATES, 1e9, max_chunk=max_chunk,
                              host_types=lambda spec: floor_tail(cfg, spec))
    f16 = floored.costs[0]
    assert (f16.tier.name, f16.spec.kv_type_k_tail, f16.spec.kv_type_v_tail) == ("f16", "q4_0", "q4_0")
    host = ctx - f16.spec.device_window
    assert f16.streamed_bytes == host * sum(cfg.n_kv_head_of(il) * (_row_bytes("q4_0", cfg.head_dim_of(il))
                                                                  + _row_bytes("q4_0", cfg.v_head_dim_of(il)))
                                            for il in range(cfg.n_layer))
    assert f16.slowdown < plain.costs[0].slowdown


def test_a_faster_copy_keeps_a_better_tier(tiny_model):
    cfg = _cfg(tiny_model, "qwen2")
    ctx, max_chunk = 8192, 64
    budget = kv_bytes(cfg, KVSpec(ctx=ctx, kv_type_k="q5_1", kv_type_v="q5_1", max_chunk=max_chunk))
    ranks = []
    for h2d in (1e8, 1e9, 1e10, 1e11, 1e12, 1e14):
        rates = dataclasses.replace(RATES, h2d_bytes_per_s=h2d, stream_chunk_s=0.0, evict_s=0.0, eager_step_s=1e-3)
        choice = plan_spill_tier(cfg, ctx, budget, rates, 0.2, max_chunk=max_chunk)
        ranks.append(TIERS.index(choice.chosen.tier))
    assert ranks == sorted(ranks, reverse=True) and ranks[0] == 3 and ranks[-1] == 0  # q5_1 whole ... f16 spilled


def test_no_tier_within_the_limit_and_none_whole_takes_the_fastest(tiny_model):
    cfg = _cfg(tiny_model, "qwen2")
    ctx, max_chunk = 8192, 64
    smallest = KVSpec(ctx=ctx, kv_type_k=TIERS[-1].kv_type_k, kv_type_v=TIERS[-1].kv_type_v, max_chunk=max_chunk)
    budget = kv_bytes(cfg, smallest) // 2  # even the smallest tier spills half
    choice = plan_spill_tier(cfg, ctx, budget, RATES, 0.2, max_chunk=max_chunk)
    assert all(c.spills and c.slowdown > 0.2 for c in choice.costs)
    assert choice.chosen == min(choice.costs, key=lambda c: c.slowdown)
    assert "none within, the fastest of --kv-spill-max-slowdown 20%" in choice.describe()
    with pytest.raises(BudgetError, match="even spilled"):  # not one prefill chunk fits
        plan_spill_tier(cfg, ctx, 1000, RATES, 0.2, max_chunk=max_chunk)


def test_the_decision_says_what_was_weighed_and_measured(tiny_model):
    cfg = _cfg(tiny_model, "qwen2")
    ctx, max_chunk = 8192, 64
    budget = kv_bytes(cfg, KVSpec(ctx=ctx, kv_type_k="q8_0", kv_type_v="q8_0", max_chunk=max_chunk))
    choice = plan_spill_tier(cfg, ctx, budget, RATES, 1e9, max_chunk=max_chunk)
    text = choice.kv_plan().describe()
    assert text.startswith("KV cache f16 (auto for") and "f16 spills" in text and "q8_0 fits whole" in text
    assert "host->device 25.0 GB/s" in text and "attention 1 ns per position" in text
    assert "step 4.00 ms eager / 1.00 ms as a graph" in text
    spill_plan = choice.spill_plan()
    assert spill_plan.predicted_slowdown == choice.chosen.slowdown > 0
    assert f"predicted decode slowdown +{choice.chosen.slowdown:.0%}" in spill_plan.describe()
    assert rates_from(dataclasses.asdict(RATES)) == RATES


@pytest.mark.parametrize("value, words", [(-0.1, "got -0.1"), ("abc", "got 'abc'"), (math.nan, "got nan"),
                                          (math.inf, "got inf"), (True, "got True"), ([0.2], "got [0.2]")])
def test_bad_max_slowdown_is_one_input_error(value, words):
    with pytest.raises(InputError, match="must be a number >= 0") as err:
        check_max_slowdown(value)
    assert words in str(err.value) and "--kv-spill-max-slowdown" in str(err.value)


def test_max_slowdown_values():
    assert check_max_slowdown(None) == 0.2 and check_max_slowdown("0.5") == 0.5 and check_max_slowdown(0) == 0.0
    assert check_max_slowdown(np.float32(1.5)) == 1.5


def test_max_slowdown_flag_errors_before_loading(tiny_model, capsys, monkeypatch):
    path = str(tiny_model("qwen2")[0])
    with pytest.raises(InputError) as api_err:
        cupyllm.load(path, device="cpu", kv_spill_max_slowdown="-1")
    monkeypatch.setattr(cupyllm.api.Transformer, "from_gguf", lambda *a, **k: pytest.fail("loaded weights"))
    assert cli_main(["generate", "hi", "-m", path, "--device", "cpu", "--kv-spill-max-slowdown", "-1"]) == 1
    err = capsys.readouterr().err
    assert f"cupyllm: error: {api_err.value}" in err and "got -1.0" in err
    with pytest.raises(InputError, match=r"needs kv_type_k='auto', kv_type_v='auto' and kv_spill=True"):
        cupyllm.load(path, device="cpu", kv_spill_max_slowdown=0.5)


# --- on a GPU, or the CUDA emulator (CUPYLLM_EMULATE=1) -----------------------------------------------------------

def _gpu(test):
    for mark in GPU_TEST_MARKS:
        test = mark(test)
    return test


@pytest.fixture(scope="module")
def flash_qwen2(tmp_path_factory):
    """A head dim the flash kernels cover (as tests/test_gpu_spill.py)."""
    import make_tiny_models
    spec = dataclasses.replace(make_tiny_models.tiny_spec("qwen2"), n_layer=2, head_dim=64)
    path = tmp_path_factory.mktemp("spill_cost") / "tiny-qwen2.gguf"
    make_tiny_models.write_gguf(spec, path)
    return path


@_gpu
def test_measured_rates_on_the_device(flash_qwen2):
    from cupyllm.backend.gpu import GPUBackend
    from cupyllm.kv.spill_cost import ProbeSizes, measure_spill_rates
    from cupyllm.models.build import Transformer
    import cupy
    transformer = Transformer.from_gguf(read_gguf(flash_qwen2), GPUBackend(attention="dispatch"), progress=False)
    cfg = transformer.cfg
    rates = measure_spill_rates(transformer)
    assert rates.probe_values == cfg.n_kv_head_of(0) * (cfg.head_dim_of(0) + cfg.v_head_dim_of(0))
    for name in ("h2d_bytes_per_s", "attention_s_per_position", "eager_step_s", "graph_step_s"):
        value = getattr(rates, name)
        assert 0 < value < math.inf, (name, value)
    assert 0 <= rates.stream_chunk_s < math.inf and 0 <= rates.evict_s < math.inf
    if getattr(cupy, "__cupyllm_emulated__", False):  # no stream capture there: the step runs eagerly
        assert rates.graph_step_s == rates.eager_step_s
        assert ProbeSizes.for_device(cupy).positions == (16, 48)
    else:
        assert ProbeSizes.for_device(cupy) == ProbeSizes()
    assert measure_spill_rates(transformer, graphs=False).graph_step_s > 0


@_gpu
def test_load_weighs_the_tiers_by_the_measured_cost(flash_qwen2):
    """A budget between q8_0 and f16 whole: any slowdown allowed keeps f16 spilled, its host part in q4_0 (and
    the choice is what the planner gives for the rates the load measured); none allowed takes q8_0 whole; without
    --kv-spill nothing is measured."""
    path = flash_qwen2
    cfg = config_from_gguf(read_gguf(path))
    ctx, max_chunk = 64, 4
    budget = kv_bytes(cfg, KVSpec(ctx=ctx, kv_type_k="q8_0", kv_type_v="q8_0", max_chunk=max_chunk)) + 64
    options = dict(device="gpu", ctx=ctx, max_chunk=max_chunk, kv_type_k="auto", kv_type_v="auto", kv_budget=budget,
                   kv_spill=True, progress=False)
    kept = cupyllm.load(path, kv_spill_max_slowdown=1e9, **options)
    choice = kept.kv_plan.spill_choice
    assert (kept.kv_spec.kv_type_k, kept.kv_spec.kv_type_v) == ("f16", "f16") and kept.kv_spec.spilled
    assert kept.spill_plan.spec.device_window == kept.kv_spec.device_window
    assert kept.spill_plan.predicted_slowdown == choice.chosen.slowdown
    from cupyllm.kv.plan import floor_tail
    assert choice == plan_spill_tier(cfg, ctx, budget, choice.rates, 1e9, max_chunk=max_chunk,
                                     host_types=lambda spec: floor_tail(cfg, spec))
    assert (kept.kv_spec.kv_type_k_tail, kept.kv_spec.kv_type_v_tail) == ("q4_0", "q4_0")  # (the q4_0 floor)
    assert kept.generate([5, 17, 99, 3], max_tokens=3, temperature=0) is not None  # the spilled cache runs
    whole = cupyllm.load(path, kv_spill_max_slowdown=0, **options)
    assert whole.kv_spec.kv_type_k == "q8_0" and not whole.kv_spec.spilled and whole.spill_plan is None
    assert [c.tier.name for c in whole.kv_plan.spill_choice.costs] == ["f16", "q8_0"]
    plain = cupyllm.load(path, **{**options, "kv_spill": False})
    assert plain.kv_plan.tier.name == "q8_0" and plain.kv_plan.spill_choice is None


@_gpu
def test_the_cli_prints_the_decision_and_the_measured_terms(flash_qwen2, capsys):
    cfg = config_from_gguf(read_gguf(flash_qwen2))
    budget = kv_bytes(cfg, KVSpec(ctx=1024, kv_type_k="q8_0", kv_type_v="q8_0")) + 64  # f16 spills past 512 rows
    assert cli_main(["generate", "the sea", "-m", str(flash_qwen2), "--device", "gpu", "-c", "1024", "-n", "2",
                     "--temp", "0", "-ctk", "auto", "-ctv", "auto", "--kv-spill", "--kv-budget", str(budget),
                     "--kv-spill-max-slowdown", "1e9"]) == 0
    err = capsys.readouterr().err
    assert "[gpu] KV cache f16 (auto for" in err and "q8_0 fits whole" in err
    assert "measured: host->device" in err and "ns per position and layer" in err
    assert "KV cache spilled: the newest" in err and "predicted decode slowdown +" in err


def test_the_device_validation_runs_on_the_emulator(tmp_path):
    """bench/spill_cost_gpu.py (tools/gpu_check.sh runs it on the device) at tiny size on the CUDA emulator: it runs
    to its end and writes a measured and a predicted slowdown for both tiers, their host part uniform and in q4_0
    (timings meaningless here)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    repo = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(repo / "tests" / "support" / "cuda_emu"))
    import emulator
    ok, why = emulator.cxx20_support()
    if not ok:
        pytest.skip(f"the CUDA emulator needs a C++20 compiler: {why}")
    env = {**os.environ, "CUPYLLM_EMULATE": "1", "CUPYLLM_BENCH_RESULTS": str(tmp_path),
           "PYTHONPATH": str(repo / "tests" / "support" / "cuda_emu" / "fakecupy")}
    env.pop("OUT", None)
    run = subprocess.run([sys.executable, "bench/spill_cost_gpu.py", "--smoke"], cwd=repo, env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "spill_cost_gpu.json").read_text())
    assert [(row["kv_type"], row["host_types"]) for row in report["results"]] == \
        [("f16", "uniform"), ("q8_0", "uniform"), ("f16", "q4_0"), ("q8_0", "q4_0")]
    assert rates_from(report["rates"]).h2d_bytes_per_s > 0
    for row in report["results"]:
        assert row["host_bytes"] > 0 and row["streamed_bytes_per_step"] == row["host_bytes"]
        assert math.isfinite(row["measured"]["slowdown"]) and row["predicted"]["slowdown"] > 0
