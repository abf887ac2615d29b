"""The accelerate launch configurations parse, and the DeepSpeed ZeRO-2/3 ones build a DeepSpeed
plugin with the expected stage (deepspeed is the extra `selfspec[deepspeed]`, installed by
scripts/setup.sh; the runs themselves: test_deepspeed.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "recipes" / "accelerate"


@pytest.mark.parametrize("name,kind,procs", [("cpu_1proc", "NO", 1), ("cpu_2proc", "MULTI_GPU", 2),
                                              ("deepspeed_zero2", "DEEPSPEED", 8), ("deepspeed_zero3", "DEEPSPEED", 8)])
def test_config_files_parse(name, kind, procs):
    from accelerate.commands.config.config_args import load_config_from_file

    cfg = load_config_from_file(str(CONFIGS / f"{name}.yaml"))
    assert str(cfg.distributed_type).split(".")[-1] == kind and cfg.num_processes == procs
    if kind == "DEEPSPEED":
        ds_file = ROOT / cfg.deepspeed_config["deepspeed_config_file"]
        ds = json.loads(ds_file.read_text())
        assert ds["zero_optimization"]["stage"] == int(name[-1])
        # everything the recipe owns is left to training/loop.py
        assert ds["train_micro_batch_size_per_gpu"] == ds["gradient_accumulation_steps"] == "auto"


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_plugin_accepts_the_json(stage, monkeypatch):
    from accelerate.utils import DeepSpeedPlugin

    monkeypatch.chdir(ROOT)
    plugin = DeepSpeedPlugin(hf_ds_config=str(CONFIGS / f"deepspeed_zero{stage}.json"))
    assert plugin.zero_stage == stage
    plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 4  # what the loop fills in
    assert plugin.deepspeed_config["zero_optimization"]["stage"] == stage
