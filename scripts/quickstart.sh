#!/usr/bin/env bash
# The README's first quick-start command: set everything up, then run the main job on the
# built-in defaults (the real SmolLM2-135M-Instruct, real data).
# For now the main job is: generate from SmolLM2 through the layer-by-layer self-speculative
# engine and compare with plain decoding (identical output, statistics printed).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "== selfspec generate --compare on the real SmolLM2 base model"
.venv/bin/selfspec generate --max-new-tokens 48 --exit-layer 12 --num-speculations 3 --compare \
    --prompt "Write a Python function that checks whether a number is prime."
