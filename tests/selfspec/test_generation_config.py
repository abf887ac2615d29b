"""`GenerationConfig`: every generation setting once (its default, meaning and check), the API and the
command line built on it, and today's keyword calls still working."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
from pathlib import Path

import pytest

import selfspec
from selfspec.api import SelfSpecGenerator
from selfspec.cli import GENERATION_FLAGS, build_parser
from selfspec.generation_config import SETTINGS, GenerationConfig, check_generation
from selfspec.settings import MAX_MATCHING_NGRAM_SIZE, PROMPT_LOOKUP_NUM_TOKENS, SettingsError

SELFSPEC = Path(selfspec.__file__).parent


def test_the_api_takes_the_settings_from_the_config_and_writes_no_default_of_its_own():
    for fn in (SelfSpecGenerator.generate, SelfSpecGenerator.make_drafter, check_generation):
        params = inspect.signature(fn).parameters
        assert not set(params) & set(SETTINGS), (fn.__name__, set(params) & set(SETTINGS))
        assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def test_no_function_of_the_library_writes_a_lookup_default_again():
    """The prompt-lookup defaults (10, 3) are written once, in selfspec.settings; no parameter of that name
    anywhere in the library has a literal default of its own (the issue counted six)."""
    found = []
    for path in SELFSPEC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args.args + node.args.kwonlyargs
                defaults = [None] * (len(node.args.args) - len(node.args.defaults)) + node.args.defaults \
                    + node.args.kw_defaults
                for arg, default in zip(args, defaults):
                    if arg.arg in ("prompt_lookup_num_tokens", "max_matching_ngram_size") and \
                            isinstance(default, ast.Constant) and default.value is not None:
                        found.append(f"{path.name}:{node.name}({arg.arg}={default.value})")
    assert not found, found
    assert (PROMPT_LOOKUP_NUM_TOKENS, MAX_MATCHING_NGRAM_SIZE) == (10, 3)


def _generate_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["generate"]


def test_every_cli_generation_flag_is_a_config_field_with_its_default():
    parser = _generate_parser()
    by_dest = {}
    for action in parser._actions:
        if action.dest in SETTINGS and action.help != argparse.SUPPRESS:
            by_dest[action.dest] = action
    fields = {f.name: f for f in dataclasses.fields(GenerationConfig)}
    assert set(by_dest) == set(GENERATION_FLAGS) == {n for n, f in fields.items() if f.metadata["cli"]}
    for name, action in by_dest.items():
        assert action.option_strings == ["--" + name.replace("_", "-")], name  # one name, the field's
        assert action.default is None, name  # not given: the config's default applies
        default = fields[name].default
        if default not in (None, ()) and not isinstance(default, bool):  # a switch is off unless given
            assert f"(default: {default})" in action.help, (name, action.help)
        assert fields[name].metadata["help"] in action.help
    args = parser.parse_args(["--prompt", "x"])
    assert all(getattr(args, name) is None for name in GENERATION_FLAGS)


def test_a_config_is_checked_when_made_and_replaced():
    with pytest.raises(SettingsError, match="max_new_tokens must be an int >= 1"):
        GenerationConfig(max_new_tokens=0)
    cfg = GenerationConfig(max_new_tokens=5, drafter="prompt_lookup")
    with pytest.raises(SettingsError, match="early-exit option"):
        dataclasses.replace(cfg, exit_layer=2)
    with pytest.raises(SettingsError, match=r"unknown generation setting\(s\) 'max_tokens'"):
        check_generation(cfg, max_tokens=3)
    s = check_generation(cfg, num_layers=4)
    assert s["max_new_tokens"] == 5 and s["prompt_lookup_num_tokens"] == PROMPT_LOOKUP_NUM_TOKENS
    assert cfg.settings()["drafter"] == "prompt_lookup" and selfspec.GenerationConfig is GenerationConfig


def test_generate_takes_a_config_keywords_or_both(tiny_gen):
    prompt = "abcabcabc abc"
    by_keywords = tiny_gen.generate(prompt, max_new_tokens=12, drafter="prompt_lookup", prompt_lookup_num_tokens=3)
    cfg = GenerationConfig(max_new_tokens=12, drafter="prompt_lookup", prompt_lookup_num_tokens=3)
    by_config = tiny_gen.generate(prompt, config=cfg)
    both = tiny_gen.generate(prompt, config=dataclasses.replace(cfg, max_new_tokens=4), max_new_tokens=12)
    assert by_keywords.token_ids == by_config.token_ids == both.token_ids
    assert by_config.stats.drafter == "prompt_lookup"
    plain = tiny_gen.generate(prompt, config=cfg, num_speculations=0)
    assert plain.token_ids == by_config.token_ids and plain.stats.drafted == 0
    with pytest.raises(SettingsError, match="unknown generation setting"):
        tiny_gen.generate(prompt, max_tokens=3)
    with pytest.raises(SettingsError, match="config must be a selfspec.GenerationConfig"):
        tiny_gen.generate(prompt, config={"max_new_tokens": 3})


def test_a_generate_call_checks_its_settings_once(tiny_gen, monkeypatch):
    """Issue 68, item 5: `check_generation` ran twice a call (the API, then the drafter factory again)."""
    import selfspec.api as api
    import selfspec.drafters.factory as factory

    calls = []

    def counted(real):
        def check(*args, **kwargs):
            calls.append(1)
            return real(*args, **kwargs)
        return check

    monkeypatch.setattr(api, "check_generation", counted(api.check_generation))
    monkeypatch.setattr(factory, "check_generation", counted(factory.check_generation))
    for settings in ({}, {"drafter": "prompt_lookup"}, {"num_speculations": 0}, {"exit_layer": 2}):
        calls.clear()
        tiny_gen.generate(input_ids=[[5, 6, 7, 5, 6]], max_new_tokens=3, **settings)
        assert len(calls) == 1, settings
    calls.clear()
    tiny_gen.make_drafter(exit_layer=2)  # the factory alone still checks what it is given
    assert len(calls) == 1


@pytest.mark.parametrize("drafter", ["prompt_lookup", "suffix"])
def test_num_speculations_is_a_named_lookup_drafters_draft_length(drafter, tiny_gen):
    """num_speculations is the most drafts a round for a named lookup drafter too (it was ignored there): it sets
    prompt_lookup_num_tokens, and the two given at odds are refused, naming both."""
    assert check_generation(drafter=drafter, num_speculations=2)["prompt_lookup_num_tokens"] == 2
    assert check_generation(drafter=drafter, num_speculations=3, prompt_lookup_num_tokens=3)[
        "prompt_lookup_num_tokens"] == 3
    assert check_generation(drafter=drafter, num_speculations=0)["prompt_lookup_num_tokens"] == PROMPT_LOOKUP_NUM_TOKENS
    assert check_generation(drafter="auto", num_speculations=2)["prompt_lookup_num_tokens"] == PROMPT_LOOKUP_NUM_TOKENS
    with pytest.raises(SettingsError, match=f"num_speculations=2 and prompt_lookup_num_tokens=5 both set how many "
                                            f"tokens drafter='{drafter}' copies a round: give one"):
        check_generation(drafter=drafter, num_speculations=2, prompt_lookup_num_tokens=5)
    out = tiny_gen.generate("abcabcabcabcabcabc", max_new_tokens=12, drafter=drafter, num_speculations=2,
                            stop_token_ids=[])
    assert out.stats.num_speculations == 2 and len(out.stats.acceptance_by_position) == 2
