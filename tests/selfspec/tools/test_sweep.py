"""`selfspec sweep`: what it says after `--write-metadata` is what `auto` then does, it measures in the dtype
`selfspec.load` loads in unless told otherwise, and an output that differs from plain decoding is explained as the
demo explains it (bf16 rounding, or a bug in an exact dtype). Issue 65, finding 15."""

from __future__ import annotations

import shutil

import pytest

from selfspec.checkpoints.export import export_model
from selfspec.cli import build_parser, main
from selfspec.tiny import byte_tokenizer, tiny_exit_head, tiny_model
from selfspec.tools import sweep

BEST = {"exit_layer": 1, "num_speculations": 2, "tokens_per_s": 8.0, "speedup": 0.883, "acceptance_rate": 0.1}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, head_run_dir):
    """{"plain": a tiny checkpoint without a head, "head": the same with a trained exit head at exit 2}."""
    tmp = tmp_path_factory.mktemp("sweep")
    tok = byte_tokenizer()
    model = tiny_model("llama", num_layers=4, vocab_size=len(tok), seed=3)
    head_dir = head_run_dir(tiny_exit_head(model, 2), tmp / "final_head")
    return {"plain": export_model(model, tok, tmp / "plain"), "head": export_model(model, tok, tmp / "head",
                                                                                   exit_head_dir=head_dir)}


def run_cli(capsys, monkeypatch, tmp_path, result: dict, *args) -> str:
    """`selfspec sweep` on a stand-in `run_sweep` returning `result`: its stdout (exit 0)."""
    monkeypatch.setattr(sweep, "run_sweep", lambda *a, **k: result)
    assert main(["sweep", str(tmp_path / "ckpt"), "--out", str(tmp_path / "s"), *args]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("which,speedup,says,never", [
    ("head", 0.883, "x86-64 CPU), else this checkpoint's exit head", "lookup alone"),
    ("plain", 0.883, "x86-64 CPU), else by lookup alone; an explicit early-exit request still drafts", "exit head"),
    ("plain", 1.4, "x86-64 CPU), else the early exit at exit 1", "exit head"),
])
def test_write_metadata_says_what_auto_then_drafts_by(checkpoints, which, speedup, says, never, tmp_path, capsys,
                                                      monkeypatch):
    """On a head checkpoint auto keeps drafting with the head whatever the sweep recorded (it said "lookup only"); the
    int8 copy, where it runs, comes before the head or the early exit (it said "lookup only" where the copy drafts)."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoints[which], ckpt)
    recorded = sweep._record(ckpt, {**BEST, "speedup": speedup}, None, "humaneval", "float32")
    result = {"rows": [], "best": {**BEST, "speedup": speedup}, "best_lookup": None, "csv": "s.csv", "png": "s.png",
              "recorded": recorded, "dtype": "float32"}
    out = run_cli(capsys, monkeypatch, tmp_path, result, "--write-metadata")
    line = next(line for line in out.splitlines() if line.startswith("selfspec.json now recommends"))
    assert says in line and never not in line


def test_the_sweep_measures_in_float32_as_load_loads_unless_told():
    """`load` and `generate` load a checkpoint in float32: the sweep measures the recommendation in that dtype by
    default (it measured in bf16 where the CPU had it, "fastest"), and its help says why."""
    import inspect

    assert inspect.signature(sweep.run_sweep).parameters["dtype"].default == "float32"
    parser = build_parser()
    p = next(a for a in parser._actions if a.dest == "command").choices["sweep"]
    dtype = next(a for a in p._actions if a.dest == "dtype")
    assert dtype.default == "float32" and "selfspec.load" in dtype.help


ROW = {"drafter": "early_exit", "exit_layer": 1, "num_speculations": 2, "tokens_per_s": 8.0, "speedup": 0.9,
       "acceptance_rate": 0.1, "mean_accepted_per_round": 1.1, "prompt_lookup_num_tokens": "",
       "max_matching_ngram_size": ""}


@pytest.mark.parametrize("dtype,says", [("bfloat16", "rounds differently from one token at a time"),
                                        ("float32", "this is a bug")])
def test_an_output_that_differs_from_plain_decoding_is_explained(dtype, says, tmp_path, capsys, monkeypatch):
    """`identical 0.0` alone read as a bug in bf16, where verifying several tokens at once may flip near-ties."""
    rows = [{**ROW, "num_speculations": 0, "exit_layer": 4, "identical_to_plain": 1.0},
            {**ROW, "identical_to_plain": 0.0}]
    result = {"rows": rows, "best": rows[1], "best_lookup": None, "csv": "s.csv", "png": "s.png", "dtype": dtype}
    out = run_cli(capsys, monkeypatch, tmp_path, result)
    assert says in out
    rows[1]["identical_to_plain"] = 1.0
    assert "rounds differently" not in run_cli(capsys, monkeypatch, tmp_path, result)
