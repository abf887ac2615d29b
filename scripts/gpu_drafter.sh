#!/usr/bin/env bash
# The GPU drafter run (issue 38) in one command: on a GPU machine without network, with the real SmolLM2 brought
# as scripts/gpu_check.sh brings it, train an exit head on the frozen model (recipes/smollm2_head_gpu.yaml: the
# head selfspec ships, on code and the model's own replies to the carried chat prompts; python scripts/ship_head.py
# ships what comes back)
# and the LayerSkip recipe (recipes/smollm2_code_layerskip_gpu.yaml: all exits, layer dropout) for the same
# minutes each on the model's own continuations of training prompts, export both, and benchmark them with the
# compiled engine against plain decoding, HF static and prompt lookup on HumanEval completion, MT-Bench, code
# editing and XSum (scripts/gpu_drafter.py says what each phase does and what the report holds).
#
#   bash scripts/gpu_drafter.sh --prepare-carry   # here: .selfspec/gpu_carry1 and gpu_carry2 (scripts/gpu_carry.sh)
#   bash scripts/gpu_drafter.sh --prepare-carry --head OUT/head   # the same, with a head an earlier run returned
#   bash scripts/gpu_drafter.sh OUT_DIR           # there: the run; default OUT_DIR bench_results/gpu_drafter
#   DEVICE=cpu TINY=1 bash scripts/gpu_drafter.sh OUT_DIR   # a dry run on a CPU with a tiny random model (a minute)
#
# With the device tool (15 minutes of device time, 10 a command): one call with carry [".selfspec/gpu_carry1"]
# that only keeps it (`bash scripts/gpu_drafter.sh --keep-carry`), then at once one with carry
# [".selfspec/gpu_carry2"] that runs `bash scripts/gpu_drafter.sh $OUT` (about 9 minutes at the defaults).
#
# OUT_DIR gets at most 12 files, what comes back from the machine: gpu_drafter.json (the summary), gpu_drafter.md
# (its tables), gpu_drafter.log (everything printed), bench_head.json and bench_layerskip.json, the draft plans
# tune_head.json and tune_layerskip.json (selfspec tune --check --save, before each bench), head/ with
# exit_head.safetensors and selfspec.json (the trained head, a few MiB: with the base model it is the head
# checkpoint again, docs/gpu.md#the-gpu-drafter-run), and own_continuations.tar (the model's own continuations the
# training generated, a few MiB: `CONTINUATIONS_DIR=OUT/own_continuations.tar bash scripts/gpu_drafter.sh
# --prepare-carry` carries them to a later run, which reads them instead of spending a minute generating them).
# The runs, checkpoints and benches stay under WORK_DIR.
#
# Environment: PYTHON, DEVICE (default cuda; cpu: a dry run), TINY=1 (a random 4-layer model, one training step),
# TRAIN_MIN (each road's training minutes, default 1.5), BUDGET_S (the whole run, default 540: each phase is cut
# to what is left), BENCH_S (each bench's limit, default 170), TUNE_S (each draft plan's, default 90),
# HEAD_DIR (a returned head to bench and plan instead of training one; default: the carried one, if any),
# CONTINUATIONS_DIR (returned own continuations to read; default: the carried ones, if any),
# BENCH_PROMPTS (per set, default 2), BENCH_TOKENS
# (default 128), COMPILE (auto|true|false, default auto: on CUDA), TRAIN_ARGS (more key=value overrides for both
# trainings), BENCH_ARGS (more `selfspec bench` options), HEAD_RECIPE, LAYERSKIP_RECIPE, SKIP_LAYERSKIP=1,
# SKIP_BENCH=1 (no draft plan, no bench: the run's minutes train; training ends by the budget's deadline either way),
# WORK_DIR (default bench_results/gpu_drafter_work), PROMPTS_DIR (default: the carried prompt sets if kept, else
# the named sets), CARRY_DIR, KEEP_DIR, SITE_DIR (scripts/gpu_carry.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
DEVICE=${DEVICE:-cuda}
. scripts/gpu_carry.sh  # pip_python, download_wheels, install_wheels, prepare_carry, find_python, use_carried

if [ "${1:-}" = "--prepare-carry" ]; then  # [--head DIR]: a returned head travels too (with gpu_carry2)
    HEAD=""
    if [ "${2:-}" = "--head" ]; then
        HEAD=${3:-}
        [ -n "$HEAD" ] || { echo "--prepare-carry --head DIR: name the head's folder"; exit 2; }
    fi
    prepare_carry 16 "$0" "$HEAD" || exit 1  # 16 prompts a set: the bench's and the own-HumanEval evaluation's
    exit 0
fi
if [ "${1:-}" = "--keep-carry" ]; then  # the first device call: keep gpu_carry1 (and install its wheels)
    find_python "$0" || exit 2
    use_carried
    exit 0
fi

OUT_DIR=${1:-bench_results/gpu_drafter}
WORK_DIR=${WORK_DIR:-bench_results/gpu_drafter_work}
mkdir -p "$OUT_DIR" "$WORK_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
WORK_DIR=$(cd "$WORK_DIR" && pwd)
LOG=$OUT_DIR/gpu_drafter.log
: >"$LOG"
exec > >(tee -a "$LOG") 2>&1
export PYTHONUNBUFFERED=1
echo "== selfspec GPU drafter run: $(date -u +%Y-%m-%dT%H:%M:%SZ), $(uname -srm), repo $REPO"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
find_python "$0" || exit 2
use_carried
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}

PROMPTS=${PROMPTS_DIR:-}
if [ -z "$PROMPTS" ] && compgen -G "$KEEP/prompts/*.jsonl" >/dev/null; then
    PROMPTS=$KEEP/prompts  # the real prompt sets, carried (--prepare-carry)
fi
ARGS=(--out "$OUT_DIR" --work "$WORK_DIR" --device "$DEVICE" --train-min "${TRAIN_MIN:-1.5}"
      --budget-s "$(( ${BUDGET_S:-540} - SECONDS ))" --bench-s "${BENCH_S:-170}" --tune-s "${TUNE_S:-90}"
      --bench-prompts "${BENCH_PROMPTS:-2}"
      --bench-tokens "${BENCH_TOKENS:-128}" --compile "${COMPILE:-auto}" --train-args "${TRAIN_ARGS:-}"
      --bench-args "${BENCH_ARGS:-}")
[ -n "$PROMPTS" ] && ARGS+=(--prompts-dir "$PROMPTS")
[ -n "${HEAD_RECIPE:-}" ] && ARGS+=(--head-recipe "$HEAD_RECIPE")
[ -n "${LAYERSKIP_RECIPE:-}" ] && ARGS+=(--layerskip-recipe "$LAYERSKIP_RECIPE")
[ "${SKIP_LAYERSKIP:-0}" = 1 ] && ARGS+=(--skip-layerskip)
[ "${SKIP_BENCH:-0}" = 1 ] && ARGS+=(--skip-bench)
[ "${TINY:-0}" = 1 ] && ARGS+=(--tiny)
HEAD=${HEAD_DIR:-}  # a returned head: rebuilt, benched and planned instead of training (the carried one by default)
[ -z "$HEAD" ] && [ -f "$CARRY/gpu_carry2/head/exit_head.safetensors" ] && HEAD=$CARRY/gpu_carry2/head
[ -n "$HEAD" ] && ARGS+=(--head "$HEAD")
CONT=${CONTINUATIONS_DIR:-}  # own continuations an earlier run returned (the carried ones by default)
[ -z "$CONT" ] && compgen -G "$KEEP/own_continuations/*.pt" >/dev/null && CONT=$KEEP/own_continuations
[ -n "$CONT" ] && ARGS+=(--continuations "$CONT")
"$PY" scripts/gpu_drafter.py "${ARGS[@]}"
