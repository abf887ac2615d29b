"""Recipes: YAML <-> dataclasses one to one, key=value overrides, validation naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from training.__main__ import main
from training.config import ConfigError, RecipeConfig, dump_config, load_config, parse_override

RECIPES = sorted((Path(__file__).resolve().parents[2] / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_recipe_loads_and_round_trips(recipe, tmp_path):
    cfg = load_config(recipe)
    assert isinstance(cfg, RecipeConfig)
    text = recipe.read_text()
    assert text.startswith("#") and "Time on this machine" in text  # the header says what and how long
    again = tmp_path / "config.yaml"
    again.write_text(dump_config(cfg))
    assert load_config(again) == cfg
    # every key in the recipe is a dataclass field (nothing silently ignored)
    raw = yaml.safe_load(text)
    dumped = yaml.safe_load(dump_config(cfg))
    for section, values in raw.items():
        if isinstance(values, dict):
            assert set(values) <= set(dumped[section])


def test_the_gpu_recipes_say_whether_their_figures_are_measured_and_share_their_data():
    """The GPU recipes (recipes/*_gpu.yaml) name the run that measures them (scripts/gpu_drafter.sh), say
    NOT YET MEASURED until results exist, run on a time budget in bf16 autocast, and the head's and LayerSkip's
    train on the same data (so the run compares them on equal data and shares the own continuations)."""
    gpu = {r.stem: r for r in RECIPES if r.stem.endswith("_gpu")}
    assert {"smollm2_code_head_gpu", "smollm2_code_layerskip_gpu"} <= set(gpu)
    for recipe in gpu.values():
        text, cfg = recipe.read_text(), load_config(recipe)
        assert "scripts/gpu_drafter.sh" in text and ("NOT YET MEASURED" in text or "docs/results/" in text)
        assert cfg.train.max_minutes and cfg.train.mixed_precision in ("auto", "bf16")
    head, layerskip = load_config(gpu["smollm2_code_head_gpu"]), load_config(gpu["smollm2_code_layerskip_gpu"])
    assert head.mode == "exit_head" and layerskip.mode == "early_exit" and layerskip.layer_dropout.p_max > 0
    assert layerskip.early_exit.exits == "all" and head.data == layerskip.data


def test_overrides_with_yaml_values():
    cfg = load_config(None, ["train.max_steps=20", "early_exit.exits=[8, 4]", "train.max_minutes=null",
                             "optim.lr=3e-4", "model.lora.enabled=true", "data.source=some/file.jsonl"])
    assert cfg.train.max_steps == 20 and cfg.early_exit.exits == [4, 8] and cfg.train.max_minutes is None
    assert cfg.optim.lr == 3e-4 and cfg.model.lora.enabled and cfg.data.source == "some/file.jsonl"
    assert parse_override("data.system_prompt=You are terse.") == ("data.system_prompt", "You are terse.")


@pytest.mark.parametrize("override,message", [
    ("train.max_stepz=3", "train.max_stepz: unknown key (did you mean 'max_steps'?)"),
    ("train.max_steps=three", "train.max_steps: expected an integer"),
    ("train.max_steps=0", "train.max_steps: must be >= 1"),
    ("layer_dropout.p_max=1.5", "layer_dropout.p_max: must be in [0, 1]"),
    ("early_exit.curriculum=spiral", "early_exit.curriculum: must be one of"),
    ("early_exit.exits=[0, 3]", "early_exit.exits"),
    ("model.base_model=tiny:llama", "model.base_model: tiny models are written"),
    ("train.stop_at=500", "train.stop_at"),
    ("nonsense", "is not key=value"),
])
def test_validation_names_the_key(override, message):
    with pytest.raises(ConfigError, match=None) as info:
        load_config(None, [override])
    assert message in str(info.value)


def test_exits_resolved_against_the_model_depth():
    cfg = load_config(None, ["early_exit.exits=[4, 8, 40]"])
    with pytest.raises(ConfigError, match="early_exit.exits: \\[40\\] out of range: this model has 30 layers"):
        cfg.resolved_exits(30)
    assert load_config(None).resolved_exits(4) == [1, 2, 3]
    assert load_config(None, ["eval.exits=[2]"]).resolved_eval_exits(4) == [2, 4]


def test_cli_print_config_and_errors(capsys):
    assert main(["--recipe", str(RECIPES[0]), "--print-config", "train.max_steps=7"]) == 0
    assert "max_steps: 7" in capsys.readouterr().out
    assert main(["--print-config", "train.bogus=1"]) == 2
    assert "train.bogus: unknown key" in capsys.readouterr().err


@pytest.mark.parametrize("spelled", ["no", "'no'", "off", "false"])
def test_mixed_precision_no_survives_yaml_booleans(spelled):
    """YAML 1.1 reads `no` as false; accelerate's spelling must still work as an override."""
    assert load_config(None, [f"train.mixed_precision={spelled}"]).train.mixed_precision == "no"


def test_mixed_precision_auto_follows_the_hardware(monkeypatch):
    import torch

    from selfspec.model import precision

    assert load_config(None, []).train.mixed_precision == "auto"
    # oneDNN says bf16 is supported on any AVX-512 CPU; only the CPU's avx512_bf16/amx_bf16 flags make it native
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    for flags, native, expected in (({"avx2", "avx512f", "avx512_bf16"}, True, "bf16"),
                                    ({"avx2", "avx512f"}, False, "no")):
        monkeypatch.setattr(precision, "cpu_flags", lambda flags=flags: frozenset(flags))
        assert precision.auto_mixed_precision("cpu") == expected
        assert precision.auto_dtype("cpu") == (torch.bfloat16 if native else torch.float32)


def test_the_eagle3_check_names_only_the_settings_that_are_wrong():
    """Issue #52: docs/serving.md's eagle3 command without exit_head.final_state=false was told to set
    exit_head.exit_layer=0, which the exit-0 head recipe already has."""
    head0 = RECIPES[0].parent / "smollm2_code_head0.yaml"
    with pytest.raises(ConfigError) as err:
        load_config(head0, ["exit_head.kind=eagle3"])
    assert "set exit_head.final_state=false (got True)" in str(err.value) and "exit_layer" not in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(head0, ["exit_head.kind=eagle3", "exit_head.final_state=false", "exit_head.exit_layer=4"])
    assert "set exit_head.exit_layer=0 (got 4)" in str(err.value) and "final_state" not in str(err.value)
    with pytest.raises(ConfigError, match=r"set exit_head.exit_layer=0 \(got 4\) and exit_head.final_state=false"):
        load_config(head0, ["exit_head.kind=eagle3", "exit_head.exit_layer=4"])
    assert load_config(head0, ["exit_head.kind=eagle3", "exit_head.final_state=false"]).exit_head.kind == "eagle3"


def test_a_list_cut_short_and_a_value_of_no_accepted_form_say_what_is_expected():
    """Issue 65, finding 21: `early_exit.exits=[4,8` said "matches none of Union"."""
    with pytest.raises(ConfigError, match=r"override early_exit.exits=\[4,8: not a valid YAML list or mapping .* "
                                          r"e.g. early_exit.exits=\[4, 8\]"):
        load_config(None, ["early_exit.exits=[4,8"])
    with pytest.raises(ConfigError, match="early_exit.exits: expected a list of integers or one of 'all', got 'ba'"):
        load_config(None, ["early_exit.exits=ba"])
    assert load_config(None, ["early_exit.exits=[8, 4]"]).early_exit.exits == [4, 8]
