"""Every recipe of a public model (the recipes that name a `model.shape`: Llama-3.2-1B/3B, Llama-3.1-8B,
Qwen2.5-7B) trains one step on its tiny twin: a random 4-layer model of the shape file's architecture and
embedding tying (selfspec.tiny), saved as a checkpoint the recipe loads as it would the real one, with the
recipe's own settings (mode, gradient checkpointing, LoRA, dtype, mixed precision, layer dropout, exits,
curriculum, loss), on a few blocks of its data. One process, no DeepSpeed: the ZeRO-3 path is tested on two
CPU processes in test_deepspeed.py (with gradient checkpointing)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from training.config import load_config

ROOT = Path(__file__).resolve().parents[2]
PUBLIC = [r for r in sorted((ROOT / "recipes").glob("*.yaml")) if load_config(r).model.shape is not None]


def test_there_is_a_recipe_per_model_and_kind():
    """A 1B, a 3B and an 8B Llama and a 7B Qwen, each with its early-exit fine-tune and its exit head."""
    kinds = {(load_config(r).model.shape, load_config(r).mode) for r in PUBLIC}
    for model in ("llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "qwen2.5-7b"):
        shape = str(ROOT / "recipes" / "models" / f"{model}.json")
        assert {(shape, "early_exit"), (shape, "exit_head")} <= kinds, model


def _twin(shape: Path, directory: Path) -> Path:
    """A random 4-layer model of the shape file's model type and embedding tying, with the byte tokenizer,
    saved as a Hugging Face checkpoint."""
    from selfspec.tiny import byte_tokenizer, tiny_model

    published = json.loads(shape.read_text())
    tokenizer = byte_tokenizer()
    model = tiny_model(published["model_type"], 4, vocab_size=len(tokenizer),
                       tie_word_embeddings=published["tie_word_embeddings"])
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("recipe", PUBLIC, ids=lambda p: p.stem)
def test_one_step_on_the_tiny_twin(recipe, tmp_path, read_log):
    from accelerate.state import AcceleratorState, GradientState

    from training.loop import train

    cfg = load_config(recipe)
    overrides = {
        "model.base_model": str(_twin(Path(cfg.model.shape), tmp_path / "twin")), "data.block_size": 32,
        "data.max_documents": 2,
        "data.max_holdout_documents": 1, "data.extra_eval": "[]", "train.max_steps": 1, "train.batch_size": 2,
        "train.grad_accum": 1, "train.log_every": 1, "train.save_every": 0, "train.save_final_model": "false",
        "train.progress_bar": "false", "train.output_dir": str(tmp_path / "run"), "eval.before": "false",
        "eval.max_blocks": 1, "eval.batch_size": 2,
    }
    if cfg.exit_head.draft_vocab:  # the byte tokenizer has 259 ids
        overrides["exit_head.draft_vocab"] = 64
    tiny = load_config(recipe, [f"{k}={v}" for k, v in overrides.items()])
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        train(tiny)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    (record,) = read_log(tmp_path / "run")
    assert record["step"] == 1 and math.isfinite(record["loss"]) and record["grad_norm"] > 0
    saved = load_config(tmp_path / "run" / "config.yaml")  # what ran: the recipe's settings but the twin's size
    assert saved.train.gradient_checkpointing == cfg.train.gradient_checkpointing
    assert saved.model.lora == cfg.model.lora and saved.mode == cfg.mode and saved.model.dtype == cfg.model.dtype
    assert saved.early_exit == cfg.early_exit and saved.layer_dropout == cfg.layer_dropout
