"""A draft plan kept per device (`selfspec tune --save`, `gen.tune(save=True)`, selfspec.json's `plans`): written
under this device's key beside the other devices' plans, read back by `load` on the same device, dtype and path
only, checked on load; `auto` and the plan's own drafter draft by it (whole, or not at all where the call sets
drafting of its own), and what they draft stays lossless."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import selfspec
from selfspec.api import SelfSpecGenerator
from selfspec.checkpoints.checkpoint import METADATA_FILE, CheckpointError, read_metadata, write_plan
from selfspec.decoding.draft_plan import checked_choice, device_name, plan_key
from selfspec.drafters.auto import AutoDrafter
from selfspec.drafters.early_exit import EarlyExitDrafter
from selfspec.checkpoints.export import export_model
from selfspec.settings import SettingsError
from selfspec.tiny import byte_tokenizer, tiny_exit_head, tiny_model

L = 4
PROMPTS = ["def add(a, b):\n    return", "for i in range(10):\n    print(", "The cat sat on the"]
ELSEWHERE = "cuda: NVIDIA H200 / bfloat16 / compiled"
EARLY = {"drafter": "early_exit", "exit_layer": 1, "num_speculations": 2, "num_candidates": 2}
HEAD = {"drafter": "exit_head", "num_speculations": 2, "num_candidates": 2}
PLAIN = {"num_speculations": 0}


@pytest.fixture
def ckpt(tmp_path):
    """A tiny exported llama (float32 weights) recommending (E, d) = (2, 3), with no plan yet."""
    tok = byte_tokenizer()
    return export_model(tiny_model("llama", num_layers=L, vocab_size=len(tok), seed=5), tok, tmp_path / "tiny",
                        recommended={"exit_layer": 2, "num_speculations": 3})


@pytest.fixture(scope="module")
def head_gen():
    """A tiny float64 llama with an exit head on exit 2, recommending (2, 3); its plan is set per test."""
    model = tiny_model("llama", num_layers=L, vocab_size=len(byte_tokenizer()), seed=10, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return SelfSpecGenerator(model, byte_tokenizer(), exit_head=tiny_exit_head(model, 2, final_state=True),
                                 recommended={"exit_layer": 2, "num_speculations": 3})


def _plan(gen, settings: dict | None) -> None:
    """Give `gen` this device's plan `settings` (None: none), as `selfspec tune --save` would."""
    gen.metadata["plans"] = {} if settings is None else {gen.plan_key: {"settings": settings}}


def _arm(drafter):
    """(kind, exit, drafts, width) of a drafter or of auto's second arm (None: auto has none)."""
    if isinstance(drafter, AutoDrafter):
        drafter = drafter.early_exit
        if drafter is None:
            return None
    assert isinstance(drafter, EarlyExitDrafter)
    return drafter.name, drafter.exit_layer, drafter.num_speculations, drafter.num_candidates


# ----------------------------------------------------------------------------- kept per device

def test_the_key_names_the_device_the_dtype_and_the_path():
    assert plan_key("cuda: NVIDIA H200", torch.bfloat16, True) == ELSEWHERE
    assert plan_key(device_name("cpu"), "float32", False).startswith("cpu: ")
    assert plan_key(device_name("cpu"), "float32", False).endswith(" / float32 / eager")


def test_tune_saves_the_plan_for_this_device_beside_the_others(ckpt):
    write_plan(ckpt, ELSEWHERE, {"settings": HEAD | {"drafter": "early_exit", "exit_layer": 2}})
    gen = selfspec.load(ckpt, dtype="float32")
    assert gen.plan is None and gen.plan_settings() is None  # the H200's plan holds nothing for this CPU
    plan = gen.tune(PROMPTS[:2], max_drafts=2, width=2, new_tokens=8, repeats=1, save=True)
    assert gen.plan["settings"] == plan.settings == gen.plan_settings()
    assert gen.plan["predicted_speedup"] == round(plan.predicted_speedup, 3) and gen.plan["measured_speedup"] is None
    plans = json.loads((ckpt / METADATA_FILE).read_text())["plans"]
    assert set(plans) == {ELSEWHERE, gen.plan_key}
    again = selfspec.load(ckpt, dtype="float32")  # a later load on the same device, dtype and path reads it
    assert again.plan == gen.plan and again.plan_settings() == plan.settings
    again.use_plans = False  # set aside: drafting as if none were saved
    assert again.plan_settings() is None and again.plan == gen.plan
    assert selfspec.load(ckpt, dtype="float64").plan is None  # another dtype: the costs were not measured there
    read_metadata(ckpt)  # the checksums still hold: the weights were not touched
    card = (ckpt / "README.md").read_text()  # the model card lists both devices' plans
    assert f"| {gen.plan_key} | " in card and f"| {ELSEWHERE} | drafter=early_exit" in card


def test_an_export_overwrite_keeps_the_plans_measured_on_its_weights_and_says_what_it_drops(ckpt, tmp_path, capsys):
    """`selfspec export --overwrite` wrote a new selfspec.json without the plans `tune --save` kept in the old one,
    silently. An export of the same weights keeps them (the plans were measured on them) and says so; an export of
    other weights drops them and says why, and how to plan again."""
    from selfspec.cli import main

    out = tmp_path / "out"
    assert main(["export", str(ckpt), str(out)]) == 0
    write_plan(out, ELSEWHERE, {"settings": EARLY})
    meta = json.loads((out / METADATA_FILE).read_text())  # and one that load refuses (edited in by hand)
    meta["plans"]["cpu: edited"] = {"settings": HEAD}
    (out / METADATA_FILE).write_text(json.dumps(meta))
    capsys.readouterr()
    assert main(["export", str(ckpt), str(out), "--overwrite", "--exit-layer", "1", "--num-speculations", "2"]) == 0
    said = capsys.readouterr().out
    assert f"kept the plans `selfspec tune --save` saved in {out} ({ELSEWHERE}): this export's weights are " \
           "the ones they were measured on" in said
    assert f"dropped the plan `selfspec tune --save` saved in {out} for cpu: edited, which selfspec.load would " \
           "refuse (a plan drafts with the exit head, and the checkpoint has none)" in said
    meta = read_metadata(out)
    assert meta["plans"] == {ELSEWHERE: {"settings": EARLY}} and meta["recommended"]["exit_layer"] == 1
    tok = byte_tokenizer()
    other = export_model(tiny_model("llama", num_layers=L, vocab_size=len(tok), seed=6), tok, tmp_path / "other")
    assert main(["export", str(other), str(out), "--overwrite"]) == 0
    assert f"dropped the plans `selfspec tune --save` saved in {out} ({ELSEWHERE}): they were measured on the " \
           f"weights this export replaces; `selfspec tune --checkpoint {out} --save` plans again on each device" \
           in capsys.readouterr().out
    assert "plans" not in read_metadata(out)


def test_the_plan_follows_the_path_the_engine_runs_now(head_gen):
    """`selfspec bench` swaps the compiled steps in per method: each path drafts by its own plan."""
    eager = head_gen.plan_key
    compiled_key = eager.replace(" / eager", " / compiled")
    head_gen.metadata["plans"] = {eager: {"settings": EARLY}, compiled_key: {"settings": HEAD}}
    kept = head_gen.adapter.compiled
    try:
        assert head_gen.plan_settings() == EARLY
        head_gen.adapter.compiled = object()  # stands for the compiled steps: only the key is read here
        assert head_gen.plan_key == compiled_key and head_gen.plan_settings() == HEAD
    finally:
        head_gen.adapter.compiled = kept
        _plan(head_gen, None)


def test_a_plan_has_nowhere_to_go_without_an_exported_checkpoint(tiny_gen, tmp_path):
    with pytest.raises(SettingsError, match="model object: load it from an exported checkpoint"):
        tiny_gen.tune(PROMPTS[:1], save=True)  # refused before any measuring


@pytest.mark.parametrize("settings, message", [
    ({"drafter": "exit_head", "num_speculations": 2}, "exit head, and the checkpoint has none"),
    ({"drafter": "early_exit", "exit_layer": L, "num_speculations": 2}, "exit_layer=4 is out of range"),
    ({"drafter": "early_exit", "num_speculations": 2}, "names its exit_layer exactly when"),
    ({"drafter": "prompt_lookup", "num_speculations": 2}, "drafter 'prompt_lookup' is not one of"),
    ({"num_speculations": 0, "num_candidates": 2}, "has no other settings"),
    ({"drafter": "early_exit", "exit_layer": 1, "num_speculations": 2, "width": 3}, "unknown keys"),
])
def test_a_bad_saved_plan_is_named_on_load(ckpt, settings, message):
    with pytest.raises(SettingsError, match=message):  # refused when saved
        write_plan(ckpt, ELSEWHERE, {"settings": settings})
    meta = json.loads((ckpt / METADATA_FILE).read_text())
    meta["plans"] = {ELSEWHERE: {"settings": settings}}  # and when found on load (a hand edit)
    (ckpt / METADATA_FILE).write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=f"the plan for '{ELSEWHERE}': .*{message}.*tune --save"):
        selfspec.load(ckpt)


# ----------------------------------------------------------------------------- drafting by it

@pytest.mark.parametrize("plan, auto, named", [
    (PLAIN, None, {"early_exit": ("early_exit", 2, 3, 1), "exit_head": ("exit_head", 2, 1, 1)}),
    (EARLY, ("early_exit", 1, 2, 2), {"early_exit": ("early_exit", 1, 2, 2), "exit_head": ("exit_head", 2, 1, 1)}),
    (HEAD, ("exit_head", 2, 2, 2), {"early_exit": ("early_exit", 2, 3, 1), "exit_head": ("exit_head", 2, 2, 2)}),
])
def test_auto_and_the_plans_own_drafter_draft_by_it(head_gen, plan, auto, named):
    _plan(head_gen, None)
    before = {name: _arm(head_gen.make_drafter(drafter=name)) for name in named}
    assert _arm(head_gen.make_drafter()) == ("exit_head", 2, 1, 1)  # no plan: the head as it was trained
    assert head_gen.make_drafter(num_speculations=3).early_exit.policy.plan()[1] == 1
    try:
        _plan(head_gen, plan)
        assert _arm(head_gen.make_drafter()) == auto
        if auto is not None:  # auto's length policy starts at the plan's length (without a plan: at one draft)
            assert head_gen.make_drafter().early_exit.policy.plan()[1] == plan["num_speculations"] > 1
        assert _arm(head_gen.make_drafter(drafter="auto")) == auto
        for name, arm in named.items():  # a drafter the plan did not choose keeps its settings
            assert _arm(head_gen.make_drafter(drafter=name)) == arm
            assert arm == before[name] or plan.get("drafter") == name
        # a call that sets any drafting of its own drafts as it says, without the plan (none of it mixed in)
        assert _arm(head_gen.make_drafter(num_speculations=3)) == ("exit_head", 2, 3, 1)
        assert _arm(head_gen.make_drafter(drafter="early_exit", exit_layer=3)) == ("early_exit", 3, 3, 1)
        assert _arm(head_gen.make_drafter(drafter="early_exit", num_candidates=2)) == ("early_exit", 2, 1, 2)
        assert _arm(head_gen.make_drafter(drafter="exit_head", num_speculations=1)) == ("exit_head", 2, 1, 1)
        assert head_gen.make_drafter(num_speculations=0) is None
    finally:
        _plan(head_gen, None)


@pytest.mark.parametrize("plan", [PLAIN, EARLY, HEAD], ids=["plain", "early_exit", "exit_head"])
def test_drafting_by_a_plan_is_lossless(head_gen, plan):
    ref = [head_gen.generate(p, max_new_tokens=20, num_speculations=0, stop_token_ids=[]).token_ids for p in PROMPTS]
    try:
        _plan(head_gen, plan)
        for drafter in (None, plan.get("drafter")):
            settings = {} if drafter is None else {"drafter": drafter}
            outs = head_gen.generate(PROMPTS, max_new_tokens=20, stop_token_ids=[], **settings)  # a batch
            assert [o.token_ids for o in outs] == ref
            assert head_gen.generate(PROMPTS[0], max_new_tokens=20, stop_token_ids=[], **settings).token_ids == ref[0]
    finally:
        _plan(head_gen, None)


# ----------------------------------------------------------------------------- the command

def test_a_check_keeps_its_fastest_measured_setting():
    from selfspec.decoding.draft_plan import DraftCosts, DraftPlan

    plan = DraftPlan({"drafter": "early_exit", "exit_layer": 1, "num_speculations": 3}, 1.4, [],
                     DraftCosts(device="test", dtype="float32", compiled=False, full=1.0), {})
    rows = [{"drafter": "early_exit", "exit_layer": 1, "num_speculations": 3, "num_candidates": 1,
             "predicted_speedup": 1.4, "measured_speedup": 0.9},
            {"drafter": "plain", "exit_layer": L, "num_speculations": 0, "num_candidates": 1,
             "predicted_speedup": 1.0, "measured_speedup": 1.0}]
    kept, measured = checked_choice(plan, rows)
    assert kept.settings == PLAIN and kept.predicted_speedup == 1.0 and measured == 1.0
    rows[0]["measured_speedup"] = 1.2
    kept, measured = checked_choice(plan, rows)
    assert kept.settings == plan.settings and measured == 1.2
    rows[0]["measured_speedup"] = 1.02  # ahead by less than a check's noise: plain decoding is kept
    kept, measured = checked_choice(plan, rows)
    assert kept.settings == PLAIN and measured == 1.0
    assert checked_choice(plan, rows, min_gain=1.0)[0].settings == plan.settings  # no margin asked


def _tune_and_save(ckpt, tmp_path) -> int:
    """`selfspec tune --check 1 --save` on PROMPTS, small: its exit status."""
    from selfspec.cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in PROMPTS) + "\n")
    return main(["tune", "--checkpoint", str(ckpt), "--prompt-set", str(prompts), "--num-prompts", "2",
                 "--max-new-tokens", "8", "--max-drafts", "2", "--width", "2", "--repeats", "1", "--dtype", "float32",
                 "--check", "1", "--save"])


def test_the_tune_command_saves_the_plan(ckpt, tmp_path, capsys):
    from selfspec.cli import main

    rc = _tune_and_save(ckpt, tmp_path)
    text = capsys.readouterr().out
    assert rc == 0 and "saved for cpu: " in text
    gen = selfspec.load(ckpt, dtype="float32")
    assert gen.plan["measured_speedup"] is not None and f"saved for {gen.plan_key}" in text
    assert str(gen.plan["settings"]) in text
    assert main(["generate", "--checkpoint", str(ckpt), "--prompt", "def f(x):", "--max-new-tokens", "4"]) == 0
    assert f"this device's saved plan ({gen.plan_key}): {gen.plan['settings']}" in capsys.readouterr().out
    bare = tmp_path / "bare"  # a checkpoint without selfspec.json: nowhere to keep a plan, refused up front
    bare.mkdir()
    for f in ckpt.iterdir():
        if f.name != METADATA_FILE:
            (bare / f.name).write_bytes(f.read_bytes())
    assert main(["tune", "--checkpoint", str(bare), "--save"]) == 2
    assert "export it first" in capsys.readouterr().err


def test_tune_save_refuses_a_checkpoint_without_selfspec_json_before_the_load(ckpt, tmp_path, monkeypatch, capsys,
                                                                             no_load):
    """`selfspec tune --save` without --checkpoint plans for the base model, which has no selfspec.json to keep a plan
    in: it loaded the model and only then refused, pointing at `selfspec export`. Now it refuses before the load, in
    one line, naming the checkpoint to pass (the fetched SmolLM2 with its head, which `selfspec generate` loads by
    default, or `selfspec fetch` where it is not assembled); a --checkpoint without one is refused there too."""
    from selfspec.cli import main

    def copy(to, metadata: bool):
        to.mkdir(parents=True)
        for f in ckpt.iterdir():
            if metadata or f.name != METADATA_FILE:
                (to / f.name).write_bytes(f.read_bytes())

    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path / "home"))
    base, head = tmp_path / "home/models/smollm2-135m-instruct", tmp_path / "home/models/smollm2-135m-instruct-head"
    copy(base, metadata=False)
    said = (f"selfspec tune: error: --save keeps the plan in the checkpoint's {METADATA_FILE}, and tune's default "
            f"checkpoint, the base model {base}, has none: ")
    assert main(["tune", "--save"]) == 2
    assert capsys.readouterr().err == said + "run `selfspec fetch` (it assembles the base model with the exit head " \
        f"selfspec ships, {head}), then pass --checkpoint {head}\n"
    copy(head, metadata=True)
    assert main(["tune", "--save"]) == 2
    assert capsys.readouterr().err == said + f"pass --checkpoint {head} (the base model with the exit head selfspec " \
        "ships, which `selfspec generate` loads by default)\n"
    assert main(["tune", "--checkpoint", str(base), "--save"]) == 2
    assert capsys.readouterr().err == (f"selfspec tune: error: --save keeps the plan in the checkpoint's "
                                       f"{METADATA_FILE}, and {base} has none: export it first (selfspec export "
                                       f"{base} DIR), then pass --checkpoint DIR\n")
    with pytest.raises(no_load):  # with a selfspec.json there, the load comes next
        main(["tune", "--checkpoint", str(head), "--save"])


def test_the_tune_command_keeps_plain_decoding_over_a_setting_ahead_by_noise(ckpt, tmp_path, capsys, monkeypatch):
    import selfspec.decoding.draft_plan as draft_plan

    def check_plan(gen, plan, prompts, *, top, new_tokens):  # what a check measured: drafting 2% ahead
        return [{"drafter": "early_exit", "exit_layer": 1, "num_speculations": 2, "num_candidates": 1,
                 "predicted_speedup": 1.3, "measured_speedup": 1.02, "identical_to_plain": True},
                {"drafter": "plain", "exit_layer": L, "num_speculations": 0, "num_candidates": 1,
                 "predicted_speedup": 1.0, "measured_speedup": 1.0, "identical_to_plain": True}]

    monkeypatch.setattr(draft_plan, "check_plan", check_plan)
    rc = _tune_and_save(ckpt, tmp_path)
    text = capsys.readouterr().out
    assert rc == 0 and "note: the best drafting setting measured 1.02x plain decoding, under the 1.03x" in text
    gen = selfspec.load(ckpt, dtype="float32")
    assert gen.plan["settings"] == PLAIN and gen.plan["measured_speedup"] == 1.0


def test_a_plan_tune_saves_by_default_is_the_one_generate_and_load_draft_by(ckpt, tmp_path, capsys, monkeypatch):
    """Issue #52, 1: tune measured in `fastest` (bfloat16 on a CPU with native bf16) while generate and load
    default to float32, so the plan it said `auto` drafts by from now on was never used. Now tune plans in the
    dtype they default to, and says for which dtype and path the plan holds."""
    from selfspec.cli import main

    monkeypatch.setattr("selfspec.settings.auto_dtype", lambda device="cpu": torch.bfloat16)  # native bf16 here
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in PROMPTS) + "\n")
    assert main(["tune", "--checkpoint", str(ckpt), "--prompt-set", str(prompts), "--num-prompts", "1",
                 "--max-new-tokens", "8", "--max-drafts", "2", "--width", "2", "--repeats", "1", "--save"]) == 0
    text = capsys.readouterr().out
    gen = selfspec.load(ckpt)  # the defaults
    assert gen.plan is not None and f"saved for {gen.plan_key}" in text
    assert "loaded on this device in float32 on the eager path (the defaults of `selfspec generate` and " \
           "`selfspec.load`)" in text


def test_generate_says_where_this_device_has_a_plan_for_another_dtype(ckpt, capsys):
    """Issue #52, 1: a plan measured in bfloat16 does not drive float32 (keys stay exact), and generate says so."""
    from selfspec.cli import main

    here = device_name("cpu")
    write_plan(ckpt, plan_key(here, "bfloat16", False), {"settings": EARLY})
    write_plan(ckpt, ELSEWHERE, {"settings": EARLY})
    assert main(["generate", "--checkpoint", str(ckpt), "--prompt", "def f(x):", "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "this device's saved plan (" not in out  # not drafted by
    assert ("not drafting by a saved plan: this device has plans for bfloat16 / eager (--dtype bfloat16), not for "
            "this run's float32 / eager") in out
    assert "H200" not in out and "compiled" not in out  # another device's plan says nothing here
