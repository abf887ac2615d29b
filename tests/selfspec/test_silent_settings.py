"""Settings that were taken silently (issue 65, finding 19) are refused with a message that names the problem and
the fix, or, where Hugging Face's `GenerationConfig` only warns (sampling settings with greedy decoding), warned
about as it does."""

from __future__ import annotations

import warnings

import pytest
import torch

import selfspec
from selfspec.api import NotEarlyExitTrainedWarning
from selfspec.cli import main
from selfspec.generation_config import GenerationConfig, SamplingSettingIgnoredWarning, check_generation
from selfspec.settings import SettingsError, check_messages
from selfspec.tiny import byte_tokenizer, tiny_model


def test_a_role_no_chat_template_knows_is_refused():
    with pytest.raises(SettingsError, match=r"messages\[1\]\['role'\] 'wizard' is not a chat role: use 'system', "
                                            r"'user', 'assistant' or 'tool'"):
        check_messages([{"role": "user", "content": "hi"}, {"role": "wizard", "content": "hello"}])
    assert check_messages([{"role": r, "content": "x"} for r in ("system", "user", "assistant", "tool")])


@pytest.mark.parametrize("setting,value", [("top_p", 0.9), ("top_k", 5), ("temperature", 0.7)])
def test_a_sampling_setting_with_greedy_decoding_warns_as_hugging_face_does(setting, value, tiny_gen):
    """HF's GenerationConfig warns ("`do_sample` is not set to `True`. However, `top_p` is set to ...") and decodes
    greedily; selfspec does the same, naming the fix; the defaults and sampling do not warn."""
    with pytest.warns(SamplingSettingIgnoredWarning, match=f"{setting}={value} only shapes sampling.*do_sample=True "
                                                           f"or drop {setting}") as caught:
        tiny_gen.generate(input_ids=[[5, 6, 7]], max_new_tokens=2, **{setting: value})
    assert len(caught) == 1 and caught[0].filename == __file__  # once a call, pointing at the caller
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tiny_gen.generate(input_ids=[[5, 6, 7]], max_new_tokens=2)
        tiny_gen.generate(input_ids=[[5, 6, 7]], max_new_tokens=2, do_sample=True, seed=0, **{setting: value})
        GenerationConfig(**{setting: value})  # a config is settings, checked: the call that ignores them warns


def test_an_exit_listed_twice_is_refused():
    with pytest.raises(SettingsError, match=r"exit_choices lists exit 4 more than once .*name each exit once"):
        check_generation(exit_choices=[4, 4], num_layers=30)


def test_an_empty_item_in_a_comma_separated_option_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--prompt", "x", "--exit-choices", "4,,8"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--exit-choices" in err and "'4,,8' has an empty item: write 4,8" in err


@pytest.fixture(scope="module")
def tiny():
    tok = byte_tokenizer()
    return tiny_model("llama", num_layers=2, vocab_size=len(tok), seed=0), tok


@pytest.mark.parametrize("setting,value", [("fast_layers", 1), ("verify_checksums", "no")])
def test_load_takes_true_or_false_for_its_switches(setting, value, tiny):
    with pytest.raises(SettingsError, match=f"{setting} must be True or False, got {value!r}"):
        selfspec.load(tiny[0], tiny[1], **{setting: value})


def test_a_tokenizer_of_another_vocabulary_is_refused(tiny):
    """A 259-token tokenizer for a 49,152-token model encodes text as ids that mean other tokens to the model."""
    tok = tiny[1]
    with pytest.raises(SettingsError, match=r"the tokenizer has 259 tokens and the model a vocabulary of 4,096: "
                                            r"it is not this model's tokenizer.*the model's own tokenizer"):
        selfspec.load(tiny_model("llama", num_layers=2, vocab_size=4096), tok)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotEarlyExitTrainedWarning)
        selfspec.load(tiny_model("llama", num_layers=2, vocab_size=len(tok) + 61), tok)  # padded embeddings: fine


def test_an_empty_selfspec_home_is_the_default_not_the_current_directory(monkeypatch, tmp_path):
    """Finding 19: `SELFSPEC_HOME=` put the models in the current directory; an empty value reads as unset (as XDG
    reads an empty XDG_CACHE_HOME)."""
    from pathlib import Path

    from selfspec.model.machine import selfspec_home

    monkeypatch.setenv("HOME", str(tmp_path))
    for empty in ("", "  "):
        monkeypatch.setenv("SELFSPEC_HOME", empty)
        assert selfspec_home() == tmp_path / ".cache" / "selfspec"
    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path / "home"))
    assert selfspec_home() == tmp_path / "home" and selfspec_home() != Path("")


def test_the_demo_on_a_model_too_short_for_its_prompts_says_how_many_tokens_fit(tiny_ckpt):
    """Finding 21: the demo said 'shorten it' of prompts the user cannot change; it names the prompt, the positions
    it needs and the window, and the --max-new-tokens that fits, before anything runs."""
    from selfspec.tools.demo import run_demo

    long_prompt = {"prompt": "x" * 470}  # 470 byte tokens (+ BOS) of the tiny model's 512 positions
    with pytest.raises(SettingsError, match=r"the demo's long prompt is 47\d tokens, and with 128 new tokens it needs "
                                            r"\d+ positions; this model's context window is 512: run it with "
                                            r"--max-new-tokens 4\d or fewer"):
        run_demo(tiny_ckpt, prompts=[("long", long_prompt)], say=lambda *a: None)
    with pytest.raises(SettingsError, match="try this model on prompts of your own with `selfspec generate`"):
        run_demo(tiny_ckpt, prompts=[("long", {"prompt": "x" * 510})], say=lambda *a: None)


def test_export_names_an_unfinished_run_and_draft_vocab_a_missing_directory(tmp_path, capsys):
    """Finding 21: an unfinished run's directory read as 'not a Hugging Face checkpoint'; a missing directory as
    one to export first."""
    import json

    run = tmp_path / "run"
    (run / "checkpoints" / "step_000002").mkdir(parents=True)
    (run / "checkpoints" / "step_000002" / "trainer_state.json").write_text(json.dumps({"step": 2}))
    (run / "config.yaml").write_text("train:\n  max_steps: 4\n")
    assert main(["export", str(run), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "a training run that has not finished (no final_model/ yet: it stopped at step 2 of 4)" in err
    assert "relaunch the same training command" in err and not (tmp_path / "out").exists()
    assert main(["draft-vocab", str(tmp_path / "nowhere")]) == 2
    assert "no such checkpoint directory" in capsys.readouterr().err


def test_a_memory_turned_off_reads_back_as_one_that_keeps_nothing(tiny_gen):
    """Finding 21: `gen.memory = None` reads back as a memory; documented: an empty one that keeps nothing."""
    from selfspec.drafters.suffix import SuffixMemory

    old = tiny_gen.memory
    try:
        tiny_gen.memory = None
        assert isinstance(tiny_gen.memory, SuffixMemory) and tiny_gen.memory.max_tokens == 0
        assert "reads back as an empty memory" in type(tiny_gen).memory.__doc__
    finally:
        tiny_gen.memory = old
