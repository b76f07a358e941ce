#!/usr/bin/env bash
# The one prepared script for the GPU machine (an H200 with cupy-cuda13x, numba, torch, transformers; no
# network, no gguf). Run it from the repository root there, with .whl/ carried (tools/fetch_gpu_wheels.sh):
#
#   run(command="bash tools/gpu_check.sh 2>&1 | tee $OUT/gpu_check.log", carry=[".whl"], timeout_s=480)
#
# What comes back: $OUT/gpu_check.log, $OUT/gpu_results.tar (the result files of bench/results, packed after
# each step: a call returns at most 8 files) and $OUT/e2e_gpu.json (rewritten after every model); here:
# tar -xf <files_at>/gpu_results.tar -C bench/results && cp <files_at>/e2e_gpu.json bench/results/
#
# 1. installs the carried wheels whose module is missing into /tmp/site
# 2. prints nvidia-smi and the CUDA stack CuPy sees
# 3. every kernel set compiled once, in parallel threads (CuPy's disk cache then serves the tests), then
#    pytest -m gpu (junit XML + log into bench/results/)
# 4. the GPU micro-benchmarks: bench/attention_gpu.py, bench/dequant_gpu.py, bench/dca_gpu.py, bench/spill_gpu.py,
#    bench/spill_cost_gpu.py (the spill cost model's predicted against measured decode slowdown, f16 and q8_0),
#    bench/kv_encode.py --device gpu (with the TCQ encoder at every trellis size and the engine's prefill step per
#    KV type), bench/prompt_cache.py, then
#    tools/profile_decode_gpu.py (kernels of a decode step), bench/e2e_gpu.py on the real-shape models (Gemma 3
#    270M, Qwen2.5-0.5B, Gemma 4 E2B, then Qwen2.5-7B while time is left), then with what is left of the budget
#    bench/decode_gpu.py (batched decode, n-gram drafting, a hybrid's decode; on the GGUFs e2e_gpu.py wrote)
# 5. packs the results into $OUT/gpu_results.tar (when OUT is set) after every step, so a run cut short keeps
#    what it measured
#
# Finishes in under 7.5 minutes: each step has its own time limit, cut to what is left of the run's budget.
set -uo pipefail
cd "$(dirname "$0")/.."
START=$SECONDS
PY=${PYTHON:-python3}
RESULTS=bench/results
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1
# The scripts below copy their JSON into $OUT when it is set; here they leave it in bench/results and publish()
# packs it, so that a run returns three files (with the log and e2e_gpu.json) however many steps it has.
RUN_OUT=${OUT:-}
unset OUT
STARTED=$(mktemp)  # publish() packs the result files written after this one (not those committed earlier)

step() { echo; echo "=== $* ($((SECONDS - START)) s)"; }
# A step's time limit: its own, or what is left of the run's 450 s (7.5 minutes), whichever is less (at least
# 5 s), so the limits together never add up past the budget.
BUDGET_S=450
limit() { local left=$((BUDGET_S - (SECONDS - START))); [ "$left" -lt 5 ] && left=5; echo $(( $1 < left ? $1 : left )); }

step "carried wheels"
source tools/gpu_wheels.sh || exit 1

step "device"
nvidia-smi || echo "nvidia-smi failed"
"$PY" - <<'EOF'
import cupy, cupy.cuda.runtime as rt
from cupy_backends.cuda.libs import nvrtc
props = rt.getDeviceProperties(0)
print(f"cupy {cupy.__version__}, CUDA runtime {rt.runtimeGetVersion()}, driver {rt.driverGetVersion()}, "
      f"NVRTC {nvrtc.getVersion()}, device {props['name'].decode()} sm_{props['major']}{props['minor']}, "
      f"{rt.getDeviceCount()} device(s)")
import numba, llvmlite.binding as llvm
print(f"numba {numba.__version__}, LLVM {'.'.join(map(str, llvm.llvm_version_info))} (the CPU path's kernels)")
from cupyllm.cuda.registry import cuda_include_dirs, kernel_source_dir
print("kernels:", kernel_source_dir(), "CUDA headers:", cuda_include_dirs())
EOF

step "compile every kernel set (parallel NVRTC; fills CuPy's kernel cache for the test processes)"
timeout $(limit 75) "$PY" tools/compile_kernels.py

step "pytest -m gpu"
# pytest-xdist and pytest-timeout are in the device image: 12 workers (2 numba threads each, for the CPU
# references), a per-test limit so a hung kernel fails one test, not the step
pytest_args=()
if "$PY" -c "import xdist" 2>/dev/null; then pytest_args+=(-n 12); export NUMBA_NUM_THREADS=2; fi
if "$PY" -c "import pytest_timeout" 2>/dev/null; then pytest_args+=(--timeout=60); fi
timeout $(limit 150) "$PY" -m pytest -m gpu -q -rs --tb=short -p no:cacheprovider "${pytest_args[@]}" \
    --junitxml="$RESULTS/gpu_pytest.xml" 2>&1 | tee "$RESULTS/gpu_pytest.log"
pytest_status=${PIPESTATUS[0]}
echo "pytest exit status: $pytest_status"
unset NUMBA_NUM_THREADS

publish() {  # every result file of this run, packed into one archive in $OUT (rewritten after each step)
    [ -n "$RUN_OUT" ] || return 0
    local files=()
    for f in gpu_pytest.log gpu_pytest.xml attention_gpu.json dequant_gpu.json dca_gpu.json kv_encode_gpu.json \
             spill_gpu.json spill_cost_gpu.json decode_profile_gpu.json prompt_cache_gpu.json e2e_gpu.json \
             decode_gpu.json; do
        [ "$RESULTS/$f" -nt "$STARTED" ] && files+=("$f")
    done
    [ ${#files[@]} -gt 0 ] && tar -cf "$RUN_OUT/gpu_results.tar" -C "$RESULTS" "${files[@]}"
    return 0
}
publish

step "GPU micro-benchmarks"
# each writes its JSON after every row and starts no new row past its --budget-s (the 64k rows first)
echo "--- bench/attention_gpu.py"
timeout $(limit 45) "$PY" bench/attention_gpu.py --budget-s 32 || echo "bench/attention_gpu.py failed or timed out ($?)"
publish
echo "--- bench/dequant_gpu.py (fa_mma's dequantizing pass: the Half8 readers vs Chunk8's floats rounded)"
timeout $(limit 30) "$PY" bench/dequant_gpu.py --rows 524288 --repeats 10 || echo "bench/dequant_gpu.py failed or timed out ($?)"
publish
echo "--- bench/dca_gpu.py"
timeout $(limit 45) "$PY" bench/dca_gpu.py --budget-s 32 || echo "bench/dca_gpu.py failed or timed out ($?)"
publish
echo "--- bench/spill_gpu.py (device window + pinned host tail vs the whole cache on the device)"
timeout $(limit 25) "$PY" bench/spill_gpu.py --budget-s 12 || echo "bench/spill_gpu.py failed or timed out ($?)"
publish
echo "--- bench/spill_cost_gpu.py (kv/spill_cost.py: predicted vs measured decode slowdown when spilled,"
echo "    f16 and q8_0, the host part uniform and in q4_0)"
timeout $(limit 55) "$PY" bench/spill_cost_gpu.py --ctx 65536 --host-fractions 0.25 0.02 --tails uniform q4_0 \
    --steps 12 --budget-s 40 \
    || echo "bench/spill_cost_gpu.py failed or timed out ($?)"
publish
echo "--- bench/kv_encode.py --device gpu (then the engine's prefill of 8192 tokens on 4 Qwen3-8B layers per KV type)"
timeout $(limit 75) "$PY" bench/kv_encode.py --device gpu || echo "kv_encode benchmark failed or timed out ($?)"
publish
echo "--- bench/prompt_cache.py (random-weight Gemma 3 270M shapes, questions after an 8192-token document)"
timeout $(limit 45) "$PY" bench/prompt_cache.py --device gpu --preset gemma3-270m --doc-tokens 8192 \
    --out "$RESULTS/prompt_cache_gpu.json" || echo "bench/prompt_cache.py failed or timed out ($?)"
publish
echo "--- tools/profile_decode_gpu.py (where a Gemma 3 270M decode step's device time goes)"
timeout $(limit 40) "$PY" tools/profile_decode_gpu.py --model gemma3-270m || echo "decode profile failed or timed out ($?)"
publish
# Small models first (~50 s with transformers beside them); the 7B (~4.7 GB GGUF written here, transformers
# from the same weights) starts only inside --budget-s and writes its row when done.
echo "--- bench/e2e_gpu.py (gemma3-270m, qwen2.5-0.5b, gemma4-e2b, qwen2.5-7b)"
# (its JSON goes straight into $OUT when set: rewritten after every model, it comes back even if the call's
# limit cuts the 7B short)
GGUF_DIR=$(mktemp -d)  # the random GGUFs, kept for bench/decode_gpu.py below (the 7B's is ~4.7 GB to write)
timeout $(limit 140) "$PY" bench/e2e_gpu.py --models gemma3-270m qwen2.5-0.5b gemma4-e2b qwen2.5-7b --budget-s 60 \
    --work-dir "$GGUF_DIR" --out "${RUN_OUT:-$RESULTS}/e2e_gpu.json" || echo "bench/e2e_gpu.py failed or timed out ($?)"
[ -n "$RUN_OUT" ] && [ -e "$RUN_OUT/e2e_gpu.json" ] && cp "$RUN_OUT/e2e_gpu.json" "$RESULTS"/
publish
# With what is left of the budget: the batched decode at 1-64 sequences, n-gram drafting and a Qwen3.6-35B-A3B
# shape's decode (issues 34, 33, 32), each against its roofline; its parts start only within --budget-s.
left=$(limit 170)
if [ "$left" -gt 60 ]; then
    echo "--- bench/decode_gpu.py (${left} s left)"
    timeout "$left" "$PY" bench/decode_gpu.py --work-dir "$GGUF_DIR" --budget-s $((left - 45)) \
        || echo "bench/decode_gpu.py failed or timed out ($?)"
    publish
else
    echo "--- bench/decode_gpu.py skipped: ${left} s left (run it in a call of its own)"
fi
rm -rf "$GGUF_DIR"

step "results"
[ -n "$RUN_OUT" ] && ls -l "$RUN_OUT" && tar -tf "$RUN_OUT/gpu_results.tar"
echo "done in $((SECONDS - START)) s; pytest exit status $pytest_status"
exit "$pytest_status"
