"""Layer plans (RYS, cupyllm/models/layer_plan.py): a plan gives exactly the logits of the GGUF rebuilt with the
repeated layers physically copied (tests/support/duplicate_layers.py writes it with gguf-py), on tiny models of
every family and on a real model; the cache grows by exactly the repeated layers; plans are checked, recorded in
prompt caches and never reach a drafter."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import cupyllm
from cupyllm.errors import InputError
from cupyllm.models.layer_plan import boundary_warning, layer_order, parse_repeat_layers

from duplicate_layers import write_with_layers
from gpu_helpers import GPU_TEST_MARKS
import make_tiny_models

IDS = [5, 17, 99, 3, 42, 7, 5, 17, 99, 3, 11, 64, 8, 2]

# A block per family that keeps the layer kinds a file derives from layer numbers: Gemma 3 makes every 6th layer
# global and Qwen3.5 every `full_attention_interval`-th (2 in the tiny ones) full attention, so a physical copy
# keeps the pattern only with blocks of that width; Gemma 4 stores its pattern per layer, and its block (3, 5)
# repeats the layers its last two KV-shared layers read.
PLANS = {"qwen2": "1,2", "qwen3": "1,2", "qwen3-moe": "0,1;2,3", "gemma3": "0,6", "gemma4": "3,5",
         "gemma4-moe": "2,3", "qwen35": "0,2", "qwen35-moe": "2,4", "qwen3next": "0,2"}


@pytest.fixture(scope="module")
def tiny_file(tiny_dir, tiny_model):
    """tiny_file(arch) -> path; Gemma 3 with 7 layers, so that a layer plan has a global layer to repeat."""
    def make(arch: str):
        if arch != "gemma3":
            return tiny_model(arch)[0]
        path = tiny_dir / "tiny-gemma3-7-layers.gguf"
        if not path.exists():
            make_tiny_models.write_gguf(make_tiny_models.TinySpec("gemma3", n_layer=7), path)
        return path
    return make


def _load(path, **options):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="repeat_layers")  # tiny models: every block is near an end
        return cupyllm.load(path, device="cpu", ctx=64, max_chunk=8, progress=False, **options)


def _physical_copy(path, plan: str, tmp_path):
    """The GGUF with `plan`'s blocks written twice."""
    n_layer = cupyllm.load(path, device="cpu", ctx=8, progress=False).cfg.n_layer
    copy = tmp_path / f"{path.stem}-repeated.gguf"
    write_with_layers(path, copy, layer_order(parse_repeat_layers(plan, n_layer), n_layer))
    return copy


@pytest.mark.parametrize("arch", list(PLANS))
def test_plan_gives_the_physically_repeated_model(arch, tiny_file, tmp_path):
    path = tiny_file(arch)
    planned = _load(path, repeat_layers=PLANS[arch])
    copied = _load(_physical_copy(path, PLANS[arch], tmp_path))
    assert planned.cfg.n_layer == copied.cfg.n_layer
    assert planned.cfg.sliding_layers == copied.cfg.sliding_layers
    assert planned.cfg.recurrent_layers == copied.cfg.recurrent_layers
    assert planned.cfg.kv_sources == copied.cfg.kv_sources
    np.testing.assert_array_equal(planned.logits(IDS), copied.logits(IDS))  # chunks of 8, then decode-sized runs
    assert planned.generate(IDS, max_tokens=6, temperature=0) == copied.generate(IDS, max_tokens=6, temperature=0)


@pytest.mark.parametrize("kv_types", [("q8_0", "q8_0"), ("q4_0", "turbo3"), ("turbo2_tcq", "q6_0"),
                                      ("turbo4", "turbo4")])
def test_plan_with_every_kind_of_kv_type(kv_types, tiny_file, tmp_path):
    path = tiny_file("qwen3")
    types = dict(kv_type_k=kv_types[0], kv_type_v=kv_types[1])
    planned = _load(path, repeat_layers="1,3", **types)
    copied = _load(_physical_copy(path, "1,3", tmp_path), **types)
    np.testing.assert_array_equal(planned.logits(IDS), copied.logits(IDS))


def test_plan_with_dual_chunk_attention(tiny_file, tmp_path):
    path = tiny_file("gemma3")
    dca = {"chunk_size": 8, "local_size": 2}
    planned = _load(path, repeat_layers="0,6", dca=dca)
    copied = _load(_physical_copy(path, "0,6", tmp_path), dca=dca)
    np.testing.assert_array_equal(planned.logits(IDS), copied.logits(IDS))


def test_empty_plan_is_no_plan(tiny_file):
    path = tiny_file("gemma4")
    plain = _load(path)
    for empty in ("", " ", None, []):
        model = _load(path, repeat_layers=empty)
        assert model.repeat_layers == () and model.cfg == plain.cfg
        assert model.prompt_cache_key() == plain.prompt_cache_key()
        np.testing.assert_array_equal(model.logits(IDS), plain.logits(IDS))


@pytest.mark.parametrize("arch, plan, repeated", [("gemma3", "0,6", range(0, 6)), ("gemma4", "3,5", (3, 4)),
                                                   ("qwen35", "0,2", (0, 1))])
def test_cache_grows_by_exactly_the_repeated_layers(arch, plan, repeated, tiny_file):
    from cupyllm.kv.cache import KVSpec, kv_bytes
    from cupyllm.kv.plan import format_bytes
    from cupyllm.report import model_report

    path = tiny_file(arch)
    plain, planned = _load(path), _load(path, repeat_layers=plan)
    stored_layers = plain._working_cache().layers
    grown = sum(stored_layers[layer].nbytes for layer in repeated)
    assert planned._working_cache().nbytes == plain._working_cache().nbytes + grown
    assert kv_bytes(planned.cfg, planned.kv_spec) == kv_bytes(plain.cfg, plain.kv_spec) + grown
    report = model_report(path, ctx=64, repeat_layers=plan)
    assert f"layers          {planned.cfg.n_layer}" in report
    spec = KVSpec(ctx=64)  # (the report sizes sliding-window rings for the default prefill chunk)
    assert f"KV cache        {format_bytes(kv_bytes(planned.cfg, spec))} at ctx 64" in report


def test_plan_survives_a_prompt_cache_file(tiny_file, tmp_path):
    from cupyllm.kv.prompt_cache import PromptCache

    path = tiny_file("qwen3")
    planned = _load(path, repeat_layers="1,3")
    expected = planned.generate(IDS, max_tokens=8, temperature=0)
    saved = tmp_path / "prompt.npz"
    planned.cache_prompt(IDS[:10]).save(saved)
    restored = PromptCache.load(saved)
    assert restored.key["repeat_layers"] == "1,3"
    assert planned.generate(IDS, max_tokens=8, temperature=0, prompt_cache=restored) == expected
    assert planned.last_stats.cached_tokens == 10
    for other in (_load(path), _load(path, repeat_layers="1,2")):
        with pytest.raises(InputError, match="layer plan"):
            other.generate(IDS, max_tokens=1, prompt_cache=restored)


def test_drafters_never_run_the_plan(tiny_file):
    from cupyllm.speculative import SpecConfig

    path = tiny_file("qwen3")
    model = _load(path, repeat_layers="1,3", draft_model=path)
    assert model.draft.repeat_layers == () and model.draft.cfg.n_layer == model.cfg.n_stored_layer == 3
    plain = model.generate(IDS, max_tokens=10, temperature=0, spec=False)
    for kind in ("self", "draft"):
        spec = SpecConfig(type=kind, draft_max=4, adaptive=False)
        assert model.generate(IDS, max_tokens=10, temperature=0, spec=spec) == plain, kind
        drafter_cache = model._model_drafters[kind].cache
        assert len(drafter_cache.layers) == 3  # the stored stack, not the plan's 5 layers


@pytest.mark.parametrize("plan, words", [
    ("1", "cannot read"), ("1,2,3", "cannot read"), ("a,b", "cannot read"), ("2,1", "not a run"),
    ("0,0", "not a run"), ("-1,2", "not a run"), ("1,4", "not a run"), ("1,3;2,3", "starts before"),
    ("2,3;0,1", "starts before"), ("1,2;;", "cannot read"), ([(1, 2, 3)], "pair"), ([(1.0, 2)], "pair"),
    (5, "write blocks"),
])
def test_malformed_plans_are_one_clear_error(plan, words, tiny_file):
    with pytest.raises(InputError, match=words):
        _load(tiny_file("qwen2"), repeat_layers=plan)
    if isinstance(plan, str):
        from cupyllm.cli import main
        assert main(["info", str(tiny_file("qwen2")), "-c", "64", f"--repeat-layers={plan}"]) == 1


def test_order_and_boundaries(tiny_file):
    assert layer_order(parse_repeat_layers("4,6", 8), 8) == (0, 1, 2, 3, 4, 5, 4, 5, 6, 7)
    assert layer_order(parse_repeat_layers(" 2,4 ; 4,5", 8), 8) == (0, 1, 2, 3, 2, 3, 4, 4, 5, 6, 7)
    assert parse_repeat_layers([(3, 5), [6, 7]], 8) == ((3, 5), (6, 7))
    assert boundary_warning(((6, 12),), 18) is None  # within [3, 15)
    assert "first or last 3" in boundary_warning(((2, 6),), 18)
    assert "first or last 3" in boundary_warning(((10, 16),), 18)
    assert "first or last 10" in boundary_warning(((8, 20),), 80)  # 80 / 8
    with pytest.warns(UserWarning, match="repeat_layers"):
        cupyllm.load(tiny_file("qwen2"), device="cpu", ctx=8, progress=False, repeat_layers="0,1")


@pytest.mark.slow
def test_plan_on_a_real_model(tmp_path):
    """Qwen2.5-Coder-0.5B (24 layers) with layers 10 and 11 run twice equals its GGUF with them copied."""
    from models import qwen_path

    path = qwen_path()
    copy = tmp_path / "qwen-repeated.gguf"
    write_with_layers(path, copy, layer_order(((10, 12),), 24))
    ids = list(range(1000, 1012))
    planned = cupyllm.load(path, device="cpu", ctx=32, progress=False, repeat_layers="10,12")
    copied = cupyllm.load(copy, device="cpu", ctx=32, progress=False)
    np.testing.assert_array_equal(planned.logits(ids), copied.logits(ids))


@pytest.mark.parametrize("arch", ["qwen3", "gemma4", "qwen35"])
@pytest.mark.gpu
def test_plan_on_the_device_matches_the_cpu(arch, tiny_file, tmp_path):
    for mark in GPU_TEST_MARKS[1:]:
        if mark.args[0]:
            pytest.skip(mark.kwargs["reason"])
    path = tiny_file(arch)
    if arch == "qwen35":  # DeltaNet head dims of 32: the tiny model's 16 is below what the GPU kernels take
        import dataclasses
        path = tmp_path / "tiny-qwen35-32.gguf"
        make_tiny_models.write_gguf(dataclasses.replace(make_tiny_models.tiny_spec(arch), ssm_k_dim=32, ssm_v_dim=32),
                                    path)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="repeat_layers")
        gpu = cupyllm.load(path, device="gpu", ctx=64, max_chunk=8, progress=False, repeat_layers=PLANS[arch])
    cpu = _load(path, repeat_layers=PLANS[arch])
    got, want = gpu.logits(IDS), cpu.logits(IDS)  # the GPU's prefill GEMMs take f16 activations: tolerances
    assert np.abs(got - want).max() <= 5e-3 * np.abs(want).max()  # as tests/test_gpu_backend.py's prefill paths
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


def test_another_plan_without_reloading(tiny_file):
    path = tiny_file("qwen3-moe")
    plain, planned = _load(path), _load(path, repeat_layers="1,3")
    switched = plain.with_layer_plan("1,3")
    assert switched.transformer.layers[3] is plain.transformer.layers[1]  # shared, not copied
    np.testing.assert_array_equal(switched.logits(IDS), planned.logits(IDS))
    np.testing.assert_array_equal(planned.with_layer_plan(None).logits(IDS), plain.logits(IDS))
    np.testing.assert_array_equal(plain.logits(IDS), _load(path).logits(IDS))  # (the original kept its own cache)
