#!/bin/bash
# Builds the peers localchat's CPU benchmarks compare with: llama-server and llama-bench from the llama.cpp that
# llama-cpp-python vendors (the same source as the project's engine), for this CPU (GGML_NATIVE), no web UI.
#   DIR/bin/llama-server, DIR/bin/llama-bench
# Usage: bash scripts/cpu_peers.sh [DIR]   (default ~/.cache/localchat-peers; about 10 min on 2 cores)
# Then: localchat bench --model qwen --peer-server DIR/bin/llama-server --llama-bench DIR/bin/llama-bench ...
set -euo pipefail
DIR=${1:-${LOCALCHAT_PEERS_DIR:-$HOME/.cache/localchat-peers}}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
PY=${PYTHON:-python3}
mkdir -p "$DIR/src" "$DIR/bin"
t0=$(date +%s)
if [ -x "$DIR/bin/llama-server" ] && [ -x "$DIR/bin/llama-bench" ]; then
  echo "already built: $DIR/bin"; exit 0
fi
SRC="$DIR/src/llama_cpp_python-$VERSION"
if [ ! -d "$SRC" ]; then
  "$PY" -m pip download -q --no-deps --no-binary llama-cpp-python -d "$DIR/src" "llama-cpp-python==$VERSION"
  tar xzf "$DIR/src/llama_cpp_python-$VERSION.tar.gz" -C "$DIR/src"
fi
cmake -S "$SRC/vendor/llama.cpp" -B "$DIR/build" -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=Release \
  > "$DIR/cmake.log" 2>&1 || { tail -20 "$DIR/cmake.log"; exit 1; }
cmake --build "$DIR/build" -j "$(nproc)" --target llama-server llama-bench > "$DIR/build.log" 2>&1 \
  || { tail -30 "$DIR/build.log"; exit 1; }
cp "$DIR/build/bin/llama-server" "$DIR/build/bin/llama-bench" "$DIR/bin/"
echo "llama-server and llama-bench built in $DIR/bin at $(( $(date +%s) - t0 )) s"
