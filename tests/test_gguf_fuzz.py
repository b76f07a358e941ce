"""Fuzzing the GGUF loader (tools/fuzz_gguf.py) over the tiny model of every family: seeded mutants of each
file's header, metadata (keys, value types, values, arrays) and tensor descriptions (names, dimension counts,
dimensions, types, offsets), each loaded by one long-lived worker process under an address-space limit and a
time limit per mutant (a worker that hangs or dies is restarted and the mutant counted as a failure).

Every mutant must be refused with cupyllm's own error (a CupyllmError), or load and give bit for bit the
original's logits (both computed by the worker with one thread). Where a change is a value a valid file may
legitimately have, the logits may differ ("changed-semantic"); this is decided per field, not per outcome:

- metadata values of the keys in fuzz_gguf.SEMANTIC_KEYS: rope base (Gemma 4: also the sliding layers' base),
  rope scaling, RMS epsilon, final and attention soft caps, trained context length, sliding window, experts
  used per token (any of 1..expert_count), and Gemma 4's sliding-layer rotary dims (partial rotation is legal
  there); and the removal of such a key by a renamed key (its default is legal too);
- any value of `general.*` but the architecture and alignment, and of `tokenizer.*` (they change tokenization,
  not the logits of given ids);
- a tensor type changed to another supported type of the same bytes per row (F16 / BF16, Q4_0 / Q4_K,
  Q5_0 / Q5_K): the same bytes read as other weights are a valid file.

A load that warns (ModelFileWarning: a tensor of an unknown name set aside, e.g. a renamed optional output
head or Gemma 4 V projection) may differ too: it is reported, not silent. Everything else is structural: header
counts, string and array lengths, value and item types, the names of other keys, head counts and sizes, layer,
vocabulary and expert counts, per-layer arrays, tensor names, dimensions, types and offsets must be refused or
exact.
"""
from __future__ import annotations

import struct

import pytest

import fuzz_gguf
import make_tiny_models

MUTANTS_PER_FAMILY = 1000
SEED = 31


@pytest.fixture(scope="module")
def worker():
    # 4 GiB of address space: a worker compiling the CPU kernels (a fresh cache) peaks near 1.1 GB
    w = fuzz_gguf.Worker(as_limit=4 << 30, timeout=60.0, first_timeout=1800.0)
    yield w
    w.close()


@pytest.mark.parametrize("arch", make_tiny_models.ARCHES)
def test_mutants_are_refused_or_exact(tiny_model, worker, tmp_path, arch):
    path, _, _ = tiny_model(arch)
    report = fuzz_gguf.fuzz(path, MUTANTS_PER_FAMILY, seed=SEED, worker=worker, workdir=tmp_path)
    assert not report.failures, report.summary()
    assert sum(report.counts.values()) == MUTANTS_PER_FAMILY
    # both ways out are exercised: most mutants are refused, some load and are compared
    assert report.counts["refused"] > MUTANTS_PER_FAMILY // 2, report.summary()
    assert report.counts["exact"] > 0, report.summary()


def _mutant(path, key: str, value: float, semantic: bool) -> fuzz_gguf.Mutant:
    fields, _ = fuzz_gguf.parse_layout(path.read_bytes())
    f = next(f for f in fields if f.kind == "value" and f.owner == key)
    return fuzz_gguf.Mutant(0, [(f.start, struct.pack(fuzz_gguf._VALUE_FORMATS[f.vtype], value))], key, "value",
                            semantic)


def _run(worker, path, tmp_path, mutant):
    data = bytearray(path.read_bytes())
    for offset, raw in mutant.patches:
        data[offset:offset + len(raw)] = raw
    out = tmp_path / "mutant.gguf"
    out.write_bytes(bytes(data))
    return fuzz_gguf.classify(worker.check(str(out)), mutant)


def test_the_harness_tells_the_outcomes_apart(tiny_model, worker, tmp_path):
    """The comparison is not vacuous: a changed RMS epsilon loads with other logits, flagged WRONG unless its key
    is declared semantic; a bad layer count is refused; a value that leaves the logits alone is exact (the tiny
    Gemma 3's three layers are all sliding-window ones: the global rope base is unused)."""
    path, _, _ = tiny_model("gemma3")
    worker.reference(str(path))
    eps = "gemma3.attention.layer_norm_rms_epsilon"
    assert _run(worker, path, tmp_path, _mutant(path, eps, 1e-2, semantic=False)) == "WRONG"
    assert _run(worker, path, tmp_path, _mutant(path, eps, 1e-2, semantic=True)) == "changed-semantic"
    assert _run(worker, path, tmp_path, _mutant(path, "gemma3.block_count", 2**27, semantic=False)) == "refused"
    assert _run(worker, path, tmp_path, _mutant(path, "gemma3.rope.freq_base", 5e5, semantic=False)) == "exact"
