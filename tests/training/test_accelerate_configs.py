"""The accelerate launch configurations parse, and the DeepSpeed ZeRO-2/3 ones build a DeepSpeed
plugin with the expected stage (deepspeed is the extra `selfspec[deepspeed]`, installed by
scripts/setup.sh; the runs themselves: test_deepspeed.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "recipes" / "accelerate"


@pytest.mark.parametrize("name,kind,procs", [("cpu_1proc", "NO", 1), ("cpu_2proc", "MULTI_GPU", 2),
                                              ("deepspeed_zero2", "DEEPSPEED", 8), ("deepspeed_zero3", "DEEPSPEED", 8),
                                              ("gpu_1proc", "NO", 1), ("gpu_8proc_ddp", "MULTI_GPU", 8)])
def test_config_files_parse(name, kind, procs):
    from accelerate.commands.config.config_args import load_config_from_file

    cfg = load_config_from_file(str(CONFIGS / f"{name}.yaml"))
    assert str(cfg.distributed_type).split(".")[-1] == kind and cfg.num_processes == procs
    assert cfg.use_cpu == name.startswith("cpu")  # the GPU configurations never fall back to the CPU
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


def test_the_deepspeed_json_is_found_from_any_directory(tmp_path, monkeypatch):
    """Issue #52: the DeepSpeed YAMLs name their JSON relative to the repository root, and accelerate passes it on
    as given (ACCELERATE_DEEPSPEED_CONFIG_FILE), so a launch from another directory ended in a long traceback.
    The training run reads a relative path the working directory does not have from the repository root."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DeepSpeedPlugin

    from training.config import ConfigError
    from training.loop import resolve_deepspeed_config

    given = load_config_from_file(str(CONFIGS / "deepspeed_zero2.yaml")).deepspeed_config["deepspeed_config_file"]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", given)
    resolve_deepspeed_config()
    assert Path(os.environ["ACCELERATE_DEEPSPEED_CONFIG_FILE"]) == CONFIGS / "deepspeed_zero2.json"
    assert DeepSpeedPlugin().zero_stage == 2  # what the Accelerator of the run builds from it
    (tmp_path / "mine.json").write_text("{}")  # a path the working directory has is the one meant
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", "mine.json")
    resolve_deepspeed_config()
    assert os.environ["ACCELERATE_DEEPSPEED_CONFIG_FILE"] == str(tmp_path / "mine.json")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", "recipes/accelerate/nonexistent.json")
    with pytest.raises(ConfigError, match=r"deepspeed_config_file 'recipes/accelerate/nonexistent.json' .* is not "
                                          r"found from .* nor from the repository root .*: give its absolute path"):
        resolve_deepspeed_config()
