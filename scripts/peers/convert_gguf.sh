#!/usr/bin/env bash
# Convert a Hugging Face model directory to GGUF with llama.cpp's bundled converter.
# Usage: scripts/peers/convert_gguf.sh MODEL_DIR OUT.gguf [OUTTYPE=f32]
# The converter needs a SentencePiece tokenizer.model (it rejects custom BPE tokenizers): for the
# demo models, `llmbus demo-model --tokenizer sentencepiece` writes one. A failed conversion leaves no OUT.
set -euo pipefail
USAGE="usage: convert_gguf.sh MODEL_DIR OUT.gguf [f32|bf16|f16|q8_0]"
MODEL="${1:?$USAGE}"
OUT="${2:?$USAGE}"
DIR="${LLAMACPP_DIR:-.peers/llamacpp}"
test -f "$DIR/src/convert_hf_to_gguf.py" || { echo "no llama.cpp tree in $DIR: run 'make peer-llamacpp'" >&2; exit 2; }
test -x "$DIR/convert-venv/bin/python" || { echo "no converter venv in $DIR/convert-venv: run 'make peer-llamacpp'" >&2; exit 2; }
test -f "$MODEL/config.json" || { echo "no config.json in model dir $MODEL" >&2; exit 2; }
test -f "$MODEL/tokenizer.model" || echo "warning: $MODEL has no SentencePiece tokenizer.model; the converter may reject its tokenizer" >&2
mkdir -p "$(dirname "$OUT")"
HF_HUB_OFFLINE=1 PYTHONPATH="$DIR/src/gguf-py" "$DIR/convert-venv/bin/python" "$DIR/src/convert_hf_to_gguf.py" \
    "$MODEL" --outfile "$OUT" --outtype "${3:-f32}" || { rm -f "$OUT"; exit 1; }
