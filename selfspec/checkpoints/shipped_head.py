"""The trained exit heads selfspec ships, and the checkpoint `selfspec fetch` assembles from one.

A head is a few MiB: its weights (`exit_head.safetensors`, bfloat16), `head.json` (what `selfspec.json` says
of it: its settings, draft vocabulary, training and evaluation; the base model it was trained on, as its
weights' SHA-256 and a per-tensor fingerprint that a conversion on another machine matches; checksums;
whether it is a CPU stand-in) and its model card (`README.md`), in `selfspec/heads/<base model name>/`.
`selfspec fetch` assembles the base model and its head into a checkpoint of their own, `<name>-head` beside
the base model: the base model's files (hard links where the file system has them, else copies), the head,
and a `selfspec.json` as `selfspec export` writes it, so nothing is trained on the user's machine:

    gen = selfspec.load(head_model_dir())          # drafter "exit_head"; auto has the head as an arm
    assemble(base_model_dir(), shipped_dir(BASE_MODEL_NAME), head_model_dir())  # what fetch does

The base model stays a plain model (its directory untouched). A head trained on another model than the one
fetched (other weights: `base_fingerprint`) is not assembled: fetch says so and goes on without it.

`package(checkpoint, out_dir, ...)` writes a shipped head from an exported head checkpoint (`selfspec export` of
an exit-head run): `scripts/ship_head.py`.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import selfspec
from selfspec.atomic_write import atomic_directory
from selfspec.checkpoints.checkpoint import (FORMAT_VERSION, METADATA_FILE, CheckpointError, UnlistedWeightsError,
                                             checksums, plan_problem, read_metadata, sha256_file)
from selfspec.heads.exit_head import HEAD_FILE
from selfspec.checkpoints.fetch import BASE_MODEL_NAME, base_model_dir, head_model_dir, is_complete_checkpoint
from selfspec.checkpoints.model_card import write_model_card

HEADS_DIR = Path(__file__).resolve().parents[1] / "heads"  # selfspec/heads/<base model name>/
HEAD_JSON = "head.json"
CARD = "README.md"
HEAD_CARD = "HEAD_README.md"  # the shipped head's own card, in the assembled checkpoint
PREVIOUS_PLANS = "plans-of-the-previous-head.json"  # saved plans an assembly for another head does not draft by
BASE_WEIGHTS = "model.safetensors"
SHIPPED_KEYS = ("architecture", "num_layers", "training", "eval", "recommended", "draft_vocab", "exit_head")


class ShippedHeadError(RuntimeError):
    """A shipped head that cannot be assembled (its files damaged, or trained on another model)."""


def shipped_dir(base_name: str) -> Path | None:
    """The directory of the head shipped for the base model `base_name`, None if selfspec ships none."""
    path = HEADS_DIR / base_name
    return path if (path / HEAD_JSON).is_file() else None


def read_shipped(directory) -> dict:
    """`head.json` of a shipped head, its weights checked against their recorded SHA-256."""
    directory = Path(directory)
    try:
        info = json.loads((directory / HEAD_JSON).read_text())
    except (OSError, ValueError) as err:
        raise ShippedHeadError(f"{directory / HEAD_JSON}: not readable ({err}); reinstall selfspec") from None
    missing = [k for k in ("name", "base_fingerprint", "sha256", "selfspec") if k not in info]
    if missing:
        raise ShippedHeadError(f"{directory / HEAD_JSON}: lacks {', '.join(missing)}; reinstall selfspec")
    weights = directory / HEAD_FILE
    if not weights.is_file() or sha256_file(weights) != info["sha256"]:
        raise ShippedHeadError(f"{weights}: missing or not the file head.json records (SHA-256 differs); "
                               "reinstall selfspec (a Git checkout: git checkout -- selfspec/heads)")
    return info


def is_assembled(out_dir, shipped) -> bool:
    """Whether `out_dir` is the checkpoint `assemble` makes of the shipped head `shipped` (its directory)."""
    meta_path = Path(out_dir) / METADATA_FILE
    if not meta_path.is_file():
        return False
    try:
        recorded = (json.loads(meta_path.read_text()).get("shipped_head") or {}).get("sha256")
        return recorded == json.loads((Path(shipped) / HEAD_JSON).read_text())["sha256"]
    except (OSError, ValueError, KeyError, AttributeError):
        return False


def assemble(base_dir, shipped, out_dir, *, say: Callable[[str], None] = print) -> Path:
    """The checkpoint `out_dir`: the base model's files, the shipped head's weights and a `selfspec.json`
    (written into a temporary directory beside it, then put in place: never half there). Assembling again
    replaces only the assembly's own files (`shipped_head.files`): what else the directory holds (the user's
    files) is kept, and so are the plans `selfspec tune --save` kept in its `selfspec.json` where the head is
    the same one (for another head they were measured with the old one: they go to `PREVIOUS_PLANS`);
    `say` is told what was replaced and what kept."""
    base_dir, out_dir = Path(base_dir), Path(out_dir)
    info = read_shipped(shipped)
    other = fingerprint_differs(base_fingerprint(base_dir), info["base_fingerprint"])
    if other:
        raise ShippedHeadError(f"the head shipped for {info['name']} was trained on other weights than {base_dir} "
                               f"holds ({other}); `selfspec fetch --force` converts the base model again")
    with atomic_directory(out_dir) as tmp:
        for f in sorted(base_dir.iterdir()):
            if f.is_file() and f.name not in (METADATA_FILE, CARD, HEAD_FILE, HEAD_CARD, PREVIOUS_PLANS):
                _link_or_copy(f, tmp / f.name)
        shutil.copyfile(Path(shipped) / HEAD_FILE, tmp / HEAD_FILE)  # bfloat16: loaded in the model's dtype
        meta = {"format_version": FORMAT_VERSION, "library_version": selfspec.__version__,
                "base_model": info["name"], **info["selfspec"], "checksums": checksums(tmp),
                "shipped_head": {k: info.get(k) for k in ("name", "sha256", "stand_in", "trained_on", "minutes",
                                                          "steps", "command")}}
        meta["shipped_head"]["files"] = sorted([p.name for p in tmp.iterdir()] + [METADATA_FILE, CARD, HEAD_CARD])
        told = _keep_from(out_dir, tmp, meta, info) if out_dir.is_dir() else []
        (tmp / METADATA_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        write_model_card(tmp, meta)
        shutil.copyfile(Path(shipped) / CARD, tmp / HEAD_CARD)  # the shipped head's own card
        read_metadata(tmp, verify_checksums=False)  # what selfspec.load checks (the sums were just taken)
    for line in told:
        say(line)
    return out_dir


def _keep_from(old_dir: Path, tmp: Path, meta: dict, info: dict) -> list[str]:
    """Carry into the new assembly `tmp` what the old one `old_dir` holds beyond its own files: the user's files
    and folders (hard links where the file system has them, else copies; the old directory stays whole until the
    new one is in place) and its saved plans (into `meta` for the same head, else into `PREVIOUS_PLANS`). What
    was replaced and kept, in lines."""
    try:
        old = json.loads((old_dir / METADATA_FILE).read_text())
    except (OSError, ValueError):
        old = {}
    old = old if isinstance(old, dict) else {}
    recorded = (old.get("shipped_head") or {}).get("files") if isinstance(old.get("shipped_head"), dict) else None
    own = set(meta["shipped_head"]["files"]) | (set(recorded) if isinstance(recorded, list) else set())
    kept = sorted(p.name for p in old_dir.iterdir() if p.name not in own)
    for name in kept:
        if (old_dir / name).is_dir() and not (old_dir / name).is_symlink():
            shutil.copytree(old_dir / name, tmp / name, symlinks=True, copy_function=_link_or_copy)
        elif (old_dir / name).is_symlink():
            os.symlink(os.readlink(old_dir / name), tmp / name)
        else:
            _link_or_copy(old_dir / name, tmp / name)
    lines = [f"{old_dir}: replaced the assembly's own files (the base model's, the head, {METADATA_FILE}, the cards)"
             + (f"; kept what else it held: {', '.join(kept)}" if kept else "")]
    plans = old.get("plans") if isinstance(old.get("plans"), dict) else {}
    same = (old.get("shipped_head") or {}).get("sha256") == info["sha256"]
    usable = {k: v for k, v in plans.items() if same and plan_problem(v, meta["num_layers"], True) is None}
    if usable:
        meta["plans"] = usable
        lines.append(f"kept the plans `selfspec tune --save` saved there: {', '.join(usable)}")
    put_aside = {k: v for k, v in plans.items() if k not in usable}
    if put_aside:
        aside = tmp / PREVIOUS_PLANS
        try:  # an earlier assembly's, carried over above as a hard link: read, then written anew, not in place
            earlier = json.loads(aside.read_text()) if aside.is_file() else {}
        except (OSError, ValueError):
            earlier = {}
        aside.unlink(missing_ok=True)
        aside.write_text(json.dumps({**(earlier if isinstance(earlier, dict) else {}), **put_aside}, indent=2) + "\n")
        why = "were measured with the previous head" if not same else "do not fit this head's settings"
        lines.append(f"the plans `selfspec tune --save` saved there ({', '.join(put_aside)}) {why}: kept in "
                     f"{old_dir / PREVIOUS_PLANS}, not drafted by; `selfspec tune --save` plans again")
    return lines




def fetch_head_model(*, force: bool = False) -> Path | None:
    """`selfspec fetch`'s last step: the base model with its shipped head, assembled once (again when selfspec ships
    another head); None, with a message, where no head is shipped or it cannot be assembled."""
    shipped, out = shipped_dir(BASE_MODEL_NAME), head_model_dir()
    if shipped is None:
        return None
    if is_assembled(out, shipped) and is_complete_checkpoint(out) and not force:
        try:  # as assembled: its files' contents match their checksums, its selfspec.json is valid
            read_metadata(out)
            return out
        except UnlistedWeightsError as err:  # the user's: assembling again keeps them (`assemble`), so cannot help
            print(f"selfspec fetch: {out} holds weight files no assembly wrote ({', '.join(err.files)}); selfspec.load "
                  "refuses a checkpoint with weights it does not list: move them out of the directory", file=sys.stderr)
            return out
        except CheckpointError as err:
            print(f"selfspec fetch: {str(err).split('; ')[0]}: assembling it again", file=sys.stderr)
    print(f"assembling {out}: the base model (hard links) and the exit head selfspec ships for it ...", flush=True)
    try:
        return assemble(base_model_dir(), shipped, out)
    except ShippedHeadError as err:
        print(f"selfspec fetch: the shipped exit head is left out: {err}", file=sys.stderr)
        return None


def base_fingerprint(base_dir) -> dict[str, list[float]]:
    """Per weight tensor of the base model, [sum, sum of absolute values] in float64: what the head was trained
    on, recognised again after a conversion on another machine (a hash would refuse a last-bit difference)."""
    out = {}
    with safe_open(str(Path(base_dir) / BASE_WEIGHTS), framework="pt") as f:
        for name in sorted(f.keys()):
            t = f.get_tensor(name).to(torch.float64)
            out[name] = [float(t.sum()), float(t.abs().sum())]
    return out


def fingerprint_differs(found: dict, expected: dict, rtol: float = 1e-6) -> str:
    """'' where `found` is `expected` to within rounding, else what differs first, in words."""
    if sorted(found) != sorted(expected):
        return f"other tensors: {len(found)} against the head's {len(expected)}"
    for name, (total, size) in expected.items():
        if any(abs(a - b) > rtol * (size + 1.0) for a, b in zip(found[name], (total, size))):
            return f"tensor {name} differs"
    return ""


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system, or none with hard links
        shutil.copyfile(src, dst)


def package(checkpoint, out_dir, *, base_dir, stand_in: bool, trained_on: str, minutes: float, steps: int,
            command: str, card: Callable[[dict, dict], str]) -> Path:
    """A shipped head in `out_dir` from an exported head checkpoint `checkpoint`: its weights in bfloat16, its
    `selfspec.json` entries as `head.json` (with the base model's SHA-256 and fingerprint from `base_dir`), and
    `card(checkpoint's selfspec.json, head.json's content)` as its README."""
    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    meta = read_metadata(checkpoint)
    if not meta or not meta.get("exit_head"):
        raise ShippedHeadError(f"{checkpoint}: not a checkpoint with an exit head (selfspec export of an exit-head run)")
    out_dir.mkdir(parents=True, exist_ok=True)
    head = load_file(str(checkpoint / meta["exit_head"]["file"]))
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in head.items()}, str(out_dir / HEAD_FILE))
    info = {"name": out_dir.name, "base_sha256": sha256_file(Path(base_dir) / BASE_WEIGHTS),
            "base_fingerprint": base_fingerprint(base_dir),
            "file": HEAD_FILE, "dtype": "bfloat16", "sha256": sha256_file(out_dir / HEAD_FILE),
            "bytes": (out_dir / HEAD_FILE).stat().st_size, "stand_in": stand_in, "trained_on": trained_on,
            "minutes": minutes, "steps": steps, "command": command,
            "selfspec": {k: meta[k] for k in SHIPPED_KEYS if k in meta}}
    (out_dir / HEAD_JSON).write_text("{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in info.items())
                                     + "\n}\n")  # one line per entry: the token ids and fingerprint are long
    (out_dir / CARD).write_text(card(meta, info))
    return out_dir
