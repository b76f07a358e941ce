#!/usr/bin/env bash
# The one prepared script for the GPU machine (an H200 with cupy-cuda13x, numba, torch, transformers; no
# network, no gguf). Run it from the repository root there, with .whl/ carried (tools/fetch_gpu_wheels.sh):
#
#   run(command="bash tools/gpu_check.sh", carry=[".whl"], timeout_s=540)
#
# 1. installs the carried wheels whose module is missing into /tmp/site
# 2. prints nvidia-smi and the CUDA stack CuPy sees
# 3. every kernel set compiled once, in parallel threads (CuPy's disk cache then serves the tests), then
#    pytest -m gpu (junit XML + log into bench/results/)
# 4. the GPU micro-benchmarks: bench/attention_gpu.py, bench/dca_gpu.py, bench/e2e_gpu.py on the two small real-shape models,
#    and bench/kv_encode.py --device gpu (JSON into bench/results/)
# 5. copies the results into $OUT when it is set (at most 8 files come back: the rest go into one .tgz)
#
# Finishes in under 8 minutes: each step has its own time limit.
set -uo pipefail
cd "$(dirname "$0")/.."
START=$SECONDS
PY=${PYTHON:-python3}
RESULTS=bench/results
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1

step() { echo; echo "=== $* ($((SECONDS - START)) s)"; }

step "carried wheels"
export PYTHONPATH=$PWD
if ls .whl/*.whl >/dev/null 2>&1; then
    missing=()
    for wheel in .whl/*.whl; do
        dist=$(basename "$wheel" | sed 's/-[0-9].*//' | tr 'A-Z' 'a-z')
        case "$dist" in
            pyyaml) module=yaml ;;
            *) module=${dist//-/_} ;;
        esac
        if ! "$PY" -c "import $module" 2>/dev/null; then missing+=("$wheel"); fi
    done
    if [ ${#missing[@]} -gt 0 ]; then
        echo "installing: ${missing[*]}"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            "${missing[@]}" || exit 1
        export PYTHONPATH=/tmp/site:$PWD
    else
        echo "every carried package is already there"
    fi
else
    echo "no .whl/ carried (run tools/fetch_gpu_wheels.sh and carry .whl); tests that need gguf will fail to import"
fi

step "device"
nvidia-smi || echo "nvidia-smi failed"
"$PY" - <<'EOF'
import cupy, cupy.cuda.runtime as rt
from cupy_backends.cuda.libs import nvrtc
props = rt.getDeviceProperties(0)
print(f"cupy {cupy.__version__}, CUDA runtime {rt.runtimeGetVersion()}, driver {rt.driverGetVersion()}, "
      f"NVRTC {nvrtc.getVersion()}, device {props['name'].decode()} sm_{props['major']}{props['minor']}, "
      f"{rt.getDeviceCount()} device(s)")
from cupyllm.cuda.registry import cuda_include_dirs, kernel_source_dir
print("kernels:", kernel_source_dir(), "CUDA headers:", cuda_include_dirs())
EOF

step "compile every kernel set (parallel NVRTC; fills CuPy's kernel cache for the test processes)"
timeout 90 "$PY" - <<'EOF'
import os, time
from concurrent.futures import ThreadPoolExecutor
from cupyllm.cuda.registry import KernelRegistry
registry, start = KernelRegistry(), time.perf_counter()
def compile_set(kernel_set):
    try:
        registry.function(kernel_set.name_expressions[0])  # compiles the whole set
    except Exception as exc:  # reported here, and again by the tests that use it
        print(f"FAILED {kernel_set.description}: {str(exc)[:300]}")
with ThreadPoolExecutor(max_workers=os.cpu_count() or 8) as pool:
    list(pool.map(compile_set, registry.sets))
print(f"{len(registry.sets)} kernel sets in {time.perf_counter() - start:.0f} s")
EOF

step "pytest -m gpu"
timeout 210 "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider --junitxml="$RESULTS/gpu_pytest.xml" 2>&1 \
    | tee "$RESULTS/gpu_pytest.log"
pytest_status=${PIPESTATUS[0]}
echo "pytest exit status: $pytest_status"

step "GPU micro-benchmarks"
# each writes its JSON after every row and starts no new row past its --budget-s (the 64k rows first)
echo "--- bench/attention_gpu.py"
timeout 45 "$PY" bench/attention_gpu.py --budget-s 32 || echo "bench/attention_gpu.py failed or timed out ($?)"
echo "--- bench/dca_gpu.py"
timeout 45 "$PY" bench/dca_gpu.py --budget-s 32 || echo "bench/dca_gpu.py failed or timed out ($?)"
# The two small real-shape models only (~1.5 min); the 7B adds ~2-3 min: run `python bench/e2e_gpu.py` alone.
echo "--- bench/e2e_gpu.py (gemma3-270m, qwen2.5-0.5b)"
timeout 80 "$PY" bench/e2e_gpu.py --models gemma3-270m qwen2.5-0.5b --budget-s 55 \
    || echo "bench/e2e_gpu.py failed or timed out ($?)"
echo "--- bench/kv_encode.py --device gpu"
timeout 40 "$PY" bench/kv_encode.py --device gpu || echo "kv_encode benchmark failed or timed out ($?)"

step "results"
if [ -n "${OUT:-}" ]; then
    files=("$RESULTS/gpu_pytest.log" "$RESULTS/gpu_pytest.xml")
    for json in "$RESULTS"/*gpu*.json; do [ -e "$json" ] && files+=("$json"); done
    if [ ${#files[@]} -le 8 ]; then
        cp "${files[@]}" "$OUT"/ 2>/dev/null
    else
        cp "${files[@]:0:7}" "$OUT"/
        tar czf "$OUT/more_results.tgz" "${files[@]:7}"
    fi
    ls -l "$OUT"
fi
echo "done in $((SECONDS - START)) s; pytest exit status $pytest_status"
exit "$pytest_status"
