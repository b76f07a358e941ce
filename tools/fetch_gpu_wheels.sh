#!/usr/bin/env bash
# Download into .whl/ the Python wheels that tools/gpu_check.sh installs on the GPU machine, which has no
# network: Python 3.12, x86-64 Linux. gpu_check.sh installs only those whose module is missing there
# (its image has pyyaml, regex and jinja2, but not gguf). .whl/ is git-ignored: pass it in `carry`.
#
#   tools/fetch_gpu_wheels.sh            # gguf (same version as here), pyyaml, regex, jinja2, markupsafe,
#                                        # threadpoolctl (the CPU backend imports it; the image may lack it)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
mkdir -p .whl

# gguf: the version this checkout is tested with, else the newest
GGUF_SPEC=gguf
if GGUF_VERSION=$("$PY" -c "import importlib.metadata as m; print(m.version('gguf'))" 2>/dev/null); then
    GGUF_SPEC="gguf==$GGUF_VERSION"
fi

target=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d .whl)
# pure-python wheels (py3-none-any): no platform tag to match
"$PY" -m pip download -q "${target[@]}" "$GGUF_SPEC" jinja2 threadpoolctl
# compiled wheels: the manylinux tags the device's glibc accepts
"$PY" -m pip download -q "${target[@]}" \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    pyyaml regex markupsafe

# one version of each: two wheels of one package stop the whole install there
dupes=$(ls .whl/*.whl | xargs -n1 basename | sed 's/-[0-9].*//' | tr 'A-Z_' 'a-z-' | sort | uniq -d)
if [ -n "$dupes" ]; then
    echo "several versions in .whl/ of: $dupes; delete the old ones" >&2
    exit 1
fi
ls -l .whl/
du -sh .whl/
