"""Weight block formats: our NumPy dequantization against the `gguf` package's independent one, and the numba
matmul kernels (streamed GEMV, integer GEMM and BLAS tiles) against the NumPy reference; the activation codes the quantized
matmuls multiply (ops/matmul/activation_codes.py) against their definition.
The CPU kernels (fused GEMV, prefill GEMM, row dequantization) of every weight format against the NumPy reference."""
from __future__ import annotations

import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from cupyllm.ops import simd
from cupyllm.ops.matmul import cpu as cpu_linear, cpu_gemm
from cupyllm.ops.matmul.activation_codes import (ACTIVATION_LEVELS, dequantize_activations, quantize_activations,
                                                 round_activations)
from cupyllm.ops.matmul.cpu import matmul, matmul_each, matmul_many
from cupyllm.ops.matmul.cpu_gemm import gemm_many
from cupyllm.ops.matmul.cpu_gemv import (F16_TABLE, dequantize_ids, dequantize_numba, gemv_blocks, gemv_many,
                                         quantize_activation_row)
from cupyllm.ops.matmul.cpu_interleaved import (LAYOUTS, deinterleave_rows_reference, interleave_rows,
                                                interleave_rows_reference)
from cupyllm.ops.matmul.reference import FLOAT_TYPES, WEIGHT_FORMATS, dequantize


QUANTIZABLE = (T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1)  # gguf.quants can quantize these


K_QUANTS = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}  # fp16 scale offsets inside each block


def random_rows(qtype: T, n_rows: int, n_in: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if qtype == T.F32:
        return rng.standard_normal((n_rows, n_in)).astype(np.float32).view(np.uint8)
    if qtype in QUANTIZABLE:
        packed = gguf.quants.quantize(rng.standard_normal((n_rows, n_in)).astype(np.float32), qtype)
        return np.ascontiguousarray(packed).view(np.uint8).reshape(n_rows, -1)
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = n_rows * n_in // block_values
    raw = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    for off in K_QUANTS[qtype]:  # finite scales: random bytes could spell inf/NaN
        raw[:, off:off + 2] = rng.uniform(-0.05, 0.05, n_blocks).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(n_rows, -1)


@pytest.mark.parametrize("qtype", list(WEIGHT_FORMATS), ids=lambda t: t.name)
def test_reference_dequant_equals_gguf(qtype):
    rows = random_rows(qtype, 8, 512)
    ours = dequantize(rows, qtype, 512)
    theirs = gguf.quants.dequantize(rows, qtype).reshape(8, 512)
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("qtype", list(WEIGHT_FORMATS), ids=lambda t: t.name)
def test_numba_dequant_equals_reference(qtype):
    rows = random_rows(qtype, 8, 512, seed=1)
    fmt = WEIGHT_FORMATS[qtype]
    np.testing.assert_allclose(dequantize_numba(rows, fmt, 512), dequantize(rows, qtype, 512), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("codes", [True, False], ids=["codes", "tiles"])
@pytest.mark.parametrize("n_tok", [1, 2, 9, 40])  # GEMV; GEMM (a padded tile; a whole one and a padded one)
@pytest.mark.parametrize("qtype", list(WEIGHT_FORMATS), ids=lambda t: t.name)
def test_matmul_from_blocks(qtype, n_tok, codes, monkeypatch):
    """Every kernel `matmul` picks against float64 products: the GEMV and GEMM multiply x_hat (x's 16-bit codes),
    the f32 tiles (ACTIVATION_CODES off) and float weights x itself."""
    monkeypatch.setattr(cpu_linear, "ACTIVATION_CODES", codes)
    n_out, n_in = 302, 512  # n_out not a multiple of the row tile, thread chunk or GEMM row quad
    rows = random_rows(qtype, n_out, n_in, seed=2)
    x = np.random.default_rng(3).standard_normal((n_tok, n_in)).astype(np.float32)
    rounded = qtype not in FLOAT_TYPES and codes  # the integer kernels multiply x's codes
    x_hat = dequantize_activations(*quantize_activations(x)) if rounded else x
    reference = x_hat.astype(np.float64) @ dequantize(rows, qtype, n_in).astype(np.float64).T
    got = matmul(x, rows, WEIGHT_FORMATS[qtype], n_in)
    assert got.dtype == np.float32 and got.shape == (n_tok, n_out)
    np.testing.assert_allclose(got, reference, rtol=2e-5, atol=2e-5 * np.abs(reference).max())


@pytest.mark.parametrize("n_tok", [9, 16, 17, 40, 64])  # half tiles (<= 16 tokens) and whole ones
@pytest.mark.parametrize("qtype", [t for t in WEIGHT_FORMATS if WEIGHT_FORMATS[t].code in cpu_gemm.GEMM_CODES],
                         ids=lambda t: t.name)
def test_wide_gemm_equals_the_narrow_one(qtype, n_tok):
    """The wide micro-kernel (8 rows x 32 tokens in 512-bit lanes) is the narrow one's arithmetic lane by lane:
    bit-equal results, rows past a multiple of 8 (and of the 32-row task) included. (It runs on any machine;
    without AVX-512 LLVM splits its vectors, so the engine only takes it where simd.MACHINE_HAS_512_BIT_LANES.)"""
    n_out, n_in = 301, 2048  # two K_CHUNK passes; a last task of 13 rows
    rows = random_rows(qtype, n_out, n_in, seed=5)
    x = np.random.default_rng(6).standard_normal((n_tok, n_in)).astype(np.float32)
    xp, xd, xs = cpu_gemm.pack_activations(x)
    fmt = WEIGHT_FORMATS[qtype]
    narrow, wide = (np.full((n_tok, n_out), np.nan, np.float32) for _ in range(2))
    cpu_gemm.gemm_blocks(fmt.code, rows, xp, xd, xs, n_tok, narrow, F16_TABLE)
    cpu_gemm.gemm_blocks_wide(fmt.code, rows, xp, xd, xs, n_tok, wide, F16_TABLE)
    assert np.isfinite(narrow).all()
    np.testing.assert_array_equal(wide, narrow)


def activation_rows() -> np.ndarray:
    """Rows that reach every case: normal values, an all-zero block, exact halves (ties round to even), one
    huge outlier, negative blocks, subnormals."""
    x = np.random.default_rng(4).standard_normal((6, 256)).astype(np.float32) * 3
    x[0, :32] = 0
    x[1, 32:64] = np.arange(32) - 15.5  # with 32767 in the block the scale is 1: every value is a tie
    x[1, 32] = 32767
    x[2, 5] = 1e30
    x[3, :64] = -np.abs(x[3, :64]) - 1000
    x[4, 64:96] = np.float32(1e-40) * np.arange(32)
    return x


def test_activation_codes_follow_their_definition():
    """quantize_activations: codes within 1/2 step of x / scale, each block's max at +-32767; all-zero blocks and
    blocks too small for a normal scale (the subnormals) at 0."""
    x = activation_rows()
    codes, scales = quantize_activations(x)
    codes = codes.reshape(6, -1, 32)
    normal = scales >= np.finfo(np.float32).tiny
    assert not normal[0, 0] and not normal[4, 2] and normal.sum() == normal.size - 2
    assert np.all(codes[~normal] == 0)
    exact = x.reshape(6, -1, 32)[normal].astype(np.float64) / scales[normal, None].astype(np.float64)
    assert np.abs(codes[normal] - exact).max() <= 0.5 + 1e-3
    assert np.all(np.abs(codes[normal]).max(-1) == ACTIVATION_LEVELS)
    assert scales[1, 1] == 1  # ties go to the even code
    np.testing.assert_array_equal(codes[1, 1, 1:], np.rint(np.arange(1, 32) - 15.5))
    x_hat = dequantize_activations(codes.reshape(6, -1), scales).astype(np.float64)
    bound = np.repeat(scales, 32, axis=-1) * 0.5 + np.abs(x) * 2.0 ** -23  # half a step, and x_hat's own rounding
    assert np.all((np.abs(x_hat - x) <= bound)[np.repeat(normal, 32, axis=-1)])


def test_numba_activation_codes_equal_reference():
    """The GEMV's codes and scales bit for bit as NumPy's; its block sums of x_hat."""
    x = activation_rows()
    codes, scales = quantize_activations(x)
    for r in range(x.shape[0]):
        xq, xd, xsum = np.empty(256, np.int16), np.empty(8, np.float32), np.empty(8, np.float32)
        quantize_activation_row(x[r], xq, xd, xsum)
        np.testing.assert_array_equal(xq, codes[r])
        np.testing.assert_array_equal(xd, scales[r])
        np.testing.assert_allclose(xsum, (codes[r].reshape(-1, 32).astype(np.float64) * scales[r, :, None]).sum(-1),
                                   rtol=1e-6)


# one K-block; Qwen's d_model (28 blocks of 32); larger; float rows with a tail past the 16-lane steps
@pytest.mark.parametrize("n_in", [256, 896, 1536, 260])
@pytest.mark.parametrize("qtype", list(WEIGHT_FORMATS), ids=lambda t: t.name)
def test_gemv_and_gemm_match_reference(qtype, n_in):
    """The decode GEMV (one token, six and seven tokens; narrow and wide) and the prefill GEMM (35 tokens: a whole 32-token tile and a padded one; 20
    tokens; 37 rows: a padded row quad) against float64 products of the dequantized weight and x_hat, each result within
    2e-6 of the sum of its products' magnitudes."""
    fmt = WEIGHT_FORMATS[qtype]
    if n_in % fmt.block_values:
        pytest.skip("row length not a whole number of blocks")
    n_out = 37
    rows = random_rows(qtype, n_out, n_in, seed=n_in)
    # activations with a large common offset: the folded block offsets/mins must not lose precision
    x = (np.random.default_rng(5).standard_normal((35, n_in)) + 3.0).astype(np.float32)
    x[7, :64] = 0  # all-zero blocks: zero codes and scale
    x_hat = x if qtype in FLOAT_TYPES else round_activations(x)  # block formats multiply the 16-bit codes
    weight = dequantize(rows, qtype, n_in).astype(np.float64)
    reference = x_hat.astype(np.float64) @ weight.T
    scale = np.abs(x_hat).astype(np.float64) @ np.abs(weight).T
    for wide in (False, True):  # (the 512-bit GEMV; on a machine without AVX-512 LLVM splits it)
        one = np.empty((1, n_out), np.float32)
        for n_tok in (6, 7):  # four tokens at a time, then two (the two-token kernels) or three as four
            out = np.empty((n_tok, n_out), np.float32)
            gemv_blocks(np.array([fmt.code]), (rows,), x[:n_tok], (out,), F16_TABLE, wide)
            np.testing.assert_array_less(np.abs(out - reference[:n_tok]), 2e-6 * scale[:n_tok] + 1e-30)
            for t in range(n_tok):  # each token's values are the one-token kernel's, bit for bit
                gemv_blocks(np.array([fmt.code]), (rows,), x[t:t + 1], (one,), F16_TABLE, wide)
                np.testing.assert_array_equal(out[t], one[0])
    if qtype not in FLOAT_TYPES:  # (float weights go to BLAS)
        for n_tok in (35, 20):  # a last tile of 3 tokens (the half-width kernel), one tile of 20 (full width)
            got = gemm_many(x[:n_tok], [(rows, fmt)])[0]
            assert got.shape == (n_tok, n_out)
            np.testing.assert_array_less(np.abs(got - reference[:n_tok]), 2e-6 * scale[:n_tok] + 1e-30)


@pytest.mark.parametrize("n_tok", [1, 2, 9])  # one parallel GEMV for all weights; two tokens; the GEMMs
def test_matmul_many_equals_one_matmul_per_weight(n_tok):
    """q/k/v and gate/up share one call: mixed formats and row counts give the very values of separate calls
    (a float32 weight among them too: DeltaNet's alpha beside its qkv)."""
    from gguf import GGMLQuantizationType as T
    shapes = [(T.Q5_0, 70), (T.Q8_0, 9), (T.F32, 16), (T.Q4_K, 130), (T.Q6_K, 1)]
    weights = [(random_rows(qtype, n_out, 512, seed=n_out), WEIGHT_FORMATS[qtype]) for qtype, n_out in shapes]
    x = np.random.default_rng(7).standard_normal((n_tok, 512)).astype(np.float32)
    for got, (rows, fmt) in zip(matmul_many(x, weights, 512), weights):
        np.testing.assert_array_equal(got, matmul(x, rows, fmt, 512))


@pytest.mark.parametrize("qtype", list(WEIGHT_FORMATS), ids=lambda t: t.name)
@pytest.mark.parametrize("n_chosen", [3, 20])  # one grouped launch; more weights than one launch takes
def test_grouped_expert_gemv_equals_one_matmul_per_expert(qtype, n_chosen):
    """A decode step's chosen experts (views of one stacked [n_expert, n_out, row_bytes] tensor, as the GGUF's
    expert tensors are held), each reading its own row of xs, in one call: the values of one matmul per expert."""
    n_expert, n_out, n_in = 24, 40, 512
    stacked = random_rows(qtype, n_expert * n_out, n_in, seed=3).reshape(n_expert, n_out, -1)
    stacked.flags.writeable = False
    fmt = WEIGHT_FORMATS[qtype]
    chosen = np.random.default_rng(5).permutation(n_expert)[:n_chosen]
    xs = np.random.default_rng(6).standard_normal((4, n_in)).astype(np.float32)
    x_of = np.arange(n_chosen) % 4
    got = matmul_each(xs, [(stacked[e], fmt) for e in chosen], x_of, n_in)
    assert len(got) == n_chosen
    for y, e, r in zip(got, chosen, x_of):
        np.testing.assert_array_equal(y, matmul(xs[r:r + 1], stacked[e], fmt, n_in)[0])


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.Q6_K, T.F32], ids=lambda t: t.name)
def test_grouped_matmul_equals_each_group_alone(qtype):
    """A prefill's experts: each group of rows (the tokens routed to one expert; one row or a few for a grouped
    GEMV launch, more than TOKENS_PER_GEMV for the GEMM) through its pair of weights, stacked in the rows' order:
    the values of matmul_many on the group's rows alone, bit for bit."""
    n_expert, n_out, n_in = 9, 40, 512
    stacked = random_rows(qtype, n_expert * n_out, n_in, seed=8).reshape(n_expert, n_out, -1)
    stacked.flags.writeable = False
    fmt = WEIGHT_FORMATS[qtype]
    sizes = [1, 3, 8, 12, 2, 40, 5, 7]  # (one launch for the groups of up to TOKENS_PER_GEMV rows)
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    xs = np.random.default_rng(9).standard_normal((bounds[-1], n_in)).astype(np.float32)
    groups = [[(stacked[e], fmt), (stacked[e + 1], fmt)] for e in range(len(sizes))]
    got = cpu_linear.matmul_grouped(xs, groups, bounds, n_in)
    assert [y.shape for y in got] == [(bounds[-1], n_out)] * 2
    for weights, a, b in zip(groups, bounds, bounds[1:]):
        for y, alone in zip(got, matmul_many(xs[a:b], weights, n_in)):
            np.testing.assert_array_equal(y[a:b], alone)


@pytest.mark.parametrize("qtype", list(WEIGHT_FORMATS), ids=lambda t: t.name)
def test_row_dequantization_is_bit_exact(qtype):
    """Prefill tiles and embedding lookups: the very float32 values of the NumPy definition."""
    rows = random_rows(qtype, 9, 512, seed=4)
    reference = dequantize(rows, qtype, 512)
    fmt = WEIGHT_FORMATS[qtype]
    np.testing.assert_array_equal(dequantize_numba(rows, fmt, 512, slice(2, 7)), reference[2:7])
    np.testing.assert_array_equal(dequantize_ids(rows, fmt, 512, np.array([8, 0, 8, 3])), reference[[8, 0, 8, 3]])


@pytest.mark.skipif(not simd.MACHINE_HAS_VNNI, reason="this machine runs the madd path itself")
def test_wide_k_quant_kernels_without_vnni(tmp_path):
    """The wide Q4_K / Q5_K GEMV of an AVX-512 machine without VNNI (the madd path of _k_token_wide, which this
    machine does not run): test_gemv_and_gemm_match_reference for both formats, in a process that compiles for
    this CPU less VNNI (NUMBA_CPU_FEATURES, a cache of its own)."""
    from llvmlite import binding
    features = ",".join(("+" if on else "-") + name for name, on in binding.get_host_cpu_features().items()
                        if name != "avx512vnni") + ",-avx512vnni"
    env = {**os.environ, "NUMBA_CPU_FEATURES": features, "NUMBA_CPU_NAME": binding.get_host_cpu_name(),
           "NUMBA_CACHE_DIR": str(tmp_path)}
    script = ("import sys, pytest\n"
              "from cupyllm.ops import simd\n"
              "assert simd.MACHINE_HAS_512_BIT_LANES and not simd.MACHINE_HAS_VNNI\n"
              f"sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', {__file__!r} + "
              "'::test_gemv_and_gemm_match_reference', '-k', 'Q4_K or Q5_K']))\n")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "4 passed" in done.stdout


# --- rows interleaved 16 at a time (cpu_interleaved.py): the decode GEMV's Q8_0, Q5_0, Q4_K and Q6_K -------------

X16_TYPES = [T.Q8_0, T.Q5_0, T.Q4_K, T.Q6_K]


def random_blocks(qtype: T, n_rows: int, n_in: int, seed: int) -> np.ndarray:
    """Rows of random code bytes (every high-bit pattern of Q5_0 too) under finite fp16 scales."""
    rows = random_rows(qtype, n_rows, n_in, seed=seed)
    if qtype in QUANTIZABLE:  # (random_rows quantizes these: random bytes after each block's d)
        rows = rows.reshape(n_rows, -1, WEIGHT_FORMATS[qtype].block_bytes).copy()
        rows[:, :, 2:] = np.random.default_rng(seed).integers(0, 256, rows[:, :, 2:].shape, dtype=np.uint8)
        rows = rows.reshape(n_rows, -1)
    rows.flags.writeable = False
    return rows


@pytest.mark.parametrize("qtype", X16_TYPES, ids=lambda t: t.name)
def test_interleaved_layout_follows_its_definition(qtype):
    """The numba interleaving writes the NumPy definition's bytes, which deinterleave_rows_reference turns back
    into the rows; for Q8_0 and Q5_0 also each value read back from the x16 layout as the module's docstring
    places it (loops over rows, blocks and values) is the GGUF row's value (the K-quants' kernels read theirs
    in test_interleaved_gemv_matches_reference)."""
    n_rows, n_in = 32, 512
    rows = random_blocks(qtype, n_rows, n_in, seed=11)
    layout = LAYOUTS[qtype.name]
    x16 = interleave_rows(rows, layout)
    np.testing.assert_array_equal(x16, interleave_rows_reference(rows, layout))
    np.testing.assert_array_equal(deinterleave_rows_reference(x16, layout), rows)
    if qtype not in (T.Q8_0, T.Q5_0):
        return
    want = dequantize(rows, qtype, n_in)
    for g in range(n_rows // 16):
        for b in range(n_in // 32):
            block = x16[g, b * layout.x16_bytes:(b + 1) * layout.x16_bytes]
            d = block[:32].view(np.float16).astype(np.float32)
            h = block[32:96].view(np.uint16) if qtype == T.Q5_0 else None
            for r in range(16):
                for k in range(32):
                    if qtype == T.Q8_0:
                        code = int(block[32 + 32 * (k // 2) + 2 * r + k % 2].view(np.int8))
                    else:
                        p, j, upper = (k % 16) // 2, k % 2, k >= 16
                        byte = int(block[96 + 32 * p + 2 * r + j])
                        code = ((byte >> 4 if upper else byte & 15) | ((int(h[2 * r + j]) >> (p + 8 * upper)) & 1) << 4) - 16
                    assert np.float32(code) * d[r] == want[16 * g + r, 32 * b + k]


@pytest.mark.parametrize("n_in", [256, 896, 1536])
@pytest.mark.parametrize("qtype", X16_TYPES, ids=lambda t: t.name)
def test_interleaved_gemv_matches_reference(qtype, n_in):
    """The GEMV on interleaved rows for 1 to 8 tokens (fours, three as four, twos, ones) against float64 products
    of the dequantized weight and x_hat, within 2e-6 of the sum of the products' magnitudes; each token's
    values are its one-token run's, bit for bit; beside other weights in one call, each weight's values are its
    own call's."""
    if n_in % WEIGHT_FORMATS[qtype].block_values:
        pytest.skip("row length not a whole number of blocks")
    n_out = 48
    rows = random_blocks(qtype, n_out, n_in, seed=n_in)
    layout = LAYOUTS[qtype.name]
    x16 = (interleave_rows(rows, layout), layout)
    x = (np.random.default_rng(5).standard_normal((8, n_in)) + 3.0).astype(np.float32)
    x[3, :64] = 0
    x_hat = round_activations(x)
    weight = dequantize(rows, qtype, n_in).astype(np.float64)
    reference = x_hat.astype(np.float64) @ weight.T
    scale = np.abs(x_hat).astype(np.float64) @ np.abs(weight).T
    for n_tok in range(1, 9):
        out, = gemv_many(x[:n_tok], [x16])
        assert out.shape == (n_tok, n_out)
        np.testing.assert_array_less(np.abs(out - reference[:n_tok]), 2e-6 * scale[:n_tok] + 1e-30)
        for t in range(n_tok):
            np.testing.assert_array_equal(out[t], gemv_many(x[t:t + 1], [x16])[0][0])
    other = (random_rows(T.Q4_0, 37, n_in, seed=3), WEIGHT_FORMATS[T.Q4_0])
    for n_tok in (1, 3):
        together = matmul_many(x[:n_tok], [other, (rows, WEIGHT_FORMATS[qtype]), other], n_in, [None, x16, None])
        np.testing.assert_array_equal(together[1], gemv_many(x[:n_tok], [x16])[0])
        np.testing.assert_array_equal(together[0], matmul(x[:n_tok], *other, n_in))
        np.testing.assert_array_equal(together[2], together[0])


@pytest.mark.parametrize("n_tok", [9, 16, 17, 40, 64])  # a last tile of 16 with padding tokens, whole tiles
@pytest.mark.parametrize("qtype", X16_TYPES, ids=lambda t: t.name)
def test_interleaved_gemm_equals_the_row_gemm(qtype, n_tok):
    """The prefill GEMM on interleaved rows gives the row GEMM's values bit for bit (the same integer sums per
    scale group, scale products and FMAs in the same order), over two GEMM_K_CHUNK passes and three groups of
    rows. (Its micro-kernel holds 16 rows a 512-bit register; it runs on any machine, the engine takes it where
    simd.MACHINE_HAS_512_BIT_LANES.)"""
    n_out, n_in = 48, 2048
    rows = random_blocks(qtype, n_out, n_in, seed=7)
    layout = LAYOUTS[qtype.name]
    x = np.random.default_rng(8).standard_normal((n_tok, n_in)).astype(np.float32)
    by_rows, = gemm_many(x, [(rows, WEIGHT_FORMATS[qtype])])
    interleaved, = gemm_many(x, [(rows, WEIGHT_FORMATS[qtype])], [(interleave_rows(rows, layout), layout)])
    assert np.isfinite(by_rows).all()
    np.testing.assert_array_equal(interleaved, by_rows)


def test_interleaved_weights_take_the_gemv_up_to_their_token_count():
    """Up to TOKENS_PER_X16_GEMV tokens, weights all interleaved go through the GEMV (each token's values its
    one-token run's), beside float32 weights too; one weight of GGUF rows among them, or more tokens, and the
    call is the GEMM's."""
    n_in = 256
    rows = random_blocks(T.Q4_K, 32, n_in, seed=4)
    fmt, layout = WEIGHT_FORMATS[T.Q4_K], LAYOUTS["Q4_K"]
    x16 = (interleave_rows(rows, layout), layout)
    x = np.random.default_rng(2).standard_normal((cpu_linear.TOKENS_PER_X16_GEMV + 1, n_in)).astype(np.float32)
    many = x[:cpu_linear.TOKENS_PER_X16_GEMV]
    both = matmul_many(many, [(rows, fmt), (rows, fmt)], n_in, [x16, x16])
    for y in both:
        np.testing.assert_array_equal(y, np.concatenate([gemv_many(row[None], [x16])[0] for row in many]))
    mixed = matmul_many(many, [(rows, fmt), (rows, fmt)], n_in, [x16, None])
    np.testing.assert_array_equal(mixed[1], gemm_many(many, [(rows, fmt)])[0])
    floats = np.random.default_rng(3).standard_normal((16, n_in)).astype(np.float32)  # (DeltaNet's alpha / beta)
    f32 = (floats.view(np.uint8), WEIGHT_FORMATS[T.F32])
    beside = matmul_many(many, [(rows, fmt), f32, (rows, fmt)], n_in, [x16, None, x16])
    np.testing.assert_array_equal(beside[0], both[0])
    np.testing.assert_array_equal(beside[2], both[0])
    np.testing.assert_array_equal(beside[1], matmul(many, *f32, n_in))
    np.testing.assert_array_equal(matmul(x, rows, fmt, n_in, x16), gemm_many(x, [(rows, fmt)], [x16])[0])


@pytest.mark.skipif(not simd.MACHINE_HAS_512_BIT_LANES, reason="rows interleave where the machine has 512-bit lanes")
def test_cpu_backend_multiplies_interleaved_rows_where_memory_allows(monkeypatch):
    """The CPU backend's matmuls read a Q8_0 / Q5_0 weight's rows interleaved (made on its first matmul, kept),
    decode and prefill; with too little host memory for the copy, the GGUF's rows."""
    from cupyllm.backend import cpu as cpu_backend
    from cupyllm.models.weights import Weight
    n_in = 256
    rows = random_blocks(T.Q8_0, 32, n_in, seed=2)
    weight = Weight("w", WEIGHT_FORMATS[T.Q8_0], (32, n_in), rows)
    x = np.random.default_rng(1).standard_normal((40, n_in)).astype(np.float32)
    x16 = (interleave_rows(rows, LAYOUTS["Q8_0"]), LAYOUTS["Q8_0"])
    backend = cpu_backend.CPUBackend()
    np.testing.assert_array_equal(backend.linear(x[:2], weight), gemv_many(x[:2], [x16])[0])
    np.testing.assert_array_equal(backend.linear_many(x[:1], [weight, weight])[1], gemv_many(x[:1], [x16])[0])
    np.testing.assert_array_equal(backend.linear(x[:20], weight), gemv_many(x[:20], [x16])[0])  # (the GEMV's)
    np.testing.assert_array_equal(backend.linear(x, weight), gemm_many(x, [(rows, weight.fmt)], [x16])[0])
    assert backend._x16[id(rows)][1][0] is backend._interleaved(weight)[0]  # (made once)
    monkeypatch.setattr(cpu_backend, "host_bytes_available", lambda: 3.0 * rows.nbytes)
    short = cpu_backend.CPUBackend()
    np.testing.assert_array_equal(short.linear(x[:2], weight), gemv_many(x[:2], [(rows, weight.fmt)])[0])
    assert short._interleaved(weight) is None


@pytest.mark.skipif(not simd.MACHINE_HAS_512_BIT_LANES, reason="rows interleave where the machine has 512-bit lanes")
def test_the_interleaving_shows_its_progress_until_the_step_after(monkeypatch, capsys):
    """The first forward's interleaving has a bar (made past INTERLEAVE_BAR_DELAY_S: here with the second
    weight), closed by the first matmul that finds its weights interleaved already."""
    from cupyllm.backend import cpu as cpu_backend
    from cupyllm.models.weights import Weight
    monkeypatch.setattr(cpu_backend, "INTERLEAVE_BAR_DELAY_S", -1)
    weights = [Weight(f"w{i}", WEIGHT_FORMATS[T.Q5_0], (32, 256), random_blocks(T.Q5_0, 32, 256, seed=i))
               for i in range(2)]
    backend = cpu_backend.CPUBackend()
    x = np.ones((1, 256), np.float32)
    backend.linear(x, weights[0])
    backend.linear(x, weights[1])  # (still the first step: a new weight)
    assert "interleaving the weights' rows" in capsys.readouterr().err
    assert backend._x16_bar is not None and backend._x16_bar.n == sum(w.data.nbytes for w in weights)
    backend.linear(x, weights[0])
    assert backend._x16_bar is None
