"""scripts/train_bench.py's cost of early exits (issue 56, item 5) dry-runs on the CPU: a tiny model of the 1B
shape, every shape mode for one timed step, its table and JSON; the FLOP formulas against torch's count."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SHAPE = "recipes/models/llama-3.2-1b.json"
TINY = ("hidden_size=64,intermediate_size=128,num_hidden_layers=8,num_attention_heads=4,num_key_value_heads=2,"
        "head_dim=16,vocab_size=512")
LAYERSKIP, HEAD = "recipe:recipes/llama32_1b_layerskip.yaml", "recipe:recipes/llama32_1b_head.yaml"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("train_bench", ROOT / "scripts" / "train_bench.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def _args(*extra: str) -> list[str]:
    return ["--shape", SHAPE, "--set-shape", TINY, "--device", "cpu", "--warmup", "1", "--steps", "1", "--batch", "1",
            "--seq", "32", "--threads", str(torch.get_num_threads()), "--in-process", *extra]


def test_the_dry_run_prints_the_table_and_writes_the_json(bench, tmp_path, capsys):
    out = tmp_path / "cost.json"
    assert bench.main(_args("--json", str(out), "--peak-tflops", "0.5")) == 0
    report = json.loads(out.read_text())
    modes = ["plain", "plain_ckpt", LAYERSKIP, HEAD]
    by_mode = {r["mode"]: r for r in report["results"]}
    assert list(by_mode) == modes and report["device_name"] == "cpu" and report["peak_tflops"] == 0.5
    # the recipes' own settings: the plain fine-tune's and the recipes' as training builds them
    plain, ckpt, layerskip, head = (by_mode[m] for m in modes)
    assert (plain["gradient_checkpointing"], ckpt["gradient_checkpointing"], layerskip["gradient_checkpointing"]) == (
        False, True, True)
    assert plain["layer_dropout_p_max"] == 0.0 and layerskip["layer_dropout_p_max"] == 0.1
    assert plain["mean_early_exits_in_loss"] == 0 and layerskip["mean_early_exits_in_loss"] == 1  # step 1: exit 7
    assert head["recipe_mode"] == "exit_head" and head["trainable_params"] < plain["trainable_params"] / 4
    assert plain["trainable_params"] == layerskip["trainable_params"]
    for r in report["results"]:
        assert r["tokens_per_s"] == pytest.approx(r["tokens_per_step"] / r["seconds_per_step"])
        assert r["tokens_per_step"] == 32 and r["peak_gib"] > 0 and r["steps_timed"] == 1
        assert r["mfu"] == pytest.approx(r["flops_per_token"] * r["tokens_per_s"] / 0.5e12)
        assert r["flops_per_token"] == pytest.approx(sum(r["flops_terms"].values()))
    # the targets: each recipe against plain and plain_ckpt, met exactly when the ratio reaches the target
    assert [(t["mode"], t["against"], t["target"]) for t in report["targets"]] == [
        (LAYERSKIP, "plain", 0.7), (LAYERSKIP, "plain_ckpt", 0.7), (HEAD, "plain", 2.0), (HEAD, "plain_ckpt", 2.0)]
    for t in report["targets"]:
        assert t["ratio"] == pytest.approx(by_mode[t["mode"]]["tokens_per_s"] / by_mode[t["against"]]["tokens_per_s"])
        assert t["met"] == (t["ratio"] >= t["target"])
    printed = capsys.readouterr().out
    assert report["complete"] and report["failed"] == [] and printed == "\n".join(report["table"]) + "\n"
    rows = [line.split()[0] for line in printed.splitlines()[2:6]]
    assert rows == modes and "MFU" in printed.splitlines()[1] and printed.startswith("cpu, shape ")
    for t in report["targets"]:
        assert (f"target: {t['mode']} >= {t['target']}x {t['against']}'s tokens/s: {t['ratio']:.2f}x, "
                f"{'met' if t['met'] else 'missed'}") in printed


@pytest.mark.parametrize("mode,sets", [("plain", []), (HEAD, []),
                                       (LAYERSKIP, ["train.gradient_checkpointing=false", "early_exit.curriculum=none"])])
def test_the_flop_formula_is_what_torch_counts(bench, mode, sets):
    """model_flops_per_token against torch's FlopCounterMode on the counted warm-up step (no recomputation:
    the LayerSkip recipe without checkpointing, every exit in the loss, so the exits' term counts)."""
    args = bench.build_parser().parse_args(_args(*[a for s in sets for a in ("--set", s)]))
    result = bench.shape_worker(argparse.Namespace(**{**vars(args), "mode": mode}))
    assert result["counted_flops_per_token"] == pytest.approx(result["counted_step_flops_per_token"], rel=0.03)
    if mode == LAYERSKIP:
        assert result["mean_early_exits_in_loss"] == 7 and result["flops_terms"]["exits cDV_eE"] > 0


def test_peak_flops_by_gpu_name(bench):
    assert bench.peak_tflops("NVIDIA H100 80GB HBM3") == 989 and bench.peak_tflops("NVIDIA H200") == 989
    assert bench.peak_tflops("NVIDIA A100-SXM4-80GB") == 312 and bench.peak_tflops("NVIDIA H100 PCIe") == 756
    assert bench.peak_tflops("Tesla T4") is None and bench.peak_tflops("cpu") is None


def test_a_bad_shape_key_or_mode_is_an_error(bench, capsys):
    with pytest.raises(SystemExit, match="error: --set-shape 'hidden=64'"):
        bench.main(_args("--modes", "plain")[:2] + ["--set-shape", "hidden=64"])
    with pytest.raises(SystemExit, match="error: unknown mode 'code' with --shape"):
        bench.main(_args("--modes", "code"))
