#!/usr/bin/env bash
# Development probe on the GPU machine (not the check script): the attention GPU tests, a split-count sweep of
# the decode kernels (tools/attention_probe.py) and an Nsight Compute profile of one fa_mma f16 decode launch.
# Output into $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/probe_out}; mkdir -p "$OUT"
source tools/gpu_wheels.sh || exit 1
timeout 60 python3 tools/compile_kernels.py
NUMBA_NUM_THREADS=2 timeout 100 python3 -m pytest -q -n 8 --timeout=60 -p no:cacheprovider --tb=short \
    tests/ops/test_attention_gpu.py tests/ops/test_matmul_gpu.py tests/ops/test_elementwise_gpu.py tests/test_gpu_backend.py tests/ops/test_attention_dca_gpu.py -m gpu 2>&1 | tail -25 | tee "$OUT/pytest.txt"
timeout 80 python3 tools/attention_probe.py --sweep 2>&1 | tee "$OUT/sweep.txt" | grep -v "^$"
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
timeout 40 "$NCU" --clock-control none -k regex:fa_mma --launch-skip 1 --launch-count 1 --section SpeedOfLight \
    --section Occupancy --section WarpStateStats --section InstructionStats --section LaunchStats \
    python3 tools/attention_probe.py --once hd128_32q8kv f16 mma 65536 > "$OUT/ncu_mma_f16.txt" 2>&1
grep -E "Duration|Memory Throughput|Achieved Occupancy|Registers Per|Executed Instructions  " "$OUT/ncu_mma_f16.txt"
