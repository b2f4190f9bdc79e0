#!/usr/bin/env bash
# Build llama.cpp's llama-server from the source inside the llama-cpp-python sdist, and a small
# venv for its convert_hf_to_gguf.py.  Usage: scripts/peers/setup_llamacpp.sh [DIR] (default .peers/llamacpp)
# About 4 minutes of both cores. Result: DIR/llama-server, DIR/src (the llama.cpp tree), DIR/convert-venv.
set -euo pipefail
DIR="${1:-.peers/llamacpp}"
PYTHON="${PYTHON:-python3.11}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
JOBS="${JOBS:-$(nproc)}"
mkdir -p "$DIR"
DIR="$(cd "$DIR" && pwd)"

if [ ! -d "$DIR/src" ]; then
    "$PYTHON" -m pip download -q --no-deps --no-binary :all: -d "$DIR/sdist" "llama-cpp-python==$VERSION"
    tar xzf "$DIR"/sdist/llama_cpp_python-"$VERSION".tar.gz -C "$DIR/sdist"
    mv "$DIR/sdist/llama_cpp_python-$VERSION/vendor/llama.cpp" "$DIR/src"
    rm -rf "$DIR/sdist"
fi
if [ ! -x "$DIR/llama-server" ]; then
    # NOTE: no web UI (it would be fetched prebuilt), no curl/openssl: nothing is downloaded.
    cmake -S "$DIR/src" -B "$DIR/src/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_USE_PREBUILT_UI=OFF \
        -DLLAMA_BUILD_UI=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
    cmake --build "$DIR/src/build" --target llama-server -j "$JOBS"
    ln -sf "$DIR/src/build/bin/llama-server" "$DIR/llama-server"
fi
if [ ! -f "$DIR/convert-venv/.installed" ]; then
    "$PYTHON" -m venv "$DIR/convert-venv"
    "$DIR/convert-venv/bin/python" -m pip install -q torch==2.13.0  # local CPU wheel first
    "$DIR/convert-venv/bin/python" -m pip install -q numpy sentencepiece safetensors protobuf "transformers>=4.45"
    touch "$DIR/convert-venv/.installed"
fi
"$DIR/llama-server" --version 2>&1 | head -2
