#!/usr/bin/env bash
# The whole GPU test suite on the CUDA emulator (tests/support/cuda_emu), three ways: blocks and threads in order, in
# reverse (EMU_ORDER=reverse: a missing barrier shows in one of the two), and with an A100's limits
# (CUPYLLM_EMULATE_ARCH=80: 163 KB of shared memory a block, 108 SMs). About 2 minutes each on 2 cores once the
# emulator libraries are built. CI runs a subset of the first two (tests/test_emulated_kernels.py); run this
# before a device run, or after changing a kernel.
#
#   bash tools/emulated_gpu_suite.sh [pytest args, e.g. -x -k fa_vec]
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
status=0
for variant in "forward" "reverse" "sm_80"; do
    echo "=== emulated GPU suite: $variant"
    order=forward arch=90
    [ "$variant" = reverse ] && order=reverse
    [ "$variant" = sm_80 ] && arch=80
    CUPYLLM_EMULATE=1 EMU_ORDER=$order CUPYLLM_EMULATE_ARCH=$arch "$PY" -m pytest -q -m gpu tests/ \
        -p no:cacheprovider "$@" | tail -3
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done
exit $status
