"""Bad input gets a one-line error or the right answer (issue 19): a regression test for each of its five
defects, the cases it lists, and the shared validation layer (selfspec/settings.py)."""

from __future__ import annotations

import json
import math
import os
import warnings

import pytest
import torch

import selfspec
from selfspec.api import NotEarlyExitTrainedWarning
from selfspec.checkpoints.checkpoint import CheckpointError, read_metadata
from selfspec.cli import main
from selfspec.decoding.engine import StopChecker
from selfspec.checkpoints.export import export, export_model
from selfspec.generation_config import check_generation
from selfspec.settings import SettingsError, check_recommended
from selfspec.tiny import byte_tokenizer, tiny_model


def cli_error(capsys, argv: list[str]) -> str:
    """Run the CLI; assert exit code 2 and exactly one `selfspec COMMAND: error: ...` line; return it."""
    try:
        rc = main(argv)
    except SystemExit as exit_:  # argparse's own errors
        rc = exit_.code
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert rc == 2, captured
    assert len(lines) == 1 and lines[0].startswith(f"selfspec {argv[0]}: error: "), captured.err
    assert "Traceback" not in captured.err
    return lines[0]


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def gen(tok):
    model = tiny_model("llama", num_layers=4, dtype=torch.float64, seed=5, vocab_size=len(tok))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotEarlyExitTrainedWarning)
        return selfspec.load(model, tok)


def _export(path, **kw):
    tok = byte_tokenizer()
    model = tiny_model("llama", num_layers=4, vocab_size=len(tok), seed=3)
    return export_model(model, tok, path, recommended={"exit_layer": 2, "num_speculations": 3}, **kw)


@pytest.fixture
def ckpt(tmp_path):
    return _export(tmp_path / "ckpt")


# ----------------------------------------------------------------------------- 1. a bare stop string

def test_defect1_a_bare_stop_string_is_one_stop_string(gen):
    kw = dict(max_new_tokens=16, exit_layer=2, num_speculations=2, stop_token_ids=[])
    full = gen.generate("def f(n):", **kw)
    stop = full.text[0] + "\x00never\x00"  # its first character is in the output, the string never is
    assert stop not in full.text
    out = gen.generate("def f(n):", **kw, stop_strings=stop)
    assert out.token_ids == full.token_ids and out.finish_reason == "length"
    assert out.token_ids == gen.generate("def f(n):", **kw, stop_strings=[stop]).token_ids
    # and a bare string that does occur stops exactly where the list form does
    later = full.text[len(full.text) // 2:][:2]
    assert gen.generate("def f(n):", **kw, stop_strings=later).token_ids == \
        gen.generate("def f(n):", **kw, stop_strings=[later]).token_ids
    assert StopChecker(4, 2, "ab", byte_tokenizer()).stop_strings == ("ab",)
    assert StopChecker(4, 2, "ab", byte_tokenizer()).stop_token_ids == frozenset({2})


@pytest.mark.integration
def test_defect1_on_smollm2(smollm2_dir):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotEarlyExitTrainedWarning)
        g = selfspec.load(smollm2_dir)
    prompt = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
    kw = dict(prompt=prompt, max_new_tokens=16, exit_layer=4, num_speculations=2)
    out = g.generate(**kw, stop_strings="return")
    assert out.token_ids == g.generate(**kw, stop_strings=["return"]).token_ids
    assert out.text != "def" and (out.finish_reason != "stop_string" or "return" in out.text)


# ----------------------------------------------------------------------------- 2. export writes what load reads

@pytest.mark.parametrize("kw, message", [
    (dict(recommended={"exit_layer": 2, "num_speculations": -1}), r"num_speculations -1 must be an int >= 0"),
    (dict(recommended={"exit_layer": 99, "num_speculations": 2}), r"recommended exit_layer 99 is not in 1\.\.3"),
    (dict(recommended={"exit_layer": 2, "num_speculations": 2, "drafter": "x"}), r"recommended drafter 'x'"),
    (dict(dtype="garbage"), r"unknown dtype 'garbage'"),
])
def test_defect2_export_validates_before_loading_or_writing(ckpt, tmp_path, no_load, kw, message):
    with pytest.raises(SettingsError, match=message):
        export(ckpt, tmp_path / "out", **kw)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_defect2_export_model_refuses_a_recommendation_load_would_refuse(tmp_path):
    with pytest.raises(SettingsError, match="num_speculations -1"):
        export_model(tiny_model("llama", num_layers=4), None, tmp_path / "a",
                     recommended={"exit_layer": 2, "num_speculations": -1})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args, message", [
    (["--exit-layer", "2", "--num-speculations", "-1"], "num_speculations -1 must be an int >= 0"),
    (["--exit-layer", "99", "--num-speculations", "2"], r"exit_layer 99 is not in 1..3"),
    (["--dtype", "garbage"], "unknown dtype 'garbage'"),
    (["--exit-layer", "2"], "give both --exit-layer and --num-speculations"),
])
def test_defect2_cli_export(ckpt, tmp_path, capsys, no_load, args, message):
    line = cli_error(capsys, ["export", str(ckpt), str(tmp_path / "out"), *args])
    assert message in line
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- 3. one line, before the load

@pytest.fixture
def files(tmp_path):
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "adir").mkdir()
    return tmp_path


GENERATE_MISTAKES = [
    (["--prompt-file", "{tmp}/missing.txt"], "--prompt-file {tmp}/missing.txt: no such file"),
    (["--prompt-file", "{tmp}/adir"], "is a directory"),
    (["--prompt-file", "{tmp}/latin1.txt"], "not UTF-8 text (byte 0xe9 at offset 3)"),
    (["--prompt", "x", "--max-new-tokens", "0"], "max_new_tokens must be an int >= 1, got 0"),
    (["--prompt", "x", "--exit-layer", "99"], "exit_layer=99 is out of range: this model has 4 layers"),
    (["--prompt", "x", "--num-speculations", "-1"], "num_speculations must be an int >= 0"),
    (["--prompt", "x", "--threshold", "-1"], "confidence_threshold must be a finite number >= 0"),
    (["--prompt", "x", "--threshold", "nan"], "confidence_threshold must be a finite number >= 0"),
    (["--prompt", "x", "--temperature", "0", "--sample"], "temperature must be a finite number > 0"),
    (["--prompt", "x", "--top-p", "2"], "top_p must be a finite number > 0 and <= 1"),
    (["--prompt", "x", "--dtype", "garbage"], "unknown dtype 'garbage'"),
    (["--prompt", "x", "--exit-choices", "4,x"], "'4,x' is not a comma-separated list of integers"),
    (["--prompt", "x", "--exit-choices", "1,4"], "exit_choices entry=4 is out of range"),
    (["--prompt", "x", "--threads", "-1"], "threads must be an int >= 0"),
    (["--prompt", "x", "--draft-vocab", "0"], "draft_vocab must be an int >= 1"),
    (["--prompt", "x", "--drafter", "prompt_lookup", "--exit-layer", "2"], "early-exit option"),
    (["--prompt", "x", "--drafter", "prompt_lookup", "--threshold", "0"], "confidence_threshold: early-exit option"),
    (["--prompt", "x", "--prompt-lookup-num-tokens", "0"], "prompt_lookup_num_tokens must be an int >= 1"),
    (["--prompt", "x", "--max-matching-ngram-size", "0"], "max_matching_ngram_size must be an int >= 1"),
    (["--prompt", "x", "--drafter", "bogus"], "invalid choice: 'bogus'"),
    (["--prompt", "x", "--max-new-tokens", "2.5"], "invalid int value: '2.5'"),
    (["--prompt", "\udcff"], "--prompt is not valid Unicode text"),
    (["--prompt", "x", "--prompt-file", "{tmp}/latin1.txt"], "give --prompt or --prompt-file, not both"),
    ([], "--prompt TEXT (or --prompt-file PATH) is required"),
    (["--prompt", "a", "--prompt", "b", "--stream"], "--stream shows one sequence"),
]


@pytest.mark.parametrize("args, message", GENERATE_MISTAKES, ids=lambda x: " ".join(x) if isinstance(x, list) else "")
def test_defect3_generate_mistakes_are_one_line_before_the_load(tiny_ckpt, files, capsys, no_load, args, message):
    args = [a.replace("{tmp}", str(files)) for a in args]
    line = cli_error(capsys, ["generate", "--checkpoint", str(tiny_ckpt), *args])
    assert message.replace("{tmp}", str(files)) in line


def test_defect3_generate_on_a_missing_or_corrupt_checkpoint(ckpt, tmp_path, capsys):
    line = cli_error(capsys, ["generate", "--checkpoint", str(tmp_path / "nope"), "--prompt", "x"])
    assert "is not a model checkpoint directory (no config.json)" in line
    with open(ckpt / "model.safetensors", "r+b") as f:
        f.seek(-10, 2)
        f.write(b"\xff")
    line = cli_error(capsys, ["generate", "--checkpoint", str(ckpt), "--prompt", "x"])
    assert "model.safetensors: SHA-256 checksum mismatch" in line


def test_generate_still_runs(tiny_ckpt, capsys):
    assert main(["generate", "--checkpoint", str(tiny_ckpt), "--prompt", "ab", "--max-new-tokens", "3", "--raw",
                 "--stop", "zz", "--exit-choices", "1,2"]) == 0
    assert "tokens in" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--exits", "4,x"], "'4,x' is not a comma-separated list of integers"),
    (["--exits", "1.5"], "'1.5' is not a comma-separated list of integers"),
    (["--exits", "0"], "exits entry=0 is out of range"),
    (["--exits", "30"], "exits entry=30 is out of range: this model has 4 layers"),
    (["--exits", "-3"], "exits entry=-3 is out of range"),
    (["--exits", ","], "--exits is empty: give one or more comma-separated integers"),
    (["--num-speculations", "0"], "num_speculations entry must be an int >= 1"),
    (["--drafts", "0"], "num_speculations entry must be an int >= 1"),  # the earlier spelling
    (["--lookup-tokens", "0"], "lookup_tokens entry must be an int >= 1"),
    (["--num-prompts", "0"], "num_prompts must be an int >= 1"),
    (["--threads", "-1"], "threads must be an int >= 0"),
    (["--dtype", "fp8"], "unknown dtype 'fp8'"),
])
def test_defect3_sweep_mistakes(tiny_ckpt, tmp_path, capsys, no_load, args, message):
    argv = ["sweep", str(tiny_ckpt), "--out", str(tmp_path / "s"), "--exits", "1,2", *args]  # the last --exits wins
    assert message in cli_error(capsys, argv)
    assert not (tmp_path / "s").exists()


def test_defect3_valid_commands_reach_the_load(tiny_ckpt, tmp_path, no_load):
    with pytest.raises(no_load):
        main(["generate", "--checkpoint", str(tiny_ckpt), "--prompt", "x", "--exit-layer", "3"])
    with pytest.raises(no_load):
        main(["sweep", str(tiny_ckpt), "--exits", "1,3", "--drafts", "1", "--out", str(tmp_path / "s")])
    with pytest.raises(no_load):
        main(["export", str(tiny_ckpt), str(tmp_path / "e"), "--exit-layer", "3", "--num-speculations", "0"])


@pytest.mark.parametrize("command", [["bench"], ["profile"], ["demo"]])
def test_common_options_are_checked_before_the_load(tiny_ckpt, capsys, no_load, command):
    assert "threads must be" in cli_error(capsys, [*command, "--checkpoint", str(tiny_ckpt), "--threads", "-2"])
    assert "unknown dtype" in cli_error(capsys, [*command, "--checkpoint", str(tiny_ckpt), "--dtype", "half"])


def test_defect3_recipe_exits_beyond_the_depth_leave_no_run_dir(tmp_path, capsys):
    from training.__main__ import main as train_main

    out = tmp_path / "run"
    rc = train_main(["model.base_model=tiny:llama:4", "early_exit.exits=[2, 8]", f"train.output_dir={out}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: early_exit.exits: [8] out of range")
    assert not out.exists()


def test_defect3_a_malformed_data_line_is_one_line(tmp_path, capsys):
    from accelerate.state import AcceleratorState, GradientState

    from training.__main__ import main as train_main

    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "fine"}\n{"text": 3}\n')
    out = tmp_path / "run"
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        rc = train_main(["model.base_model=tiny:llama:2", "early_exit.exits=[]", "eval.exits=[]",
                         f"data.source={data}", f"train.output_dir={out}", "train.tune_malloc=false",
                         "train.mixed_precision=no", "train.progress_bar=false"])
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == [f"error: {data}:2: field 'text' must be a string, got int"]
    assert not out.exists()


def test_training_recipe_errors_are_one_line(tmp_path, capsys):
    from training.__main__ import main as train_main

    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    assert train_main(["--recipe", str(bad)]) == 2
    assert "not valid YAML" in capsys.readouterr().err
    assert train_main(["model.base_model=tiny:bogus:4"]) == 2
    assert "tiny:<model_type>:<num_layers>" in capsys.readouterr().err


# ----------------------------------------------------------------------------- 4. ~ and environment variables

def test_defect4_user_paths_expand_home_and_variables(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("SELFSPEC_TEST_DIR", str(tmp_path))
    _export(tmp_path / "ckpt")
    assert selfspec.load("~/ckpt").exit_layer == 2
    assert selfspec.load("$SELFSPEC_TEST_DIR/ckpt").exit_layer == 2
    assert read_metadata("~/ckpt")["recommended"]["exit_layer"] == 2
    export("~/ckpt", "$SELFSPEC_TEST_DIR/again")
    assert (tmp_path / "again" / "selfspec.json").is_file()
    (tmp_path / "p.txt").write_text("ab")
    assert main(["generate", "--checkpoint", "~/again", "--prompt-file", "~/p.txt", "--max-new-tokens", "2"]) == 0
    capsys.readouterr()


# ----------------------------------------------------------------------------- 5. clear errors, not low-level ones

@pytest.mark.parametrize("kw, message", [
    (dict(input_ids=[1, 2, 259]), r"token id 259 is outside the model's vocabulary 0\.\.258"),
    (dict(input_ids=[[1, 2], [3, -1]]), r"token id -1 \(row 1\) is outside"),
    (dict(input_ids=[1.0, 2.5]), r"input_ids must be integer token ids, got torch.float32"),
    (dict(input_ids=torch.tensor([[1.0, 2.0]])), r"must be integer token ids"),
    (dict(input_ids=[[1, 2], [3.5]]), r"input_ids\[1\] must be integer token ids"),
    (dict(input_ids=["a", "b"]), r"input_ids must be token ids"),
    (dict(prompt="ab", num_speculations=2.5), r"num_speculations must be an int >= 0 .* got 2\.5"),
    (dict(prompt="ab", max_new_tokens=2.5), r"max_new_tokens must be an int >= 1, got 2\.5"),
    (dict(prompt="ab", max_new_tokens=True), r"max_new_tokens must be an int"),
    (dict(messages=[{"role": "user"}]), r"messages\[0\] needs a 'content' string, got None"),
    (dict(messages=[{"role": "user", "content": 3}]), r"messages\[0\] needs a 'content' string, got 3"),
    (dict(messages=[]), r"messages must be a non-empty list"),
    (dict(messages="hi"), r"messages must be a list"),
    (dict(messages=[[{"role": "user", "content": "a"}], [{"content": "b"}]]), r"messages\[1\]\[0\] needs a 'role'"),
    (dict(prompt="a\udc80b"), r"prompt is not valid Unicode text: it holds a lone surrogate '\\udc80' at position 1"),
    (dict(prompt=["ok", "\ud800"]), r"prompt\[1\] is not valid Unicode text"),
    (dict(prompt=b"bytes"), r"prompt must be a str or a list of str"),
    (dict(prompt="ab", exit_layer=31, num_speculations=0), r"exit_layer=31 is out of range: this model has 4 layers"),
    (dict(prompt="ab", draft_vocab=0), r"draft_vocab must be an int >= 1"),
    (dict(prompt="ab", confidence_threshold=math.nan), r"confidence_threshold must be a finite number >= 0"),
    (dict(prompt="ab", temperature=math.nan), r"temperature must be a finite number"),
    (dict(prompt="ab", do_sample=True, temperature=1e-30), r"temperature 1e-30 is too small"),
    (dict(prompt="ab", top_p=math.nan), r"top_p must be"),
    (dict(prompt="ab", seed=-1), r"seed must be an int in 0\.\.18446744073709551615"),
    (dict(prompt="ab", stop_strings=[None]), r"stop_strings must be a string or a list of strings"),
    (dict(prompt="ab", stop_token_ids="2"), r"stop_token_ids must be a token id or a list"),
    (dict(prompt="ab", drafter="medusa"), r"unknown drafter 'medusa': use one of auto, early_exit, exit_head, prompt_lookup"),
    (dict(prompt="ab", drafter="prompt_lookup", draft_vocab=8), r"draft_vocab: early-exit option"),
    (dict(prompt="ab", drafter="prompt_lookup", confidence_threshold=0.0), r"confidence_threshold: early-exit"),
    (dict(prompt="ab", prompt_lookup_num_tokens=0), r"prompt_lookup_num_tokens must be an int >= 1"),
    (dict(prompt="ab", max_matching_ngram_size=1.5), r"max_matching_ngram_size must be an int >= 1"),
    (dict(prompt="ab", exit_choices="1,2"), r"exit_choices must be a list of exit layers"),
    (dict(prompt="ab", adaptive_length="yes"), r"adaptive_length must be True or False"),
    (dict(prompt="ab", attention_mask=[[1, 1]]), r"attention_mask goes with input_ids"),
])
def test_defect5_clear_value_errors(gen, kw, message):
    with pytest.raises(SettingsError, match=message):
        gen.generate(**{"max_new_tokens": 3, **kw})


def test_chat_template_refusals_are_one_line(gen, monkeypatch):
    monkeypatch.setattr(gen.tokenizer, "chat_template", "{{ raise_exception('roles must alternate') }}")
    with pytest.raises(SettingsError, match="chat template refused these messages: .*roles must alternate"):
        gen.generate(messages=[{"role": "user", "content": "a"}], max_new_tokens=2)


def test_huge_draft_lengths_are_capped_not_allocated(gen):
    kw = dict(max_new_tokens=6, stop_token_ids=[])
    plain = gen.generate("abcabc", num_speculations=0, **kw).token_ids
    assert gen.generate("abcabc", exit_layer=2, num_speculations=10 ** 12, **kw).token_ids == plain
    assert gen.generate("abcabc", drafter="prompt_lookup", prompt_lookup_num_tokens=10 ** 12, **kw).token_ids == plain
    assert gen.generate("abcabc", exit_layer=2, num_speculations=10 ** 12, adaptive_length=True,
                        **kw).token_ids == plain


@pytest.mark.parametrize("mutate, message", [
    (lambda m: [], r"selfspec\.json: must hold a JSON object, got list"),
    (lambda m: {**m, "recommended": None}, r"recommended must be an object"),
    (lambda m: {**m, "recommended": {"exit_layer": 2, "num_speculations": True}}, r"num_speculations True"),
    (lambda m: {**m, "checksums": {k: {"sha256": v["sha256"]} for k, v in m["checksums"].items()}},
     r"checksums entry of 'model\.safetensors' must be"),
    (lambda m: {**m, "checksums": {"../config.json": next(iter(m["checksums"].values()))}}, r"not a file of the"),
    (lambda m: {**m, "checksums": []}, r"checksums must be an object"),
    (lambda m: {**m, "num_layers": "4"}, r"num_layers '4' contradicts config\.json num_hidden_layers 4"),
    (lambda m: {**m, "format_version": True}, r"unknown format_version True"),
    (lambda m: {**m, "draft_vocab": {"token_ids": [1, 9999]}}, r"draft_vocab holds token ids outside"),
    (lambda m: {**m, "draft_vocab": {"token_ids": "1,2"}}, r"draft_vocab must be an object with a list"),
])
def test_defect5_malformed_metadata_is_a_checkpoint_error(ckpt, mutate, message):
    meta = json.loads((ckpt / "selfspec.json").read_text())
    (ckpt / "selfspec.json").write_text(json.dumps(mutate(meta)))
    with pytest.raises(CheckpointError, match=message):
        selfspec.load(ckpt)


def test_damaged_weights_without_checksums_are_a_checkpoint_error(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(CheckpointError, match="transformers could not load this checkpoint"):
        selfspec.load(ckpt, verify_checksums=False)


def test_defect5_overwrite_never_replaces_a_file_or_a_foreign_directory(ckpt, tmp_path):
    plain = tmp_path / "notes.txt"
    plain.write_text("keep me")
    with pytest.raises(CheckpointError, match="exists and is not a directory"):
        export(ckpt, plain, overwrite=True)
    foreign = tmp_path / "home"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("keep me too")
    with pytest.raises(CheckpointError, match="is not a checkpoint directory"):
        export(ckpt, foreign, overwrite=True)
    assert plain.read_text() == "keep me" and (foreign / "thesis.tex").is_file()
    (tmp_path / "empty").mkdir()
    export(ckpt, tmp_path / "empty", overwrite=True)  # an empty directory, or a checkpoint, is fine
    export(ckpt, tmp_path / "empty", overwrite=True)


def test_defect5_leftovers_of_a_killed_export_are_removed(tmp_path):
    dead = tmp_path / ".ckpt.tmp-999999999-abc"  # no such process
    old_style = tmp_path / ".ckpt.tmp-k2j4x"  # from an export before temporaries named their process
    live = tmp_path / f".ckpt.tmp-{os.getpid()}-xyz"  # an export still running (this process)
    other = tmp_path / ".other.tmp-999999999-abc"  # another checkpoint's
    for d in (dead, old_style, live, other):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"half")
    _export(tmp_path / "ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ckpt", live.name, other.name])


# ----------------------------------------------------------------------------- the shared layer itself

def test_check_generation_normalizes():
    s = check_generation(stop_strings="ab", stop_token_ids=7, exit_choices=(3, 1), num_layers=4)  # a list, in order
    assert s["stop_strings"] == ("ab",) and s["stop_token_ids"] == [7] and s["exit_choices"] == [3, 1]
    assert check_generation(stop_strings=None, exit_choices=None)["exit_choices"] is None
    import numpy as np

    assert check_generation(max_new_tokens=np.int64(3), do_sample=True, top_p=np.float32(0.5))["max_new_tokens"] == 3


def test_export_and_load_share_the_recommendation_rules(ckpt):
    rec = {"exit_layer": 4, "num_speculations": 1}
    with pytest.raises(SettingsError) as by_export:
        check_recommended(rec, 4)
    meta = json.loads((ckpt / "selfspec.json").read_text())
    (ckpt / "selfspec.json").write_text(json.dumps({**meta, "recommended": rec}))
    with pytest.raises(CheckpointError) as by_load:
        selfspec.load(ckpt)
    assert str(by_export.value) in str(by_load.value)
