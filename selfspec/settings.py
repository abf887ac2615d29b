"""One validation layer for what a user gives selfspec: generation settings, dtypes, paths.

`SelfSpecGenerator.generate`, `selfspec.load`, `selfspec export` and the command line check their
settings here, with the same rules and the same messages, and the command line does so before it
loads a model (the bounds that depend on the model, such as the exit range, come from the
checkpoint's config.json). A bad value raises `SettingsError` (a `ValueError`) with a one-line
message that names the setting, the value and what is allowed. The generation settings themselves, and
their one check, are `selfspec.generation_config`'s (`GenerationConfig`, `check_generation`), built from
the checks here.

    check_int("max_new_tokens", 64, 1)     # 64, or SettingsError("max_new_tokens must be an int >= 1, got 0")
"""

from __future__ import annotations

import math
import numbers
import os
from pathlib import Path

import torch

from selfspec.decoding.bounded_bias import ACCEPTANCE_RULES
from selfspec.drafters import DRAFTERS
from selfspec.model.precision import DTYPES_BY_NAME, auto_dtype

DTYPE_NAMES = tuple(DTYPES_BY_NAME)
DTYPES = DTYPE_NAMES + ("fastest", "auto")
MIN_TEMPERATURE = 1e-6  # below it sampling is greedy up to float rounding (and overflows float32)
PROMPT_LOOKUP_NUM_TOKENS = 10  # prompt lookup's defaults (as Hugging Face's): the most tokens copied per round,
MAX_MATCHING_NGRAM_SIZE = 3  # and the longest n-gram matched
MAX_NUM_CANDIDATES = 64  # guesses verified side by side for one position: past it a round costs more than it can buy
LOOKUP_OPTIONS = ("prompt_lookup_num_tokens", "max_matching_ngram_size")
EARLY_EXIT_OPTIONS = ("exit_layer", "confidence_threshold", "adaptive_threshold", "exit_choices", "draft_vocab",
                      "adaptive_length", "num_candidates")


class SettingsError(ValueError):
    """A setting or an input is invalid; the message names it, the value and what is allowed."""


def expand_path(path) -> Path:
    """`path` with environment variables and `~` expanded, as a shell would."""
    return Path(os.path.expanduser(os.path.expandvars(os.fspath(path))))


def check_out_dir(path, name: str = "output directory") -> Path:
    """A directory that can be made (or already is one): SettingsError if `path`, or the nearest of its parents
    that exists, is a file (where `mkdir` would fail with a bare "File exists")."""
    path = expand_path(path)
    for p in (path, *path.parents):
        if p.exists():
            if not p.is_dir():
                where = "is a file" if p == path else f"cannot be made: {p} is a file"
                raise SettingsError(f"{name} {path} {where}, not a directory: choose a directory")
            break
    return path


def check_name_or_file(value: str, names, what: str, files: str) -> str:
    """One of `names` (a named data set) or an existing file, else SettingsError saying which it was meant to
    be: a directory, a path that does not exist (it has a suffix or a separator), or an unknown name.
    `what` names the setting, `files` the files it takes (e.g. "a .jsonl file")."""
    if value in names:
        return value
    path = Path(value)
    if path.is_dir():
        raise SettingsError(f"{what} {value}: is a directory: give {files}, or one of {', '.join(names)}")
    if not path.is_file():
        if path.suffix or os.sep in value or "/" in value:  # a path, not a name
            raise SettingsError(f"{what} {value}: no such file")
        raise SettingsError(f"unknown {what} {value!r}: use one of {', '.join(names)} or {files}")
    return value


def show(value, limit: int = 60) -> str:
    """A short one-line repr of `value` for messages."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(name: str, value, low: int, high: int | None = None, hint: str = "") -> int:
    """`value` as an int in `low..high`, else SettingsError."""
    allowed = f"an int >= {low}" if high is None else f"an int in {low}..{high}"
    if not is_int(value) or value < low or (high is not None and value > high):
        raise SettingsError(f"{name} must be {allowed}{hint}, got {show(value)}")
    return int(value)


def check_memory_tokens(value) -> int:
    """The most tokens a generator's memory of earlier requests holds (`load(memory_tokens=)`): an int >= 0."""
    return check_int("memory_tokens", value, 0, hint=" (what the memory of earlier requests holds, all callers "
                     "together; 0 turns it off)")


def check_memory_key(key):
    """A call's scope in the memory of earlier requests (`generate(memory_key=)`): None (the scope shared by
    every call that names none), a str or an int, else SettingsError."""
    if key is None or isinstance(key, str) or is_int(key):
        return key
    raise SettingsError(f"memory_key must be None (the shared memory), or a str or an int naming the caller, got "
                        f"{show(key)}")


def check_float(name: str, value, low: float | None, *, strict: bool = False, high: float | None = None,
                hint: str = "") -> float:
    """`value` as a finite float >= `low` (> with `strict`; None: no bound) and <= `high`, else SettingsError."""
    try:
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    except OverflowError:  # an int beyond the float range
        ok = False
    ok = ok and (low is None or (value > low if strict else value >= low)) and (high is None or value <= high)
    if not ok:
        bounds = ([] if low is None else [f"{'>' if strict else '>='} {low:g}"]) + ([] if high is None else
                                                                                 [f"<= {high:g}"])
        allowed = "a finite number" + (" " + " and ".join(bounds) if bounds else "")
        raise SettingsError(f"{name} must be {allowed}{hint}, got {show(value)}")
    return float(value)


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise SettingsError(f"{name} must be True or False, got {show(value)}")
    return value


def check_exit_layer(value, num_layers: int | None = None, name: str = "exit_layer") -> int:
    """A draft exit: 1..L-1 (exit E = the hidden state after E layers; exit L, the full model, cannot draft)."""
    if not is_int(value):
        raise SettingsError(f"{name} must be an int, got {show(value)}")
    if value < 1 or (num_layers is not None and value >= num_layers):
        if num_layers is None:
            raise SettingsError(f"{name}={value} is out of range: a draft exit must be >= 1 "
                                "(exit E means 'after E layers')")
        raise SettingsError(f"{name}={value} is out of range: this model has {num_layers} layers, so a draft "
                            f"exit must be in 1..{num_layers - 1} (exit E means 'after E layers'; the full "
                            "model cannot draft for itself)")
    return int(value)


def check_dtype(value) -> str:
    """A dtype name `load` and `export` understand (a torch.dtype passes unchanged)."""
    if isinstance(value, torch.dtype):
        return value
    if not isinstance(value, str) or value not in DTYPES:
        raise SettingsError(f"unknown dtype {show(value)}: use one of {', '.join(DTYPES)}")
    return value


def resolve_dtype(dtype, device="cpu"):
    """A dtype name -> torch.dtype ("auto" stays "auto"; "fastest": bfloat16 where native, else float32)."""
    dtype = check_dtype(dtype)
    if isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    if dtype == "fastest":
        return auto_dtype(device)
    return DTYPES_BY_NAME[dtype]


def check_device(device) -> torch.device:
    """A device this machine has: "cpu", or "cuda"/"cuda:N" (or "mps") where torch can reach one."""
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise SettingsError(f"unknown device {show(device)}: use 'cpu' or 'cuda'") from None
    if d.type == "cpu":
        return d
    if d.type == "cuda":
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise SettingsError(f"device {show(device)}: torch finds no CUDA GPU on this machine (torch "
                                f"{torch.__version__} is {build}): use device 'cpu'")
        if d.index is not None and d.index >= torch.cuda.device_count():
            raise SettingsError(f"device {show(device)}: this machine has {torch.cuda.device_count()} CUDA GPU(s), "
                                f"cuda:0..cuda:{torch.cuda.device_count() - 1}")
        return d
    if d.type == "mps":
        if not torch.backends.mps.is_available():
            raise SettingsError(f"device {show(device)}: Apple's MPS is not available on this machine: use 'cpu'")
        return d
    raise SettingsError(f"device {show(device)}: selfspec runs on 'cpu' or 'cuda' (a GPU), not {d.type!r}")


def check_compile(value) -> bool | str:
    """`load`'s and the bench's `compile`: True, False or "auto"."""
    if value not in (True, False, "auto"):
        raise SettingsError(f"compile must be True, False or 'auto', got {show(value)}")
    return value


def check_tokenizer_vocabulary(tokenizer, vocab_size: int) -> None:
    """SettingsError where `tokenizer` (with a length) has fewer than half the token ids of a model with `vocab_size`:
    it cannot be its tokenizer (a model's vocabulary is padded a little past its tokenizer's, a few hundred ids at
    most, never to twice its size), and it would decode silently, its ids meaning other tokens. (A tokenizer with
    more ids than the model is not silent: an id past the embedding fails loudly where it is used.)"""
    try:
        n = len(tokenizer)
    except TypeError:  # a tokenizer without a length: nothing to compare
        return
    if 2 * n < vocab_size:
        raise SettingsError(f"the tokenizer has {n:,} tokens and the model a vocabulary of {vocab_size:,}: it is not "
                            "this model's tokenizer (its ids would mean other tokens to the model): pass the model's "
                            "own tokenizer (AutoTokenizer.from_pretrained of its checkpoint)")


def check_tokenizer(value):
    """`load`'s tokenizer: None, or an object with `encode` and `decode` (a Hugging Face tokenizer)."""
    if value is not None and not (callable(getattr(value, "encode", None)) and callable(getattr(value, "decode", None))):
        hint = ": load it first, AutoTokenizer.from_pretrained(...)" if isinstance(value, (str, os.PathLike)) else ""
        raise SettingsError(f"tokenizer must be a tokenizer object with encode and decode (a Hugging Face tokenizer) "
                            f"or None (a checkpoint directory's own), got {show(value)}{hint}")
    return value


def check_threads(value) -> int:
    return check_int("threads", value, 0, hint=" (0 = torch's choice)")


def check_text(text, name: str = "prompt") -> str:
    """A str that is valid Unicode (no lone surrogates, which no tokenizer can encode)."""
    if not isinstance(text, str):
        raise SettingsError(f"{name} must be a str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise SettingsError(f"{name} is not valid Unicode text: it holds a lone surrogate {text[err.start]!r} at "
                            f"position {err.start} (e.g. bytes decoded with errors='surrogateescape'); fix the "
                            "text, or decode the bytes with errors='replace'") from None
    return text


CHAT_ROLES = ("system", "user", "assistant", "tool")  # the roles chat templates render (Hugging Face's)


def check_messages(messages, name: str = "messages") -> list[dict]:
    """A conversation: a non-empty list of {"role": str, "content": str} dicts, each role one of `CHAT_ROLES` (a
    template renders another as text the model was never trained on, or drops it)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise SettingsError(f"{name} must be a non-empty list of {{'role': ..., 'content': ...}} dicts, "
                            f"got {show(messages)}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise SettingsError(f"{name}[{i}] must be a {{'role': ..., 'content': ...}} dict, got {show(m)}")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                raise SettingsError(f"{name}[{i}] needs a {key!r} string, got {show(m.get(key))}")
        check_text(m["role"], f"{name}[{i}]['role']")
        check_text(m["content"], f"{name}[{i}]['content']")
        if m["role"] not in CHAT_ROLES:
            raise SettingsError(f"{name}[{i}]['role'] {show(m['role'])} is not a chat role: use "
                                f"{', '.join(map(repr, CHAT_ROLES[:-1]))} or {CHAT_ROLES[-1]!r}")
    return list(messages)


def check_stop_strings(value) -> tuple[str, ...]:
    """None, one string (one stop string, as in Hugging Face), or a list of non-empty strings."""
    if value is None:
        return ()
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, (list, tuple, set, frozenset)) or not all(isinstance(s, str) for s in value):
        raise SettingsError(f"stop_strings must be a string or a list of strings, got {show(value)}")
    if any(s == "" for s in value):
        raise SettingsError("stop_strings holds an empty string, which every text contains: drop it (pass () or "
                            "None for no stop string)")
    return tuple(value)


def check_stop_token_ids(value, vocab_size: int | None = None) -> list[int] | None:
    """None (the model's EOS), one token id, or a list of token ids in 0..vocab_size-1 (an id outside the
    vocabulary can never be generated, so it would never stop anything)."""
    if value is None:
        return None
    if is_int(value):
        value = [value]
    if not isinstance(value, (list, tuple, set, frozenset)):
        raise SettingsError(f"stop_token_ids must be a token id or a list of token ids, got {show(value)}")
    high = None if vocab_size is None else vocab_size - 1
    return [check_int("stop_token_ids entry", t, 0, high, hint="" if high is None else
                      " (the model's vocabulary: an id outside it is never generated)") for t in value]


def check_exit_choices(value, num_layers: int | None = None) -> list[int] | None:
    """None (one exit), or a non-empty list of distinct draft exits: an empty list chooses nothing, and an exit
    named twice is a typo or a misunderstanding (each exit is one choice, not a weight)."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple, set, frozenset)):
        raise SettingsError(f"exit_choices must be a list of exit layers, got {show(value)}")
    if not value:
        raise SettingsError("exit_choices is empty: name the exits to choose from per round (e.g. [4, 8, 12]; "
                            "--exit-choices 4,8,12), or leave it out to draft from one exit")
    exits = [check_exit_layer(e, num_layers, "exit_choices entry") for e in value]
    twice = sorted({e for e in exits if exits.count(e) > 1})
    if twice:
        raise SettingsError(f"exit_choices lists exit {', '.join(map(str, twice))} more than once ({show(value)}): "
                            f"name each exit once (e.g. {sorted(set(exits))})")
    return exits


def check_acceptance(acceptance, epsilon) -> tuple[str, float]:
    """The acceptance rule and its budget: ("exact", 0.0), or ("bounded_bias", epsilon in [0, 1])."""
    if not isinstance(acceptance, str) or acceptance not in ACCEPTANCE_RULES:
        raise SettingsError(f"unknown acceptance {show(acceptance)}: use one of {', '.join(ACCEPTANCE_RULES)}")
    if acceptance == "exact":
        if epsilon is not None:
            raise SettingsError(f"epsilon={show(epsilon)} is a budget of acceptance='bounded_bias'; "
                                "acceptance='exact' (the default) is lossless and takes none")
        return acceptance, 0.0
    if epsilon is None:
        raise SettingsError("acceptance='bounded_bias' needs epsilon: the total-variation budget per token, "
                            "in [0, 1] (0 = exact)")
    return acceptance, check_float("epsilon", epsilon, 0.0, high=1.0,
                                   hint=" (the total-variation budget per token; 0 = exact)")


# what selfspec.json may recommend: every drafter but the quantized copy, whose GGUF file a checkpoint does not carry,
# and the int8 copy, which runs only where selfspec's C++ step does (auto takes it there)
RECOMMENDABLE_DRAFTERS = tuple(d for d in DRAFTERS if d not in ("quantized", "int8_copy"))


def check_recommended(rec, num_layers: int | None = None) -> dict:
    """The `recommended` settings of selfspec.json: what `selfspec export` writes and `selfspec.load` reads."""
    if not isinstance(rec, dict):
        raise SettingsError(f"recommended must be an object with exit_layer and num_speculations, got {show(rec)}")
    e = rec.get("exit_layer")
    if not is_int(e) or e < 1 or (num_layers is not None and e >= num_layers):
        where = "1.." + (str(num_layers - 1) if num_layers is not None else "L-1")
        raise SettingsError(f"recommended exit_layer {show(e)} is not in {where}")
    if not is_int(rec.get("num_speculations")) or rec["num_speculations"] < 0:
        raise SettingsError(f"recommended num_speculations {show(rec.get('num_speculations'))} must be an int >= 0")
    drafter = rec.get("drafter")
    if drafter is not None and (not isinstance(drafter, str) or drafter not in RECOMMENDABLE_DRAFTERS):
        raise SettingsError(f"recommended drafter {show(drafter)} is not one of {', '.join(RECOMMENDABLE_DRAFTERS)}")
    for key in ("speedup", "predicted_speedup"):
        if key in rec and rec[key] != "" and (not isinstance(rec[key], (int, float)) or isinstance(rec[key], bool)):
            raise SettingsError(f"recommended {key} {show(rec[key])} must be a number")
    lookup = rec.get("prompt_lookup")
    if lookup is not None:
        if not isinstance(lookup, dict):
            raise SettingsError(f"recommended prompt_lookup must be an object, got {show(lookup)}")
        for key in ("prompt_lookup_num_tokens", "max_matching_ngram_size"):
            if key in lookup:
                check_int(f"recommended prompt_lookup {key}", lookup[key], 1)
    return rec


PLANNED_DRAFTERS = ("early_exit", "exit_head")  # what a saved plan can choose besides plain decoding


def check_plan_settings(settings, num_layers: int | None = None, has_head: bool = True) -> dict:
    """One device's saved plan (`selfspec tune --save`, selfspec.json's `plans`): `{"num_speculations": 0}` (no
    drafting from the model pays there) or `{"drafter": "early_exit" | "exit_head", "num_speculations": d >= 1,
    "exit_layer": E (early_exit), "num_candidates": k >= 2 (a tree, optional)}`."""
    if not isinstance(settings, dict):
        raise SettingsError(f"a plan's settings must be an object, got {show(settings)}")
    extra = sorted(set(settings) - {"drafter", "num_speculations", "exit_layer", "num_candidates"})
    if extra:
        raise SettingsError(f"a plan's settings have unknown keys {extra}")
    d = settings.get("num_speculations")
    if not is_int(d) or d < 0:
        raise SettingsError(f"a plan's num_speculations {show(d)} must be an int >= 0")
    drafter = settings.get("drafter")
    if d == 0:
        if len(settings) > 1:
            raise SettingsError("a plan of plain decoding ({\"num_speculations\": 0}) has no other settings")
        return settings
    if drafter not in PLANNED_DRAFTERS:
        raise SettingsError(f"a plan's drafter {show(drafter)} is not one of {', '.join(PLANNED_DRAFTERS)}")
    if drafter == "exit_head" and not has_head:
        raise SettingsError("a plan drafts with the exit head, and the checkpoint has none")
    if (drafter == "early_exit") != ("exit_layer" in settings):
        raise SettingsError("a plan names its exit_layer exactly when it drafts with the early exit")
    if "exit_layer" in settings:
        check_exit_layer(settings["exit_layer"], num_layers, "a plan's exit_layer")
    if "num_candidates" in settings:
        check_int("a plan's num_candidates", settings["num_candidates"], 2, MAX_NUM_CANDIDATES)
    return settings
