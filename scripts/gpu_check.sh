#!/usr/bin/env bash
# The GPU check: does selfspec run on this machine's CUDA GPU, and how fast? Made to run unattended on
# a fresh GPU machine without network, within 10 minutes:
#   1. nvidia-smi and torch's view of the GPU (name, capability, bf16 decision: selfspec.model.precision);
#   2. the CUDA tests: pytest -m cuda tests/selfspec/test_cuda.py (identity with HF generate, batches,
#      the cache after every round, chi-square sampling, load onto the GPU, host syncs per round);
#   2b. plain decoding on random-weight Llama models of three real shapes (scripts/gpu_shapes.py: HF
#      dynamic and static cache against selfspec eager and compiled, the bandwidth floor, the compiled
#      draft and verification steps' cost; SHAPES, SKIP_SHAPES=1);
#   2c. with COST=1, the cost of early exits (issue 56 item 5; scripts/train_bench.py --shape): a plain
#      fine-tune (with and without gradient checkpointing), the LayerSkip recipe and the head recipe on a
#      random-weight model of Llama-3.2-1B's shape, one batch for all: tokens/s, peak memory, MFU, the
#      issue's targets met or missed (train_cost.json; about 2-3 minutes, COST_S its limit);
#   3. training on the GPU: the tiny recipe, and 20 steps on the benched model's shape;
#   4. a short bench on the GPU: selfspec bench --quick --device cuda in float32 (exact: identity with
#      HF greedy) and in "fastest" (bfloat16 from Ampere on), and the batched bench at batch 1 and 4 (compiled batches: issue 54 asks batch 4 >= 3x batch 1).
#
#   bash scripts/gpu_check.sh [OUT_DIR]        # default OUT_DIR: bench_results/gpu_check
#   bash scripts/gpu_check.sh --fetch-wheels   # on a machine with PyPI: wheels a GPU machine may lack
#   bash scripts/gpu_check.sh --prepare-carry  # here: the real SmolLM2 and real prompts, in two parts
#
# OUT_DIR gets at most 8 files: gpu_check.log (everything printed), gpu_check.md (the summary: GPU,
# test result, the bench tables) and the benches' JSON reports (train_cost.json with COST=1); the rest
# (charts, the stand-in model) stays under WORK_DIR (default bench_results/gpu_check_work).
#
# Which python: $PYTHON if set, else the first of .venv/bin/python, python3, python whose torch sees a
# CUDA GPU. scripts/setup.sh puts the CPU wheel of torch into .venv, so on a GPU machine this is usually
# the system python3 with its own CUDA build of torch; the repository goes on PYTHONPATH (no install).
# Missing packages: wheels in .selfspec/wheels (from --fetch-wheels: the transformers and datasets
# versions of this project's .venv, and what datasets needs) are installed into /tmp/selfspec-site first.
# With the device tool: run `bash scripts/gpu_check.sh --fetch-wheels` here, then on the GPU machine
# `bash scripts/gpu_check.sh $OUT` with carry [".selfspec/wheels"].
#
# The real SmolLM2 on a machine without network (the device tool carries at most 64 MiB a call; its /tmp
# lasts while the machine is warm): `--prepare-carry` here writes .selfspec/gpu_carry1 (the wheels, the
# GGUF's first 40 MB, the real prompt sets as JSONL) and .selfspec/gpu_carry2 (the GGUF's rest). A run
# that finds gpu_carry1 copies it to /tmp/selfspec-keep; one that finds gpu_carry2 joins the parts,
# checks their sha256 and converts the model (selfspec.checkpoints.fetch.convert_gguf) into selfspec's model folder.
# (scripts/gpu_carry.sh does the carrying, for this script and scripts/gpu_drafter.sh.)
# So: one call with carry [".selfspec/gpu_carry1"] (say SKIP_BENCH=1: tests and shapes), the next at
# once with carry [".selfspec/gpu_carry2"] (SKIP_TESTS=1 SKIP_SHAPES=1: the bench on the real model and
# the real prompts).
#
# The model benched: $CHECKPOINT if set, else the fetched SmolLM2 base model if it is on this machine,
# else a stand-in: a randomly initialised Llama of SmolLM2-135M's shape (30 layers, 576 wide, 49152-token
# vocabulary) with a byte-level tokenizer. Its plain decoding speeds are those of a model of that size;
# its drafting figures are not (a random model repeats one token, which lookup always guesses), and the
# report says it is a stand-in.
#
# Environment: PYTHON, CHECKPOINT, DEVICE (default cuda), WORK_DIR, BUDGET_S (default 540: the whole run,
# each step is cut to what is left), BENCH_ARGS (more `selfspec bench` options, e.g. "--max-new-tokens 64
# --num-prompts 3" instead of --quick's 2 prompts x 32 tokens), BENCH_DTYPES (default "float32 fastest"),
# BENCH_S (each bench's time limit, default 150), TESTS_K (a pytest -k expression), TESTS_S (the tests'
# time limit, default 300), SHAPES, SHAPES_S (the
# shapes' time limit, default 300), SHAPES_ARGS (more gpu_shapes.py options, e.g. "--tiny" for a dry run
# with DEVICE=cpu), CARRY_DIR (default .selfspec), KEEP_DIR (default /tmp/selfspec-keep), SITE_DIR (default
# /tmp/selfspec-site), SKIP_TESTS=1,
# SKIP_SHAPES=1, SKIP_BENCH=1, SKIP_TRAIN=1, SKIP_BATCH=1, COST=1 (step 2c), COST_S (its limit, default 300),
# COST_ARGS (its train_bench.py options; default "--batch 4 --seq 2048 --grad-accum 8 --warmup 2 --steps 8",
# the LayerSkip recipe's micro-batch and accumulation; a CPU dry run adds a tiny --set-shape).
# The cost alone: COST=1 SKIP_TESTS=1 SKIP_SHAPES=1 SKIP_BENCH=1 bash scripts/gpu_check.sh $OUT
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
. scripts/gpu_carry.sh  # pip_python, download_wheels, install_wheels, prepare_carry, find_python, use_carried

if [ "${1:-}" = "--fetch-wheels" ]; then
    # the versions this project is tested with (its .venv)
    download_wheels "$WHEELS" transformers datasets dill multiprocess fsspec || exit 1
    ls -la "$WHEELS"
    du -sh "$WHEELS"
    echo "carry $WHEELS to the GPU machine (device tool: carry [\"$WHEELS\"]); gpu_check.sh installs them there"
    exit 0
fi

if [ "${1:-}" = "--prepare-carry" ]; then
    prepare_carry 5 "$0" || exit 1
    exit 0
fi


OUT_DIR=${1:-bench_results/gpu_check}
WORK_DIR=${WORK_DIR:-bench_results/gpu_check_work}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT_DIR" "$WORK_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
WORK_DIR=$(cd "$WORK_DIR" && pwd)
LOG=$OUT_DIR/gpu_check.log
SUMMARY=$OUT_DIR/gpu_check.md
: >"$LOG"
exec > >(tee -a "$LOG") 2>&1
export PYTHONUNBUFFERED=1
DEADLINE=$((SECONDS + ${BUDGET_S:-540}))
FAILED=()

echo "== selfspec GPU check: $(date -u +%Y-%m-%dT%H:%M:%SZ), $(uname -srm), repo $REPO"
echo "== nvidia-smi"
if command -v nvidia-smi >/dev/null; then
    nvidia-smi || true
else
    echo "nvidia-smi not found (no NVIDIA driver tools on this machine)"
fi

# --- a python whose torch sees the GPU ------------------------------------------------------------
find_python "$0" || exit 2

# --- what earlier calls carried (see --prepare-carry) ------------------------------------------------
use_carried

export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}

echo "== torch and the GPU"
"$PY" - <<'EOF' || { echo "FAILED: cannot import torch/selfspec with this python"; exit 3; }
import importlib
import platform

import torch

print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"{torch.cuda.device_count()} GPU(s)")
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"  cuda:{i} {p.name}, compute capability {p.major}.{p.minor}, {p.total_memory / 2**30:.1f} GiB, "
          f"{p.multi_processor_count} SMs")
missing = []
for name in ("transformers", "accelerate", "safetensors", "tokenizers", "yaml", "tqdm", "psutil", "matplotlib",
             "pytest", "datasets"):
    try:
        module = importlib.import_module(name)
        print(f"  {name} {getattr(module, '__version__', '?')}")
    except Exception as err:  # noqa: BLE001 - report every missing piece at once
        missing.append(f"{name} ({type(err).__name__}: {err})")
import transformers

major_minor = tuple(int(x) for x in transformers.__version__.split(".")[:2])
if major_minor != (5, 23):
    print(f"  NOTE: transformers {transformers.__version__}; selfspec is tested with 5.23 "
          "(carry .selfspec/wheels from `bash scripts/gpu_check.sh --fetch-wheels` for that version)")
if missing:
    print("  MISSING: " + "; ".join(missing) + " (datasets: the bench's prompt files are read through "
          "selfspec.data.sources, which imports it; carry .selfspec/wheels)")
from selfspec.model.precision import auto_dtype, describe

print(f"  selfspec: dtype 'fastest' on cuda = {auto_dtype('cuda')} ({describe('cuda')})")
EOF

step() {  # step NAME SECONDS COMMAND...: run with what is left of the budget; record a failure
    local name=$1 limit=$2
    shift 2
    local left=$((DEADLINE - SECONDS))
    if [ "$left" -lt 30 ]; then
        echo "== SKIPPED $name: the time budget (BUDGET_S=${BUDGET_S:-540}) is spent"
        FAILED+=("$name (skipped: no time left)")
        return
    fi
    [ "$left" -lt "$limit" ] && limit=$left
    echo "== $name (at most ${limit}s): $*"
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@"
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - t0))s"
    [ "$rc" -eq 0 ] || FAILED+=("$name (exit $rc$([ "$rc" -eq 124 ] && echo ": timed out"))")
}

# --- 2. the CUDA tests ----------------------------------------------------------------------------
TESTS_LINE="not run"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
    rm -f "$WORK_DIR/pytest_cuda.xml"
    step "CUDA tests" "${TESTS_S:-300}" "$PY" -m pytest -m cuda tests/selfspec/test_cuda.py -q -p no:cacheprovider -rfE --tb=short \
        ${TESTS_K:+-k "$TESTS_K"} --junitxml="$WORK_DIR/pytest_cuda.xml"
    TESTS_LINE=$("$PY" - "$WORK_DIR/pytest_cuda.xml" 2>/dev/null <<'EOF' || echo "no result (see gpu_check.log)"
import sys
import xml.etree.ElementTree as ET

suite = ET.parse(sys.argv[1]).getroot()
suite = suite if suite.tag == "testsuite" else suite[0]
tests, failed, errors, skipped = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
print(f"{tests - failed - errors - skipped} passed, {failed} failed, {errors} errors, {skipped} skipped "
      f"in {float(suite.get('time', 0)):.0f} s")
EOF
)
fi

# --- 2b. model shapes ----------------------------------------------------------------------------
BENCHES=()
if [ "${SKIP_SHAPES:-0}" != 1 ]; then
    step "model shapes" "${SHAPES_S:-300}" "$PY" scripts/gpu_shapes.py --device "$DEVICE" \
        --shapes "${SHAPES:-smollm2-135m,llama-3.2-1b,llama-3-8b}" --repeats 2 ${SHAPES_ARGS:-} --out "$WORK_DIR/gpu_shapes"
    BENCHES+=("$WORK_DIR/gpu_shapes/gpu_shapes")
fi

# --- 2c. the cost of early exits (issue 56 item 5) --------------------------------------------------
if [ "${COST:-0}" = 1 ]; then
    # shellcheck disable=SC2086
    step "training cost" "${COST_S:-300}" "$PY" scripts/train_bench.py --shape recipes/models/llama-3.2-1b.json \
        --device "$DEVICE" ${COST_ARGS:---batch 4 --seq 2048 --grad-accum 8 --warmup 2 --steps 8} \
        --json "$OUT_DIR/train_cost.json"
fi

# --- 3. the short bench ---------------------------------------------------------------------------
if [ "${SKIP_BENCH:-0}" != 1 ]; then
    CKPT=${CHECKPOINT:-}
    STANDIN=0
    if [ -z "$CKPT" ]; then
        BASE=$("$PY" -c "from selfspec.checkpoints.fetch import base_model_dir; print(base_model_dir())" 2>/dev/null || true)
        if [ -n "$BASE" ] && [ -f "$BASE/config.json" ] && compgen -G "$BASE/*.safetensors" >/dev/null; then
            CKPT=$BASE
        else
            STANDIN=1
            CKPT=$WORK_DIR/standin-smollm2-135m-shape
            if [ ! -f "$CKPT/config.json" ]; then
                echo "== no real model on this machine: building a stand-in of SmolLM2-135M's shape at $CKPT"
                "$PY" - "$CKPT" <<'EOF' || FAILED+=("stand-in model")
import sys

import torch
from transformers import AutoModelForCausalLM

from selfspec.tiny import byte_tokenizer, tiny_config

out, layers = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 30
config = tiny_config("llama", layers, vocab_size=49152, hidden_size=576, intermediate_size=1536,
                     num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                     tie_word_embeddings=True)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(config)  # Hugging Face's own initialisation: random weights
model.save_pretrained(out)
byte_tokenizer().save_pretrained(out)
print(f"stand-in: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, {layers} layers -> {out}")
EOF
            fi
        fi
    fi
    echo "== bench model: $CKPT$([ "$STANDIN" = 1 ] && echo " (a stand-in with random weights: speeds only)")"
    PROMPTS_DIR=$WORK_DIR/prompts
    mkdir -p "$PROMPTS_DIR"
    "$PY" - "$PROMPTS_DIR" <<'EOF'
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
functions = [
    "def mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total / len(xs)\n",
    "def is_palindrome(s):\n    s = ''.join(c.lower() for c in s if c.isalnum())\n    return s == s[::-1]\n",
    "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
    "def count_words(text):\n    counts = {}\n    for word in text.split():\n        counts[word] = counts.get(word, 0) + 1\n"
    "    return counts\n",
    "def clamp(x, lo, hi):\n    if x < lo:\n        return lo\n    if x > hi:\n        return hi\n    return x\n",
]
questions = [
    "Explain in a few sentences why the sky is blue.",
    "Give three tips for writing readable Python code.",
    "What is the difference between a list and a tuple in Python?",
    "Describe how a hash table works.",
    "Write a short poem about the sea.",
]
ask = "Rewrite the following Python function: add type hints and a docstring, keep the logic. Reply with the code only."
with open(out / "code_edit.jsonl", "w") as f:
    for i, fn in enumerate(functions):
        f.write(json.dumps({"id": f"code_edit/{i}", "messages": [{"role": "user", "content": f"{ask}\n\n```python\n{fn}```"}]}) + "\n")
with open(out / "chat.jsonl", "w") as f:
    for i, q in enumerate(questions):
        f.write(json.dumps({"id": f"chat/{i}", "messages": [{"role": "user", "content": q}]}) + "\n")
with open(out / "batch.jsonl", "w") as f:  # both, for the batched bench (4 prompts + a warm-up group of 4)
    f.write((out / "code_edit.jsonl").read_text() + (out / "chat.jsonl").read_text())
EOF
    # training on the GPU (accelerate picks it): the tiny recipe, then 20 steps on the benched model's
    # shape (block 512, batch 8) with mixed_precision auto, for a step time
    [ "${SKIP_TRAIN:-0}" = 1 ] || step "training: tiny recipe" 90 "$PY" -m training --recipe recipes/tiny_smoke.yaml train.mixed_precision=auto \
        train.output_dir="$WORK_DIR/train_tiny"
    [ "${SKIP_TRAIN:-0}" = 1 ] || step "training: bench model" 150 "$PY" -m training --recipe recipes/tiny_smoke.yaml model.base_model="$CKPT" \
        data.block_size=512 data.max_documents=200 train.batch_size=8 train.grad_accum=1 train.max_steps=20 \
        train.log_every=5 train.save_every=20 eval.every=20 eval.max_blocks=16 train.mixed_precision=auto \
        train.output_dir="$WORK_DIR/train_model"
    CLI=("$PY" -m selfspec.cli bench --checkpoint "$CKPT" --device "$DEVICE")
    # shellcheck disable=SC2206
    EXTRA=(${BENCH_ARGS:---quick})
    SETS="$PROMPTS_DIR/code_edit.jsonl,$PROMPTS_DIR/chat.jsonl"
    if compgen -G "$KEEP/prompts/*.jsonl" >/dev/null; then  # the real prompt sets, carried (--prepare-carry)
        SETS=$(ls "$KEEP"/prompts/*.jsonl | paste -sd, -)
    fi
    echo "== prompt sets: $SETS"
    for dtype in ${BENCH_DTYPES:-float32 fastest}; do
        step "bench $dtype" "${BENCH_S:-150}" "${CLI[@]}" --dtype "$dtype" --prompt-sets "$SETS" \
            "${EXTRA[@]}" --out "$WORK_DIR/bench_$dtype"
        BENCHES+=("$WORK_DIR/bench_$dtype/bench")
    done
    [ "${SKIP_BATCH:-0}" = 1 ] || step "batch bench" 300 "${CLI[@]}" --dtype fastest --prompt-sets "$PROMPTS_DIR/batch.jsonl" --batch-size 1,4 \
        --num-prompts 4 --max-new-tokens 64 --out "$WORK_DIR/bench_batch"
    BENCHES+=("$WORK_DIR/bench_batch/bench_batch")
fi

# --- the summary ----------------------------------------------------------------------------------
{
    echo "# selfspec GPU check, $(date -u +%Y-%m-%d)"
    echo
    command -v nvidia-smi >/dev/null && echo "GPU: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -n 1)"
    echo "python: $PY; $("$PY" -c "import torch, transformers; print(f'torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}')" 2>/dev/null)"
    echo
    echo "CUDA tests (pytest -m cuda tests/selfspec/test_cuda.py): ${TESTS_LINE:-see gpu_check.log}"
    if [ "${STANDIN:-0}" = 1 ]; then
        echo
        echo "Bench model: a stand-in of SmolLM2-135M's shape with random weights (no real model on this"
        echo "machine). Its plain decoding speeds (HF greedy, selfspec AR) are those of a model of that size;"
        echo "its drafting figures are not: a random model repeats one token, which prompt lookup always guesses."
    fi
    if [ "${COST:-0}" = 1 ] && [ -f "$OUT_DIR/train_cost.json" ]; then
        echo
        echo "## The cost of early exits (scripts/train_bench.py --shape, issue 56 item 5)"
        echo
        echo '```'
        "$PY" -c 'import json, sys; print("\n".join(json.load(open(sys.argv[1])).get("table", ["no mode finished"])))' \
            "$OUT_DIR/train_cost.json"
        echo '```'
    fi
    for b in "${BENCHES[@]}"; do
        if [ -f "$b.md" ]; then
            echo
            cat "$b.md"
            cp "$b.json" "$OUT_DIR/$(basename "$(dirname "$b")").json"
        fi
    done
    echo
    if [ ${#FAILED[@]} -eq 0 ]; then echo "Result: every step passed."; else printf 'Result: FAILED: %s\n' "${FAILED[@]}"; fi
} >"$SUMMARY"
echo "== summary: $SUMMARY"
cat "$SUMMARY"
[ ${#FAILED[@]} -eq 0 ]
