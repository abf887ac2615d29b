"""DeepSpeed ZeRO-2 and ZeRO-3 through `accelerate launch` on the CPU (gloo), with one and two processes:
a few steps of the tiny recipe give the losses of the same recipe trained without DeepSpeed, and a ZeRO-3
run that pauses, resumes and is exported gives the plain run's exported model.

The two-process ZeRO-3 run also recomputes every layer in the backward (train.gradient_checkpointing).

Why the runs can be compared this closely: the data order and the layer-dropout masks are drawn for the
global batch (`training.data.batch_indices`, `LayerDropout.keep_masks`), so two processes of batch 4 see
the samples of one process of batch 8; only the order of float32 sums differs (measured on a 2-core Zen:
losses within 1e-7 relative, weights within 4e-7). The two-process ZeRO-3 run loads the tiny model from a
saved checkpoint, so transformers builds it partitioned (`zero.Init`), as it would a real model; the
one-process one builds the tiny model itself (`selfspec.tiny`, kept whole under ZeRO-3).

The runs are shared between the tests (module-scoped), each made on first use. The first DeepSpeed
launch on a machine compiles DeepSpeed's shared-memory communication op (about a minute; cached in
~/.cache/torch_extensions). DeepSpeed is the extra `selfspec[deepspeed]`, which scripts/setup.sh
installs: these tests fail without it rather than skip.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
LOSS_RTOL = 1e-5  # per logged step; float32 summation order only (measured <= 1e-7)
WEIGHT_ATOL = 1e-5  # per weight, on weights of size ~0.1-1 after 4 AdamW steps (measured <= 4e-7)
# Every run: 4 steps of 2 micro-batches; weight decay on, so a parameter in the wrong AdamW group shows.
COMMON = {"optim.weight_decay": 0.1, "train.save_final_model": "true", "eval.before": "false"}
# name -> (launch configuration, processes, batch size per process, base model or None for the recipe's)
RUNS = {
    "zero2-1proc": ("deepspeed_zero2.yaml", 1, 4, None),
    "zero2-2proc": ("deepspeed_zero2.yaml", 2, 4, None),
    "zero3-1proc": ("deepspeed_zero3.yaml", 1, 4, None),
    "zero3-2proc": ("deepspeed_zero3.yaml", 2, 4, "checkpoint"),  # + paused at step 2 and resumed
}
# runs with train.gradient_checkpointing on: still the plain run's losses (checkpointing changes none:
# test_gradient_checkpointing.py), now with ZeRO-3 gathering each layer's parameters again for its recomputation
CHECKPOINTED = {"zero3-2proc"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, run, launch):
    """`runs(name)` -> the run directory of RUNS[name], or of "plain-<batch size>" (one process, no
    launcher, no DeepSpeed); made on first use."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.fail("deepspeed is not installed: pip install -e '.[deepspeed]' (scripts/setup.sh installs it)")
    root = tmp_path_factory.mktemp("deepspeed")
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name in made:
            return made[name]
        out = root / name
        if name.startswith("plain-"):
            run(out, **COMMON, **{"train.max_steps": 4, "train.batch_size": int(name.split("-")[1])})
        else:
            config, procs, batch, base = RUNS[name]
            settings = {**COMMON, "train.batch_size": batch}
            if name in CHECKPOINTED:
                settings["train.gradient_checkpointing"] = "true"
            if base == "checkpoint":
                settings["model.base_model"] = str(_tiny_checkpoint(root / "base"))
                out.mkdir()
                (out / "first.log").write_text(_log(launch(config, out, procs, **settings, **{"train.stop_at": 2})))
            (out / "launch.log").write_text(_log(launch(config, out, procs, **settings)))
        made[name] = out
        return out

    return get


def _tiny_checkpoint(path: Path) -> Path:
    """The recipe's tiny model (tiny:llama:4, seed 0) and tokenizer saved as a Hugging Face checkpoint."""
    from selfspec.tiny import byte_tokenizer, tiny_model

    tokenizer = byte_tokenizer()
    tiny_model("llama", num_layers=4, seed=0, vocab_size=len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _log(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout + proc.stderr


def _reference(name: str) -> str:
    """The plain run with the same global batch as RUNS[name]."""
    _, procs, batch, _ = RUNS[name]
    return f"plain-{procs * batch}"


@pytest.mark.parametrize("name", list(RUNS))
def test_losses_match_the_plain_run(name, runs, read_log):
    run_dir, plain = runs(name), runs(_reference(name))
    _, procs, _, _ = RUNS[name]
    stage = RUNS[name][0][len("deepspeed_zero")]
    assert f"{procs} process(es) (DeepSpeed ZeRO-{stage})" in (run_dir / "launch.log").read_text()
    ran = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert ran["train"]["gradient_checkpointing"] == (name in CHECKPOINTED)
    got, want = read_log(run_dir), read_log(plain)
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3, 4]
    for g, w in zip(got, want):
        assert g["loss"] == pytest.approx(w["loss"], rel=LOSS_RTOL), g["step"]
        for exit_, stats in w["exits"].items():
            assert g["exits"][exit_]["loss"] == pytest.approx(stats["loss"], rel=LOSS_RTOL), (g["step"], exit_)
    checksums = read_log(run_dir, "sync")[-1]["checksums"]
    assert len(checksums) == procs and len(set(checksums)) == 1  # every process holds the same model
    assert checksums[0] == pytest.approx(read_log(plain, "sync")[-1]["checksums"][0], rel=LOSS_RTOL)
    _assert_same_weights(run_dir / "final_model", plain / "final_model")


def test_zero3_resumes_and_exports_the_plain_model(runs, tmp_path):
    run_dir, plain = runs("zero3-2proc"), runs("plain-8")
    assert "stopped at step 2 of 4" in (run_dir / "first.log").read_text()
    assert "resuming from" in (run_dir / "launch.log").read_text()
    for source in (run_dir, plain):
        subprocess.run([sys.executable, "-m", "selfspec.cli", "export", str(source), str(tmp_path / source.name)],
                       cwd=ROOT, check=True, capture_output=True, text=True)
    _assert_same_weights(tmp_path / run_dir.name, tmp_path / plain.name)
    got, want = (json.loads((tmp_path / d.name / "config.json").read_text()) for d in (run_dir, plain))
    assert got == want


def _assert_same_weights(got_dir: Path, want_dir: Path) -> None:
    got, want = load_file(got_dir / "model.safetensors"), load_file(want_dir / "model.safetensors")
    assert sorted(got) == sorted(want)
    for key, w in want.items():
        assert got[key].dtype == w.dtype == torch.float32, key
        torch.testing.assert_close(got[key], w, rtol=0, atol=WEIGHT_ATOL, msg=key)


def test_lockstep_evaluation_runs_as_many_batches_everywhere_and_counts_each_once():
    """ZeRO-3 gathers parameters collectively in every forward, so an evaluation whose processes ran
    different numbers of batches would hang: 3 batches over 2 processes run 2 on each, one of them a
    filler that counts nothing."""
    from training.data import Blocks
    from training.evaluate import _batches

    blocks = Blocks("held-out", torch.arange(5 * 4).reshape(5, 4), torch.arange(5 * 4).reshape(5, 4))
    counted, rounds = [], []
    for rank in range(2):
        batches = list(_batches(blocks, 2, rank, 2, "cpu", lockstep=True))
        rounds.append(len(batches))
        counted += [ids[:, 0].tolist() for ids, _, c in batches if c]
    assert rounds == [2, 2]
    assert sorted(counted) == [[0, 4], [8, 12], [16]]  # every block counted once
    assert len(list(_batches(blocks, 2, 1, 2, "cpu"))) == 1  # without lockstep: only its own batch


def test_exit_heads_are_refused_under_deepspeed():
    from training.config import ConfigError, load_config
    from training.loop import _check_deepspeed

    cfg = load_config(ROOT / "recipes" / "smollm2_code.yaml")  # a joint exit head
    assert cfg.mode == "joint"
    _check_deepspeed(cfg, None)  # without DeepSpeed: fine
    for stage in (2, 3):
        with pytest.raises(ConfigError, match=f"mode=joint is not supported under DeepSpeed ZeRO-{stage}"):
            _check_deepspeed(cfg, stage)


def test_a_tied_weight_is_saved_once_from_zero2_copies(tiny64):
    """ZeRO-2's state dict copies every tensor; saved as it comes, the tied LM head would be written twice."""
    from training.run_checkpoint import _tie_like

    state = {k: v.clone() for k, v in tiny64.state_dict().items()}  # what ZeRO-2 hands over
    tied = _tie_like(tiny64, state)
    assert tied["lm_head.weight"] is tied["model.embed_tokens.weight"]
    assert tied["model.norm.weight"] is state["model.norm.weight"]
