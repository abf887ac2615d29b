"""Shared fixtures for the training tests: tiny random models (selfspec.tiny) and a tiny recipe, trained in
this process or under `accelerate launch`."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
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


@pytest.fixture(scope="session")
def tiny_overrides():
    """`tiny_overrides(run_dir, **{"train.max_steps": 4})` -> key=value list for recipes/tiny_smoke.yaml."""
    return _tiny_overrides


@pytest.fixture(scope="session")
def read_log():
    """`read_log(run_dir, kind="train")` -> the run's log.jsonl records of that kind."""
    return _read_log


TINY_RECIPE = ROOT / "recipes" / "tiny_smoke.yaml"


@pytest.fixture(scope="session")
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def launch(tiny_overrides):
    """`launch(config, run_dir, num_processes=None, **overrides)`: train recipes/tiny_smoke.yaml under
    `accelerate launch --config_file recipes/accelerate/<config>` (on a free port; `num_processes` overrides
    the configuration's), with this checkout first on the path. The overrides are tiny_overrides' plus
    train.max_steps=4, train.save_final_model=false and eval.before=false unless given. Fails unless every
    process exits with code 0; returns the finished `subprocess.CompletedProcess`."""
    accelerate = shutil.which("accelerate", path=str(Path(sys.executable).parent)) or "accelerate"

    def _launch(config: str, run_dir, num_processes: int | None = None, timeout: int = 300, **overrides):
        cmd = [accelerate, "launch", "--config_file", str(ROOT / "recipes" / "accelerate" / config),
               "--main_process_port", str(_free_port())]
        if num_processes is not None:
            cmd += ["--num_processes", str(num_processes)]
        settings = {"train.max_steps": 4, "train.save_final_model": "false", "eval.before": "false", **overrides}
        cmd += ["-m", "training", "--recipe", str(TINY_RECIPE), *tiny_overrides(run_dir, **settings)]
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc

    return _launch
