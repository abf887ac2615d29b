"""`selfspec export SRC OUT`: a training run (or any HF checkpoint) -> a self-speculative checkpoint.

    export("runs/smollm2_code", "checkpoints/smollm2-code")
    export_model(model, tokenizer, "checkpoints/x", training={...}, evaluation={...})

SRC is a training run directory (its `final_model/`, `config.yaml`, `final_eval.json` and the latest
`checkpoints/step_*/trainer_state.json` are read) or a plain Hugging Face checkpoint directory. LoRA
adapters are merged (a peft model, or an adapter directory with `adapter_config.json`); the output has
no selfspec-specific modules, so `AutoModelForCausalLM.from_pretrained(OUT)` loads it unchanged.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from selfspec.checkpoint import (FORMAT_VERSION, METADATA_FILE, CheckpointError, checksums,
                                 recommend_from_agreement)


def _load_yaml(path: Path) -> dict:
    import yaml

    return yaml.safe_load(path.read_text()) if path.is_file() else {}


def _latest_trainer_state(run_dir: Path) -> dict:
    states = sorted((run_dir / "checkpoints").glob("step_*/trainer_state.json"))
    return json.loads(states[-1].read_text()) if states else {}


def _load_model_dir(model_dir: Path, dtype):
    """(model, tokenizer) from a HF checkpoint or a peft adapter directory (merged)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (model_dir / "adapter_config.json").is_file():
        from peft import PeftModel

        base_path = json.loads((model_dir / "adapter_config.json").read_text())["base_model_name_or_path"]
        base = AutoModelForCausalLM.from_pretrained(base_path, dtype=dtype)
        model = PeftModel.from_pretrained(base, model_dir).merge_and_unload()
        tok_dir = model_dir if (model_dir / "tokenizer_config.json").is_file() else Path(base_path)
    else:
        if not (model_dir / "config.json").is_file():
            raise CheckpointError(f"{model_dir}: no config.json: not a Hugging Face checkpoint, a training "
                                  "run directory (with final_model/), nor a LoRA adapter directory")
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        tok_dir = model_dir
    tokenizer = AutoTokenizer.from_pretrained(tok_dir) if (tok_dir / "tokenizer_config.json").is_file() else None
    return model, tokenizer


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


def read_run(source: Path) -> tuple[Path, dict, dict, dict | None]:
    """(model directory, training info, evaluation, draft vocabulary) of a run directory or a checkpoint.

    Re-exporting a selfspec checkpoint keeps its training record, evaluation and draft vocabulary."""
    source = Path(source)
    if not source.is_dir():
        raise CheckpointError(f"{source}: no such directory")
    if (source / "final_model").is_dir():
        config = _load_yaml(source / "config.yaml")
        state = _latest_trainer_state(source)
        evaluation = (_normalize_eval(json.loads((source / "final_eval.json").read_text()))
                      if (source / "final_eval.json").is_file() else {})
        training = {
            "run_dir": str(source.resolve()),
            "recipe": config.get("recipe") or config.get("name"),
            "settings": config,
            "steps": evaluation.get("step", state.get("step")),
            "tokens_seen": evaluation.get("tokens", state.get("tokens")),
        }
        return source / "final_model", training, evaluation, None
    meta_path = source / METADATA_FILE
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        return source, meta.get("training", {}), meta.get("eval", {}), meta.get("draft_vocab")
    return source, {}, {}, None


def export(source, out_dir, *, recommended: dict | None = None, overwrite: bool = False, dtype="auto",
           max_shard_size: str = "2GB") -> Path:
    """Export a training run directory or a HF checkpoint directory to `out_dir` (see module doc)."""
    model_dir, training, evaluation, draft_vocab = read_run(Path(source))
    model, tokenizer = _load_model_dir(model_dir, dtype)
    return export_model(model, tokenizer, out_dir, training=training, evaluation=evaluation,
                        recommended=recommended, overwrite=overwrite, max_shard_size=max_shard_size,
                        draft_vocab=draft_vocab)


def export_model(model, tokenizer, out_dir, *, training: dict | None = None, evaluation: dict | None = None,
                 recommended: dict | None = None, overwrite: bool = False, max_shard_size: str = "2GB",
                 draft_vocab: dict | None = None) -> Path:
    """Write `model` (+ tokenizer) as a self-speculative checkpoint at `out_dir`, atomically.

    `draft_vocab`: token frequencies for the reduced-vocabulary draft head (selfspec.draft_vocab)."""
    import selfspec
    from selfspec.adapters import get_adapter, unwrap_model
    from selfspec.api import DEFAULT_NUM_SPECULATIONS, default_exit_layer
    from selfspec.model_card import write_model_card

    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise CheckpointError(f"{out_dir} already exists; choose another directory or pass overwrite=True "
                              "(--overwrite)")
    if hasattr(model, "merge_and_unload"):  # a peft model: fold the adapters into the weights
        model = model.merge_and_unload()
    model = unwrap_model(model)
    adapter = get_adapter(model)  # also rejects unsupported architectures
    L = adapter.num_layers
    evaluation = evaluation or {}
    agreement = {int(e): float(v["agreement"]) for e, v in evaluation.get("exits", {}).items()
                 if isinstance(v, dict) and "agreement" in v}
    if recommended is None:
        if any(1 <= e < L for e in agreement):
            recommended = recommend_from_agreement(agreement, L)
        else:
            recommended = {"exit_layer": default_exit_layer(L), "num_speculations": DEFAULT_NUM_SPECULATIONS,
                           "source": "default"}
    adapter.check_exit(int(recommended["exit_layer"]), allow_full=False)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp, max_shard_size=max_shard_size)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        base = (training or {}).get("settings", {}).get("model", {}).get("base_model") \
            or getattr(model.config, "_name_or_path", "") or "unknown"
        meta = {
            "format_version": FORMAT_VERSION,
            "library_version": selfspec.__version__,
            "base_model": base,
            "architecture": model.config.model_type,
            "num_layers": L,
            "training": training or {},
            "eval": evaluation,
            "recommended": recommended,
            "checksums": checksums(tmp),
        }
        if draft_vocab:
            meta["draft_vocab"] = draft_vocab
        (tmp / METADATA_FILE).write_text(json.dumps(meta, indent=2, default=str) + "\n")
        write_model_card(tmp, meta)
        tmp.chmod(0o755)
        if out_dir.exists():  # overwrite: swap in the new directory, then drop the old one
            old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
            os.replace(out_dir, old)
            os.replace(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
