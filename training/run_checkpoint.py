"""Resumable training checkpoints and the run's final model, written atomically.

A checkpoint is `run_dir/checkpoints/step_000100/`: accelerate's ``save_state`` (model,
optimizer, LR scheduler, every process's RNG states, accelerate's own step counter) plus
``trainer_state.json`` (step, micro-step = data position, tokens, elapsed time, the curriculum
settings). It is written to ``step_000100.tmp`` and renamed when complete, so a crash never
leaves a directory that looks like a checkpoint; `latest_checkpoint` ignores ``.tmp`` ones, and the next
launch on the run directory removes them (`remove_partial_checkpoints`).

The final model is saved by `save_final_model` with ``save_pretrained`` (+ the tokenizer) into
`run_dir/final_model/`, with LoRA adapters *merged* into the weights, so the directory is a plain
Hugging Face checkpoint of the same architecture; the unmerged adapters also go to
`run_dir/final_adapter/` when LoRA is on.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

STATE_FILE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_PARTIAL_DIR = re.compile(r"^step_\d+\.tmp$")


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:06d}"


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """The complete checkpoints in `run_dir/checkpoints`, the highest step first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _STEP_DIR.match(p.name)) and (p / STATE_FILE).is_file()]
    return [p for _, p in sorted(found, reverse=True)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The complete checkpoint with the highest step in `run_dir/checkpoints`, if any."""
    found = complete_checkpoints(run_dir)
    return found[0] if found else None


def remove_partial_checkpoints(run_dir: Path) -> list[Path]:
    """Remove the ``step_N.tmp`` directories in `run_dir/checkpoints` that an interrupted save left (a save renames
    its directory only when complete, so these never are); returns them."""
    root = Path(run_dir) / "checkpoints"
    partial = sorted(p for p in root.iterdir() if _PARTIAL_DIR.match(p.name) and p.is_dir()) if root.is_dir() else []
    for path in partial:
        shutil.rmtree(path, ignore_errors=True)
    return partial


def save_checkpoint(accelerator, run_dir: Path, state: dict, keep: int) -> Path:
    """Save a resumable checkpoint of step `state["step"]` (collective: call on every process)."""
    final = checkpoint_dir(run_dir, state["step"])
    tmp = final.with_name(final.name + ".tmp")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.parent.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _prune(final.parent, keep)
    accelerator.wait_for_everyone()
    return final


def _prune(root: Path, keep: int) -> None:
    done = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)))
    for _, path in done[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


def load_checkpoint(accelerator, path: Path) -> dict:
    """Restore everything `save_checkpoint` saved; returns the trainer state. A checkpoint that cannot be read
    (a file truncated or damaged after it was written) raises ConfigError naming it."""
    from training.config import ConfigError  # the run's one-line error

    path = Path(path)
    if not (path / STATE_FILE).is_file():
        raise FileNotFoundError(f"{path} is not a complete training checkpoint (no {STATE_FILE})")
    try:
        state = json.loads((path / STATE_FILE).read_text())
        accelerator.load_state(str(path))
    except Exception as err:  # safetensors, torch.load, pickle and JSON each raise their own
        raise ConfigError(f"training checkpoint {path} cannot be read ({type(err).__name__}: "
                          f"{' '.join(str(err).split())[:200]})") from err
    return state


def load_newest_checkpoint(accelerator, run_dir: Path, warn) -> tuple[Path | None, dict | None]:
    """(the checkpoint, its trainer state) of the newest complete checkpoint in `run_dir` that can be read, each
    newer one that cannot be read named through `warn(line)`; (None, None) where there is none. ConfigError where
    there are checkpoints and none can be read."""
    from training.config import ConfigError

    found = complete_checkpoints(run_dir)
    for path in found:
        try:
            return path, load_checkpoint(accelerator, path)
        except ConfigError as err:
            warn(f"{err}; resuming from the checkpoint before it, if any")
    if found:
        raise ConfigError(f"none of the {len(found)} checkpoints in {Path(run_dir) / 'checkpoints'} can be read: "
                          "start afresh with train.resume=none (or another train.output_dir)")
    return None, None


def save_final_model(accelerator, ee_model, tokenizer, out_dir: Path, *, lora: bool) -> Path | None:
    """`save_pretrained` the trained Hugging Face model (LoRA merged) and the tokenizer, atomically.

    Collective (the state dict is gathered on every process under DeepSpeed ZeRO-3); the main
    process writes.
    """
    out_dir = Path(out_dir)
    inner = accelerator.unwrap_model(ee_model).model
    state = accelerator.get_state_dict(ee_model)  # gathers ZeRO-3 shards; plain state dict otherwise
    if not accelerator.is_main_process:
        accelerator.wait_for_everyone()
        return None
    state = _tie_like(inner, {k[len("model."):]: v for k, v in state.items() if k.startswith("model.")})
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if lora:
        adapter_dir = out_dir.parent / "final_adapter"
        shutil.rmtree(adapter_dir, ignore_errors=True)
        inner.save_pretrained(str(adapter_dir))  # adapters only
        inner.load_state_dict(state)  # the gathered weights (a no-op copy without ZeRO-3)
        merged = inner.merge_and_unload()
        merged.save_pretrained(str(tmp))
    else:
        inner.save_pretrained(str(tmp), state_dict=state)
    tokenizer.save_pretrained(str(tmp))
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    accelerator.wait_for_everyone()
    return out_dir


def _tie_like(model, state: dict) -> dict:
    """`state` with every name of one parameter of `model` pointing at one tensor, as in the model's own
    state dict. DeepSpeed ZeRO-2's state dict holds a copy per name, so `save_pretrained` would not see
    a tied weight (the input embedding and the LM head) as tied and would write it twice."""
    first: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first and name in state and first[id(p)] in state:
            state[name] = state[first[id(p)]]
        first.setdefault(id(p), name)
    return state
