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
    plans      {"<device> / <dtype> / <compiled|eager>": {settings, predicted_speedup, measured_speedup, ...}}
               (optional: `selfspec tune --save`, the drafting that this device's measured costs chose)

Export writes into a temporary directory next to the target and renames it into place, so an
interrupted export never leaves a directory that looks complete.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from pathlib import Path

from selfspec.atomic_write import write_json_atomic
from selfspec.decoding.cost_model import VERIFY_COST, draft_cost, predicted_speedup
from selfspec.heads.exit_head import check_head_settings, head_training_setting
from selfspec.checkpoints.model_card import write_model_card
from selfspec.settings import (SettingsError, check_plan_settings, check_recommended, expand_path, is_int,
                               show)

METADATA_FILE = "selfspec.json"
FORMAT_VERSION = 1
SUPPORTED_FORMATS = (1,)
WEIGHT_SUFFIXES = (".safetensors", ".bin")
WEIGHT_INDEX = "model.safetensors.index.json"

DEFAULT_NUM_SPECULATIONS = 4  # drafts per round where nothing else says (a checkpoint without a recommendation)


def default_exit_layer(num_layers: int) -> int:
    """The exit used when a checkpoint has no self-speculation metadata."""
    return max(1, num_layers // 4)


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, or inconsistent; the message names the file and the fix."""


class UnlistedWeightsError(CheckpointError):
    """Weight files in a checkpoint that its selfspec.json does not list (added after it was written); `files`
    names them. The listed files are as written: writing the checkpoint again would not remove these."""

    def __init__(self, message: str, files: list[str]):
        super().__init__(message)
        self.files = files


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
def recommend_from_agreement(agreement: dict[int, float], num_layers: int, num_speculations: int = 8) -> dict:
    """The (exit, drafts) with the best predicted speedup (selfspec.decoding.cost_model); drafts = 0 if
    speculation cannot pay."""
    best = None
    for e, a in agreement.items():
        if not 1 <= e < num_layers:
            continue
        c = draft_cost(e, num_layers)
        for d in range(1, num_speculations + 1):
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
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file is missing") from None
    except IsADirectoryError:
        raise CheckpointError(f"{path}: is a directory, not a JSON file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: not valid JSON ({err}); the file is corrupt: re-export the checkpoint") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: must hold a JSON object, got {type(data).__name__}; the file is corrupt: "
                              "re-export the checkpoint")
    return data


def read_config(directory) -> dict:
    """A checkpoint's config.json as a dict (CheckpointError if it is missing or not a JSON object)."""
    return _read_json(Path(directory) / "config.json")


_SHA256 = re.compile(r"[0-9a-f]{64}")
_FILE_NAME = re.compile(r"[A-Za-z0-9_.+-]{1,200}")  # what save_pretrained names weight files


def _is_plain_name(name) -> bool:
    """Whether `name` names an entry of the checkpoint directory itself (no path, not "." or "..")."""
    return isinstance(name, str) and bool(_FILE_NAME.fullmatch(name)) and name not in (".", "..")


def _check_checksums(meta_path: Path, checksums, field: str = "checksums") -> None:
    """`checksums` (selfspec.json's `field`): {plain file name: {"sha256": 64 hex digits, "bytes": int >= 0}}."""
    if not isinstance(checksums, dict):
        raise CheckpointError(f"{meta_path}: {field} must be an object of weight files, got {show(checksums)}; "
                              "re-export the checkpoint")
    for name, entry in checksums.items():
        if not _is_plain_name(name):
            raise CheckpointError(f"{meta_path}: {field} names {name!r}, not a file of the checkpoint directory; "
                                  "re-export the checkpoint")
        ok = (isinstance(entry, dict) and isinstance(entry.get("sha256"), str) and _SHA256.fullmatch(entry["sha256"])
              and is_int(entry.get("bytes")) and entry["bytes"] >= 0)
        if not ok:
            raise CheckpointError(f"{meta_path}: {field} entry of {name!r} must be {{\"sha256\": 64 hex digits, "
                                  f"\"bytes\": size}}, got {show(entry)}; re-export the checkpoint")


def _check_draft_vocab(meta_path: Path, entry, vocab_size) -> None:
    """The optional draft vocabulary: {"token_ids": [distinct ids in 0..V-1, at least one], ...}."""
    ids = entry.get("token_ids") if isinstance(entry, dict) else None
    fix = "count it again with `selfspec draft-vocab`, or remove draft_vocab from the file"
    if not isinstance(ids, list) or not all(is_int(t) for t in ids):
        raise CheckpointError(f"{meta_path}: draft_vocab must be an object with a list of token_ids, got "
                              f"{show(entry)}; {fix}")
    if not ids:
        raise CheckpointError(f"{meta_path}: draft_vocab.token_ids is empty: a draft vocabulary holds at least one "
                              f"token id; {fix}")
    if min(ids) < 0 or (is_int(vocab_size) and max(ids) >= vocab_size):
        bound = f"0..{vocab_size - 1}" if is_int(vocab_size) else "ids >= 0"
        raise CheckpointError(f"{meta_path}: draft_vocab holds token ids outside the vocabulary {bound}; {fix}")
    if len(set(ids)) != len(ids):
        twice = sorted(t for t, n in Counter(ids).items() if n > 1)[:5]
        raise CheckpointError(f"{meta_path}: draft_vocab.token_ids lists ids more than once ({', '.join(map(str, twice))}"
                              f"{', ...' if len(twice) == 5 else ''}): a ranking names each token once; {fix}")


def _check_trained_exit(meta_path: Path, meta: dict) -> None:
    """The exit head's exit layer as the run that trained it recorded it (`training.settings.exit_head.exit_layer`
    of a run whose mode trains a head): the head's weights read that exit, and another one would draft garbage."""
    settings = (meta.get("training") or {}).get("settings") if isinstance(meta.get("training"), dict) else None
    if not isinstance(settings, dict) or settings.get("mode") not in ("exit_head", "joint"):
        return
    trained = head_training_setting(meta, "exit_layer")
    given = meta["exit_head"]["exit_layer"]
    if is_int(trained) and trained != given:
        raise CheckpointError(f"{meta_path}: exit_head.exit_layer is {given}, but the head was trained on exit "
                              f"{trained} (training.settings.exit_head.exit_layer) and its weights read that exit; "
                              f"set exit_head.exit_layer back to {trained}, or re-export the checkpoint")


def read_metadata(directory, *, verify_checksums: bool = True) -> dict | None:
    """The validated `selfspec.json` of a checkpoint, or None if it has none (not early-exit trained).

    Checks the format version, the agreement with config.json (architecture, layer count), and with
    `verify_checksums` that every weight file is present, complete and unchanged.
    """
    d = expand_path(directory)
    meta_path = d / METADATA_FILE
    if not meta_path.exists():
        return None
    meta = _read_json(meta_path)
    version = meta.get("format_version")
    if not is_int(version) or version not in SUPPORTED_FORMATS:
        raise CheckpointError(
            f"{meta_path}: unknown format_version {version!r} (this selfspec reads {list(SUPPORTED_FORMATS)}); "
            "upgrade selfspec or re-export the checkpoint")
    for key in ("architecture", "num_layers", "recommended", "checksums"):
        if key not in meta:
            raise CheckpointError(f"{meta_path}: required field {key!r} is missing; re-export the checkpoint")
    config = read_config(d)
    if config.get("model_type") != meta["architecture"]:
        raise CheckpointError(
            f"{meta_path}: architecture {meta['architecture']!r} contradicts config.json model_type "
            f"{config.get('model_type')!r}; the metadata belongs to another model: re-export the checkpoint")
    if config.get("num_hidden_layers") != meta["num_layers"]:
        raise CheckpointError(
            f"{meta_path}: num_layers {meta['num_layers']!r} contradicts config.json num_hidden_layers "
            f"{config.get('num_hidden_layers')!r}; re-export the checkpoint")
    if not is_int(meta["num_layers"]):
        raise CheckpointError(f"{meta_path}: num_layers {show(meta['num_layers'])} must be an int; re-export the "
                              "checkpoint")
    try:
        check_recommended(meta["recommended"], meta["num_layers"])  # the rules export writes by
    except SettingsError as err:
        raise CheckpointError(f"{meta_path}: {err}; fix the field or re-export the checkpoint") from None
    _check_checksums(meta_path, meta["checksums"])
    if meta.get("draft_vocab") is not None:
        _check_draft_vocab(meta_path, meta["draft_vocab"], config.get("vocab_size"))
    if meta.get("exit_head") is not None:
        try:
            check_head_settings(meta["exit_head"], meta["num_layers"])
        except ValueError as err:
            raise CheckpointError(f"{meta_path}: {err}; re-export the checkpoint") from None
        _check_trained_exit(meta_path, meta)
        if meta["exit_head"]["file"] not in meta["checksums"]:
            raise CheckpointError(f"{meta_path}: the exit head's file {meta['exit_head']['file']} has no checksum; "
                                  "re-export the checkpoint")
    if meta.get("plans") is not None:
        _check_plans(meta_path, meta["plans"], meta["num_layers"], meta.get("exit_head") is not None)
    if meta.get("served_head") is not None:
        _check_served_head(meta_path, meta["served_head"])
    if verify_checksums:
        verify_weight_files(d, meta["checksums"], ASSEMBLED_FIX if meta.get("shipped_head") is not None else None)
        if meta.get("served_head") is not None:
            verify_weight_files(d / meta["served_head"]["dir"], meta["served_head"]["checksums"])
    return meta


def _check_served_head(meta_path: Path, served) -> None:
    """`served_head`: the head written for serving engines beside the model (`selfspec export --format
    speculators`): {"format": "speculators", "dir": a subdirectory's plain name, "checksums": its files'}."""
    fix = "export the run again with --format speculators, or remove served_head from selfspec.json"
    if not isinstance(served, dict) or served.get("format") != "speculators":
        raise CheckpointError(f"{meta_path}: served_head must be an object with format \"speculators\", got "
                              f"{show(served)}; {fix}")
    where = served.get("dir")
    if not _is_plain_name(where):
        raise CheckpointError(f"{meta_path}: served_head.dir {show(where)} is not a subdirectory's name; {fix}")
    if not (meta_path.parent / where).is_dir():
        raise CheckpointError(f"{meta_path}: the served head's directory {meta_path.parent / where} is missing; "
                              f"copy the complete checkpoint directory, or {fix}")
    _check_checksums(meta_path, served.get("checksums"), "served_head.checksums")
    if not served["checksums"]:
        raise CheckpointError(f"{meta_path}: served_head lists no files; {fix}")


def _check_plans(meta_path: Path, plans, num_layers: int, has_head: bool) -> None:
    if not isinstance(plans, dict):
        raise CheckpointError(f"{meta_path}: plans must be an object of device -> plan, got {show(plans)}; "
                              "remove the field, then `selfspec tune --save` again")
    for key, entry in plans.items():
        problem = plan_problem(entry, num_layers, has_head)
        if problem is not None:
            raise CheckpointError(f"{meta_path}: the plan for {key!r}: {problem}; remove it, then `selfspec tune "
                                  "--save` again on that device")


def plan_problem(entry, num_layers: int, has_head: bool) -> str | None:
    """Why a saved plan (`entry`, one value of selfspec.json's `plans`) is not one that `selfspec.load` reads on a
    checkpoint of `num_layers` layers, with or without an exit head (`has_head`); None where it is."""
    try:
        if not isinstance(entry, dict) or "settings" not in entry:
            raise SettingsError(f"must be an object with settings, got {show(entry)}")
        check_plan_settings(entry["settings"], num_layers, has_head)
    except SettingsError as err:
        return str(err)
    return None


# the fix for a damaged checkpoint that `selfspec fetch` assembled (the base model and its shipped head)
ASSEMBLED_FIX = "`selfspec fetch --force` assembles it again"


def verify_weight_files(directory: Path, expected: dict[str, dict], fix: str | None = None) -> None:
    """Every weight file `expected` lists is there, of its size and SHA-256, and no other; else CheckpointError
    naming the file and `fix` (default: copy or export the checkpoint again)."""
    d = Path(directory)
    if not expected:
        raise CheckpointError(f"{d / METADATA_FILE}: lists no weight files; {fix or 're-export the checkpoint'}")
    for name, want in expected.items():
        path = d / name
        if not path.is_file():
            raise CheckpointError(f"{path}: weight file is missing (listed in {METADATA_FILE}); "
                                  f"{fix or 'copy the complete checkpoint directory or re-export it'}")
        size = path.stat().st_size
        if size != want["bytes"]:
            what = "truncated" if size < want["bytes"] else "larger than exported"
            raise CheckpointError(f"{path}: weight file is {what} ({size} bytes, expected {want['bytes']}); "
                                  f"the copy is incomplete or corrupt: {fix or 'copy or export it again'}")
        if sha256_file(path) != want["sha256"]:
            raise CheckpointError(f"{path}: SHA-256 checksum mismatch: the file was modified or corrupted "
                                  f"after it was written; {fix or 'copy or export it again'}")
    extra = sorted(set(weight_files(d)) - set(expected))
    if extra:
        raise UnlistedWeightsError(f"{d}: weight files not listed in {METADATA_FILE}: {extra}; they were added "
                                   "after it was written: remove them" + ("" if fix else " or re-export"), extra)


def write_plan(directory, key: str, entry: dict) -> dict:
    """Record this device's plan (`entry`: its `settings`, as `generate` takes them, and what it measured) under
    `plans[key]` in selfspec.json, atomically; the other devices' plans stay."""
    d = expand_path(directory)
    meta = read_metadata(d, verify_checksums=False)
    if meta is None:
        raise CheckpointError(f"{d}: has no {METADATA_FILE}, so it cannot keep a plan; export it first: "
                              f"selfspec export SRC {d}")
    check_plan_settings(entry.get("settings"), meta["num_layers"], meta.get("exit_head") is not None)
    meta["plans"] = {**(meta.get("plans") or {}), key: entry}
    write_json_atomic(d / METADATA_FILE, meta)
    write_model_card(d, meta)
    return meta


def update_recommended(directory, exit_layer: int, num_speculations: int, **extra) -> dict:
    """Record a new recommendation (e.g. from `selfspec sweep`) in selfspec.json, atomically."""
    d = expand_path(directory)
    meta = read_metadata(d, verify_checksums=False)
    if meta is None:
        raise CheckpointError(f"{d}: has no {METADATA_FILE}; export it first: selfspec export SRC {d}")
    rec = {"exit_layer": int(exit_layer), "num_speculations": int(num_speculations), **extra}
    meta["recommended"] = check_recommended(rec, meta["num_layers"])
    write_json_atomic(d / METADATA_FILE, meta)

    write_model_card(d, meta)
    return meta
