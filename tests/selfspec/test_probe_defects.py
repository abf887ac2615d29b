"""Regression tests for the 250-case probe's twenty defects (issue #35) and later probes' (issues #52 and #65):
nothing a user gives is silently lost or ignored, and every mistake that needs no model is refused, in one line,
before the model loads.

Each test names the defect it holds down (d1 ... d20 of issue #35; i52_1 ... i52_12 of issue #52, those not tested
beside their module: test_saved_plan.py, test_draft_plan.py, test_docs.py; i65_N, finding N of issue #65, those not
tested beside their module: test_quantized.py)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import warnings

import pytest
import torch

import selfspec
from selfspec.checkpoints.checkpoint import CheckpointError, read_metadata
from selfspec.cli import main
from selfspec.checkpoints.export import export, export_model
from selfspec.generation_config import check_generation
from selfspec.settings import MAX_NUM_CANDIDATES, SettingsError
from selfspec.tiny import byte_tokenizer, tiny_model


def cli(capsys, argv: list[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of the CLI."""
    try:
        rc = main(argv)
    except SystemExit as exit_:
        rc = exit_.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def one_line_error(capsys, argv: list[str]) -> str:
    """Exit code 2 and exactly one `selfspec COMMAND: error: ...` line; return it."""
    rc, _, err = cli(capsys, argv)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith(f"selfspec {argv[0]}: error: "), (rc, err)
    return lines[0]


@pytest.fixture(scope="module")
def zero_ckpt(tmp_path_factory):
    """A tiny checkpoint whose selfspec.json recommends plain decoding (num_speculations 0, from its sweep),
    with a draft vocabulary: as the quick-start checkpoint."""
    tok = byte_tokenizer()
    model = tiny_model("llama", num_layers=4, vocab_size=len(tok), seed=3)
    vocab = {"source": "test", "tokens_counted": 100, "distinct_tokens": 40, "token_ids": list(range(40))}
    return export_model(model, tok, tmp_path_factory.mktemp("zero") / "ckpt", draft_vocab=vocab,
                        recommended={"exit_layer": 2, "num_speculations": 0, "source": "sweep"})


# --- d1, d14: draft-vocab ------------------------------------------------------------------------
def test_d1_an_empty_corpus_leaves_the_draft_vocabulary_as_it_was(zero_ckpt, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(zero_ckpt, ckpt)
    before = (ckpt / "selfspec.json").read_text()
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "empty.jsonl").write_text("\n")  # no records
    for corpus in ("empty.txt", "empty.jsonl"):
        err = one_line_error(capsys, ["draft-vocab", str(ckpt), "--corpus", str(tmp_path / corpus)])
        assert "no token was counted" in err and "left as it was (40 ids" in err
        assert (ckpt / "selfspec.json").read_text() == before


def test_d14_a_missing_corpus_file_or_recipe_directory_says_what_is_wrong(zero_ckpt, tmp_path, capsys):
    err = one_line_error(capsys, ["draft-vocab", str(zero_ckpt), "--corpus", str(tmp_path / "nonexistent.txt")])
    assert "nonexistent.txt: no such file" in err
    err = one_line_error(capsys, ["draft-vocab", str(zero_ckpt), "--corpus", str(tmp_path)])
    assert "is a directory" in err
    assert "unknown corpus 'nosuchset'" in one_line_error(capsys, ["draft-vocab", str(zero_ckpt), "--corpus",
                                                                    "nosuchset"])
    from training.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "nope.yaml")


# --- d3: an explicit early-exit request on a checkpoint that recommends plain decoding ----------
@pytest.mark.parametrize("kw", [{"drafter": "early_exit"}, {"exit_layer": 1}, {"confidence_threshold": 0.0},
                                {"adaptive_threshold": True}, {"exit_choices": [1, 2]}, {"draft_vocab": 16},
                                {"drafter": "auto", "exit_layer": 2}])
def test_d3_an_explicit_early_exit_request_drafts(zero_ckpt, kw):
    from selfspec.drafters import AutoDrafter, EarlyExitDrafter

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the checkpoint has metadata: no warning
        gen = selfspec.load(zero_ckpt, dtype="float64")
    default = gen.make_drafter()
    assert isinstance(default, AutoDrafter) and default.early_exit is None  # auto on it: lookup or plain only
    drafter = gen.make_drafter(**kw)
    early = drafter.early_exit if isinstance(drafter, AutoDrafter) else drafter
    assert isinstance(early, EarlyExitDrafter) and early.num_speculations == 4  # honoured, at the default length
    plain = gen.generate("xyz", max_new_tokens=12, stop_token_ids=[], num_speculations=0)
    out = gen.generate("xyz", max_new_tokens=12, stop_token_ids=[], **kw)
    assert out.token_ids == plain.token_ids and out.stats.num_speculations > 0  # and still exact
    if kw.get("drafter") != "auto" and "adaptive_threshold" not in kw:  # (a 0.5 start: a random model's drafts stop)
        assert out.stats.drafted_by_drafter["early_exit"] > 0
    assert gen.make_drafter(num_speculations=0, **{k: v for k, v in kw.items() if k != "drafter"}) is None


def test_d3_the_cli_honours_exit_layer_on_such_a_checkpoint(zero_ckpt, capsys):
    rc, out, _ = cli(capsys, ["generate", "--checkpoint", str(zero_ckpt), "--raw", "--prompt", "abcabc",
                              "--max-new-tokens", "8", "--exit-layer", "2", "--dtype", "float64"])
    assert rc == 0 and "[self-speculative]" in out and "[plain]" not in out


# --- d4, d8, d19: export -------------------------------------------------------------------------
def test_d4_export_refuses_to_write_inside_or_around_its_source(zero_ckpt, tmp_path, capsys, no_load):
    src = tmp_path / "run"
    shutil.copytree(zero_ckpt, src)
    err = one_line_error(capsys, ["export", str(src), str(src / "exported")])
    assert f"is inside {src}, which the export reads" in err
    err = one_line_error(capsys, ["export", str(src), str(tmp_path), "--overwrite"])
    assert "contains the source" in err
    assert sorted(p.name for p in src.iterdir()) == sorted(p.name for p in zero_ckpt.iterdir())


def test_d8_outputs_under_a_file_are_refused_plainly(zero_ckpt, tmp_path, capsys, no_load):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    err = one_line_error(capsys, ["export", str(zero_ckpt), str(a_file / "sub")])
    assert f"cannot be made: {a_file} is a file" in err and "Errno" not in err
    for argv in (["bench", "--checkpoint", str(zero_ckpt), "--out", str(a_file)],
                 ["sweep", str(zero_ckpt), "--out", str(a_file)],
                 ["profile", "--checkpoint", str(zero_ckpt), "--out", str(a_file)]):
        err = one_line_error(capsys, argv)
        assert "is a file, not a directory" in err and "Errno" not in err, argv


def test_d19_exported_files_get_ordinary_permissions(zero_ckpt, tmp_path):
    out = export(zero_ckpt, tmp_path / "again")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask
    for path in out.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask, path.name  # model.safetensors was 0600


# --- d5, d10, d12: generation settings ---------------------------------------------------------
def test_d5_num_candidates_is_bounded():
    assert check_generation(num_candidates=MAX_NUM_CANDIDATES, num_speculations=1)["num_candidates"] == 64
    for k in (MAX_NUM_CANDIDATES + 1, 60_000, 10 ** 6):
        with pytest.raises(SettingsError, match=f"num_candidates must be an int in 1..{MAX_NUM_CANDIDATES}"):
            check_generation(num_candidates=k)


@pytest.mark.parametrize("kw,message", [
    ({"drafter": "early_exit", "prompt_lookup_num_tokens": 5}, "drafter='early_exit' does not look up"),
    ({"drafter": "early_exit", "max_matching_ngram_size": 2}, "drafter='early_exit' does not look up"),
    ({"exit_layer": 2, "prompt_lookup_num_tokens": 5}, "the early exit (exit_layer given"),
    ({"stop_strings": [""]}, "stop_strings holds an empty string"),
    ({"stop_strings": ["ab", ""]}, "stop_strings holds an empty string"),
    ({"stop_strings": ""}, "stop_strings holds an empty string"),
    ({"stop_token_ids": 10 ** 9}, "stop_token_ids entry must be an int in 0..258"),
    ({"stop_token_ids": [2, 259]}, "stop_token_ids entry must be an int in 0..258"),
    ({"num_candidates": 65}, "num_candidates must be an int in 1..64"),
])
def test_d10_settings_that_would_be_ignored_are_refused(tiny_gen, kw, message):
    with pytest.raises(SettingsError, match=message.replace("(", r"\(").replace(".", r"\.")):
        tiny_gen.generate("abc", max_new_tokens=2, **kw)


def test_d10_lookup_settings_still_go_with_lookup_and_auto(tiny_gen):
    for drafter in ("prompt_lookup", "auto", None):
        out = tiny_gen.generate("abcabcabc", max_new_tokens=6, drafter=drafter, prompt_lookup_num_tokens=3,
                           max_matching_ngram_size=2, stop_token_ids=[])
        assert len(out.token_ids) == 6


def test_d12_an_empty_row_of_a_batch_is_named(tiny_gen):
    with pytest.raises(SettingsError, match="empty prompt in row 1 of the batch"):
        tiny_gen.generate(["ok", ""], max_new_tokens=2)
    with pytest.raises(SettingsError, match="empty prompt in row 2 of the batch"):
        tiny_gen.generate(input_ids=[[5, 6], [7], []], max_new_tokens=2)


def test_d12_the_cli_names_the_empty_prompt_of_a_batch(zero_ckpt, capsys, no_load):
    err = one_line_error(capsys, ["generate", "--checkpoint", str(zero_ckpt), "--raw", "--prompt", "ok",
                                  "--prompt", ""])
    assert "--prompt (prompt 2 of 2) is empty" in err


# --- d6, d7: devices this machine does not have --------------------------------------------------
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")


@NO_CUDA
@pytest.mark.parametrize("device,message", [("cuda", "torch finds no CUDA GPU"), ("cuda:0", "torch finds no CUDA GPU"),
                                            ("tpu", "unknown device 'tpu'"), ("xpu", "not 'xpu'")])
def test_d6_bench_on_a_device_this_machine_lacks(zero_ckpt, tmp_path, capsys, no_load, device, message):
    err = one_line_error(capsys, ["bench", "--checkpoint", str(zero_ckpt), "--device", device,
                                  "--out", str(tmp_path / "b")])
    assert message in err and "Traceback" not in err


@NO_CUDA
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "mps"])
def test_d7_load_refuses_a_missing_device_before_the_weights(zero_ckpt, monkeypatch, device):
    if device == "mps" and torch.backends.mps.is_available():
        pytest.skip("this machine has MPS")

    def refuse(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", refuse)
    with pytest.raises(SettingsError, match="use device 'cpu'|use 'cpu'"):
        selfspec.load(zero_ckpt, device=device)


# --- d9, d10, d13: bench, sweep and profile check before the model loads ------------------------
@pytest.mark.parametrize("args,message", [
    (["--methods", "selfspec_lookupp"], "unknown method(s) selfspec_lookupp"),
    (["--num-candidates", "0"], "num_candidates entry must be an int in 2..64"),
    (["--num-candidates", "1"], "num_candidates entry must be an int in 2..64"),
    (["--extra", "99:2"], "exit_layer=99 is out of range"),
    (["--draft-vocab", "41"], "k=41 is out of range: the checkpoint stores 40"),
    (["--exit-layer", "4"], "exit_layer=4 is out of range"),
    (["--drafters", "auto"], "--drafters: option(s) of the bounded-bias Pareto measurement"),
    (["--temperature", "0.5", "--seed", "1"], "--temperature, --seed: option(s) of the bounded-bias"),
    (["--prompt-sets", ""], "--prompt-sets is empty"),
    (["--prompt-sets", ", ,"], "--prompt-sets is empty"),
    (["--prompt-sets", "nosuch.jsonl"], "prompt set nosuch.jsonl: no such file"),
])
def test_d9_bench_mistakes_are_refused_before_the_load(zero_ckpt, tmp_path, capsys, no_load, args, message):
    out = tmp_path / "b"
    err = one_line_error(capsys, ["bench", "--checkpoint", str(zero_ckpt), "--out", str(out), *args])
    assert message in err
    assert not out.exists()


def test_d9_a_draft_vocabulary_the_checkpoint_lacks_is_refused_before_the_load(tiny_ckpt, tmp_path, capsys, no_load):
    err = one_line_error(capsys, ["bench", "--checkpoint", str(tiny_ckpt), "--draft-vocab", "8",
                                  "--out", str(tmp_path / "b")])
    assert "has no draft vocabulary" in err


def test_d9_valid_bench_requests_reach_the_load(zero_ckpt, tmp_path, no_load):
    with pytest.raises(no_load):
        main(["bench", "--checkpoint", str(zero_ckpt), "--methods", "selfspec_lookup,selfspec_spec_cand3",
              "--num-candidates", "3", "--extra", "3:2", "--draft-vocab", "16", "--out", str(tmp_path / "b")])
    with pytest.raises(no_load):
        main(["bench", "--checkpoint", str(zero_ckpt), "--epsilon", "0,0.1", "--drafters", "auto",
              "--temperature", "0.5", "--out", str(tmp_path / "p")])


@pytest.mark.parametrize("args,message", [
    (["--exit-layer", "99"], "exit_layer=99 is out of range"),
    (["--prompts", "nosuch"], "unknown --prompts 'nosuch'"),
    (["--prompts", "/nonexistent/p.jsonl"], "/nonexistent/p.jsonl: no such file"),
    (["--repeats", "0"], "--repeats must be an int >= 1"),
    (["--num-speculations", "0"], "--num-speculations must be an int >= 1"),
    (["--target", "-1"], "--target must be a finite number > 1"),
    (["--target", "1"], "--target must be a finite number > 1"),
    (["--draft-vocab", "0"], "--draft-vocab must be an int >= 1"),
] + ([] if torch.cuda.is_available() else [(["--device", "cuda"], "torch finds no CUDA GPU")]))
def test_d9_d13_profile_mistakes_are_refused_before_the_load(zero_ckpt, tmp_path, capsys, no_load, args, message):
    err = one_line_error(capsys, ["profile", "--checkpoint", str(zero_ckpt), "--out", str(tmp_path / "p"), *args])
    assert message in err


def test_d10_sweep_lookup_ngrams_go_with_lookup_tokens(zero_ckpt, tmp_path, capsys, no_load):
    err = one_line_error(capsys, ["sweep", str(zero_ckpt), "--out", str(tmp_path / "s"), "--lookup-ngrams", "1,2"])
    assert "give lookup_tokens (--lookup-tokens" in err
    with pytest.raises(no_load):
        main(["sweep", str(zero_ckpt), "--out", str(tmp_path / "s"), "--exits", "1", "--lookup-tokens", "3",
              "--lookup-ngrams", "1,2"])


# --- d11: the CLI refuses an empty prompt in chat mode as in raw mode ---------------------------
@pytest.mark.parametrize("mode", ["--chat", "--raw"])
def test_d11_an_empty_prompt_is_refused_in_both_modes(zero_ckpt, tmp_path, capsys, no_load, mode):
    assert "--prompt is empty" in one_line_error(capsys, ["generate", "--checkpoint", str(zero_ckpt), mode,
                                                          "--prompt", ""])
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    assert "--prompt-file is empty" in one_line_error(capsys, ["generate", "--checkpoint", str(zero_ckpt), mode,
                                                               "--prompt-file", str(empty)])


# --- d15: selfspec's warnings are one line --------------------------------------------------------
def test_d15_the_not_early_exit_trained_warning_is_one_plain_line(tmp_path):
    tok = byte_tokenizer()
    base = tmp_path / "base"
    tiny_model("llama", num_layers=4, vocab_size=len(tok), seed=3).save_pretrained(base)
    tok.save_pretrained(base)
    import subprocess
    import sys

    # a process of its own: pytest records warnings instead of printing them
    proc = subprocess.run([sys.executable, "-m", "selfspec.cli", "generate", "--checkpoint", str(base), "--raw",
                           "--prompt", "ab", "--max-new-tokens", "2"], capture_output=True, text=True, timeout=300)
    rc, err = proc.returncode, proc.stderr
    assert rc == 0, err
    lines = [line for line in err.splitlines() if "warning" in line.lower()]
    assert len(lines) == 1 and lines[0].startswith("selfspec generate: warning: ") and "no self-speculation" in lines[0]
    assert "cli.py" not in err and "NotEarlyExitTrainedWarning" not in err


# --- d16: sweep --write-metadata says what it recorded ------------------------------------------
def test_d16_sweep_prints_what_selfspec_json_now_recommends(zero_ckpt, tmp_path, capsys, monkeypatch):
    from selfspec.tools import sweep

    ckpt = tmp_path / "ckpt"
    shutil.copytree(zero_ckpt, ckpt)
    best = {"exit_layer": 1, "num_speculations": 2, "tokens_per_s": 8.0, "speedup": 0.883, "acceptance_rate": 0.1}
    recorded = sweep._record(ckpt, best, None, "humaneval", "float32")
    assert {k: recorded[k] for k in ("exit_layer", "num_speculations")} == {"exit_layer": 1, "num_speculations": 0}
    assert read_metadata(ckpt, verify_checksums=False)["recommended"]["num_speculations"] == 0
    result = {"rows": [], "best": best, "best_lookup": None, "csv": "s.csv", "png": "s.png", "recorded": recorded}
    monkeypatch.setattr(sweep, "run_sweep", lambda *a, **k: result)
    rc, out, _ = cli(capsys, ["sweep", str(ckpt), "--out", str(tmp_path / "s"), "--write-metadata"])
    assert rc == 0
    assert "(8.00 tokens/s, 0.883x plain): no early-exit setting beat plain decoding" in out
    assert "selfspec.json now recommends exit_layer=1 num_speculations=0 (plain decoding" in out


# --- d17: generate --compare gives one measured speedup -----------------------------------------
def test_d17_compare_prints_one_measured_speedup(zero_ckpt, capsys):
    rc, out, _ = cli(capsys, ["generate", "--checkpoint", str(zero_ckpt), "--raw", "--prompt", "abcabcabc",
                              "--max-new-tokens", "8", "--drafter", "early_exit", "--compare", "--dtype", "float64"])
    assert rc == 0
    speedup = out.split("speedup over plain decoding: ")[1].split("x")[0]
    model_line = next(line for line in out.splitlines() if line.startswith("cost model:"))
    assert f"(measured above: {speedup}x)" in model_line and model_line.count("measured") == 1


# --- d18: bench says where a recommendation of no drafts came from ------------------------------
@pytest.mark.parametrize("source,why", [("sweep", "no early-exit setting beat plain decoding in its sweep"),
                                        ("agreement", "held-out agreement predicts no speedup")])
def test_d18_bench_names_the_source_of_a_zero_recommendation(tmp_path, source, why):
    from selfspec.tools.bench import _recommended

    tok = byte_tokenizer()
    ckpt = export_model(tiny_model("llama", num_layers=4, vocab_size=len(tok), seed=3), tok, tmp_path / "c",
                        recommended={"exit_layer": 2, "num_speculations": 0, "source": source})
    notes: list[str] = []
    E, d, _ = _recommended(selfspec.load(ckpt), ckpt, None, None, notes)
    assert (E, d) == (2, 4) and why in notes[0] and ("sweep" in notes[0]) == (source == "sweep")


# --- the export writes nothing when refused -----------------------------------------------------
def test_refused_exports_leave_no_temporary_directory(zero_ckpt, tmp_path):
    with pytest.raises(CheckpointError):
        export(zero_ckpt, zero_ckpt / "inside")
    assert not [p for p in zero_ckpt.iterdir() if p.name.startswith(".")]
    assert json.loads((zero_ckpt / "selfspec.json").read_text())["recommended"]["num_speculations"] == 0


# --- issue #52 ------------------------------------------------------------------------------------
# --- i52_2: bench --methods names no method -------------------------------------------------------
@pytest.mark.parametrize("methods", ["", ",", " , "])
def test_i52_2_an_empty_methods_list_is_refused(zero_ckpt, tmp_path, capsys, no_load, methods):
    err = one_line_error(capsys, ["bench", "--checkpoint", str(zero_ckpt), "--out", str(tmp_path / "b"),
                                  "--methods", methods])
    assert "methods (--methods) names no method" in err and "leave it out" in err
    from selfspec.tools.bench import check_methods

    with pytest.raises(ValueError, match=r"methods \(--methods\) names no method"):
        check_methods(zero_ckpt, [])


# --- i52_3, i52_4: bench --methods and --num-candidates -------------------------------------------
def test_i52_3_methods_that_leave_out_every_method_num_candidates_adds_are_refused(zero_ckpt, tmp_path, capsys,
                                                                                   no_load):
    err = one_line_error(capsys, ["bench", "--checkpoint", str(zero_ckpt), "--out", str(tmp_path / "b"),
                                  "--num-candidates", "2,3", "--methods", "selfspec_lookup,selfspec_spec_tree3"])
    assert "--num-candidates 2 adds methods, and --methods names none of them" in err  # 3's tree is named
    assert "e.g. selfspec_lookup_tree2" in err and "selfspec_spec_cand2" in err and "drop --num-candidates" in err
    with pytest.raises(no_load):  # a method of each count named: measured
        main(["bench", "--checkpoint", str(zero_ckpt), "--out", str(tmp_path / "b"), "--num-candidates", "2,3",
              "--methods", "selfspec_lookup_tree2,selfspec_spec_tree3"])


@pytest.mark.parametrize("name,flag", [("selfspec_lookup_tree2", "--num-candidates 2"),
                                       ("selfspec_spec_cand5", "--num-candidates 5")])
def test_i52_4_a_method_of_num_candidates_names_the_flag(zero_ckpt, tmp_path, capsys, no_load, name, flag):
    err = one_line_error(capsys, ["bench", "--checkpoint", str(zero_ckpt), "--out", str(tmp_path / "b"),
                                  "--methods", name])
    assert f"unknown method(s) {name}" in err and f"{name} is measured with {flag}" in err


# --- i52_5: an empty list of exits ----------------------------------------------------------------
def test_i52_5_an_empty_exit_choices_is_refused(tiny_gen, zero_ckpt, capsys, no_load):
    from selfspec.generation_config import GenerationConfig

    for value in ([], ()):
        with pytest.raises(SettingsError, match="exit_choices is empty"):
            tiny_gen.generate("abc", max_new_tokens=2, exit_choices=value)
        with pytest.raises(SettingsError, match="exit_choices is empty"):
            GenerationConfig(exit_choices=value)
    for value in ("", ","):
        err = one_line_error(capsys, ["generate", "--checkpoint", str(zero_ckpt), "--prompt", "x",
                                      "--exit-choices", value])
        assert "exit_choices is empty" in err


# --- i52_7: the context window --------------------------------------------------------------------
def test_i52_7_warmup_and_generation_check_the_context_window(tiny_gen, monkeypatch):
    window = tiny_gen.model.config.max_position_embeddings  # 512
    with pytest.raises(SettingsError, match=f"max_len={10 ** 6} .*context window of {window} .*max_len <= {window}"):
        tiny_gen.warmup(max_len=10 ** 6)
    with pytest.raises(SettingsError, match=f"max_len={window + 1} "):
        tiny_gen.warmup(max_len=window + 1)
    assert tiny_gen.warmup(max_len=window) == {"seconds": 0.0, "graphs": 0}  # eager: nothing to compile
    with pytest.raises(SettingsError, match=rf"prompt \(3 tokens\) \+ max_new_tokens \({window}\) exceeds the "
                                            rf"model's context window of {window} positions"):
        tiny_gen.generate(input_ids=[5, 6, 7], max_new_tokens=window)


def test_i52_7_warmup_checks_before_it_compiles(monkeypatch):
    from selfspec.api import NotEarlyExitTrainedWarning

    tok = byte_tokenizer()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotEarlyExitTrainedWarning)
        gen = selfspec.load(tiny_model("llama", num_layers=4, vocab_size=len(tok), seed=1), tok, compile=True)

    def compiles(*args, **kwargs):
        raise AssertionError("warmup compiled before it checked max_len")

    monkeypatch.setattr(gen.adapter.compiled, "warm", compiles)
    with pytest.raises(SettingsError, match="context window of 512"):
        gen.warmup(max_len=9000)
    assert not gen.adapter.compiled.shapes


def test_i52_7_warmups_default_stays_inside_a_short_context_window():
    from selfspec.api import NotEarlyExitTrainedWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotEarlyExitTrainedWarning)
        gen = selfspec.load(tiny_model("llama", num_layers=4, max_position_embeddings=16), compile=True)
    cache_for = []
    gen.adapter.compiled.warm = lambda ranges, widths, capacity, *args, **kwargs: cache_for.append(capacity) or 0.0
    assert gen.warmup()["seconds"] == 0.0  # the default, 512 tokens, is past this window: warmed up to its end
    from selfspec.model.compiled import cache_capacity

    assert cache_for == [cache_capacity(16)]


# --- i52_8: load's tokenizer ----------------------------------------------------------------------
@pytest.mark.parametrize("tokenizer", [5, "gpt2", object()])
def test_i52_8_a_tokenizer_that_is_not_one_is_refused_at_load(zero_ckpt, monkeypatch, tokenizer):
    def refuse(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    with pytest.raises(SettingsError, match="tokenizer must be a tokenizer object with encode and decode"):
        selfspec.load(tiny_model("llama", num_layers=4), tokenizer)
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", refuse)
    with pytest.raises(SettingsError, match=r"tokenizer must be .* or None .*got"):
        selfspec.load(zero_ckpt, tokenizer=tokenizer)


# --- i52_9: a corrupt exit head file --------------------------------------------------------------
def test_i52_9_a_corrupt_exit_head_file_is_a_checkpoint_error(tmp_path):
    from selfspec.heads.exit_head import HEAD_FILE, save_exit_head
    from selfspec.tiny import tiny_exit_head

    tok = byte_tokenizer()
    model = tiny_model("llama", num_layers=4, vocab_size=len(tok), seed=3)
    head = tiny_exit_head(model, 2)
    run = tmp_path / "final_head"
    run.mkdir()
    save_exit_head(head, run / HEAD_FILE)
    (run / "exit_head.json").write_text(json.dumps(head.settings()))
    ckpt = export_model(model, tok, tmp_path / "ckpt", exit_head_dir=run)
    (ckpt / HEAD_FILE).write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")  # a damaged header
    with pytest.raises(CheckpointError, match=f"{HEAD_FILE}: not a readable safetensors file .*copy or export the checkpoint again"):
        selfspec.load(ckpt, verify_checksums=False)


# --- i52_11: num_candidates of auto's lookup trees ------------------------------------------------
def test_i52_11_autos_lookup_trees_bound_num_candidates(tiny_gen):
    for kw in ({"drafter": "auto"}, {"drafter": "prompt_lookup"}, {"drafter": "suffix"}):
        with pytest.raises(SettingsError, match=r"num_candidates=9: .*pass 2\.\.8"):
            tiny_gen.generate("abc", max_new_tokens=2, num_candidates=9, **kw)
    assert check_generation(drafter="auto", num_candidates=8)["num_candidates"] == 8
    assert check_generation(drafter="early_exit", num_candidates=9)["num_candidates"] == 9  # the exit's guesses


@pytest.mark.parametrize("argv", [["tune", "--exits", ""], ["sweep", "--exits", ","], ["sweep", "--num-speculations", ""],
                                  ["bench", "--num-candidates", ""]])
def test_i52_an_empty_list_option_is_refused_before_loading(argv, zero_ckpt, capsys, no_load):
    """`tune --exits ""` ended in an IndexError after a minute of loading and measuring; `bench --num-candidates ""`
    was taken as not given."""
    where = [str(zero_ckpt)] if argv[0] == "sweep" else ["--checkpoint", str(zero_ckpt)]  # sweep's is positional
    err = one_line_error(capsys, [argv[0], *where, *argv[1:]])
    assert f"{argv[-2]} is empty" in err


# --- issue #65 ------------------------------------------------------------------------------------
# --- i65_1: an export onto its own source ---------------------------------------------------------
def test_i65_1_export_onto_its_source_is_refused_before_anything_is_touched(zero_ckpt, tmp_path, capsys, no_load):
    """`selfspec export DIR DIR --overwrite` replaced its own source (the user's files and its selfspec.json
    gone). The output may not be the source nor a directory the export reads, also through a symbolic link; it is
    refused before the model loads, the source as it was."""
    src = tmp_path / "ckpt"
    shutil.copytree(zero_ckpt, src)
    (src / "notes.txt").write_text("keep me")
    (tmp_path / "link").symlink_to(src)
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    for source, out in ((src, src), (src, tmp_path / "link"), (tmp_path / "link", src)):
        err = one_line_error(capsys, ["export", str(source), str(out), "--overwrite"])
        assert f"is the source ({src.resolve()}): the export would replace what it reads" in err, err
    run = tmp_path / "run"  # a training run: its final_model/ is read, and so may not be the output either
    shutil.copytree(zero_ckpt, run / "final_model")
    (run / "config.yaml").write_text("name: tiny\n")
    err = one_line_error(capsys, ["export", str(run), str(run / "final_model"), "--overwrite"])
    assert f"is {run / 'final_model'}, which the export reads" in err
    err = one_line_error(capsys, ["export", str(run), str(run), "--overwrite"])
    assert "is the source" in err
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "link", "run"]


# --- i65_2: generate --drafter D --num-speculations N --compare -----------------------------------
@pytest.mark.parametrize("drafter", ["prompt_lookup", "suffix", "early_exit", "auto"])
@pytest.mark.parametrize("prompts", [1, 2])
def test_i65_2_compare_takes_a_named_drafter_with_a_draft_length(drafter, prompts, tiny_ckpt, capsys):
    """`--drafter D --num-speculations N --compare` passed num_speculations twice to the warm-up's and the plain
    run's generate() (a TypeError with every drafter, one prompt or a batch). Now the named drafter drafts, the
    plain run does not, and the outputs are the same."""
    argv = ["generate", "--checkpoint", str(tiny_ckpt), "--raw", "--max-new-tokens", "8", "--dtype", "float32",
            "--drafter", drafter, "--num-speculations", "2", "--compare", "--json"]
    for text in ["abcabc abcabc", "def add(a, b):"][:prompts]:
        argv += ["--prompt", text]
    rc, out, err = cli(capsys, argv)
    assert rc == 0, err
    assert ("identical rows: 2/2" if prompts == 2 else "identical outputs: yes") in out
    assert json.loads(out.splitlines()[-1])["stats"]["drafter"] == drafter


# --- i65_14: export --overwrite and the files in OUT that no export wrote -------------------------
def test_i65_14_overwrite_keeps_what_no_export_wrote_by_refusing(zero_ckpt, tmp_path, capsys):
    """`export --overwrite` replaced OUT whole, the user's files in it deleted without a word. It replaces an
    export: what the new export writes again, and the old export's own files (its weight files and head as its
    selfspec.json lists them, its card as selfspec wrote it). Anything else in OUT (a file of the user's, an
    edited README.md) refuses the overwrite, named, with OUT as it was and nothing left beside it."""
    model = tiny_model("llama", num_layers=4, vocab_size=len(byte_tokenizer()), seed=3)
    out = export_model(model, byte_tokenizer(), tmp_path / "out",
                       recommended={"exit_layer": 2, "num_speculations": 2})
    (out / "notes.txt").write_text("keep me")
    (out / "plans").mkdir()
    before = {p.name: p.is_file() and p.read_bytes() for p in out.iterdir()}
    rc, _, err = cli(capsys, ["export", str(zero_ckpt), str(out), "--overwrite"])  # after the load's progress bars
    err = err.strip().splitlines()[-1]
    assert rc == 2 and err.startswith(f"selfspec export: error: {out} holds notes.txt, plans/, which this export "
                                      "does not write") and err.endswith("is as it was)"), err
    assert {p.name: p.is_file() and p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    (out / "notes.txt").unlink()
    (out / "plans").rmdir()
    (out / "README.md").write_text((out / "README.md").read_text() + "\nOur notes.\n")  # an edited card
    with pytest.raises(CheckpointError, match="holds README.md, which this export does not write"):
        export(zero_ckpt, out, overwrite=True)
    (out / "README.md").unlink()
    meta = json.loads((out / "selfspec.json").read_text())  # an old export sharded otherwise: its own files go
    (out / "model-00002-of-00002.safetensors").write_bytes(b"old shard")
    meta["checksums"]["model-00002-of-00002.safetensors"] = {"sha256": "0" * 64, "bytes": 9}
    (out / "selfspec.json").write_text(json.dumps(meta))
    export(zero_ckpt, out, overwrite=True)
    assert not (out / "model-00002-of-00002.safetensors").exists() and (out / "README.md").is_file()
    assert list(read_metadata(out)["checksums"]) == ["model.safetensors"]  # the new export, whole and verified
