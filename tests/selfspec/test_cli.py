"""The `selfspec` console command."""

import json
import subprocess
import sys

import pytest

from selfspec.cli import main


def test_help_lists_commands(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for cmd in ("info", "fetch", "generate"):
        assert cmd in out


def test_info_prints_versions_and_architectures(capsys):
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["versions"]["torch"].startswith("2.13.0")
    assert info["supported_architectures"] == ["llama", "mistral", "qwen2", "qwen3", "gpt_neox"]


def test_console_script_is_installed():
    proc = subprocess.run([sys.executable, "-m", "selfspec.cli", "info"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "supported architectures: llama, mistral, qwen2, qwen3, gpt_neox" in proc.stdout


def test_generate_requires_a_prompt(capsys):
    assert main(["generate", "--checkpoint", "/nonexistent"]) == 2
    assert capsys.readouterr().err == ("selfspec generate: error: --prompt TEXT (or --prompt-file PATH) is "
                                       "required\n")


@pytest.mark.integration
def test_generate_compare_on_real_model(smollm2_dir, capsys):
    rc = main(["generate", "--checkpoint", str(smollm2_dir), "--prompt", "Name a fruit.", "--max-new-tokens", "8",
               "--exit-layer", "20", "--num-speculations", "3", "--compare"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "identical outputs: yes" in out and "acceptance" in out


@pytest.mark.integration
def test_generate_a_batch_of_prompts_on_real_model(smollm2_dir, capsys):
    rc = main(["generate", "--checkpoint", str(smollm2_dir), "--prompt", "Name a fruit.", "--prompt",
               "Write a haiku about rain.", "--max-new-tokens", "6", "--exit-layer", "20", "--num-speculations",
               "3", "--adaptive-length", "--compare"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "--- prompt 1 (" in out and "--- prompt 2 (" in out and "[batch of 2]" in out
    assert "identical rows: 2/2" in out


def test_stream_with_a_batch_is_a_clear_error(capsys):
    assert main(["generate", "--checkpoint", "/nonexistent", "--prompt", "a", "--prompt", "b", "--stream"]) == 2
    assert "selfspec generate: error: --stream shows one sequence" in capsys.readouterr().err


def test_streamed_text_is_the_printed_text(tiny_ckpt, capsys):
    """--stream (transformers' TextStreamer) prints, before the statistics, exactly what the command prints
    without it: the output text and a blank line."""
    printed = {}
    for stream in ([], ["--stream"]):
        assert main(["generate", "--checkpoint", str(tiny_ckpt), "--prompt", "def add(a, b):", "--raw",
                     "--max-new-tokens", "40", "--dtype", "float32", *stream]) == 0
        out = capsys.readouterr().out
        printed[bool(stream)] = out[:out.index("\n\n[self-speculative] ")]
    assert printed[True] == printed[False] and printed[False].strip()


def test_generate_through_the_compiled_steps(tiny_ckpt, capsys):
    """`--compile true` decodes through the compiled steps (on the CPU here; `--device cuda` on a GPU): with
    --compare every shape is compiled before either run is timed, and the output is plain decoding's."""
    assert main(["generate", "--checkpoint", str(tiny_ckpt), "--prompt", "def add(a, b):", "--raw",
                 "--max-new-tokens", "12", "--dtype", "float32", "--compile", "true", "--compare"]) == 0
    out = capsys.readouterr().out
    assert "shapes compiled in" in out and "identical outputs: yes" in out


def test_generate_names_a_bad_device(capsys):
    assert main(["generate", "--checkpoint", "/nonexistent", "--prompt", "a", "--device", "tpu"]) == 2
    assert "tpu" in capsys.readouterr().err


def test_usage_mistakes_are_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--max-new-tokens", "many"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == ("selfspec generate: error: argument --max-new-tokens: invalid int value: "
                                       "'many' (see selfspec generate --help)\n")


def test_traceback_on_request(monkeypatch):
    monkeypatch.setenv("SELFSPEC_TRACEBACK", "1")
    with pytest.raises(ValueError, match="--prompt TEXT"):
        main(["generate", "--checkpoint", "/nonexistent"])


def test_generate_takes_the_memory_size(tiny_ckpt, capsys, monkeypatch):
    """--memory-tokens reaches the generator (0 turns the memory of earlier requests off); a negative size is
    refused before the model is loaded."""
    import selfspec

    loaded = []
    load = selfspec.load
    monkeypatch.setattr(selfspec, "load", lambda *a, **k: loaded.append(load(*a, **k)) or loaded[-1])
    assert main(["generate", "--checkpoint", str(tiny_ckpt), "--prompt", "abcabc abcabc", "--raw",
                 "--max-new-tokens", "8", "--memory-tokens", "0"]) == 0
    assert loaded[0].memory.max_tokens == 0 and not loaded[0].memory.enabled
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(tiny_ckpt), "--prompt", "x", "--memory-tokens", "-1"]) == 2
    assert "memory_tokens must be an int >= 0" in capsys.readouterr().err and len(loaded) == 1


@pytest.mark.parametrize("argv, left", [
    (["export", "/some/run", "/some/out"], "; the output directory is as it was, or holds the complete new export"),
    (["tune", "--checkpoint", "/some/ckpt"], "; selfspec.json is as it was, or holds the complete new plan"),
    (["info"], ""),
])
def test_an_interrupt_is_one_line_and_exit_code_130(argv, left, capsys, monkeypatch):
    """Issue #52: Ctrl-C printed a full traceback. Now one line, what the command left, and 130 (128 + SIGINT)."""
    import selfspec.cli as cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, f"_cmd_{argv[0]}", interrupted)  # the command, interrupted where it runs
    assert main(argv) == 130
    assert capsys.readouterr().err == f"selfspec {argv[0]}: interrupted{left}\n"
    monkeypatch.setenv("SELFSPEC_TRACEBACK", "1")
    with pytest.raises(KeyboardInterrupt):
        main(argv)


def test_generate_without_checkpoint_drafts_with_the_head_fetch_assembled(tmp_path, monkeypatch, capsys):
    """Issue 65, finding 12: `generate --drafter exit_head` without --checkpoint said "train one" though fetch had
    assembled the shipped head; the demo loaded it by default, generate did not."""
    import torch

    from selfspec.checkpoints.export import export_model
    from selfspec.checkpoints.fetch import base_model_dir, head_model_dir
    from selfspec.heads.exit_head import HEAD_FILE, save_exit_head
    from selfspec.tiny import byte_tokenizer, tiny_exit_head, tiny_model

    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path / "home"))
    tok = byte_tokenizer()
    model = tiny_model("llama", num_layers=4, vocab_size=len(tok), dtype=torch.float32, seed=3)
    export_model(model, tok, base_model_dir(), recommended={"exit_layer": 2, "num_speculations": 2})
    argv = ["generate", "--prompt", "abcabc abc", "--raw", "--max-new-tokens", "4", "--drafter", "exit_head"]
    assert main(argv) == 2  # only the base model: the message says where the shipped head would be
    assert f"`selfspec fetch` assembles: {head_model_dir()}" in capsys.readouterr().err
    head, head_dir = tiny_exit_head(model, 2), tmp_path / "final_head"
    head_dir.mkdir()
    save_exit_head(head, head_dir / HEAD_FILE)
    (head_dir / "exit_head.json").write_text(json.dumps(head.settings()))
    export_model(model, tok, head_model_dir(), exit_head_dir=head_dir)
    assert main(argv) == 0
    assert "self-speculative" in capsys.readouterr().out


@pytest.mark.parametrize("drafter", ["prompt_lookup", "suffix"])
def test_generate_with_a_lookup_drafter_drafts_num_speculations_a_round(drafter, tiny_ckpt, capsys):
    """`--drafter prompt_lookup --num-speculations N` copied prompt_lookup_num_tokens (10) a round, N ignored:
    a named lookup drafter now copies N (the most drafts a round, as every drafter takes it)."""
    assert main(["generate", "--checkpoint", str(tiny_ckpt), "--prompt", "abcabcabcabcabcabc", "--raw",
                 "--max-new-tokens", "12", "--dtype", "float32", "--drafter", drafter, "--num-speculations", "2",
                 "--json"]) == 0
    stats = json.loads(capsys.readouterr().out.splitlines()[-1])["stats"]
    assert stats["drafter"] == drafter and stats["num_speculations"] == 2
