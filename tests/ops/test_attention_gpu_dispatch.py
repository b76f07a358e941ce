"""The GPU attention's host-side decisions, without a GPU: kernel choice, split sizing, shared-memory
sizes against the devices' limits, and that every kernel a launch can ask for is declared."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from cupyllm.ops.attention import gpu_dispatch as dispatch
from cupyllm.ops.attention import gpu as fk
from cupyllm.ops.kv_formats.formats import get_format, list_formats

REPO = Path(__file__).resolve().parents[2]
SM80_SMEM_OPTIN = 166912  # A100: the smallest opt-in limit we support
SHAPES = ((128, 32, 8), (256, 8, 4), (256, 4, 1), (512, 16, 2), (64, 14, 2))  # (head_dim, n_head, n_kv)


def test_decode_of_f32_and_bf16_caches_uses_vec_and_the_rest_mma():
    for d, n_head, n_kv in SHAPES:
        assert dispatch.choose_kernel(1, n_head, n_kv, d, "f16", "f16") == "mma"  # fa_mma's f16 path
        assert dispatch.choose_kernel(1, n_head, n_kv, d, "bf16", "bf16") == "vec"
        assert dispatch.choose_kernel(1, n_head, n_kv, d, "bf16", "f32") == "vec"
        assert dispatch.choose_kernel(1, n_head, n_kv, d, "f16", "bf16") == "mma"
        assert dispatch.choose_kernel(1, n_head, n_kv, d, "f32", "q4_0") == "vec"  # f32: exact values
        assert dispatch.choose_kernel(1, n_head, n_kv, d, "q8_0", "turbo3") == "mma"  # decode tiles
        assert dispatch.choose_kernel(1, n_head, n_kv, d, "q4_0", "q4_0") == "mma"
        # measured faster on fa_vec (VEC_DECODE_FORMATS): turbo3 at head dim 128 only
        assert dispatch.choose_kernel(1, n_head, n_kv, d, "turbo3", "turbo3") == ("vec" if d == 128 else "mma")
        assert dispatch.choose_kernel(64, n_head, n_kv, d, "f16", "f16") == "mma"  # prefill
    assert dispatch.choose_kernel(4, 32, 8, 128, "bf16", "bf16") == "vec"  # 16 rows per KV head
    assert dispatch.choose_kernel(5, 32, 8, 128, "bf16", "bf16") == "mma"  # 20 rows
    assert dispatch.choose_kernel(9, 8, 8, 128, "f16", "f16") == "mma"     # more queries than decode takes
    assert fk.mma_is_decode(16) and not fk.mma_is_decode(17)


@pytest.mark.parametrize("kernel", ("vec", "mma"))
@pytest.mark.parametrize("n_keys", (1, 31, 4096, 65536, 1 << 20))
@pytest.mark.parametrize("shape", SHAPES)
def test_splits_cover_the_keys_in_whole_tiles(shape, n_keys, kernel):
    d, n_head, n_kv = shape
    n_q = 1 if kernel == "vec" else 256
    plan = dispatch.plan_attention(n_q, n_head, n_kv, d, n_keys, 132, kernel)
    tile = (fk.VecGeometry(d) if kernel == "vec" else fk.MmaGeometry(d, fk.mma_is_decode(n_q * n_head // n_kv))).tile
    assert plan.keys_per_split % tile == 0
    assert plan.n_split * plan.keys_per_split >= n_keys > (plan.n_split - 1) * plan.keys_per_split
    if kernel == "vec" and n_keys >= 65536:  # long decode: about DECODE_BLOCKS_PER_SM blocks per SM (less what
        # rounding the splits to whole tiles takes), unless that would leave fewer than DECODE_MIN_KEYS_PER_SPLIT keys
        base = n_kv * -(-(n_head // n_kv) // fk.vec_rows_for(n_head // n_kv))
        want = 0.9 * dispatch.DECODE_BLOCKS_PER_SM * 132
        assert plan.n_split * base >= min(want, base * (n_keys // dispatch.DECODE_MIN_KEYS_PER_SPLIT))
        assert plan.keys_per_split >= dispatch.DECODE_MIN_KEYS_PER_SPLIT


def test_forced_split_count_is_respected():
    plan = dispatch.plan_attention(1, 8, 2, 128, 1000, 132, "vec", n_split=3)
    assert plan.n_split == 3 and plan.keys_per_split * 3 >= 1000


@pytest.mark.parametrize("d", fk.HEAD_DIMS)
def test_shared_memory_fits_every_format_pair_on_sm80(d):
    lens = {n: fk.table_len(get_format(n, head_dim=d)) for n in list_formats()}
    rows = {n: get_format(n, head_dim=d).row_bytes(d) for n in list_formats()}
    for k in list_formats():
        for v in list_formats():
            for r in fk.VEC_ROW_OPTIONS:
                assert fk.vec_smem_bytes(d, r, rows[k], rows[v], lens[k], lens[v]) <= SM80_SMEM_OPTIN
            assert fk.mma_smem_bytes(d, False, rows[k], rows[v], lens[k], lens[v]) <= SM80_SMEM_OPTIN
            if dispatch.choose_kernel(1, 8, 8, d, k, v) == "mma":  # the pairs decode sends to fa_mma
                assert fk.mma_smem_bytes(d, True, rows[k], rows[v], lens[k], lens[v]) <= SM80_SMEM_OPTIN


def test_staged_rows_are_whole_16_byte_units_off_128():
    for row_bytes in (18, 34, 36, 50, 66, 72, 96, 104, 128, 136, 256, 512, 1024, 2048):
        slot = fk.staged_slot_bytes(row_bytes)
        assert slot % 16 == 0 and slot % 128 != 0 and slot >= row_bytes + (2 if row_bytes % 4 else 0)


def test_format_ids_match_the_kernel_enum():
    text = (REPO / "kernels_cu" / "attention" / "fa_common.cuh").read_text()
    body = re.search(r"enum FaFormatId : int \{(.*?)\};", text, re.S).group(1)
    names = [n.strip().split("=")[0].strip() for n in body.split(",") if n.strip()]
    assert names[-1] == "kFaFormatCount" and len(names) - 1 == len(fk.FORMAT_IDS)
    spelled = {"f32": "kFaF32", "f16": "kFaF16", "bf16": "kFaBF16", "q8_0": "kFaQ8_0", "q6_0": "kFaQ6_0",
               "q5_1": "kFaQ5_1", "q5_0": "kFaQ5_0", "q4_1": "kFaQ4_1", "q4_0": "kFaQ4_0", "turbo4": "kFaTurbo4",
               "turbo3": "kFaTurbo3", "turbo2": "kFaTurbo2", "turbo3_tcq": "kFaTurbo3Tcq", "turbo2_tcq": "kFaTurbo2Tcq"}
    for name, index in fk.FORMAT_IDS.items():
        assert names[index] == spelled[name]


def test_every_launchable_kernel_is_declared():
    from cupyllm.cuda.registry import KERNEL_SET_PROVIDERS, KernelRegistry
    assert "cupyllm.ops.attention.gpu" in KERNEL_SET_PROVIDERS
    registry = KernelRegistry()
    names = [fk.mma_kernel_name(d, dec) for d in fk.HEAD_DIMS for dec in (False, True)]
    names += [fk.vec_kernel_name(d, r) for d in fk.HEAD_DIMS for r in fk.VEC_ROW_OPTIONS]
    for g in (0, 64, 128):
        names += [fk.prep_kernel_name(g, q, o) for q in fk.Q_TYPES for o in fk.Q_TYPES]
        names += [fk.combine_kernel_name(g, o) for o in fk.Q_TYPES]
    for name in names:
        registry.kernel_set_for(name)  # raises DeviceError if undeclared


def test_rotation_groups_follow_the_head_dim():
    assert fk.rotation_group(get_format("q4_0"), 128) == 0
    assert fk.rotation_group(get_format("turbo3", head_dim=64), 64) == 64
    assert fk.rotation_group(get_format("turbo3_tcq", head_dim=512), 512) == 128
    with pytest.raises(Exception, match="head_dim"):
        fk.rotation_group(get_format("turbo3", head_dim=64), 128)


def test_auto_prefill_path_picks_by_matrix_size():
    """backend/gpu.py prefill="auto": tensor-core tiles for the small models' matrices, cuBLAS for a 7B's large
    ones (the measured winners); a forced path stays forced."""
    from cupyllm.backend.gpu import prefill_path
    assert prefill_path("auto", 4864, 896) == "mma"      # Qwen2.5-0.5B gate/up
    assert prefill_path("auto", 2048, 640) == "mma"      # Gemma 3 270M gate/up
    assert prefill_path("auto", 3584, 3584) == "cublas"  # Qwen2.5-7B q / o
    assert prefill_path("auto", 18944, 3584) == "cublas"
    assert prefill_path("mma", 18944, 3584) == "mma" and prefill_path("cublas", 64, 64) == "cublas"


def test_vec_decode_formats_are_what_the_last_gpu_run_measured():
    """dispatch.VEC_DECODE_FORMATS is the rule of tools/dispatch_from_bench.py applied to the committed
    bench/results/attention_gpu.json: a new GPU run that times the kernels differently must update it."""
    import json

    from dispatch_from_bench import BENCH_JSON, measured_vec_formats
    results = json.loads(BENCH_JSON.read_text())["results"]
    assert measured_vec_formats(results) == dispatch.VEC_DECODE_FORMATS
