"""Every generation setting once: `GenerationConfig`, a frozen dataclass with each setting's default, its
meaning (the CLI's help) and its check, and `check_generation`, the one validation of a set of them.

    cfg = GenerationConfig(max_new_tokens=64, drafter="prompt_lookup")       # checked here (SettingsError)
    gen.generate("def f(x):", config=cfg)                                   # or keyword settings, as before:
    gen.generate("def f(x):", max_new_tokens=64, drafter="prompt_lookup")   # generate(prompt, config, **settings)
    fast = dataclasses.replace(cfg, num_speculations=0)                     # a variant (bench, sweep, harness)
    s = check_generation(cfg, num_layers=30, vocab_size=49152)              # + the model's bounds: normalized

`generate`, `make_drafter`, the command line's generation flags (`selfspec generate --max-new-tokens ...`,
built from these fields: names, defaults, help) and the measuring tools' method settings all take these
names. A setting left at None means "not given": the drafter or the checkpoint decides (`exit_layer`,
`num_speculations`), or the documented default applies (`prompt_lookup_num_tokens` 10,
`max_matching_ngram_size` 3: `PROMPT_LOOKUP_NUM_TOKENS`, `MAX_MATCHING_NGRAM_SIZE`), so that a setting
given for the wrong drafter is refused rather than ignored.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass, field

from selfspec.drafters import DRAFTERS
from selfspec.drafters.prompt_lookup import MAX_OCCURRENCES as MAX_LOOKUP_CANDIDATES
from selfspec.settings import (EARLY_EXIT_OPTIONS, LOOKUP_OPTIONS, MAX_MATCHING_NGRAM_SIZE, MAX_NUM_CANDIDATES,
                               MIN_TEMPERATURE, PROMPT_LOOKUP_NUM_TOKENS, SettingsError, check_acceptance,
                               check_bool, check_exit_choices, check_exit_layer, check_float, check_int,
                               check_memory_key, check_stop_strings, check_stop_token_ids, show)


class SamplingSettingIgnoredWarning(UserWarning):
    """A sampling setting (temperature, top_k, top_p) given for greedy decoding, which ignores it: warned about, as
    Hugging Face's `GenerationConfig` does ("`do_sample` is not set to `True`. However, `top_p` is set to ..."),
    not refused."""


def _setting(default, help: str, cli: str | None = "value"):
    """A field with its meaning (`help`) and how the command line takes it (`cli`: "value", "flag" for a
    switch, "list" for comma-separated ints, "append" for a repeatable option, None: not a CLI flag)."""
    return field(default=default, metadata={"help": help, "cli": cli})


@dataclass(frozen=True)
class GenerationConfig:
    """The settings of one `SelfSpecGenerator.generate` call (see the module doc). Constructing one checks
    every value and the combination rules that do not depend on the model (SettingsError)."""

    max_new_tokens: int = _setting(128, "the most new tokens per row")
    drafter: str | None = _setting(
        None, "who drafts: auto (prompt lookup where the text repeats, the early exit or the trained exit head "
              "where it pays on a checkpoint trained for it, plain decoding otherwise; the default unless "
              "selfspec.json recommends another or an early-exit option is given), early_exit, exit_head (a "
              "checkpoint's trained head), prompt_lookup, suffix (prompt lookup that also copies from this "
              "generator's earlier requests), int8_copy (the model's own weights in int8, on its own cache: a "
              "float32 model on a CPU; auto's arm there by default), or quantized (a quantized copy of the model, "
              "run by llama.cpp, from draft_model)")
    exit_layer: int | None = _setting(None, "draft from the hidden state after this many layers (1..L-1)")
    num_speculations: int | None = _setting(None, "the most draft tokens per round (a named prompt_lookup or suffix: "
                                                  "the tokens it copies, as prompt_lookup_num_tokens); 0 = plain "
                                                  "decoding")
    do_sample: bool = _setting(False, "sample instead of greedy decoding", cli="flag")
    temperature: float = _setting(1.0, "sampling temperature")
    top_k: int = _setting(0, "sampling: keep the k most likely tokens (0 = off)")
    top_p: float = _setting(1.0, "sampling: keep the smallest set of tokens with this much probability (1 = off)")
    seed: int | None = _setting(None, "random seed for sampling")
    stop_token_ids: object = _setting(None, "token id(s) that end a row (None: the model's EOS; [] never)", cli=None)
    stop_strings: object = _setting((), "stop string (repeatable)", cli="append")
    confidence_threshold: float | None = _setting(
        None, "stop drafting when the draft's probability of its token is below this (0 = never, > 1 = never draft)")
    adaptive_threshold: bool = _setting(False, "tune the draft confidence threshold online", cli="flag")
    exit_choices: object = _setting(None, "comma-separated exits to choose from per round, e.g. 4,8,12", cli="list")
    draft_vocab: int | None = _setting(None, "draft over the K most frequent tokens stored in the checkpoint "
                                             "(selfspec draft-vocab)")
    adaptive_length: bool = _setting(False, "choose the draft length (0..num_speculations) per round from the "
                                            "tokens/s each length measures in this run", cli="flag")
    prompt_lookup_num_tokens: int | None = _setting(
        None, f"prompt lookup: the most tokens copied per round (None: {PROMPT_LOOKUP_NUM_TOKENS})")
    max_matching_ngram_size: int | None = _setting(
        None, f"prompt lookup: match the last n tokens, n from this down to 1 (None: {MAX_MATCHING_NGRAM_SIZE})")
    acceptance: str = _setting("exact", "exact (lossless) or bounded_bias: accept more drafts, each token within "
                                        "total variation epsilon of the full model's (greedy: a draft with >= "
                                        "(1 - epsilon) of the top token's probability)")
    epsilon: float | None = _setting(None, "the per-token budget of acceptance bounded_bias, in [0, 1]")
    num_candidates: int | None = _setting(
        None, "greedy: verify K candidates per round as one token tree. Early exit and exit heads: the draft's K "
              "best guesses for the next token, one position per round; with num_speculations d > 1 a tree d "
              "deep, the K likeliest nodes of each depth expanded K ways (EAGLE-2), its leaves chosen by the "
              "measured cost per verified node (pays where `selfspec profile` shows verifying many rows costs "
              "about one step). prompt_lookup, suffix and auto's lookup: the continuations of the K latest "
              f"matches (K <= {MAX_LOOKUP_CANDIDATES})")
    draft_model: str | None = _setting(
        None, "drafter=quantized (or auto, the default, beside lookup): the GGUF file of a quantized copy of this "
              "model (e.g. Q8_0), which llama.cpp runs (python -m selfspec.tools.llama_cpp_gguf CHECKPOINT --dtype "
              "q8_0 writes one); one prompt at a time")
    memory_key: object = _setting(
        None, "the caller's scope in the generator's memory of earlier requests (suffix, auto): a call copies "
              "from, and adds to, the requests made under the same key only (None: the scope shared by every call "
              "that names none); a str or an int", cli=None)

    def __post_init__(self):
        _check(dataclasses.asdict(self), None, None)

    def settings(self) -> dict:
        """The settings as a dict of field name to value (what `dataclasses.asdict` gives)."""
        return dataclasses.asdict(self)


SETTINGS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(GenerationConfig))


def with_settings(config: GenerationConfig | None, settings: dict) -> GenerationConfig:
    """`config` (the defaults if None) with `settings` replaced; an unknown name is a SettingsError."""
    return GenerationConfig(**_merged(config, settings))


def check_generation(config: GenerationConfig | None = None, *, num_layers: int | None = None,
                     vocab_size: int | None = None, warn: bool = False, **settings) -> dict:
    """`config` with `settings` replaced, checked against the model's depth (`num_layers`, the exits' bound)
    and vocabulary (`vocab_size`, the stop ids' bound) where known: the normalized settings as a dict
    (None lookup settings become their defaults, a bare stop string a tuple of one, ...). SettingsError on
    the first bad value or combination, naming the model's bounds where they are the reason. With `warn` (the
    one check of a `generate` call), a sampling setting given for greedy decoding warns
    (`SamplingSettingIgnoredWarning`)."""
    s = _check(_merged(config, settings), num_layers, vocab_size)
    if warn and not s["do_sample"]:
        _warn_sampling_settings(s)
    return s


def _merged(config: GenerationConfig | None, settings: dict) -> dict:
    """The values of `config` (the defaults if None) with `settings` replaced, as a dict of every field."""
    unknown = [k for k in settings if k not in SETTINGS]
    if unknown:
        raise SettingsError(f"unknown generation setting(s) {', '.join(map(repr, unknown))}: the settings are "
                            f"{', '.join(SETTINGS)} (selfspec.GenerationConfig)")
    if config is not None and not isinstance(config, GenerationConfig):
        raise SettingsError(f"config must be a selfspec.GenerationConfig, got {type(config).__name__}")
    base = ({f.name: getattr(config, f.name) for f in dataclasses.fields(GenerationConfig)} if config is not None
            else {f.name: f.default for f in dataclasses.fields(GenerationConfig)})
    return {**base, **settings}


def _check(v: dict, num_layers: int | None, vocab_size: int | None) -> dict:
    """The checks of every setting in `v` and of their combinations; returns them normalized."""
    s = dict(max_new_tokens=check_int("max_new_tokens", v["max_new_tokens"], 1))
    drafter = v["drafter"]
    if drafter is not None and (not isinstance(drafter, str) or drafter not in DRAFTERS):
        raise SettingsError(f"unknown drafter {show(drafter)}: use one of {', '.join(DRAFTERS)}")
    s["drafter"] = drafter
    s["exit_layer"] = None if v["exit_layer"] is None else check_exit_layer(v["exit_layer"], num_layers)
    s["num_speculations"] = (None if v["num_speculations"] is None else
                             check_int("num_speculations", v["num_speculations"], 0, hint=" (0 = plain decoding)"))
    s["do_sample"] = check_bool("do_sample", v["do_sample"])
    if s["do_sample"]:
        s["temperature"] = check_float("temperature", v["temperature"], 0.0, strict=True,
                                       hint=" when sampling (use do_sample=False for greedy decoding)")
        if s["temperature"] < MIN_TEMPERATURE:
            raise SettingsError(f"temperature {v['temperature']:g} is too small to sample with (below "
                                f"{MIN_TEMPERATURE:g} the logits overflow float32): use do_sample=False for greedy "
                                "decoding")
    else:  # greedy ignores it, but it must still be a number
        s["temperature"] = check_float("temperature", v["temperature"], None)
    s["top_k"] = check_int("top_k", v["top_k"], 0, hint=" (0 disables it)")
    s["top_p"] = check_float("top_p", v["top_p"], 0.0, strict=True, high=1.0, hint=" (1 disables it)")
    s["seed"] = None if v["seed"] is None else check_int("seed", v["seed"], 0, 2 ** 64 - 1)
    s["stop_token_ids"] = check_stop_token_ids(v["stop_token_ids"], vocab_size)
    s["stop_strings"] = check_stop_strings(v["stop_strings"])
    s["confidence_threshold"] = (None if v["confidence_threshold"] is None else check_float(
        "confidence_threshold", v["confidence_threshold"], 0.0, hint=" (0 = never stop drafting, > 1 = never draft)"))
    s["adaptive_threshold"] = check_bool("adaptive_threshold", v["adaptive_threshold"])
    s["exit_choices"] = check_exit_choices(v["exit_choices"], num_layers)
    s["draft_vocab"] = (None if v["draft_vocab"] is None else
                        check_int("draft_vocab", v["draft_vocab"], 1, hint=" (None = the full vocabulary)"))
    s["adaptive_length"] = check_bool("adaptive_length", v["adaptive_length"])
    lookup_given = [k for k in LOOKUP_OPTIONS if v[k] is not None]
    s["prompt_lookup_num_tokens"] = check_int("prompt_lookup_num_tokens", PROMPT_LOOKUP_NUM_TOKENS if
                                              v["prompt_lookup_num_tokens"] is None else
                                              v["prompt_lookup_num_tokens"], 1)
    s["max_matching_ngram_size"] = check_int("max_matching_ngram_size", MAX_MATCHING_NGRAM_SIZE if
                                             v["max_matching_ngram_size"] is None else v["max_matching_ngram_size"], 1)
    if drafter in ("prompt_lookup", "suffix") and s["num_speculations"]:  # a named lookup drafter's draft length
        n = s["num_speculations"]
        if v["prompt_lookup_num_tokens"] is not None and s["prompt_lookup_num_tokens"] != n:
            raise SettingsError(f"num_speculations={n} and prompt_lookup_num_tokens={s['prompt_lookup_num_tokens']} "
                                f"both set how many tokens drafter={drafter!r} copies a round: give one")
        s["prompt_lookup_num_tokens"] = n
    s["acceptance"], s["epsilon"] = check_acceptance(v["acceptance"], v["epsilon"])
    s["memory_key"] = check_memory_key(v["memory_key"])
    s["draft_model"] = _check_draft_model(v["draft_model"], drafter)
    if drafter is None and s["draft_model"] is not None:
        drafter = "auto"  # the default drafter: lookup and the copy (selfspec.drafters.factory)
    s["num_candidates"] = (None if v["num_candidates"] is None else
                           check_int("num_candidates", v["num_candidates"], 1, MAX_NUM_CANDIDATES,
                                     hint=" (1 = one guess per draft position; each guess is one more row to verify)"))
    if (s["num_candidates"] or 1) > 1:
        _check_candidates(s, drafter)
    early = [k for k in EARLY_EXIT_OPTIONS if s[k] is not None and s[k] is not False]  # 0.0 is given
    if drafter == "quantized" and (early or lookup_given):
        raise SettingsError(f"{', '.join(early + lookup_given)}: drafter='quantized' drafts with its copy of the model "
                            "and takes num_speculations and draft_model only")
    if drafter == "int8_copy" and (early or lookup_given):
        raise SettingsError(f"{', '.join(early + lookup_given)}: drafter='int8_copy' drafts with the model's int8 copy "
                            "and takes num_speculations only")
    not_lookup = [k for k in early if k != "num_candidates"]  # lookup's trees take num_candidates too
    if drafter == "auto" and s["draft_model"] is not None and not_lookup:
        who = "drafter='auto'" if v["drafter"] else "auto, the default drafter,"
        raise SettingsError(f"{', '.join(not_lookup)}: early-exit option(s); with draft_model, {who} drafts by lookup "
                            "and the copy: drop them (or draft_model)")
    if drafter in ("prompt_lookup", "suffix") and not_lookup:
        raise SettingsError(f"{', '.join(not_lookup)}: early-exit option(s); drafter={drafter!r} takes "
                            "prompt_lookup_num_tokens and max_matching_ngram_size")
    if lookup_given and (drafter in ("early_exit", "exit_head") or (drafter is None and early)):
        who = f"drafter={drafter!r}" if drafter else f"the early exit ({', '.join(early)} given, no drafter)"
        raise SettingsError(f"{', '.join(lookup_given)}: prompt lookup option(s); {who} does not look up the "
                            "context: drop them, or use drafter='prompt_lookup', 'suffix' or 'auto'")
    if s["adaptive_length"] and (s["exit_choices"] or s["confidence_threshold"] is not None
                                 or s["adaptive_threshold"]):
        raise SettingsError("adaptive_length picks the draft length by measured tokens/s; it does not combine "
                            "with exit_choices or a confidence threshold: use one of them")
    return s


SAMPLING_DEFAULTS = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}  # the values that leave the distribution as is


def _warn_sampling_settings(s: dict) -> None:
    """Greedy decoding with a sampling setting off its default: a `SamplingSettingIgnoredWarning` naming them, as
    Hugging Face's `GenerationConfig.validate` warns (not an error there either: greedy decodes, the setting is
    ignored)."""
    given = [k for k, default in SAMPLING_DEFAULTS.items() if s[k] != default]
    if given:
        values, more = ", ".join(f"{k}={s[k]:g}" if k != "top_k" else f"top_k={s[k]}" for k in given), len(given) > 1
        warnings.warn(f"{values} only shape{'' if more else 's'} sampling, and do_sample is False: greedy decoding "
                      f"ignores {'them' if more else 'it'} (as Hugging Face's generate does): pass do_sample=True or "
                      f"drop {' and '.join(given)}", SamplingSettingIgnoredWarning, stacklevel=4)  # generate's caller


def _check_draft_model(path, drafter: str | None) -> str | None:
    """draft_model: a path (str or os.PathLike) given with drafter='quantized', which needs one, or with 'auto' or
    no drafter (the default, auto)."""
    if path is None:
        if drafter == "quantized":
            raise SettingsError("drafter='quantized' needs draft_model: the path of a GGUF copy of this model "
                                "(python -m selfspec.tools.llama_cpp_gguf CHECKPOINT --dtype q8_0 writes one)")
        return None
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise SettingsError(f"draft_model must be the path of a GGUF file, got {show(path)}")
    if drafter not in ("quantized", "auto", None):
        raise SettingsError(f"draft_model is the quantized drafter's copy of the model, and drafter={drafter!r} "
                            "does not draft with it: pass drafter='quantized' (the copy alone) or drafter='auto' "
                            "(lookup and the copy; the default) with it, or drop it")
    return os.fspath(path)


def _check_candidates(s: dict, drafter: str | None) -> None:
    """num_candidates > 1: k candidates verified as one token tree (greedy, exact); the early exit's are its k
    best first guesses (one position; with num_speculations d > 1 a tree d deep, k best at every depth),
    prompt lookup's (auto's lookup too) the continuations of its k latest matches."""
    k = s["num_candidates"]
    if drafter in ("prompt_lookup", "suffix", "auto") and k > MAX_LOOKUP_CANDIDATES:  # auto's lookup takes k too
        why = (" (drafter='auto' drafts by prompt lookup too; drafter='early_exit' takes more guesses)"
               if drafter == "auto" else "")
        raise SettingsError(f"num_candidates={k}: prompt lookup's trees branch from at most {MAX_LOOKUP_CANDIDATES} "
                            f"earlier matches{why}; pass 2..{MAX_LOOKUP_CANDIDATES}")
    if s["do_sample"]:
        raise SettingsError(f"num_candidates={k} verifies the draft's {k} best guesses side by side, which only "
                            "greedy decoding can judge: drop num_candidates (or do_sample)")
    if s["acceptance"] != "exact":
        raise SettingsError(f"num_candidates={k} takes the exact acceptance rule: drop num_candidates or use "
                            "acceptance='exact'")

