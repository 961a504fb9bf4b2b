#!/bin/bash
# Builds what a chat through llama.cpp's RPC backend needs, beside (not in) the project's .venv:
#   DIR/venv             llama-cpp-python built with GGML_RPC=ON, plus localchat (editable)
#   DIR/bin/ggml-rpc-server  the server a remote machine runs, from the same llama.cpp source
# Usage: bash scripts/rpc_build.sh [DIR]   (default ~/.cache/localchat-rpc; about 15 min on 2 cores)
# Steps already done in DIR are skipped. Needs cmake, a C++ compiler and PyPI.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DIR=${1:-${LOCALCHAT_RPC_DIR:-$HOME/.cache/localchat-rpc}}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
PY=${PYTHON:-python3}
mkdir -p "$DIR/src" "$DIR/bin"
t0=$(date +%s)
if [ ! -x "$DIR/venv/bin/python" ] || ! "$DIR/venv/bin/python" -c "import llama_cpp, sys; sys.exit(not llama_cpp.llama_supports_rpc())" 2>/dev/null; then
  rm -rf "$DIR/venv"
  "$PY" -m venv "$DIR/venv"
  "$DIR/venv/bin/pip" install -q --upgrade pip
  # --no-cache-dir: pip's wheel cache is keyed by the source, not CMAKE_ARGS, and would hand back a build without RPC
  CMAKE_ARGS="-DGGML_RPC=ON" "$DIR/venv/bin/pip" install -q --no-cache-dir --no-binary llama-cpp-python \
    "llama-cpp-python==$VERSION"
  echo "llama-cpp-python $VERSION with RPC built at $(( $(date +%s) - t0 )) s"
fi
"$DIR/venv/bin/pip" install -q -e "$ROOT" 2>/dev/null || "$DIR/venv/bin/pip" install -q -e "$ROOT"
if [ ! -x "$DIR/bin/ggml-rpc-server" ]; then
  SRC=$(ls -d "$DIR"/src/llama_cpp_python-"$VERSION" 2>/dev/null || true)
  if [ -z "$SRC" ]; then
    "$DIR/venv/bin/pip" download -q --no-deps --no-binary llama-cpp-python -d "$DIR/src" "llama-cpp-python==$VERSION"
    tar xzf "$DIR/src/llama_cpp_python-$VERSION.tar.gz" -C "$DIR/src"
    SRC="$DIR/src/llama_cpp_python-$VERSION"
  fi
  cmake -S "$SRC/vendor/llama.cpp" -B "$DIR/build" -DGGML_RPC=ON -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DCMAKE_BUILD_TYPE=Release \
    > "$DIR/cmake.log" 2>&1 || { tail -20 "$DIR/cmake.log"; exit 1; }
  cmake --build "$DIR/build" -j "$(nproc)" --target ggml-rpc-server > "$DIR/build.log" 2>&1 \
    || { tail -30 "$DIR/build.log"; exit 1; }
  cp "$DIR/build/bin/ggml-rpc-server" "$DIR/bin/"
  echo "ggml-rpc-server built at $(( $(date +%s) - t0 )) s"
fi
"$DIR/venv/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'rpc:', llama_cpp.llama_supports_rpc())"
