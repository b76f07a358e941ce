"""The CPU kernels compile once per machine (cupyllm/backend/precompile.py): a run after that compiles nothing,
whatever its prompt length, KV types, weight formats or thread count."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Runs in a fresh process, so that only numba's on-disk cache can spare it compiling: every numba compile event
# of the runs is counted. The runs differ from one another (and from the precompile's tiny calls) in what could
# make a kernel compile again: prompt length (decode GEMV, prefill GEMM, more than one prefill chunk), KV types
# (scalar, rotated, trellis-coded, the float32 mirror), threads, model family (with Qwen3.5's Gated DeltaNet
# layers) and weight formats.
RUNS = r"""
import json, sys
from numba.core import event

compiled = []

class Count(event.Listener):
    def on_start(self, ev):
        f = getattr((ev.data or {}).get("dispatcher"), "py_func", None)
        compiled.append(f"{getattr(f, '__module__', '?')}.{getattr(f, '__qualname__', '?')}")

    def on_end(self, ev):
        pass

event.register("numba:compile", Count())
import cupyllm
from cupyllm.backend import precompile

assert precompile.is_compiled()  # (else the backend would compile in its worker processes, unseen here)

runs = [(1, 3, "f16", "f16", None, False), (1, 21, "q8_0", "turbo3", 1, False),
        (2, 40, "turbo3_tcq", "q4_0", None, False), (2, 5, "q8_0", "turbo2", 1, True), (3, 20, "q8_0", "f16", 1, False),
        (3, 2, "f16", "f16", None, False), (4, 9, "q8_0", "q8_0", None, False)]
for model_arg, n_prompt, kv_k, kv_v, threads, mirror in runs:
    model = cupyllm.load(sys.argv[model_arg], device="cpu", kv_type_k=kv_k, kv_type_v=kv_v,
                         threads=threads, kv_mirror=mirror, max_chunk=16)
    model.generate([1 + i % 50 for i in range(n_prompt)], max_tokens=3, temperature=0)
# a prompt past the GEMV's tokens in one chunk: the prefill GEMM on rows interleaved and as stored
model = cupyllm.load(sys.argv[1], device="cpu")
model.generate([1 + i % 50 for i in range(40)], max_tokens=2, temperature=0)

# the server's batcher: its thread warm-up, then decode steps of several sequences in one forward (Gemma 3; the
# Qwen3.5 hybrid's DeltaNet layers on each sequence's rows)
import numpy as np
from cupyllm.models.batch import Segment, forward_batch
from cupyllm.server.engine import start_cpu_threads
start_cpu_threads()
for model_arg in (1, 3):
    model = cupyllm.load(sys.argv[model_arg], device="cpu", max_chunk=16)
    t = model.transformer
    caches = [t.ops.new_cache(model.cfg, model.kv_spec) for _ in range(3)]
    for cache, n in zip(caches, (5, 9, 2)):
        forward_batch(t, [Segment(np.arange(1, n + 1), cache)])
        cache.n_past = n
    for step in range(2):
        forward_batch(t, [Segment(np.array([7 + step]), cache) for cache in caches])
        for cache in caches:
            cache.n_past += 1
print(json.dumps(compiled))
"""


def test_a_run_after_the_precompile_compiles_nothing(tiny_model):
    """Compile events counted in a process that runs tiny Gemma 3, Qwen3, Qwen3.5 (Gated DeltaNet) and
    Qwen3.5-MoE models with prompts of 2 to 40 tokens (chunks of 16, and one of 40: the GEMM on interleaved rows
    and on rows as stored), six KV formats and the mirror, 1 and all threads, and the server's batcher (its
    warm-up, batched decode steps), after the precompile filled the cache: none. (The cache is the suite's own, which earlier tests
    fill too; the strict form of this check, on a fresh NUMBA_CACHE_DIR, takes the whole precompile:
    docs/benchmarks.md#cpu-first-run.)"""
    from cupyllm.backend import precompile

    precompile.ensure_compiled()  # (normally done already: by the first CPU backend of the test session)
    assert precompile.is_compiled()
    models = [str(tiny_model(arch)[0]) for arch in ("gemma3", "qwen3", "qwen35", "qwen35-moe")]
    out = subprocess.run([sys.executable, "-c", RUNS, *models], capture_output=True, text=True, cwd=ROOT,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_stamp_follows_the_sources(monkeypatch, tmp_path):
    """The stamp's key changes with any kernel source's bytes (a changed kernel is compiled again), and
    is_compiled reads the stamp of the current key only."""
    from cupyllm.backend import precompile

    source = tmp_path / "kernel.py"
    source.write_text("x = 1\n")
    monkeypatch.setattr(precompile, "SOURCES", [source])
    monkeypatch.setattr(precompile, "cache_dir", lambda: tmp_path)
    before = precompile.cache_key()
    assert not precompile.is_compiled()
    precompile.stamp_path().write_text("")
    assert precompile.is_compiled()
    source.write_text("x = 2\n")
    assert precompile.cache_key() != before
    assert not precompile.is_compiled()


def test_a_new_compile_drops_every_cached_kernel_of_the_sources(monkeypatch, tmp_path):
    """numba keys a cached kernel by its own file alone, so one that inlines another file's helpers would load
    stale after they changed: compile_all deletes the cache files of every cached kernel in SOURCES' modules
    before it compiles. _cached_kernel_files finds a stale index file of a source module beside the kernels (not
    another module's); compile_all (here with no jobs, and a file of tmp_path standing for the cache's) deletes
    what it finds."""
    from cupyllm.backend import precompile
    from cupyllm.ops.matmul import cpu_gemv

    folder = Path(cpu_gemv.gemv_blocks._cache._cache_path)
    folder.mkdir(parents=True, exist_ok=True)
    stale = folder / "cpu_gemv.no_such_kernel-1.py0.nbi"  # (a name numba's index files take)
    other = folder / "unrelated.kernel-1.py0.nbi"
    try:
        stale.write_bytes(b"")
        other.write_bytes(b"")
        found = precompile._cached_kernel_files()
        assert stale in found and other not in found
    finally:
        stale.unlink(missing_ok=True)
        other.unlink(missing_ok=True)
    cached = tmp_path / "cpu_gemv.gemv_blocks-1.py0.nbc"
    cached.write_bytes(b"")
    monkeypatch.setattr(precompile, "_cached_kernel_files", lambda: [cached])
    monkeypatch.setattr(precompile, "JOBS", {})
    monkeypatch.setattr(precompile, "stamp_path", lambda: tmp_path / "stamp")
    precompile.compile_all(processes=1)
    assert not cached.exists()


def test_every_cached_kernel_the_engine_imports_is_a_stamp_source():
    """Every module with a cached numba kernel that the engine imports is among the sources the stamp hashes (a
    new kernel module must join them, and get a precompile job, or a first run would compile it after all)."""
    import inspect

    import cupyllm  # noqa: F401 - the engine, and every kernel module it can reach
    from numba.core.caching import NullCache
    from numba.core.registry import CPUDispatcher

    from cupyllm.backend import precompile

    kernel_files = set()
    for name, module in list(sys.modules.items()):
        if name.startswith("cupyllm."):
            for value in vars(module).values():
                if isinstance(value, CPUDispatcher) and not isinstance(value._cache, NullCache):
                    kernel_files.add(Path(inspect.getfile(value.py_func)).resolve())
    assert kernel_files, "no cached numba kernels found"
    assert kernel_files <= {path.resolve() for path in precompile.SOURCES}


@pytest.mark.parametrize("writable", [True, False])
def test_weight_rows_are_one_numba_type(writable):
    """A weight built in memory (writable) and one read from the mapped file (read-only) reach the kernels as
    one numba type, so neither compiles them again."""
    import numpy as np
    from numba import typeof

    from cupyllm.ops.matmul.cpu_gemv import weight_rows

    mapped = np.zeros((4, 18), np.uint8)
    mapped.flags.writeable = False
    data = np.arange(72, dtype=np.uint8).reshape(4, 18)
    data.flags.writeable = writable
    rows = weight_rows(data)
    assert typeof(rows) == typeof(mapped)
    assert (rows == data).all()


def test_a_job_that_fails_names_itself_and_its_error():
    """A worker process whose job fails ends the compile with an error naming the job and the child's own
    traceback (here: a job that does not exist)."""
    import queue

    from cupyllm.backend import precompile

    jobs, done = queue.Queue(), queue.Queue()
    jobs.put("no such kernels")
    precompile._worker(jobs, done)
    failure = done.get()
    assert isinstance(failure, RuntimeError)
    assert "compiling the no such kernels kernels failed" in str(failure) and "KeyError" in str(failure)
    assert done.get() is None


def test_ensure_compiled_falls_back_to_compiling_on_first_use(monkeypatch, tmp_path, capsys):
    """If compiling ahead fails, the backend still starts: one line says the kernels compile on first use."""
    from cupyllm.backend import precompile

    def broken(stream=None):
        raise OSError("no processes left")

    monkeypatch.setattr(precompile, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(precompile, "compile_all", broken)
    assert precompile.ensure_compiled() is False
    err = capsys.readouterr().err
    assert "could not compile the CPU kernels ahead (OSError: no processes left)" in err
    assert err.count("\n") == 1
