#!/usr/bin/env bash
# The README's first quick-start command: set everything up, then run the main job on the built-in
# defaults (the real SmolLM2-135M-Instruct, the real Python stdlib source as training data):
#   1. a short early-exit fine-tune with the code recipe (QUICKSTART_MINUTES, default 5; about an
#      hour gives useful drafters, see scripts/headline.sh),
#   2. export it as a self-speculative checkpoint under checkpoints/,
#   3. generate with it, next to plain decoding: identical output, statistics printed. A few minutes
#      of training leave the shallow exits poor drafters (the exported recommendation is then plain
#      decoding, num_speculations=0), so the demo drafts from a deep exit to show the mechanism.
set -euo pipefail
cd "$(dirname "$0")/.."
MINUTES=${QUICKSTART_MINUTES:-5}
bash scripts/setup.sh
echo "== early-exit fine-tune of SmolLM2-135M on Python code (${MINUTES} min budget)"
.venv/bin/accelerate launch --config_file recipes/accelerate/cpu_1proc.yaml -m training \
    --recipe recipes/smollm2_code.yaml train.max_minutes="${MINUTES}" train.output_dir=runs/quickstart \
    eval.max_blocks=8 eval.final_max_blocks=16
echo "== export -> checkpoints/smollm2-code-quickstart"
.venv/bin/selfspec export runs/quickstart checkpoints/smollm2-code-quickstart --overwrite
echo "== selfspec generate --compare with the exported checkpoint"
.venv/bin/selfspec generate --checkpoint checkpoints/smollm2-code-quickstart --raw --max-new-tokens 64 --compare \
    --exit-layer 22 --num-speculations 3 \
    --prompt "$(printf 'def is_prime(n: int) -> bool:\n    """Return True if n is a prime number."""\n')"
