#!/usr/bin/env bash
# Build llama.cpp's own `llama-server` from the llama.cpp sources that llama-cpp-python's sdist vendors (the
# llama.cpp that the llama-cpp-python peer of bench/serve_load.py and tests/data's llama.cpp references run), for
# bench/serve_load.py's `llama-server` peer.
#
#   bash tools/build_llama_server.sh [OUT_DIR]    # default: ~/.cache/cupyllm/llama-server-0.3.36
#   -> OUT_DIR/bin/llama-server (bench/serve_load.py looks there, or takes --llama-server PATH)
#
# What it does (a CPU build; cmake, a C++17 compiler and ninja or make; ~15 minutes on 2 cores):
#   pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36      (SDIST=path.tar.gz: use that one)
#   cmake -S llama_cpp_python-0.3.36/vendor/llama.cpp -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON \
#         -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF \
#         -DBUILD_SHARED_LIBS=OFF
#   cmake --build build --target llama-server -j 2                          (JOBS=N: another count)
# GGML_NATIVE is left at llama.cpp's default (on: the build machine's instruction set, as llama-cpp-python's own
# build from source does), so the binary is for this machine.
set -euo pipefail
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
OUT=${1:-$HOME/.cache/cupyllm/llama-server-$VERSION}
JOBS=${JOBS:-2}
PY=${PYTHON:-python3}
if [ -x "$OUT/bin/llama-server" ]; then
    echo "$OUT/bin/llama-server (built already; remove it to build again)"
    exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
sdist=${SDIST:-}
if [ -z "$sdist" ]; then
    "$PY" -m pip download --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$work"
    sdist="$work/llama_cpp_python-$VERSION.tar.gz"
fi
tar -xzf "$sdist" -C "$work" "llama_cpp_python-$VERSION/vendor/llama.cpp"
src="$work/llama_cpp_python-$VERSION/vendor/llama.cpp"
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S "$src" -B "$work/build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF \
    -DBUILD_SHARED_LIBS=OFF
cmake --build "$work/build" --target llama-server -j "$JOBS"
mkdir -p "$OUT/bin"
cp "$work/build/bin/llama-server" "$OUT/bin/llama-server"
"$OUT/bin/llama-server" --version 2>&1 | head -2 || true
echo "$OUT/bin/llama-server"
