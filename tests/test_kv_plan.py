"""Auto KV-tier selection (kv/plan.py): the ladder against the quality measurements, the choice against the
caches actually allocated, and the errors a budget that cannot fit gives."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import cupyllm
from cupyllm.cli import main as cli_main
from cupyllm.files.config import config_from_gguf
from cupyllm.errors import BudgetError, CupyllmError
from cupyllm.files.gguf import read_gguf
from cupyllm.kv.cache import KVCache, KVSpec, kv_bytes
from cupyllm.ops.kv_formats.formats import get_format
from cupyllm.kv.plan import TIERS, format_bytes, parse_bytes, plan_kv

QUALITY = Path(__file__).resolve().parents[1] / "bench" / "results" / "kv_quality.json"


def _bits(k: str, v: str) -> float:
    return (get_format(k).bits_per_value + get_format(v).bits_per_value) / 2


def test_tiers_are_the_measured_pareto_front():
    """Recomputed from bench/results/kv_quality.json: the types and pairs no other measured one beats in both
    bits per value and median KLD (the worse of the two models), best first, with the stored medians."""
    models = json.loads(QUALITY.read_text())["models"]
    gemma, qwen = models["gemma"]["configs"], models["qwen"]["configs"]
    points = {name: (_bits(c["k"], c["v"]), max(c["kld_median"], qwen[name]["kld_median"]))
              for name, c in gemma.items() if name not in ("f32", "bf16")}
    front = [name for name, (bits, kld) in points.items()
             if not any(b <= bits and q <= kld and (b, q) != (bits, kld) for b, q in points.values())]
    front.sort(key=lambda name: -points[name][0])
    assert [tier.name for tier in TIERS] == front
    for tier in TIERS:
        want = (gemma[tier.name]["kld_median"], qwen[tier.name]["kld_median"])
        np.testing.assert_allclose(tier.median_kld, want, rtol=5e-3, atol=1e-9)


@pytest.mark.parametrize("arch", ["qwen2", "gemma3", "gemma4"])
@pytest.mark.parametrize("mirror", [False, True])
def test_plan_picks_the_best_tier_whose_cache_fits(tiny_model, arch, mirror):
    cfg = config_from_gguf(read_gguf(tiny_model(arch)[0]))
    ctx = 96

    def allocated(tier) -> int:  # what the cache really takes, allocated
        spec = KVSpec(ctx=ctx, kv_type_k=tier.kv_type_k, kv_type_v=tier.kv_type_v, max_chunk=8)
        cache = KVCache.for_model(cfg, spec, mirror=mirror)
        return cache.nbytes + (sum(layer.k_f32.nbytes + layer.v_f32.nbytes for layer in cache.own_layers())
                               if mirror else 0)

    sizes = [allocated(tier) for tier in TIERS]
    assert sizes[0] == max(sizes) and sizes[-1] == min(sizes)  # (in between, tiny heads' group norms reorder some)
    for budget in sorted(set(sizes)) + [(a + b) // 2 for a, b in zip(sorted(sizes), sorted(sizes)[1:])]:
        plan = plan_kv(cfg, ctx, budget, mirror=mirror, max_chunk=8)
        first_fit = next(j for j, size in enumerate(sizes) if size <= budget)
        assert plan.tier == TIERS[first_fit] and plan.bytes_needed == sizes[first_fit] <= budget


def test_budget_no_tier_fits_says_the_context_that_would(tiny_model):
    cfg = config_from_gguf(read_gguf(tiny_model("qwen2")[0]))
    smallest = TIERS[-1]
    budget = kv_bytes(cfg, KVSpec(ctx=1000, kv_type_k=smallest.kv_type_k, kv_type_v=smallest.kv_type_v)) + 1
    with pytest.raises(BudgetError, match="it fits ctx 1000 there") as err:
        plan_kv(cfg, 4096, budget)
    assert "--kv-budget" in str(err.value) and "-c/--ctx" in str(err.value)


@pytest.mark.parametrize("text, want", [("6GiB", 6 * 2**30), ("512 MiB", 512 * 2**20), ("2.5G", 2_500_000_000),
                                        ("1e6", 1_000_000), (4096, 4096), ("300kb", 300_000)])
def test_parse_bytes(text, want):
    assert parse_bytes(text) == want


@pytest.mark.parametrize("n_bytes, text", [(512, "512 bytes"), (1024, "1.0 KiB"), (70.1 * 2**20, "70.1 MiB"),
                                            (6 * 2**30, "6.00 GiB")])
def test_format_bytes(n_bytes, text):
    assert format_bytes(n_bytes) == text


@pytest.mark.parametrize("text", ["six gigs", "-1GiB", "0", "5 parsecs", ""])
def test_parse_bytes_rejects_nonsense(text):
    with pytest.raises(CupyllmError, match="size"):
        parse_bytes(text)


def test_load_with_auto_types_and_a_budget(tiny_model):
    path = tiny_model("gemma3")[0]
    cfg = config_from_gguf(read_gguf(path))
    budget = kv_bytes(cfg, KVSpec(ctx=64, kv_type_k="q8_0", kv_type_v="q8_0"))
    model = cupyllm.load(path, device="cpu", ctx=64, kv_type_k="auto", kv_type_v="auto", kv_budget=budget,
                         progress=False)
    assert (model.kv_spec.kv_type_k, model.kv_spec.kv_type_v) == ("q8_0", "q8_0")
    assert model.kv_plan.tier.name == "q8_0" and "auto for" in model.kv_plan.describe()
    ids = [5, 17, 99, 3, 42]
    assert model.logits(ids).shape == (5, cfg.n_vocab)
    with pytest.raises(BudgetError, match="over the budget"):  # explicit types: checked, not changed
        cupyllm.load(path, device="cpu", ctx=64, kv_type_k="f16", kv_type_v="f16", kv_budget=budget, progress=False)
    mirrored_budget = kv_bytes(cfg, KVSpec(ctx=64, kv_type_k="q8_0", kv_type_v="q8_0"), mirror=True)
    mirrored = cupyllm.load(path, device="cpu", ctx=64, kv_type_k="auto", kv_type_v="auto", kv_mirror=True,
                            kv_budget=mirrored_budget, progress=False)  # the float32 copy counted too
    assert (mirrored.kv_spec.kv_type_k, mirrored.kv_spec.float_mirror) == ("q8_0", True)
    with pytest.raises(CupyllmError, match="kv_type_v='auto' too"):
        cupyllm.load(path, device="cpu", ctx=64, kv_type_k="auto", progress=False)


def test_cli_auto_types(tiny_model, capsys):
    path = str(tiny_model("gemma3")[0])
    assert cli_main(["info", path, "-c", "4096", "-ctk", "auto", "-ctv", "auto", "--kv-budget", "1MiB"]) == 0
    assert "KV plan" in capsys.readouterr().out
    assert cli_main(["info", path, "-ctk", "auto", "-ctv", "auto"]) == 1
    assert "--kv-budget" in capsys.readouterr().err
    assert cli_main(["info", path, "-c", "4096", "--kv-budget", "ten"]) == 1
    assert "not a size" in capsys.readouterr().err


@pytest.mark.parametrize("head_dim", [64, 128, 256, 512])
def test_tiers_shrink_at_real_head_dims(head_dim):
    """Each tier stores no more bits per value than the one before it at the head dims real models have."""
    bits = [(get_format(t.kv_type_k, head_dim=head_dim).row_bytes(head_dim)
             + get_format(t.kv_type_v, head_dim=head_dim).row_bytes(head_dim)) for t in TIERS]
    assert bits == sorted(bits, reverse=True)


# ---- spilling (GPU window + host tail) -------------------------------------------------------------------

def test_plan_spill_takes_the_largest_window_that_fits(tiny_model):
    from cupyllm.kv.plan import plan_spill
    cfg = config_from_gguf(read_gguf(tiny_model("gemma4")[0]))
    spec = KVSpec(ctx=4096, kv_type_k="q8_0", kv_type_v="q8_0", max_chunk=64)
    device = lambda window: kv_bytes(cfg, KVSpec(**{**spec.__dict__, "device_window": window}))  # noqa: E731
    plan = plan_spill(cfg, spec, device(1000) + 1)
    assert plan.spec.device_window == 1000 and plan.device_bytes == device(1000)
    assert plan.host_bytes == kv_bytes(cfg, spec) - device(1000) > 0
    assert plan_spill(cfg, spec, device(1001) - 1).spec.device_window == 1000
    with pytest.raises(BudgetError, match="even spilled"):
        plan_spill(cfg, spec, device(64) - 1)
    with pytest.raises(BudgetError, match="the host has"):
        plan_spill(cfg, spec, device(1000), host_available=1000)


def test_spill_is_for_the_gpu(tiny_model):
    with pytest.raises(CupyllmError, match="on the CPU the whole cache is in host memory"):
        cupyllm.load(tiny_model("qwen2")[0], device="cpu", ctx=64, kv_budget="1KiB", kv_spill=True, progress=False)


def test_cli_lists_the_tiers(tiny_model, capsys):
    path = tiny_model("gemma4")[0]
    cfg = config_from_gguf(read_gguf(path))
    assert cli_main(["info", str(path), "-c", "8192", "--kv-tiers"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
    assert [row[0] for row in rows] == [t.name for t in TIERS]
    for row, tier in zip(rows, TIERS):  # sizes as kv_bytes counts them
        want = kv_bytes(cfg, KVSpec(ctx=8192, kv_type_k=tier.kv_type_k, kv_type_v=tier.kv_type_v)) / 2**20
        assert row[2] == "MiB" and abs(float(row[1].replace(",", "")) - want) < 0.06
