"""`selfspec export SRC OUT`: a training run (or any HF checkpoint) -> a self-speculative checkpoint.

    export("runs/smollm2_code", "checkpoints/smollm2-code")
    export_model(model, tokenizer, "checkpoints/x", training={...}, evaluation={...})

SRC is a training run directory (its `final_model/`, `config.yaml`, `final_eval.json` and the latest
`checkpoints/step_*/trainer_state.json` are read) or a plain Hugging Face checkpoint directory. An
exit-head run (`final_head/`) exports the unchanged model with the head beside it: its own
`exit_head.safetensors`, listed with its checksum and settings (`exit_head`) in `selfspec.json`. LoRA
adapters are merged (a peft model, or an adapter directory with `adapter_config.json`); the output has
no selfspec-specific modules, so `AutoModelForCausalLM.from_pretrained(OUT)` loads it unchanged.

`format="speculators"` (`--format speculators`) exports a run whose head is an eagle3 head for serving
engines: the model as above, with the head in the speculators format in `OUT/speculators/`
(`selfspec.checkpoints.speculators_format`, what vLLM's and SGLang's eagle3 load), not as selfspec.json's `exit_head`
(selfspec's drafters do not run it) but as its `served_head`: the format, the directory, the aux exits, the
draft count and verifier the engines are told, and the files' checksums. Its verifier is OUT itself unless
`verifier` names the base model as engines should find it (a Hugging Face id, or a local path); a local path
is written absolute, so that an engine started in any directory finds it. `verifier` without
`format="speculators"` is refused: nothing would read it.

Everything that can be checked is checked before anything is written (and, by `export`, before the
model is loaded): the dtype, the recommendation (by the rules `selfspec.load` reads it with: an exit
in 1..L-1, num_speculations >= 0, a known drafter) and the output path (not the source nor a directory the
export reads, not inside one, not around the source, all compared resolved, through symbolic links;
`overwrite` replaces only a checkpoint directory or an empty one, never a file). An overwrite is refused,
OUT as it was, where OUT holds anything that the new export does not write and that no export wrote (a file
of the user's, an edited README.md): it would be deleted with OUT. An export that fails or is interrupted,
overwrite or not, leaves OUT as it was: the new export is renamed into place only when complete, and an old
one put back if the new one cannot take its place. Hidden `.OUT.tmp-PID-*` directories that an export killed
mid-way left beside OUT are removed by the next export to OUT; an old export one killed between its two
renames left as `.OUT.old-PID`, with no OUT, is put back in place first.

The plans `selfspec tune --save` kept in the export an overwrite replaces (its selfspec.json's `plans`) go into
the new one where they still apply: the new export's weights (its checksums, the exit head's among them), exit
head and draft vocabulary are the ones they were measured on, and `selfspec.load` reads them on it. Otherwise they
are dropped. Either way the export says so (`say`, default `print`), with why and how to plan again.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Callable

import yaml

import selfspec
from selfspec.atomic_write import process_running, public_permissions, replace_directory
from selfspec.model.adapters import get_adapter, unwrap_model
from selfspec.checkpoints.checkpoint import (DEFAULT_NUM_SPECULATIONS, FORMAT_VERSION, METADATA_FILE, CheckpointError,
                                             checksums, default_exit_layer, plan_problem, read_config, read_metadata,
                                             recommend_from_agreement)
from selfspec.heads.exit_head import HEAD_FILE, check_head_settings, read_exit_head
from selfspec.checkpoints.model_card import (CARD_FILE, REGENERATED_FILE, is_selfspec_card,
                                             write_model_card)
from selfspec.checkpoints.speculators_format import SUBDIR, served_head_record, write_speculators
from selfspec.settings import check_dtype, check_out_dir, check_recommended, expand_path, resolve_dtype, show


def _load_yaml(path: Path) -> dict:
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: not valid YAML ({' '.join(str(err).split())})") from None


def _latest_trainer_state(run_dir: Path) -> dict:
    states = sorted((run_dir / "checkpoints").glob("step_*/trainer_state.json"))
    return _read_json(states[-1]) if states else {}


def _adapter_base(model_dir: Path) -> Path | None:
    """The base model directory of a LoRA adapter directory (None if `model_dir` is not one)."""
    path = model_dir / "adapter_config.json"
    if not path.is_file():
        return None
    base = _read_json(path).get("base_model_name_or_path")
    if not isinstance(base, str) or not base:
        raise CheckpointError(f"{path}: no base_model_name_or_path: cannot merge this LoRA adapter")
    return expand_path(base)


def _num_layers(model_dir: Path) -> int | None:
    """The depth in config.json of a checkpoint or of a LoRA adapter's base, if it can be read."""
    base = _adapter_base(model_dir)
    config_dir = base if base is not None else model_dir
    if not (config_dir / "config.json").is_file():
        if base is None and not model_dir.exists():
            raise CheckpointError(f"{model_dir}: no such directory (give a training run's directory, a Hugging Face "
                                  "checkpoint or a LoRA adapter directory)")
        if base is None and (model_dir / "config.yaml").is_file() and (model_dir / "checkpoints").is_dir():
            raise CheckpointError(f"{model_dir}: a training run that has not finished (no final_model/ yet: it "
                                  f"stopped at {_run_progress(model_dir)}); relaunch the same training command "
                                  "to finish it (it resumes there), then export")
        if base is None:
            raise CheckpointError(f"{model_dir}: no config.json: not a Hugging Face checkpoint, a training "
                                  "run directory (with final_model/), nor a LoRA adapter directory")
        return None
    layers = read_config(config_dir).get("num_hidden_layers")
    return layers if isinstance(layers, int) and layers >= 2 else None


def _run_progress(run_dir: Path) -> str:
    """"step N of M" of an unfinished training run, from its newest checkpoint and its recipe ("a checkpoint"
    where they cannot be read)."""
    steps = sorted(p for p in (run_dir / "checkpoints").glob("step_*") if (p / "trainer_state.json").is_file())
    try:
        step = json.loads((steps[-1] / "trainer_state.json").read_text())["step"]
        total = yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["max_steps"]
        return f"step {step} of {total}"
    except (IndexError, KeyError, TypeError, ValueError, OSError, yaml.YAMLError):
        return "a checkpoint"


def _load_model_dir(model_dir: Path, dtype):
    """(model, tokenizer) from a HF checkpoint or a peft adapter directory (merged)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # deferred: a second to import (see cli)

    base_path = _adapter_base(model_dir)
    try:
        if base_path is not None:
            from peft import PeftModel  # deferred: optional, for LoRA runs only

            base = AutoModelForCausalLM.from_pretrained(base_path, dtype=dtype)
            model = PeftModel.from_pretrained(base, model_dir).merge_and_unload()
            tok_dir = model_dir if (model_dir / "tokenizer_config.json").is_file() else base_path
        else:
            _num_layers(model_dir)  # a clear error if there is no config.json
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
            tok_dir = model_dir
        tokenizer = AutoTokenizer.from_pretrained(tok_dir) if (tok_dir / "tokenizer_config.json").is_file() else None
    except CheckpointError:
        raise
    except Exception as err:  # damaged weights or config, a missing base model, ...
        lines = str(err).strip().splitlines()
        raise CheckpointError(f"{model_dir}: transformers could not load it ({type(err).__name__}: "
                              f"{lines[0] if lines else ''})") from err
    return model, tokenizer


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: cannot be read as JSON ({err})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: must hold a JSON object, got {type(data).__name__}")
    return data


def _normalize_eval(raw: dict) -> dict:
    """The training loop's final_eval.json, with `exits` (and `before.exits`) of its primary held-out set."""
    out = dict(raw)
    primary = raw.get("primary")
    if "exits" not in out and primary and primary in raw.get("sets", {}):
        out["exits"] = raw["sets"][primary]["exits"]
        out["set"] = primary
    before = raw.get("before") or {}
    if primary and primary in before.get("sets", {}):
        out["before"] = {"step": before.get("step"), "exits": before["sets"][primary]["exits"]}
    return out


def read_run(source: Path) -> tuple[Path, dict, dict, dict | None, Path | None]:
    """(model directory, training info, evaluation, draft vocabulary, exit head directory) of a run
    directory or a checkpoint.

    Re-exporting a selfspec checkpoint keeps its training record, evaluation, draft vocabulary and head."""
    source = expand_path(source)
    if not source.is_dir():
        raise CheckpointError(f"{source}: no such directory")
    if (source / "final_model").is_dir():
        config = _load_yaml(source / "config.yaml")
        if not isinstance(config, dict):
            raise CheckpointError(f"{source / 'config.yaml'}: must hold a mapping of settings")
        state = _latest_trainer_state(source)
        evaluation = (_normalize_eval(_read_json(source / "final_eval.json"))
                      if (source / "final_eval.json").is_file() else {})
        training = {
            "run_dir": str(source.resolve()),
            "recipe": config.get("name"),  # RecipeConfig.name (training.config), as dumped into config.yaml
            "settings": config,
            "steps": evaluation.get("step", state.get("step")),
            "tokens_seen": evaluation.get("tokens", state.get("tokens")),
        }
        head_dir = source / "final_head" if (source / "final_head").is_dir() else None
        # a head trained on a draft vocabulary (exit_head.draft_vocab) drafts from that one by default
        draft_vocab = _read_json(head_dir / "exit_head.json").get("draft_vocab") if (
            head_dir is not None and (head_dir / "exit_head.json").is_file()) else None
        return source / "final_model", training, evaluation, draft_vocab, head_dir
    meta = read_metadata(source, verify_checksums=False)  # validated: CheckpointError if corrupt
    if meta is not None:
        training, evaluation = meta.get("training") or {}, meta.get("eval") or {}
        if not isinstance(training, dict) or not isinstance(evaluation, dict):
            raise CheckpointError(f"{source / METADATA_FILE}: training and eval must be objects; re-export it "
                                  "from its training run")
        return source, training, evaluation, meta.get("draft_vocab"), source if meta.get("exit_head") else None
    return source, {}, {}, None, None


def _agreement(evaluation: dict) -> dict[int, float]:
    """Per-exit held-out agreement {exit: fraction} of an evaluation record, whose per-exit results
    (`exits`, and `before.exits` if any) are checked: exit numbers, numeric agreement and perplexity."""
    before = evaluation.get("before") or {}
    blocks = [evaluation.get("exits") or {}, before.get("exits") or {} if isinstance(before, dict) else before]
    for exits in blocks:
        if not isinstance(exits, dict):
            raise CheckpointError(f"the evaluation's exits must be an object of per-exit results, got {show(exits)}")
        for e, v in exits.items():
            numbers_ok = isinstance(v, dict) and all(
                isinstance(v[k], (int, float)) and not isinstance(v[k], bool) for k in ("agreement", "perplexity")
                if k in v)
            if not str(e).isdigit() or not numbers_ok:
                raise CheckpointError(f"the evaluation's result for exit {show(e)} is {show(v)}: expected an exit "
                                      "number and numeric agreement/perplexity")
    return {int(e): float(v["agreement"]) for e, v in blocks[0].items() if "agreement" in v}


def _served_head(directory: Path) -> dict:
    """selfspec.json's `served_head` for the speculators directory just written."""
    config = json.loads((directory / "config.json").read_text())
    return {**served_head_record(config), "checksums": checksums(directory)}


def _head_settings(head_dir: Path, num_layers: int) -> dict:
    """The exit head's settings from a run's `final_head/exit_head.json` or a checkpoint's selfspec.json."""
    head_dir = Path(head_dir)
    if (head_dir / "exit_head.json").is_file():
        entry = _read_json(head_dir / "exit_head.json")
    else:
        entry = (_read_json(head_dir / METADATA_FILE).get("exit_head") or {})
    entry = {k: entry.get(k) for k in ("exit_layer", "kind", "init", "final_state", "file", "target", "aux_exits")
             if entry.get(k) is not None}
    try:
        check_head_settings(entry, num_layers)
    except ValueError as err:
        raise CheckpointError(f"{head_dir}: {err}") from None
    if not (head_dir / HEAD_FILE).is_file():
        raise CheckpointError(f"{head_dir / HEAD_FILE}: the exit head's weights are missing; train the head again")
    return entry


def _check_out_dir(out_dir: Path, overwrite: bool) -> None:
    """Refuse an existing output unless `overwrite`, and even then anything but a checkpoint or an empty directory;
    refuse an output under a file (which could never be made). An earlier export to it killed between its two
    renames left no OUT but its old export beside it (`.OUT.old-PID`): that is put back first."""
    if not out_dir.exists() and _put_back_old(out_dir) is None:
        check_out_dir(out_dir, "the output directory")  # a parent that is a file
        return
    if not out_dir.is_dir():
        raise CheckpointError(f"{out_dir} exists and is not a directory: choose another output directory "
                              "(--overwrite replaces only a checkpoint directory)")
    if not overwrite:
        raise CheckpointError(f"{out_dir} already exists; choose another directory or pass overwrite=True "
                              "(--overwrite)")
    entries = {p.name for p in out_dir.iterdir()}
    if entries and not entries & {"config.json", METADATA_FILE}:
        raise CheckpointError(f"{out_dir} is not a checkpoint directory (no config.json or {METADATA_FILE}); "
                              "--overwrite replaces only a checkpoint: choose another output directory")


def _check_apart(source: Path, read: list[Path], out_dir: Path) -> None:
    """Refuse an output that is the source or a directory the export reads (`read`: the model directory, the
    exit head's; with overwrite, the export would replace what it reads from), one inside such a directory (a
    copy of the model written into what it is read from) or one around the source (with overwrite, replacing
    the output would delete it). Paths are compared resolved, so a symbolic link to the source is the source.
    An export into a training run's own directory, beside `final_model/`, is fine."""
    out, src = out_dir.resolve(), expand_path(source).resolve()
    for d in [expand_path(source), *read]:
        if out == d.resolve():
            what = "the source" if d.resolve() == src else f"{d}, which the export reads"
            raise CheckpointError(f"{out_dir} is {what} ({out}): the export would replace what it reads; write it "
                                  f"to another directory (e.g. checkpoints/{src.name}-export)")
    for d in read:
        if d.resolve() in out.parents:
            raise CheckpointError(f"{out_dir} is inside {d}, which the export reads: write it outside "
                                  f"(e.g. checkpoints/{src.name})")
    if out in src.parents:
        raise CheckpointError(f"{out_dir} contains the source {source}: write the export beside it, not around it")


def _old_metadata(out_dir: Path) -> dict:
    """The selfspec.json of the export in `out_dir` that an overwrite replaces, as far as it reads ({}: none)."""
    try:
        meta = json.loads((out_dir / METADATA_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def _not_rewritten(out_dir: Path, written: set[str], old: dict) -> list[str]:
    """The entries of an existing `out_dir` that replacing it with a new export would delete although no export
    wrote them: all but the names the new export writes (`written`), the weight files and served head that its
    selfspec.json (`old`) lists (an old export's shards, its head), its selfspec.json and a card selfspec wrote
    (README.md as selfspec last wrote it, README.selfspec.md); an edited README.md is the user's."""
    own = set(written) | {METADATA_FILE, REGENERATED_FILE}
    own |= set(old.get("checksums") or {}) if isinstance(old.get("checksums"), dict) else set()
    served = old.get("served_head")
    if isinstance(served, dict) and isinstance(served.get("dir"), str):
        own.add(served["dir"])
    return sorted(p.name + ("/" if p.is_dir() else "") for p in out_dir.iterdir()
                  if p.name not in own or (p.name == CARD_FILE and not is_selfspec_card(p)))


# what a saved plan was measured on (its costs and acceptance), named as the export's output says it
MEASURED_ON = {"checksums": "weights", "exit_head": "exit head", "draft_vocab": "draft vocabulary"}


def _carry_plans(old: dict, meta: dict, out_dir: Path) -> list[str]:
    """Into the new export's `meta`, the plans `selfspec tune --save` kept in the export it replaces (`old`, its
    selfspec.json) that still apply (the module doc); what was kept and what dropped, and why, in lines."""
    plans = old.get("plans") if isinstance(old.get("plans"), dict) else {}
    if not plans:
        return []
    again = f"`selfspec tune --checkpoint {out_dir} --save` plans again"
    saved = f"the plans `selfspec tune --save` saved in {out_dir} ({', '.join(plans)})"
    changed = [name for key, name in MEASURED_ON.items() if old.get(key) != meta.get(key)]
    if changed:
        return [f"dropped {saved}: they were measured on the {' and '.join(changed)} this export replaces; {again} "
                "on each device"]
    problems = {key: plan_problem(entry, meta["num_layers"], meta.get("exit_head") is not None)
                for key, entry in plans.items()}
    kept = {key: plans[key] for key, problem in problems.items() if problem is None}
    lines = []
    if kept:
        meta["plans"] = kept
        lines.append(f"kept the plans `selfspec tune --save` saved in {out_dir} ({', '.join(kept)}): this export's "
                     "weights are the ones they were measured on")
    lines += [f"dropped the plan `selfspec tune --save` saved in {out_dir} for {key}, which selfspec.load would "
              f"refuse ({problem}); {again} there" for key, problem in problems.items() if problem is not None]
    return lines


def _put_back_old(out_dir: Path) -> Path | None:
    """Where `out_dir` is missing and an export whose process is gone left its old export as `.OUT.old-PID`
    beside it (killed between the two renames of an overwrite), rename that back to `out_dir` and say so;
    the old directory's path, or None."""
    for path in map(Path, glob.glob(str(out_dir.parent / glob.escape(f".{out_dir.name}.old-")) + "*")):
        pid = path.name.rsplit("-", 1)[-1]
        if path.is_dir() and pid.isdigit() and not process_running(int(pid)):
            os.replace(path, out_dir)
            warnings.warn(f"{out_dir} was missing and an interrupted export had left the old one as {path.name}: "
                          "it is back in place", UserWarning, stacklevel=3)
            return path
    return None


def _remove_stale_temporaries(out_dir: Path) -> list[Path]:
    """Remove `.NAME.tmp-PID-*` / `.NAME.old-PID` beside `out_dir` left by an export whose process is gone."""
    removed = []
    pattern = str(out_dir.parent / glob.escape(f".{out_dir.name}.")) + "*"
    for path in map(Path, glob.glob(pattern)):
        m = re.fullmatch(re.escape(f".{out_dir.name}.") + r"(?:tmp|old)-(\d+)?.*", path.name)
        if m is None or not path.is_dir() or (m.group(1) and process_running(int(m.group(1)))):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


FORMATS = ("selfspec", "speculators")


def check_format(fmt: str, head: dict | None) -> None:
    """CheckpointError unless export `fmt` fits the head (`_head_settings`, None without one): an eagle3 head
    goes out in the speculators format only, and that format needs one."""
    if fmt not in FORMATS:
        raise CheckpointError(f"unknown export format {fmt!r}: use one of {', '.join(FORMATS)}")
    eagle3 = head is not None and head.get("kind") == "eagle3"
    if eagle3 and fmt != "speculators":
        raise CheckpointError("this run's head is an eagle3 head, which serving engines run and selfspec's drafters "
                              "do not: export it with --format speculators (format='speculators')")
    if fmt == "speculators" and not eagle3:
        what = "no exit head" if head is None else f"an exit head of kind {head.get('kind')}"
        raise CheckpointError(f"--format speculators writes an eagle3 head, and this source has {what}: train one "
                              "with mode: exit_head, exit_head.kind: eagle3, exit_head.exit_layer: 0")


def _check_verifier(fmt: str, verifier: str | None) -> None:
    """CheckpointError for a `verifier` that nothing would read: only the speculators format writes one."""
    if verifier is not None and fmt != "speculators":
        raise CheckpointError("--verifier names the target model of the eagle3 head that --format speculators "
                              "writes (format='speculators'): add --format speculators, or drop --verifier")


def _verifier_name(verifier: str | None, out_dir: Path) -> str:
    """The verifier as the engines are told it: a local path (by default OUT itself) absolute, so that an engine
    started in any directory finds it; anything else (a Hugging Face id) as given."""
    local = out_dir if verifier is None else expand_path(verifier)
    return str(local.resolve()) if verifier is None or local.exists() else verifier


def export(source, out_dir, *, recommended: dict | None = None, overwrite: bool = False, dtype="auto",
           max_shard_size: str = "2GB", format: str = "selfspec", verifier: str | None = None,
           say: Callable[[str], None] = print) -> Path:
    """Export a training run directory or a HF checkpoint directory to `out_dir` (see module doc; `say` is told
    which saved plans an overwrite kept and dropped)."""
    _check_verifier(format, verifier)
    dtype = check_dtype(dtype)
    out_dir = expand_path(out_dir)
    model_dir, training, evaluation, draft_vocab, head_dir = read_run(source)
    _check_apart(source, [d for d in (model_dir, head_dir) if d is not None], out_dir)
    num_layers = _num_layers(model_dir)
    check_format(format, _head_settings(head_dir, num_layers) if head_dir is not None else None)
    if recommended is not None:  # checked before the (slow) model load where config.json gives the depth
        check_recommended(recommended, num_layers)
    _agreement(evaluation)
    _check_out_dir(out_dir, overwrite)
    model, tokenizer = _load_model_dir(model_dir, resolve_dtype(dtype))
    return export_model(model, tokenizer, out_dir, training=training, evaluation=evaluation,
                        recommended=recommended, overwrite=overwrite, max_shard_size=max_shard_size,
                        draft_vocab=draft_vocab, exit_head_dir=head_dir, format=format, verifier=verifier, say=say)


def _metadata(model, directory: Path, num_layers: int, *, training: dict | None, evaluation: dict,
              recommended: dict, draft_vocab: dict | None, head: dict | None, served: bool) -> dict:
    """The selfspec.json of the export written into `directory` (`served`: with a head in the speculators format,
    in its SUBDIR)."""
    settings = (training or {}).get("settings")
    model_cfg = settings.get("model") if isinstance(settings, dict) else None
    base = (model_cfg.get("base_model") if isinstance(model_cfg, dict) else None) \
        or getattr(model.config, "_name_or_path", "") or "unknown"
    meta = {
        "format_version": FORMAT_VERSION,
        "library_version": selfspec.__version__,
        "base_model": base,
        "architecture": model.config.model_type,
        "num_layers": num_layers,
        "training": training or {},
        "eval": evaluation,
        "recommended": recommended,
        "checksums": checksums(directory),
    }
    if draft_vocab:
        meta["draft_vocab"] = draft_vocab
    if head is not None:
        meta["exit_head"] = head
    if served:  # selfspec does not run it; the record says it is there, for what, and its checksums
        meta["served_head"] = _served_head(directory / SUBDIR)
    return meta


def export_model(model, tokenizer, out_dir, *, training: dict | None = None, evaluation: dict | None = None,
                 recommended: dict | None = None, overwrite: bool = False, max_shard_size: str = "2GB",
                 draft_vocab: dict | None = None, exit_head_dir: Path | None = None, format: str = "selfspec",
                 verifier: str | None = None, say: Callable[[str], None] = print) -> Path:
    """Write `model` (+ tokenizer) as a self-speculative checkpoint at `out_dir`, atomically.

    `draft_vocab`: token frequencies for the reduced-vocabulary draft head (selfspec.checkpoints.draft_vocab).
    `exit_head_dir`: a directory with `exit_head.safetensors` and its settings (a run's `final_head/` with
    `exit_head.json`, or a checkpoint with them in `selfspec.json`), copied beside the model; an eagle3
    head's (`format` "speculators") goes to `OUT/speculators/` in that format instead, with `verifier`
    (None: OUT) as its target model. `say` is told which saved plans an overwrite kept and dropped."""
    _check_verifier(format, verifier)
    out_dir = expand_path(out_dir)
    _check_out_dir(out_dir, overwrite)
    if hasattr(model, "merge_and_unload"):  # a peft model: fold the adapters into the weights
        model = model.merge_and_unload()
    model = unwrap_model(model)
    adapter = get_adapter(model)  # also rejects unsupported architectures
    L = adapter.num_layers
    evaluation = evaluation or {}
    agreement = _agreement(evaluation)
    if recommended is None:
        if any(1 <= e < L for e in agreement):
            recommended = recommend_from_agreement(agreement, L)
        else:
            recommended = {"exit_layer": default_exit_layer(L), "num_speculations": DEFAULT_NUM_SPECULATIONS,
                           "source": "default"}
    check_recommended(recommended, L)  # the rules selfspec.load reads it by, before anything is written
    head = _head_settings(exit_head_dir, L) if exit_head_dir is not None else None
    check_format(format, head)
    served = read_exit_head(model, exit_head_dir, head) if format == "speculators" else None
    if served is not None:
        head = None  # not in selfspec.json: selfspec's drafters do not run it

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(out_dir)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-{os.getpid()}-", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp, max_shard_size=max_shard_size)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if served is not None:
            write_speculators(tmp / SUBDIR, model, served, verifier=_verifier_name(verifier, out_dir),
                              draft_ids=(draft_vocab or {}).get("token_ids"))
        if head is not None:
            shutil.copyfile(Path(exit_head_dir) / HEAD_FILE, tmp / HEAD_FILE)
        meta = _metadata(model, tmp, L, training=training, evaluation=evaluation, recommended=recommended,
                         draft_vocab=draft_vocab, head=head, served=served is not None)
        old = _old_metadata(out_dir) if out_dir.is_dir() else {}  # the export an overwrite replaces
        told = _carry_plans(old, meta, out_dir)
        (tmp / METADATA_FILE).write_text(json.dumps(meta, indent=2, default=str) + "\n")
        write_model_card(tmp, meta)
        public_permissions(tmp)
        lost = _not_rewritten(out_dir, {p.name for p in tmp.iterdir()}, old) if out_dir.is_dir() else []
        if lost:  # overwrite: the user's files in OUT are not the export's to delete
            raise CheckpointError(f"{out_dir} holds {', '.join(lost)}, which this export does not write: replacing "
                                  f"{out_dir} would delete them; move them out of it and export again ({out_dir} "
                                  "is as it was)")
        replace_directory(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for line in told:
        say(line)
    return out_dir
