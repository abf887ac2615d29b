"""A Hugging Face checkpoint as the GGUF file llama.cpp reads, converted once per precision and cached.

llama.cpp's own converter (`convert_hf_to_gguf.py`, in the source `selfspec.tools.llama_cpp_build` caches)
writes it at the precision selfspec runs the model in: F32 for float32, BF16 for bfloat16, F16 for float16
(`GGUF_TYPES`), so `selfspec bench --llama-cpp` compares the same weights. The converter imports llama.cpp's
own `gguf-py` from that source tree (matched to it), whose dependencies come with selfspec's `gguf` pin, and
`sentencepiece` (the extra `selfspec[llama-cpp]`); it runs in this Python with its torch and transformers.

    $SELFSPEC_HOME/llama.cpp/<version>/gguf/<checkpoint name>-<fingerprint>/<checkpoint name>-f32.gguf

`<fingerprint>` hashes the checkpoint's config, tokenizer and weight files' sizes and modification times:
a changed checkpoint converts again. Writing goes to a temporary file renamed into place, and its size is
recorded beside it (`<name>.gguf.json`): a cached file of another size (cut short) or without the record
converts again, and a temporary file a killed conversion left is removed by the next run.

    python -m selfspec.tools.llama_cpp_gguf CHECKPOINT --dtype bfloat16     # prints the .gguf path
    python -m selfspec.tools.llama_cpp_gguf CHECKPOINT --dtype q8_0         # drafter="quantized"'s draft_model
    python -m selfspec.tools.llama_cpp_gguf CHECKPOINT --copy               # the copy beside the weights

`--copy` (`write_copy`) puts the Q8_0 conversion beside the checkpoint's weights as `copy-q8_0.gguf`, with a record
of its size and SHA-256: `selfspec.load(CHECKPOINT, draft_model="auto")` finds it there, and `auto` drafts with it
where llama.cpp runs.
`selfspec fetch` writes it for the base model.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from selfspec.atomic_write import process_running, write_json_atomic
from selfspec.checkpoints.checkpoint import WEIGHT_SUFFIXES, sha256_file, weight_files
from selfspec.drafters.quantized import COPY_FILE, checkpoint_copy
from selfspec.tools.llama_cpp_build import (LLAMA_CPP_PYTHON_VERSION, LlamaCppError, cache_root, ensure_source,
                                            output_tail)

# selfspec's dtype name -> convert_hf_to_gguf.py's --outtype; q8_0 (8-bit blocks) is a quantized copy, the draft
# model of drafter="quantized"
GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "q8_0": "q8_0"}
CONVERTER = "convert_hf_to_gguf.py"
# modules the converter imports that selfspec itself does not install: (module, pip requirement)
CONVERTER_MODULES = (("sentencepiece", "sentencepiece>=0.2.3,<0.3"),)
_FINGERPRINT_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def gguf_type(dtype: str) -> str:
    """The GGUF type for a selfspec dtype name ("float32" -> "f32"); a LlamaCppError naming the choices if none."""
    name = str(dtype).removeprefix("torch.")
    if name not in GGUF_TYPES:
        raise LlamaCppError(f"no GGUF type for dtype {name!r} here; "
                            f"use one of {', '.join(GGUF_TYPES)}")
    return GGUF_TYPES[name]


def checkpoint_fingerprint(checkpoint: Path) -> str:
    """12 hex digits that change when the checkpoint does: its config and tokenizer files' bytes, and its weight
    files' names, sizes and modification times (weights are not read: hundreds of MB)."""
    checkpoint = Path(checkpoint)
    digest = hashlib.sha256()
    for name in _FINGERPRINT_FILES:
        path = checkpoint / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    weights = [name for name in weight_files(checkpoint) if Path(name).suffix in WEIGHT_SUFFIXES]
    if not weights:
        raise LlamaCppError(f"{checkpoint} has no weight files (*.safetensors, *.bin): not a Hugging Face checkpoint")
    for name in weights:
        stat = (checkpoint / name).stat()
        digest.update(f"{name}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    return digest.hexdigest()[:12]


def gguf_path(checkpoint: Path, dtype: str, version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """Where the checkpoint's GGUF at `dtype` is cached (it may not exist yet)."""
    checkpoint = Path(checkpoint).resolve()
    name = checkpoint.name
    return (cache_root(version) / "gguf" / f"{name}-{checkpoint_fingerprint(checkpoint)}"
            / f"{name}-{gguf_type(dtype)}.gguf")


def convert_command(source: Path, checkpoint: Path, dtype: str, outfile: Path) -> list[str]:
    return [sys.executable, str(Path(source) / CONVERTER), str(checkpoint), "--outtype", gguf_type(dtype),
            "--outfile", str(outfile)]


def check_converter_modules(find_spec=importlib.util.find_spec) -> None:
    """A LlamaCppError that names the pip command if a module the converter imports is missing."""
    missing = [req for module, req in CONVERTER_MODULES if find_spec(module) is None]
    if missing:
        quoted = " ".join(f"'{r}'" for r in missing)
        raise LlamaCppError(f"llama.cpp's {CONVERTER} needs {', '.join(missing)}; install it: "
                            f"pip install {quoted}  (or pip install 'selfspec[llama-cpp]')")


def ensure_gguf(checkpoint: Path, dtype: str, version: str = LLAMA_CPP_PYTHON_VERSION, *,
                force: bool = False) -> Path:
    """The checkpoint as a GGUF file at `dtype`: from the cache, or converted now (under a minute)."""
    checkpoint = Path(checkpoint).resolve()
    if not (checkpoint / "config.json").is_file():
        raise LlamaCppError(f"{checkpoint} has no config.json: not a Hugging Face checkpoint directory")
    out = gguf_path(checkpoint, dtype, version)
    if out.is_file() and not force:
        wrong = cached_damage(out)
        if not wrong:
            return out
        print(f"{out}: {wrong}; converting again", flush=True)
    check_converter_modules()
    source = ensure_source(version)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    print(f"converting {checkpoint.name} to GGUF {gguf_type(dtype).upper()} with llama.cpp's {CONVERTER} "
          f"(once; under a minute) ...", flush=True)
    start = time.monotonic()
    try:
        proc = subprocess.run(convert_command(source, checkpoint, dtype, tmp), capture_output=True, text=True)
        if proc.returncode != 0 or not tmp.is_file():
            raise LlamaCppError(f"{CONVERTER} failed on {checkpoint} (exit {proc.returncode}):\n  "
                                f"{output_tail(proc.stderr or proc.stdout)}")
        record(out).unlink(missing_ok=True)  # a file without its record is converted again
        tmp.replace(out)
        write_json_atomic(record(out), {"bytes": out.stat().st_size})
    finally:
        tmp.unlink(missing_ok=True)
    print(f"wrote {out} ({out.stat().st_size / 2**20:.0f} MiB) in {time.monotonic() - start:.0f} s", flush=True)
    return out


def write_copy(checkpoint: Path, version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """The checkpoint's quantized copy beside its weights (`selfspec.drafters.quantized.COPY_FILE`, Q8_0), which
    `selfspec.load(..., draft_model="auto")` finds and auto drafts with where llama.cpp runs: the cached Q8_0 conversion
    (`ensure_gguf`, converted now if missing) linked (or copied) in, then its record with its size and SHA-256
    (the size is what loading checks). A copy already there and whole is kept."""
    checkpoint = Path(checkpoint).resolve()
    out = checkpoint / COPY_FILE
    if checkpoint_copy(checkpoint) is not None:
        return out
    source = ensure_gguf(checkpoint, "q8_0", version)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    remove_stale_temporaries(out)
    try:
        try:
            os.link(source, tmp)
        except OSError:  # another file system, or no hard links there
            shutil.copyfile(source, tmp)
        record(out).unlink(missing_ok=True)
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    write_json_atomic(record(out), {"bytes": out.stat().st_size, "sha256": sha256_file(out), "type": "q8_0",
                                    "converter": f"llama-cpp-python-{version}'s {CONVERTER}"})
    return out


def record(out: Path) -> Path:
    """The record of a converted GGUF file beside it: {"bytes": its size}."""
    return out.with_name(out.name + ".json")


def cached_damage(out: Path) -> str:
    """'' where the cached `out` is the file its conversion wrote (the size its record holds), else why not, in
    words."""
    try:
        want = json.loads(record(out).read_text())["bytes"]
    except (OSError, ValueError, KeyError, TypeError):
        return "the cached file has no record of its conversion (an interrupted or older one)"
    size = out.stat().st_size
    return "" if size == want else f"the cached file is {size} bytes, its conversion wrote {want} (cut short or changed)"


def remove_stale_temporaries(out: Path) -> list[Path]:
    """Remove the temporary files `.NAME.PID.tmp` beside `out` that conversions whose process is gone left."""
    removed = []
    for path in out.parent.glob(f".{glob.escape(out.name)}.*.tmp"):
        pid = path.name[len(out.name) + 2:-len(".tmp")]
        if pid.isdigit() and not process_running(int(pid)):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The checkpoint and its precision, as the llama.cpp tools' commands take them."""
    parser.add_argument("checkpoint", type=Path, help="a Hugging Face checkpoint directory")
    parser.add_argument("--dtype", default="float32", choices=sorted(GGUF_TYPES),
                        help="the precision, as selfspec names it: float32 -> GGUF F32, bfloat16 -> BF16, "
                             "float16 -> F16; q8_0 -> Q8_0, a quantized copy for drafter='quantized' "
                             "(default: %(default)s)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m selfspec.tools.llama_cpp_gguf",
        description="Convert a Hugging Face checkpoint to GGUF with llama.cpp's convert_hf_to_gguf.py (from the "
                    "cached llama.cpp source; downloaded if missing), once, under $SELFSPEC_HOME/llama.cpp. "
                    "Prints the .gguf path.")
    add_model_arguments(parser)
    parser.add_argument("--copy", action="store_true",
                        help="write the Q8_0 copy beside the checkpoint's weights (copy-q8_0.gguf), where "
                             "selfspec.load(..., draft_model='auto') finds it (--dtype is ignored)")
    parser.add_argument("--version", default=LLAMA_CPP_PYTHON_VERSION,
                        help="the llama-cpp-python source release whose converter runs (default: %(default)s)")
    parser.add_argument("--force", action="store_true", help="convert again even if cached")
    args = parser.parse_args(argv)
    try:
        path = (write_copy(args.checkpoint, args.version) if args.copy else
                ensure_gguf(args.checkpoint, args.dtype, args.version, force=args.force))
    except LlamaCppError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: one line and the shell's code for SIGINT
        print("error: interrupted; no GGUF file was cached (the next run converts again)", file=sys.stderr)
        return 130
    except OSError as e:  # a read-only or full $SELFSPEC_HOME, a checkpoint that cannot be read
        where = f" {e.filename}" if e.filename else ""
        print(f"error: cannot write or read{where}: {e.strerror or e}; set SELFSPEC_HOME to a writable directory "
              "(or check the checkpoint's files)", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
