#!/usr/bin/env bash
# Needle-in-a-haystack on the GPU machine (issue: DCA retrieval with --device gpu), with the real Gemma 3 270M
# GGUF joined from parts carried call by call (tools/device_model.py: the 253 MB file exceeds one call's 64 MiB).
#
#   here:   echo /.carry/ >> .git/info/exclude
#           python tools/device_model.py split ~/.cache/cupyllm/models/gemma-3-270m-q4_k_m.gguf .carry --part-mib 48
#   device, one call per part (back to back: a machine idle for 30 s is given back and its /tmp with it):
#           run(command="python3 tools/device_model.py stash .carry /tmp/model_parts",
#               carry=[".carry/gemma-3-270m-q4_k_m.gguf.partK", ".carry/gemma-3-270m-q4_k_m.gguf.manifest.json"])
#   then:   run(command="bash tools/gpu_niah.sh 2>&1 | tee $OUT/gpu_niah.log", carry=[".whl"], timeout_s=300)
#
# Writes bench/results/niah_gpu.{json,md} (and into $OUT): single needle at 8k-64k, depths 0-1, with and
# without DCA, then the multi-key / multi-value / variable-tracking tasks at 32k and 64k, while time is left.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
source tools/gpu_wheels.sh || exit 1
MODEL=${MODEL:-/tmp/gemma-3-270m-q4_k_m.gguf}
[ -s "$MODEL" ] || python3 tools/device_model.py join /tmp/model_parts "$MODEL" || exit 1
OUTFILE=bench/results/niah_gpu.json
publish() { [ -n "${OUT:-}" ] && cp bench/results/niah_gpu.* "$OUT"/ 2>/dev/null; true; }
timeout 150 python3 tools/niah.py -m "$MODEL" --device gpu --modes dca plain --tasks single \
    --lengths 8192 16384 32768 49152 65536 --depths 0 0.25 0.5 0.75 1 --out "$OUTFILE"
publish
timeout 100 python3 tools/niah.py -m "$MODEL" --device gpu --modes dca plain --tasks multikey multivalue vartrack \
    --lengths 32768 65536 --depths 0.5 --out "$OUTFILE" --append
publish
