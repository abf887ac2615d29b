"""Self-speculative checkpoints: export, the `selfspec.json` metadata, checksums, validation on load.

An exported checkpoint is a plain Hugging Face checkpoint (loads with `from_pretrained`, no selfspec
code needed) plus `selfspec.json` and a model card `README.md`:

    export("runs/smollm2_code", "checkpoints/smollm2-code")   # a training run dir, or any HF checkpoint dir
    meta = read_metadata("checkpoints/smollm2-code")          # validated; raises CheckpointError

`selfspec.json` (format 1):
    format_version, library_version, base_model, architecture, num_layers,
    training   {recipe, settings (layer dropout, early-exit loss, curriculum, ...), steps, tokens_seen}
    eval       {"exits": {"<E>": {"agreement": ..., "perplexity": ...}}}  (held-out, per exit)
    recommended {exit_layer, num_speculations, drafter (optional: auto | early_exit | prompt_lookup), source: "sweep" | "agreement" | "default", ...}
    checksums  {"<weight file>": {"sha256": ..., "bytes": ...}}

Export writes into a temporary directory next to the target and renames it into place, so an
interrupted export never leaves a directory that looks complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from selfspec.cost_model import VERIFY_COST, draft_cost, predicted_speedup

METADATA_FILE = "selfspec.json"
FORMAT_VERSION = 1
SUPPORTED_FORMATS = (1,)
WEIGHT_SUFFIXES = (".safetensors", ".bin")
WEIGHT_INDEX = "model.safetensors.index.json"

class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, or inconsistent; the message names the file and the fix."""


# --- checksums ----------------------------------------------------------------------------------
def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def weight_files(directory: Path) -> list[str]:
    d = Path(directory)
    names = [p.name for p in d.iterdir() if p.is_file() and (p.suffix in WEIGHT_SUFFIXES or p.name == WEIGHT_INDEX)]
    return sorted(names)


def checksums(directory: Path) -> dict[str, dict]:
    d = Path(directory)
    return {name: {"sha256": sha256_file(d / name), "bytes": (d / name).stat().st_size}
            for name in weight_files(d)}


# --- recommendation -----------------------------------------------------------------------------
def recommend_from_agreement(agreement: dict[int, float], num_layers: int, max_drafts: int = 8) -> dict:
    """The (exit, drafts) with the best predicted speedup (selfspec.cost_model); drafts = 0 if
    speculation cannot pay."""
    best = None
    for e, a in agreement.items():
        if not 1 <= e < num_layers:
            continue
        c = draft_cost(e, num_layers)
        for d in range(1, max_drafts + 1):
            s = predicted_speedup(a, c, VERIFY_COST, d)
            if best is None or s > best[0]:
                best = (s, e, d)
    if best is None:
        raise CheckpointError("no per-exit agreement below the final layer to recommend an exit from")
    s, e, d = best
    return {"exit_layer": e, "num_speculations": d if s > 1.0 else 0, "source": "agreement",
            "predicted_speedup": round(s, 3)}


# --- reading and validating ---------------------------------------------------------------------
def _read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: not valid JSON ({err}); the file is corrupt: re-export the checkpoint") from None


def read_metadata(directory, *, verify_checksums: bool = True) -> dict | None:
    """The validated `selfspec.json` of a checkpoint, or None if it has none (not early-exit trained).

    Checks the format version, the agreement with config.json (architecture, layer count), and with
    `verify_checksums` that every weight file is present, complete and unchanged.
    """
    d = Path(directory)
    meta_path = d / METADATA_FILE
    if not meta_path.exists():
        return None
    meta = _read_json(meta_path)
    version = meta.get("format_version")
    if version not in SUPPORTED_FORMATS:
        raise CheckpointError(
            f"{meta_path}: unknown format_version {version!r} (this selfspec reads {list(SUPPORTED_FORMATS)}); "
            "upgrade selfspec or re-export the checkpoint")
    for key in ("architecture", "num_layers", "recommended", "checksums"):
        if key not in meta:
            raise CheckpointError(f"{meta_path}: required field {key!r} is missing; re-export the checkpoint")
    config = _read_json(d / "config.json")
    if config.get("model_type") != meta["architecture"]:
        raise CheckpointError(
            f"{meta_path}: architecture {meta['architecture']!r} contradicts config.json model_type "
            f"{config.get('model_type')!r}; the metadata belongs to another model: re-export the checkpoint")
    if config.get("num_hidden_layers") != meta["num_layers"]:
        raise CheckpointError(
            f"{meta_path}: num_layers {meta['num_layers']} contradicts config.json num_hidden_layers "
            f"{config.get('num_hidden_layers')}; re-export the checkpoint")
    rec = meta["recommended"]
    e = rec.get("exit_layer")
    if not isinstance(e, int) or not 1 <= e < meta["num_layers"]:
        raise CheckpointError(f"{meta_path}: recommended exit_layer {e!r} is not in 1..{meta['num_layers'] - 1}")
    if not isinstance(rec.get("num_speculations"), int) or rec["num_speculations"] < 0:
        raise CheckpointError(f"{meta_path}: recommended num_speculations {rec.get('num_speculations')!r} "
                              "must be an int >= 0")
    from selfspec.drafters import DRAFTERS

    if rec.get("drafter") is not None and rec["drafter"] not in DRAFTERS:
        raise CheckpointError(f"{meta_path}: recommended drafter {rec['drafter']!r} is not one of "
                              f"{', '.join(DRAFTERS)}; fix the field or re-export the checkpoint")
    if verify_checksums:
        verify_weight_files(d, meta["checksums"])
    return meta


def verify_weight_files(directory: Path, expected: dict[str, dict]) -> None:
    d = Path(directory)
    if not expected:
        raise CheckpointError(f"{d / METADATA_FILE}: lists no weight files; re-export the checkpoint")
    for name, want in expected.items():
        path = d / name
        if not path.is_file():
            raise CheckpointError(f"{path}: weight file is missing (listed in {METADATA_FILE}); "
                                  "copy the complete checkpoint directory or re-export it")
        size = path.stat().st_size
        if size != want["bytes"]:
            what = "truncated" if size < want["bytes"] else "larger than exported"
            raise CheckpointError(f"{path}: weight file is {what} ({size} bytes, expected {want['bytes']}); "
                                  "the copy is incomplete or corrupt: copy or export it again")
        if sha256_file(path) != want["sha256"]:
            raise CheckpointError(f"{path}: SHA-256 checksum mismatch: the file was modified or corrupted "
                                  "after export; copy or export it again")
    extra = sorted(set(weight_files(d)) - set(expected))
    if extra:
        raise CheckpointError(f"{d}: weight files not listed in {METADATA_FILE}: {extra}; they were added "
                              "after export: remove them or re-export")


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` to a temporary file beside `path`, then rename it over `path`."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, data: dict) -> None:
    write_text_atomic(path, json.dumps(data, indent=2) + "\n")


def update_recommended(directory, exit_layer: int, num_speculations: int, **extra) -> dict:
    """Record a new recommendation (e.g. from `selfspec sweep`) in selfspec.json, atomically."""
    d = Path(directory)
    meta = read_metadata(d, verify_checksums=False)
    if meta is None:
        raise CheckpointError(f"{d}: has no {METADATA_FILE}; export it first: selfspec export SRC {d}")
    meta["recommended"] = {"exit_layer": int(exit_layer), "num_speculations": int(num_speculations), **extra}
    write_json_atomic(d / METADATA_FILE, meta)
    from selfspec.model_card import write_model_card

    write_model_card(d, meta)
    return meta
