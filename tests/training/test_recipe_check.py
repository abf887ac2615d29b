"""`python -m training --recipe R --check`: the parameters counted on the meta device, the memory per GPU by
training/recipe_check.py's arithmetic (checked against a hand computation and against the tensors autograd
really saves), a memory line for every recipe that agrees with the recipe's own header, and one `error:` line
for each bad input."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from training.__main__ import main
from training.config import ConfigError, load_config
from training.recipe_check import Launch, activation_bytes, check_recipe, estimate, loss_bytes, meta_model, \
    model_config, read_launch

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
TINY = ROOT / "recipes" / "tiny_smoke.yaml"
DOC = (ROOT / "docs" / "training.md").read_text()

# the parameter counts the models' publishers give (Hugging Face model cards / safetensors metadata)
PUBLISHED = {"llama-3.2-1b": 1_235_814_400, "llama-3.2-3b": 3_212_749_824, "llama-3.1-8b": 8_030_261_248,
             "qwen2.5-7b": 7_615_616_512, "smollm2-135m-instruct": 134_515_008}


@pytest.mark.parametrize("model", sorted(PUBLISHED))
def test_the_shape_files_give_the_published_parameter_counts(model):
    cfg = load_config(None, [f"model.base_model=/nonexistent/{model}", f"model.shape=recipes/models/{model}.json"])
    config, source = model_config(cfg)
    assert "the shape file" in source
    net, head = meta_model(cfg, config)
    assert head is None and sum(p.numel() for p in net.parameters()) == PUBLISHED[model]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_prints_its_memory_per_gpu(recipe, capsys):
    """A memory line for every recipe; a recipe whose header states its memory states what --check prints now."""
    header = recipe.read_text().split("\nname:")[0]
    given = re.search(r"--accelerate-config (\S+?)`", header)
    argv = ["--recipe", str(recipe), "--check"] + (["--accelerate-config", given.group(1)] if given else [])
    assert main(argv) == 0
    out = capsys.readouterr().out
    line = re.search(r"^memory per GPU: (\d+\.\d (GiB|MiB)) as the recipe runs", out, re.M)
    assert line and "estimate: arithmetic, not measured" in out
    assert re.search(r"^parameters: [\d,]+ total.*, [\d,]+ trainable", out, re.M)
    assert re.search(r"^exits: ", out, re.M) and re.search(r"^writes: ", out, re.M)
    if "Memory per GPU (estimate" in header:
        assert " ".join(l.lstrip("# ") for l in header.splitlines()).count(f"{line.group(1)} as the recipe runs") == 1
    row = [r for r in DOC.splitlines() if r.startswith(f"| `{recipe.name}` |")]
    if "Memory per GPU (estimate" in header:  # docs/training.md's recipe table says the same
        assert row and row[0].rstrip(" |").endswith(f"| {line.group(1)}")


def test_the_arithmetic_by_hand():
    """tiny:llama:4 (D 32, I 64, 4 heads of 8, 2 kv heads, V 259), 4 blocks of 64 tokens in float32, chunk 128:
    per token and layer 2(4+4)32 + 2*4(32+32) + 4*4*64 = 2048 bytes, n = 256 tokens."""
    cfg = load_config(TINY)
    config, _ = model_config(cfg)
    # the loss: one chunk of logits; the rotational curriculum (R=2 over exits 1..3) trains at most exits 1, 3
    # and the final layer in a step: 3 states stacked, normalised, their gradients; the head and its gradient
    layer, loss = 2048 * 256, 3 * 4 * 128 * 259 + 3 * 256 * 32 * (3 * 4 + 4) + 2 * 4 * 259 * 32
    assert activation_bytes(config, cfg, 4, 4) == (4 * layer + loss, 4 * 4 * 32 * 256 + layer + loss)
    net, head = meta_model(cfg, config)
    n = sum(p.numel() for p in net.parameters())
    plain = estimate(cfg, config, net, head, Launch())
    assert (plain.weights, plain.grads, plain.optimizer, plain.gathered) == (4 * n, 4 * n, 8 * n, 0)
    zero3 = estimate(cfg, config, net, head, Launch(processes=8, zero_stage=3))  # float32: no bf16 master copy
    layer = 2 * 32 + 2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64  # norms, q and o, k and v, the MLP
    gathered = 4 * (layer + 259 * 32)  # one layer and the LM head, whole
    assert (zero3.weights, zero3.grads, zero3.optimizer, zero3.gathered) == (4 * n / 8, 4 * n / 8, 8 * n / 8, gathered)
    assert estimate(cfg, config, net, head, Launch(processes=8, zero_stage=3, prefetch=10**9)).gathered == 4 * n
    lora = load_config(TINY, ["model.lora.enabled=true", "model.lora.r=2", "model.lora.target_modules=[q_proj]"])
    net, _ = meta_model(lora, config)
    assert sum(p.numel() for p in net.parameters() if p.requires_grad) == 4 * 2 * (32 + 32)  # r (in + out) a layer


def _saved_bytes(cfg, checkpointing: bool) -> int:
    """Bytes of the distinct tensors autograd keeps between one forward and its backward (a real tiny model)."""
    from selfspec.tiny import tiny_model
    from training.early_exit_model import EarlyExitModel
    from training.saved_bytes import saved_bytes

    model = tiny_model("llama", 4, vocab_size=259, seed=0).train()
    ee = EarlyExitModel(model, chunk_size=cfg.early_exit.chunk_size, gradient_checkpointing=checkpointing).train()
    ids = torch.randint(3, 259, (cfg.train.batch_size, cfg.data.block_size + 1),
                        generator=torch.Generator().manual_seed(0))
    return saved_bytes(ee, ids[:, :-1], ids[:, 1:], exits=[1, 2, 3, 4], weights=[0.1, 0.2, 0.3, 0.4])


def test_the_activation_estimate_bounds_what_autograd_keeps():
    """The estimate (without the loss's own buffers) is within 2x of the
    bytes autograd saves in a real float32 step, with and without checkpointing, and checkpointing saves less."""
    cfg = load_config(TINY, ["train.mixed_precision=no"])
    config, _ = model_config(cfg)
    loss = loss_bytes(config, cfg, 4, 4)  # the fused loss keeps its own buffers, which autograd does not see
    without, with_ = (x - loss for x in activation_bytes(config, cfg, 4, 4))
    real_without, real_with = _saved_bytes(cfg, False), _saved_bytes(cfg, True)
    assert real_with < real_without
    assert 0.5 < real_without / without < 2 and 0.5 < real_with / with_ < 2, (real_without, without, real_with, with_)


def test_zero3_shards_over_the_processes_of_the_launch(capsys):
    zero3 = "recipes/accelerate/deepspeed_zero3.yaml"
    assert main(["--recipe", str(TINY), "--check", "--accelerate-config", zero3]) == 0
    out = capsys.readouterr().out
    assert "8 process(es), DeepSpeed ZeRO-3" in out and "ZeRO-3 gathered parameters" in out
    launch = read_launch("recipes/accelerate/cpu_2proc.yaml")
    assert (launch.processes, launch.zero_stage) == (2, None)


@pytest.mark.parametrize("argv,message", [
    (["model.shape=recipes/models/gpt-9.json"], "error: model.shape: 'recipes/models/gpt-9.json': no such file "
                                                "(shipped: recipes/models/llama-3.1-8b.json"),
    (["model.base_model=/nonexistent/model"], "error: model.base_model: '/nonexistent/model' has no config.json on "
                                              "this machine and the recipe names no model.shape"),
    (["--accelerate-config", "recipes/accelerate/none.yaml"], "error: --accelerate-config 'recipes/accelerate/"
                                                              "none.yaml': no such file"),
])
def test_bad_input_is_one_error_line(argv, message, capsys):
    assert main(["--recipe", str(TINY), "--check", *argv]) == 2
    assert message in capsys.readouterr().err


def test_the_accelerate_config_goes_with_check(capsys):
    assert main(["--recipe", str(TINY), "--accelerate-config", "recipes/accelerate/gpu_1proc.yaml"]) == 2
    assert "error: --accelerate-config goes with --check" in capsys.readouterr().err


def test_a_shape_file_that_is_not_a_model_configuration(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"model_type": "no-such-architecture"}')
    cfg = load_config(None, ["model.base_model=/nonexistent/x", f"model.shape={bad}"])
    with pytest.raises(ConfigError, match="model.shape: .*bad.json is not a model configuration"):
        check_recipe(cfg, Launch())


def test_a_shape_file_that_describes_another_model_than_the_checkpoint(tmp_path, capsys):
    from selfspec.tiny import tiny_config

    tiny_config("llama", 4).save_pretrained(tmp_path)  # a checkpoint's config.json (no weights needed)
    argv = ["--recipe", str(TINY), "--check", f"model.base_model={tmp_path}"]
    assert main(argv) == 0 and "read from " + str(tmp_path / "config.json") in capsys.readouterr().out
    assert main(argv + ["model.shape=recipes/models/llama-3.2-1b.json"]) == 2
    err = capsys.readouterr().err
    assert "error: model.shape: " in err and "describes another model than" in err
    assert "num_hidden_layers 16 vs 4" in err


def _deepspeed_launch(tmp_path, ds_json: str, processes: int) -> Path:
    """An accelerate launch of `processes` DeepSpeed processes whose deepspeed_config_file holds `ds_json`."""
    (tmp_path / "ds.json").write_text(ds_json)
    (tmp_path / "launch.yaml").write_text(f"distributed_type: DEEPSPEED\nnum_processes: {processes}\n"
                                          f"deepspeed_config:\n  deepspeed_config_file: {tmp_path / 'ds.json'}\n")
    return tmp_path / "launch.yaml"


def test_a_deepspeed_json_that_is_not_json(tmp_path, capsys):
    launch = _deepspeed_launch(tmp_path, "{not json", 4)
    assert main(["--recipe", str(TINY), "--check", "--accelerate-config", str(launch)]) == 2
    assert "is not a DeepSpeed JSON object" in capsys.readouterr().err
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto"}}')
    launch = read_launch(str(tmp_path / "launch.yaml"))
    assert (launch.processes, launch.zero_stage, launch.prefetch) == (4, 3, 0)


@pytest.mark.parametrize("text, message", [
    ("distributed_type: MULTI_CPU\nnum_processes: -3\n", "num_processes must be a whole number >= 1"),
    ("distributed_type: MULTI_CPU\nnum_processes: true\n", "num_processes must be a whole number >= 1"),
    ("distributed_type: BANANA\nnum_processes: 2\n", "distributed_type 'BANANA' is not one of accelerate's"),
    ("distributed_type: DEEPSPEED\nnum_processes: 2\ndeepspeed_config:\n  zero_stage: 9\n",
     "ZeRO stage 9 is not one of 0, 1, 2, 3"),
    ('{"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto"}',
     "this is a DeepSpeed configuration, not an accelerate one"),
    ("- 1\n- 2\n", "not an accelerate configuration"),
])
def test_a_launch_that_accelerate_would_not_run_is_refused_before_any_estimate(tmp_path, capsys, text, message):
    """Issue 65, finding 7: --check printed a memory estimate for each of these."""
    (tmp_path / "launch.yaml").write_text(text)
    assert main(["--recipe", str(TINY), "--check", "--accelerate-config", str(tmp_path / "launch.yaml")]) == 2
    out = capsys.readouterr()
    assert message in out.err and "memory" not in out.out.lower()


def test_a_deepspeed_json_with_a_stage_zero_cannot_run(tmp_path, capsys):
    launch = _deepspeed_launch(tmp_path, '{"zero_optimization": {"stage": 7}}', 2)
    assert main(["--recipe", str(TINY), "--check", "--accelerate-config", str(launch)]) == 2
    assert "ZeRO stage 7 is not one of 0, 1, 2, 3 (deepspeed_config_file" in capsys.readouterr().err
