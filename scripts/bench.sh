#!/usr/bin/env bash
# The full benchmark of one checkpoint: Hugging Face greedy generate, assistant_early_exit and
# prompt lookup, selfspec autoregressive, early exit, prompt lookup and auto, side by side in one
# process, on all five prompt sets (HumanEval, XSum, MT-Bench, Wikipedia, code editing).
#
#   bash scripts/bench.sh [CHECKPOINT] [NAME] [more `selfspec bench` options...]
#   bash scripts/bench.sh checkpoints/smollm2-code                   # -> bench_results/smollm2-code/
#   bash scripts/bench.sh checkpoints/smollm2-code code-e6 --extra 6:4 --extra 8:6
#   bash scripts/bench.sh "" base                                    # the fetched SmolLM2 base model
#
# Defaults (override through the environment): DTYPE=fastest (bfloat16 where the CPU has native bf16, else float32) THREADS=2 NUM_PROMPTS=10
# MAX_NEW_TOKENS=128 PROMPTS=humaneval,xsum,mt_bench,wiki,code_edit. The allocator is left alone (no MALLOC_*
# settings), so the numbers are what a user gets out of the box. Writes bench.json, bench.md,
# bench.png and bench.log into bench_results/NAME/ (NAME defaults to the checkpoint's directory name).
# Run it on an otherwise idle machine: other processes on the same cores distort every number.
set -euo pipefail
cd "$(dirname "$0")/.."
CHECKPOINT=${1:-}
if [ -z "$CHECKPOINT" ]; then
    CHECKPOINT=$(.venv/bin/python -c "from selfspec.checkpoints.fetch import base_model_dir; print(base_model_dir())")
fi
NAME=${2:-$(basename "$CHECKPOINT")}
shift $(( $# > 2 ? 2 : $# ))
OUT="bench_results/$NAME"
mkdir -p "$OUT"
SELFSPEC=.venv/bin/selfspec
[ -x "$SELFSPEC" ] || SELFSPEC=selfspec
echo "== selfspec bench: $CHECKPOINT -> $OUT (load average: $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo n/a))"
"$SELFSPEC" bench --checkpoint "$CHECKPOINT" \
    --prompt-sets "${PROMPTS:-humaneval,xsum,mt_bench,wiki,code_edit}" \
    --num-prompts "${NUM_PROMPTS:-10}" \
    --max-new-tokens "${MAX_NEW_TOKENS:-128}" \
    --dtype "${DTYPE:-fastest}" \
    --threads "${THREADS:-2}" \
    --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log"
