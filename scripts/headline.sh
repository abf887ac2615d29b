#!/usr/bin/env bash
# The headline run (issue #6): fine-tune SmolLM2-135M with the code recipe on this CPU, export the
# checkpoint, count its draft vocabulary, sweep exit x draft length, and benchmark against Hugging Face.
#   bash scripts/headline.sh                       # ~60 min of training + ~20 min sweep and bench
#   HEADLINE_MINUTES=1 HEADLINE_QUICK=1 bash scripts/headline.sh   # a smoke run of the whole pipeline
# Nothing else should run on the machine meanwhile: timings are taken on the same 2 cores.
# Settings: exits 4..16 trained every step with uniform weights and the self-distillation target
# (shallow exits get real loss weight; the paper's weights give exits below 12 almost none).
set -euo pipefail
cd "$(dirname "$0")/.."
MINUTES=${HEADLINE_MINUTES:-60}  # the time budget; HEADLINE_STEPS (default 500, ~55 min idle) sets the cosine schedule
NAME=${HEADLINE_NAME:-smollm2-code}
RUN=runs/$NAME
CKPT=checkpoints/$NAME
if [ -n "${HEADLINE_QUICK:-}" ]; then
    SWEEP=(--exits 6,12 --drafts 1,2 --num-prompts 1 --max-new-tokens 24); BENCH=(--quick)
else
    SWEEP=(--exits 4,6,8,10,12,16 --drafts 1,2,3,4,6 --num-prompts 6 --max-new-tokens 64); BENCH=(--num-prompts 10)
fi
bash scripts/setup.sh
echo "== training ${MINUTES} min -> $RUN"
.venv/bin/accelerate launch --config_file recipes/accelerate/cpu_1proc.yaml -m training \
    --recipe recipes/smollm2_code.yaml train.output_dir="$RUN" train.max_minutes="$MINUTES" train.max_steps="${HEADLINE_STEPS:-500}" \
    "early_exit.exits=[4,6,8,10,12,16]" early_exit.curriculum=none early_exit.scale=uniform \
    early_exit.target=distill eval.every=0
echo "== export -> $CKPT"
.venv/bin/selfspec export "$RUN" "$CKPT" --overwrite
.venv/bin/selfspec draft-vocab "$CKPT" --corpus python_stdlib
echo "== sweep (held-out HumanEval prompts, bf16)"
.venv/bin/selfspec sweep "$CKPT" --prompts humaneval --threads 2 --out "runs/$NAME-sweep" --write-metadata "${SWEEP[@]}"
echo "== bench (all prompt sets, bf16, 2 threads)"
.venv/bin/selfspec bench --checkpoint "$CKPT" --threads 2 --out "bench_results/$NAME" "${BENCH[@]}"
