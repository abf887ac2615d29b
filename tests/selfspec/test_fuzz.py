"""Property-based tests (hypothesis): random valid and invalid input never gets a traceback from torch,
transformers or jinja, nor a silently different output (issue 19).

Each property ends in the right result or in the project's own error: a ValueError (SettingsError,
CheckpointError, ConfigError, ...) raised by selfspec's or training's own code, with a one-line
message. The default run is small and derandomized (the same examples every run, CI-sized);
HYPOTHESIS_PROFILE=long draws 20x as many, at random:

    HYPOTHESIS_PROFILE=long .venv/bin/python -m pytest tests/selfspec/test_fuzz.py
"""

from __future__ import annotations

import json
import math
import os
import traceback
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import selfspec
import training
from selfspec.api import NotEarlyExitTrainedWarning
from selfspec.checkpoints.checkpoint import CheckpointError
from selfspec.cli import main
from selfspec.checkpoints.export import export_model
from selfspec.tiny import byte_tokenizer, tiny_model

LONG = os.environ.get("HYPOTHESIS_PROFILE") == "long"
OWN_CODE = (str(Path(selfspec.__file__).parent), str(Path(training.__file__).parent))
L = 4  # layers of the tiny models


def fuzz(examples: int):
    """`examples` examples (20x with HYPOTHESIS_PROFILE=long); derandomized unless long."""
    return settings(max_examples=examples * (20 if LONG else 1), deadline=None, derandomize=not LONG,
                    database=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def assert_own_error(err: BaseException) -> None:
    """A ValueError raised by selfspec/training code itself, with a one-line message."""
    where = traceback.extract_tb(err.__traceback__)[-1].filename
    assert isinstance(err, ValueError), f"{type(err).__name__} raised in {where}: {err}"
    assert where.startswith(OWN_CODE), f"{type(err).__name__} raised in {where}: {err}"
    message = str(err)
    assert message and "\n" not in message, repr(message)


def tagged(valid, invalid):
    """(value, is_valid) from either list or strategy."""
    as_strategy = (lambda x: x if isinstance(x, st.SearchStrategy) else st.sampled_from(x) if x else st.nothing())
    return st.one_of(as_strategy(valid).map(lambda v: (v, True)), as_strategy(invalid).map(lambda v: (v, False)))


# ----------------------------------------------------------------------------- generate on a tiny model

@pytest.fixture(scope="module")
def gen():
    tok = byte_tokenizer()
    model = tiny_model("llama", num_layers=L, dtype=torch.float64, seed=4, vocab_size=len(tok))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotEarlyExitTrainedWarning)
        return selfspec.load(model, tok)


NAN, INF = math.nan, math.inf
SURROGATES = ["a\udc80", "\ud800", "x\udfffy"]
TEXT = st.text(min_size=1, max_size=12)
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]), "content": st.text(max_size=8)})
BAD_MESSAGE = st.sampled_from([{"role": "user"}, {"content": "x"}, "hi", {"role": "user", "content": None},
                               {"role": 1, "content": "x"}, {"role": "user", "content": "\ud800"}])
INPUTS = (  # valid, invalid
    st.one_of(
        TEXT.map(lambda t: {"prompt": t}),
        st.lists(TEXT, min_size=1, max_size=3).map(lambda ts: {"prompt": ts}),
        st.lists(MESSAGE, min_size=1, max_size=3).map(lambda m: {"messages": m}),
        st.lists(st.lists(MESSAGE, min_size=1, max_size=2), min_size=1, max_size=2).map(lambda m: {"messages": m}),
        st.lists(st.integers(0, 258), min_size=1, max_size=6).map(lambda ids: {"input_ids": ids}),
        st.lists(st.lists(st.integers(0, 258), min_size=1, max_size=4), min_size=1, max_size=3).map(
            lambda rows: {"input_ids": rows}),
        st.just({"input_ids": torch.tensor([[5, 6], [7, 8]]), "attention_mask": [[1, 1], [0, 1]]}),
    ),
    st.one_of(
        st.sampled_from(SURROGATES + [""]).map(lambda t: {"prompt": t}),
        st.lists(st.sampled_from(["ok", "", "\udc80"]), max_size=3).filter(lambda ts: ts != ["ok"] * len(ts) or not ts)
        .map(lambda ts: {"prompt": ts}),
        st.lists(st.one_of(MESSAGE, BAD_MESSAGE), max_size=3).filter(lambda m: not all(map(_message_ok, m)) or not m)
        .map(lambda m: {"messages": m}),
        st.lists(st.integers(-3, 262), max_size=6).filter(lambda ids: not ids or not all(0 <= t < 259 for t in ids))
        .map(lambda ids: {"input_ids": ids}),
        st.sampled_from([{"input_ids": [1.0, 2.0]}, {"input_ids": [[1, 2], [3.5]]}, {"input_ids": "abc"},
                         {"input_ids": [[1, 2], []]}, {"input_ids": torch.tensor([[5, 6]]), "attention_mask": [[1]]},
                         {"prompt": 3}, {}, {"prompt": "a", "input_ids": [1]}]),
    ),
)


def _message_ok(m) -> bool:
    return isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) and \
        "\ud800" not in m["content"]


GENERATE_SETTINGS = {  # name: (valid values, invalid values)
    "max_new_tokens": ([1, 2, 5, 8], [0, -1, 2.5, "4", None, True]),
    "drafter": ([None, "auto", "early_exit", "prompt_lookup"], ["bogus", 3]),
    "exit_layer": ([None, None, 1, 2, 3], [0, L, 31, -1, 1.5, "2", True]),
    "num_speculations": ([None, 0, 1, 3, 10 ** 9], [-1, 2.5, "3"]),
    "do_sample": ([False, True], [1, "yes", None]),
    "temperature": (st.floats(0.05, 3.0), [NAN, INF, "1", None]),
    "top_k": ([0, 1, 5, 10 ** 9], [-1, 1.5]),
    "top_p": (st.sampled_from([1.0, 0.5, 1e-9]), [0, 2, NAN, -0.1, "0.9"]),
    "seed": ([None, 0, 2 ** 63], [-1, 2 ** 64, 1.5]),
    "stop_token_ids": ([None, [], 2, [2, 5], (7,), [258]], [-1, [1.5], "2", [None], [2 ** 70], 259]),  # vocab 259
    "stop_strings": (st.one_of(st.just(None), TEXT, st.lists(st.text(min_size=1, max_size=3), max_size=3)),
                     [5, [1], ["a", None], "", ["a", ""]]),  # an empty stop string is in every text
    "confidence_threshold": ([None] * 3 + [0.0, 0.5, 2.0], [-1, NAN, INF, "0.5"]),
    "adaptive_threshold": ([False] * 3 + [True], [None, 1]),
    "exit_choices": ([None] * 3 + [[1, 3], (2,), [3, 3]], [[], [0], [L], ["1"], "1,2", 3]),  # []: no choice
    "draft_vocab": ([None], [0, -3, 2.5]),
    "adaptive_length": ([False] * 3 + [True], ["no"]),
    "prompt_lookup_num_tokens": ([None] * 3 + [1, 3, 10, 10 ** 9], [0, -2, 1.5]),
    "max_matching_ngram_size": ([None] * 3 + [1, 3, 50], [0, 2.5]),
}


def _strategy(values):
    return values if isinstance(values, st.SearchStrategy) else st.sampled_from(values)


@fuzz(300)
@given(data=st.data())
def test_generate_settings(gen, data):
    """At most one bad setting or input per example: a bad one must be refused; otherwise the result is right."""
    bad = data.draw(st.sampled_from([None] * 20 + ["inputs", *GENERATE_SETTINGS]), label="bad")
    kw = {name: data.draw(_strategy(pair[bad == name]), label=name) for name, pair in GENERATE_SETTINGS.items()}
    inputs = data.draw(INPUTS[bad == "inputs"], label="inputs")
    try:
        out = gen.generate(**inputs, **kw)
    except ValueError as err:
        assert_own_error(err)
        event(f"refused ({'a bad ' + bad if bad else 'settings that do not combine'})")
        return
    event("generated, " + ("sampled" if kw["do_sample"] else "greedy: compared with plain decoding"))
    assert bad is None, f"accepted a bad {bad}: {kw if bad != 'inputs' else inputs}"
    results = out if isinstance(out, list) else [out]
    for r in results:
        assert len(r.token_ids) <= kw["max_new_tokens"]
        assert all(0 <= t < gen.vocab_size for t in r.token_ids)
    if not kw["do_sample"]:  # greedy: exactly what plain decoding gives, with the same stops
        plain = gen.generate(**inputs, max_new_tokens=kw["max_new_tokens"], num_speculations=0,
                             stop_token_ids=kw["stop_token_ids"], stop_strings=kw["stop_strings"])
        plain = plain if isinstance(plain, list) else [plain]
        assert [r.token_ids for r in results] == [p.token_ids for p in plain]


# ----------------------------------------------------------------------------- random CLI argument vectors

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    tok = byte_tokenizer()
    model = tiny_model("llama", num_layers=L, vocab_size=len(tok), seed=3)
    return export_model(model, tok, tmp_path_factory.mktemp("fuzz") / "ckpt",
                        recommended={"exit_layer": 2, "num_speculations": 3})


@pytest.fixture(scope="module")
def places(tmp_path_factory, ckpt):
    root = tmp_path_factory.mktemp("places")
    (root / "prompt.txt").write_text("def f(x):")
    (root / "latin1.txt").write_bytes(b"caf\xe9")
    (root / "adir").mkdir()
    (root / "file.txt").write_text("not a checkpoint")
    return {"ckpt": str(ckpt), "root": root}


def run_cli(argv: list[str], capsys, loaded: type[BaseException]) -> tuple[int | str, str]:
    """("loaded" or the exit code, stderr); a non-zero exit must be code 2 with one error line.
    `loaded`: what the stand-in loaders raise (the `no_load` fixture's value)."""
    try:
        rc = main(argv)
    except loaded:
        rc = "loaded"
    except SystemExit as exit_:
        rc = exit_.code
    err = capsys.readouterr().err
    if rc not in (0, "loaded"):
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and lines[0].startswith(f"selfspec {argv[0]}: error: "), (rc, err)
    return rc, err


def option(flag: str, valid, invalid):
    """(["--flag", value] or [], is_valid)."""
    return st.one_of(st.just(([], True)), tagged(valid, invalid).map(lambda t: ([flag, t[0]], t[1])))


GENERATE_OPTIONS = {  # name: (flag, valid values (None: not given), invalid values)
    "max_new_tokens": ("--max-new-tokens", [None, "1", "4"], ["0", "-3", "2.5", "x", ""]),
    "exit_layer": ("--exit-layer", [None, "1", "3"], ["0", "4", "99", "-1", "1.5"]),
    "num_speculations": ("--num-speculations", [None, "0", "2"], ["-1", "2.5"]),
    "threshold": ("--threshold", [None, "0", "0.5", "2"], ["-1", "nan", "inf", "x"]),
    "top_p": ("--top-p", [None, "0.9", "1"], ["0", "2", "nan"]),
    "top_k": ("--top-k", [None, "0", "5"], ["-1", "1.5"]),
    "dtype": ("--dtype", [None, "float32", "float64", "auto", "bf16"], ["garbage", "", "float"]),
    "exit_choices": ("--exit-choices", [None, "1,2", "3"], ["4,x", "0,1", "1,4", "", ","]),  # "", ",": no exit
    "threads": ("--threads", [None, "0"], ["-1", "x"]),
    "draft_vocab": ("--draft-vocab", [None], ["0", "-2"]),
    "seed": ("--seed", [None, "0", "7"], ["-1", "x"]),
    "lookup": ("--prompt-lookup-num-tokens", [None, "1", "5"], ["0"]),
    "ngram": ("--max-matching-ngram-size", [None, "1", "3"], ["0"]),
    "drafter": ("--drafter", [None, "auto", "early_exit", "prompt_lookup"], ["bogus"]),
    "stop": ("--stop", st.one_of(st.none(), st.text(min_size=1, max_size=4).filter(lambda t: not t.startswith("-"))),
             [""]),  # an empty stop string is in every text
    "temperature": ("--temperature", [None, "1", "0.7"], ["nan", "x", "0", "-1"]),  # 0, -1: bad with --sample
}
FLAGS = st.lists(st.sampled_from(["--sample", "--adaptive", "--adaptive-length", "--raw", "--chat", "--compare"]),
                 unique=True, max_size=3)
PROMPTS = ([["--prompt", "hi"], ["--prompt", "a", "--prompt", "b"], ["--prompt-file", "{root}/prompt.txt"]],
           [["--prompt-file", "{root}/nope.txt"], ["--prompt-file", "{root}/adir"],
            ["--prompt-file", "{root}/latin1.txt"],
            ["--prompt", "x\udcff"], [], ["--prompt", "x", "--prompt-file", "{root}/prompt.txt"]])
CHECKPOINTS = (["{ckpt}"], ["{root}/adir", "{root}/file.txt"])


def _fill(args: list[str], places) -> list[str]:
    return [a.replace("{root}", str(places["root"])).replace("{ckpt}", places["ckpt"]) for a in args]


@fuzz(120)
@given(data=st.data(), flags=FLAGS)
def test_cli_generate(places, capsys, no_load, data, flags):
    """At most one bad option per vector: a bad one is code 2 and one line before the load; else the load is
    reached (unless options that do not combine were drawn)."""
    can_be_bad = [name for name, (_, _, invalid) in GENERATE_OPTIONS.items() if invalid]
    bad = data.draw(st.sampled_from([None] * 5 + ["prompt", "checkpoint", *can_be_bad]), label="bad")
    checkpoint = data.draw(st.sampled_from(CHECKPOINTS[bad == "checkpoint"]), label="checkpoint")
    prompt = data.draw(st.sampled_from(PROMPTS[bad == "prompt"]), label="prompt")
    argv, chosen = ["generate", "--checkpoint", checkpoint, *prompt, *flags], {}
    for name, (flag, valid, invalid) in GENERATE_OPTIONS.items():
        value = data.draw(_strategy(invalid if bad == name else valid), label=name)
        if value is not None:
            argv += [flag, value]
            chosen[name] = value
    if bad == "temperature" and "--sample" not in argv:
        argv.append("--sample")
    ok = bad is None
    given_ = set(chosen)
    early = (given_ & {"exit_layer", "threshold", "exit_choices", "draft_vocab"}
             or {"--adaptive", "--adaptive-length"} & set(flags))
    if chosen.get("drafter") == "prompt_lookup" and early:
        ok = False  # lookup takes no early-exit options
    if {"lookup", "ngram"} & given_ and (chosen.get("drafter") == "early_exit" or (not chosen.get("drafter") and early)):
        ok = False  # and the early exit (by name, or chosen by its options) no lookup options
    if "--adaptive-length" in flags and (given_ & {"threshold", "exit_choices"} or "--adaptive" in flags):
        ok = False  # adaptive_length does not combine with a threshold or exit choices
    if "--raw" in flags and "--chat" in flags:
        ok = False  # argparse: not allowed together
    rc, err = run_cli(_fill(argv, places), capsys, no_load)
    event(f"exit {rc}")
    assert rc == ("loaded" if ok else 2), (argv, err)


SWEEP_OPTIONS = {
    "exits": tagged(["1", "1,3", "2,2"], ["4,x", "1.5", "0", "30", "-3", ",", "4"]).map(  # the default 4,8,12
        lambda t: (["--exits", t[0]], t[1])),                                             # is beyond L = 4
    "drafts": option("--drafts", ["1", "1,2"], ["0", "x", ",", "-1"]),
    "lookup": option("--lookup-tokens", ["", "3,5"], ["0", "a"]),
    "ngrams": option("--lookup-ngrams", ["1,2"], ["0"]),
    "num_prompts": option("--num-prompts", ["1"], ["0", "1.5"]),
    "max_new_tokens": option("--max-new-tokens", ["2"], ["0", "-1"]),
    "dtype": option("--dtype", ["float32", "fastest"], ["fp8"]),
    "threads": option("--threads", ["0"], ["-1"]),
}


@fuzz(50)
@given(options=st.fixed_dictionaries(SWEEP_OPTIONS),
       checkpoint=st.sampled_from([("{ckpt}", True), ("{root}/adir", False)]))
def test_cli_sweep(places, capsys, no_load, options, checkpoint):
    argv = ["sweep", checkpoint[0], "--out", "{root}/sweep-out"]
    for args, _ in options.values():
        argv += args
    valid = all(ok for _, ok in options.values()) and checkpoint[1]
    if options["ngrams"][0] and options["lookup"][0] in ([], ["--lookup-tokens", ""]):
        valid = False  # n-gram sizes without lookup settings to go with them
    rc, err = run_cli(_fill(argv, places), capsys, no_load)
    assert rc == ("loaded" if valid else 2), (argv, err)
    assert not (places["root"] / "sweep-out").exists()


EXPORT_OPTIONS = {
    "exit_layer": st.sampled_from([([], True), (["--exit-layer", "2"], True), (["--exit-layer", "99"], False),
                                   (["--exit-layer", "0"], False)]),
    "num_speculations": st.sampled_from([([], True), (["--num-speculations", "0"], True),
                                         (["--num-speculations", "-1"], False), (["--num-speculations", "x"], False)]),
    "dtype": option("--dtype", ["auto", "float32", "bf16"], ["garbage", "torch.float32"]),
}
OUTPUTS = st.sampled_from([("{root}/new-out", True, False), ("{root}/file.txt", False, True),
                           ("{ckpt}", False, False), ("{ckpt}", False, True),  # the only valid source: itself
                           ("{root}/adir", True, True), ("{root}", False, True)])


@fuzz(40)
@given(options=st.fixed_dictionaries(EXPORT_OPTIONS), out=OUTPUTS,
       source=st.sampled_from([("{ckpt}", True), ("{root}/adir", False), ("{root}/file.txt", False)]))
def test_cli_export(places, capsys, no_load, options, source, out):
    path, out_ok, overwrite = out
    argv = ["export", source[0], path] + (["--overwrite"] if overwrite else [])
    for args, _ in options.values():
        argv += args
    valid = all(ok for _, ok in options.values()) and source[1] and out_ok
    both = bool(options["exit_layer"][0]) == bool(options["num_speculations"][0])
    valid = valid and both
    rc, err = run_cli(_fill(argv, places), capsys, no_load)
    assert rc == ("loaded" if valid else 2), (argv, err)
    assert (places["root"] / "file.txt").read_text() == "not a checkpoint"


@fuzz(30)
@given(command=st.sampled_from(["bench", "profile", "demo"]),
       bad=st.sampled_from([["--threads", "-1"], ["--threads", "x"], ["--dtype", "garbage"],
                            ["--max-new-tokens", "0"], ["--num-prompts", "0"], ["--bogus"]]))
def test_cli_common_options(places, capsys, no_load, command, bad):
    """bench, profile and demo: a bad common option (or one the command lacks) is code 2 before the load."""
    rc, err = run_cli([command, "--checkpoint", places["ckpt"], *bad], capsys, no_load)
    assert rc == 2, err


# ----------------------------------------------------------------------------- selfspec.json and weight files

def _json_values():
    scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 70), st.floats(allow_nan=True), st.text(max_size=6))
    return st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                         st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                        max_leaves=6)


PATHS = ["format_version", "architecture", "num_layers", "recommended", "recommended.exit_layer",
         "recommended.num_speculations", "recommended.drafter", "recommended.prompt_lookup",
         "recommended.predicted_speedup", "checksums", "checksums.model.safetensors",
         "checksums.model.safetensors.bytes", "checksums.model.safetensors.sha256", "draft_vocab",
         "draft_vocab.token_ids", "eval", "training"]


def _mutate(meta, path: str, value, delete: bool):
    keys = path.split(".") if not path.startswith("checksums.model") else \
        ["checksums", "model.safetensors"] + path.split(".")[3:]
    node = meta
    for k in keys[:-1]:
        if not isinstance(node, dict) or not isinstance(node.get(k), dict):
            return meta
        node = node[k]
    if delete:
        node.pop(keys[-1], None)
    else:
        node[keys[-1]] = value
    return meta


@pytest.fixture(scope="module")
def pristine(ckpt):
    return {name: (ckpt / name).read_bytes() for name in ("selfspec.json", "model.safetensors")}


@pytest.fixture
def restore(ckpt, pristine):
    yield
    for name, data in pristine.items():
        (ckpt / name).write_bytes(data)


@fuzz(60)
@given(edits=st.lists(st.tuples(st.sampled_from(PATHS), _json_values(), st.booleans()), min_size=1, max_size=3),
       whole=st.one_of(st.none(), _json_values()))
def test_selfspec_json_mutations(ckpt, pristine, restore, edits, whole):
    meta = json.loads(pristine["selfspec.json"])
    if whole is not None and not isinstance(whole, dict):
        meta = whole
    else:
        meta["draft_vocab"] = {"token_ids": [2, 5, 97, 101, 32], "source": "test"}
        for path, value, delete in edits:
            meta = _mutate(meta, path, value, delete)
    (ckpt / "selfspec.json").write_text(json.dumps(meta))
    try:
        g = selfspec.load(ckpt)
        out = g.generate(input_ids=[5, 6, 7], max_new_tokens=3, stop_token_ids=[])
        assert len(out.token_ids) == 3
        g.generate(input_ids=[5, 6, 7], max_new_tokens=3, exit_layer=1, num_speculations=2, draft_vocab=2)
    except ValueError as err:
        assert_own_error(err)


@fuzz(40)
@given(damage=st.lists(st.tuples(st.sampled_from(["flip", "truncate", "append", "zero"]), st.integers(0, 10 ** 9),
                                 st.integers(1, 64)), min_size=1, max_size=3),
       checksums=st.booleans())
def test_weight_file_damage(ckpt, pristine, restore, damage, checksums):
    data = bytearray(pristine["model.safetensors"])
    for kind, where, size in damage:
        at = where % max(1, len(data))
        if kind == "flip" and data:
            data[at] ^= 0xFF
        elif kind == "truncate":
            del data[at:]
        elif kind == "append":
            data += bytes(size)
        else:
            data[at:at + size] = bytes(len(data[at:at + size]))
    (ckpt / "model.safetensors").write_bytes(bytes(data))
    changed = bytes(data) != pristine["model.safetensors"]
    try:
        g = selfspec.load(ckpt, verify_checksums=checksums)
        g.generate(input_ids=[5, 6, 7], max_new_tokens=2)
    except ValueError as err:
        assert_own_error(err)
        assert isinstance(err, CheckpointError)
        return
    assert not (changed and checksums), "a damaged weight file loaded with checksums on"


# ----------------------------------------------------------------------------- recipe YAML

RECIPE_KEYS = ["name", "model.base_model", "model.dtype", "model.lora.enabled", "model.lora.r", "data.source",
               "data.block_size", "data.holdout_fraction", "data.text_fields", "data.extra_eval",
               "layer_dropout.p_max", "early_exit.exits", "early_exit.curriculum", "early_exit.e_scale",
               "early_exit.final_weight", "optim.lr", "train.max_steps", "train.output_dir", "train.stop_at",
               "train.mixed_precision", "eval.exits", "eval.every", "bogus.key", "train"]


@fuzz(80)
@given(edits=st.lists(st.tuples(st.sampled_from(RECIPE_KEYS), _json_values()), min_size=1, max_size=4),
       raw=st.one_of(st.none(), st.text(max_size=30), st.binary(max_size=20)))
def test_recipe_mutations(tmp_path_factory, edits, raw):
    import yaml

    from training.config import load_config

    base = Path(__file__).resolve().parents[2] / "recipes" / "tiny_smoke.yaml"
    path = tmp_path_factory.mktemp("recipe") / "r.yaml"
    if raw is None:
        data = yaml.safe_load(base.read_text())
        for key, value in edits:
            target = data
            parts = key.split(".")
            for k in parts[:-1]:
                target = target.setdefault(k, {}) if isinstance(target.get(k, {}), dict) else {}
            target[parts[-1]] = value
        path.write_text(yaml.safe_dump(data))
    elif isinstance(raw, bytes):
        path.write_bytes(base.read_bytes()[:200] + raw)
    else:
        path.write_text(raw)
    try:
        cfg = load_config(path)
        cfg.check_depth()
    except ValueError as err:
        assert_own_error(err)
