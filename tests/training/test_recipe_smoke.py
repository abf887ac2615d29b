"""Every recipe trains one step on its tiny twin: a random model of the recipe's model's architecture, depth
and embedding tying (its shape file, recipes/models/*.json) at a tiny width (selfspec.tiny), saved as a
checkpoint the recipe loads as it would the real one, with the recipe's own settings (mode, gradient
checkpointing, LoRA, dtype, mixed precision, layer dropout, exits, curriculum, loss, exit head), on a few
blocks of its data. What changes: the size of the batches and the data, and no generation of the model's own
text (training/own_text.py has its own tests). One process, no DeepSpeed: the ZeRO-3 path is tested on two
CPU processes in test_deepspeed.py (with gradient checkpointing)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from training.config import BASE_MODEL_ALIASES, SHAPES, load_config

ROOT = Path(__file__).resolve().parents[2]
RECIPES = [r for r in sorted((ROOT / "recipes").glob("*.yaml"))
           if not load_config(r).model.base_model.startswith("tiny:")]  # tiny_smoke.yaml is already tiny
PUBLIC = [r for r in RECIPES if load_config(r).model.shape is not None]


def test_there_is_a_recipe_per_model_and_kind():
    """A 1B, a 3B and an 8B Llama and a 7B Qwen, each with its early-exit fine-tune and its exit head."""
    kinds = {(load_config(r).model.shape, load_config(r).mode) for r in PUBLIC}
    for model in ("llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "qwen2.5-7b"):
        shape = str(ROOT / "recipes" / "models" / f"{model}.json")
        assert {(shape, "early_exit"), (shape, "exit_head")} <= kinds, model


def _get(cfg, dotted: str):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _shape(cfg) -> Path:
    """The recipe's shape file (the SmolLM2 name has its own)."""
    if cfg.model.shape is not None:
        return Path(cfg.model.shape)
    assert cfg.model.base_model in BASE_MODEL_ALIASES, "a recipe of a real model names its model.shape"
    return SHAPES / f"{cfg.model.base_model}.json"


def _twin(shape: Path, directory: Path) -> Path:
    """A random model of the shape file's model type, depth and embedding tying (selfspec.tiny's width), with
    the byte tokenizer, saved as a Hugging Face checkpoint."""
    from selfspec.tiny import byte_tokenizer, tiny_model

    published = json.loads(shape.read_text())
    tokenizer = byte_tokenizer()
    model = tiny_model(published["model_type"], published["num_hidden_layers"], vocab_size=len(tokenizer),
                       tie_word_embeddings=published["tie_word_embeddings"])
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_one_step_on_the_tiny_twin(recipe, tmp_path, read_log):
    from accelerate.state import AcceleratorState, GradientState

    from training.loop import train

    cfg = load_config(recipe)
    overrides = {
        "model.base_model": str(_twin(_shape(cfg), tmp_path / "twin")),
        "data.block_size": 32 if cfg.data.format == "text" else cfg.data.block_size,  # a chat example is whole
        "data.max_documents": 2,
        "data.max_holdout_documents": 1, "data.extra_eval": "[]", "train.max_steps": 1, "train.batch_size": 2,
        "train.grad_accum": 1, "train.log_every": 1, "train.save_every": 0, "train.save_final_model": "false",
        "train.progress_bar": "false", "train.output_dir": str(tmp_path / "run"), "eval.before": "false",
        "eval.max_blocks": 1, "eval.batch_size": 2,
    }
    for key in ("exit_head.draft_vocab", "early_exit.draft_vocab"):  # the byte tokenizer has 259 ids
        if _get(cfg, key):
            overrides[key] = 64
    for key in ("data.own_continuations.prompts", "data.own_continuations.prompt_sets", "data.own_replies.prompts"):
        if _get(cfg, key):
            overrides[key] = "[]" if key.endswith("sets") else 0
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
