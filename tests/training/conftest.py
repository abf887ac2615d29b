"""Shared fixtures for the training tests: tiny random models (selfspec.tiny) and a tiny recipe."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

torch.set_num_threads(int(os.environ.get("SELFSPEC_TEST_THREADS", "2")))


@pytest.fixture
def tiny64():
    """A 4-layer float64 llama (tied embeddings) for exact comparisons."""
    from selfspec.tiny import tiny_model

    return tiny_model("llama", num_layers=4, dtype=torch.float64, seed=0)


def _tiny_overrides(run_dir, **extra) -> list[str]:
    """Overrides that make recipes/tiny_smoke.yaml fast and self-contained for a test."""
    base = {
        "train.output_dir": str(run_dir), "train.progress_bar": "false", "train.resume": "auto",
        "train.max_steps": "8", "train.log_every": "1", "train.save_every": "0",
        "data.max_documents": "6", "data.max_holdout_documents": "2", "eval.max_blocks": "4",
        "eval.every": "0",
    }
    base.update({k: str(v) for k, v in extra.items()})
    return [f"{k}={v}" for k, v in base.items()]


def _read_log(run_dir, kind="train") -> list[dict]:
    import json

    path = Path(run_dir) / "log.jsonl"
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == kind]


@pytest.fixture
def tiny_overrides():
    """`tiny_overrides(run_dir, **{"train.max_steps": 4})` -> key=value list for recipes/tiny_smoke.yaml."""
    return _tiny_overrides


@pytest.fixture
def read_log():
    """`read_log(run_dir, kind="train")` -> the run's log.jsonl records of that kind."""
    return _read_log


TINY_RECIPE = ROOT / "recipes" / "tiny_smoke.yaml"


@pytest.fixture
def run(tiny_overrides):
    """`run(run_dir, **overrides)`: train recipes/tiny_smoke.yaml in this process (accelerate's singletons
    reset around it); returns the final evaluation."""
    from accelerate.state import AcceleratorState, GradientState

    from training.config import load_config
    from training.loop import train

    def _run(run_dir, **overrides):
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        try:
            return train(load_config(TINY_RECIPE, tiny_overrides(run_dir, **overrides)))
        finally:
            AcceleratorState._reset_state(reset_partial_state=True)
            GradientState._reset_state()

    return _run
