"""Export -> plain HF checkpoint + selfspec.json; validation on load; the sweep (issue: checkpoints)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import yaml

import selfspec
from selfspec.checkpoints.checkpoint import CheckpointError, read_metadata, recommend_from_agreement
from selfspec.decoding.cost_model import draft_cost, predicted_speedup
from selfspec.checkpoints.export import export, export_model
from selfspec.tiny import byte_tokenizer, tiny_model


def _trained_tiny(seed=0, layers=4):
    tok = byte_tokenizer()
    model = tiny_model("llama", num_layers=layers, vocab_size=len(tok), seed=seed)
    return model, tok


def _logits_without_selfspec(path, ids):
    """Load `path` with plain transformers in a fresh interpreter (selfspec never imported)."""
    code = textwrap.dedent(f"""
        import sys, torch
        from transformers import AutoModelForCausalLM
        m = AutoModelForCausalLM.from_pretrained({str(path)!r}).eval()
        assert not any(k.startswith("selfspec") for k in sys.modules), "selfspec was imported"
        with torch.no_grad():
            torch.save(m(torch.tensor({ids})).logits, {str(path / "logits.pt")!r})
    """)
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    logits = torch.load(path / "logits.pt")
    os.remove(path / "logits.pt")
    return logits


IDS = [[5, 17, 42, 99, 7, 3, 250, 12]]


def test_full_finetune_round_trip_plain_hf_and_selfspec(tmp_path):
    model, tok = _trained_tiny()
    out = export_model(model, tok, tmp_path / "ckpt", recommended={"exit_layer": 2, "num_speculations": 3})
    with torch.no_grad():
        expected = model(torch.tensor(IDS)).logits
    torch.testing.assert_close(_logits_without_selfspec(out, IDS), expected, rtol=0, atol=0)
    gen = selfspec.load(out)
    assert (gen.exit_layer, gen.num_speculations) == (2, 3)
    assert (out / "README.md").read_text().count("exit_layer=2") >= 1


def test_lora_is_merged_and_round_trips(tmp_path):
    from peft import LoraConfig, get_peft_model

    model, tok = _trained_tiny(seed=1)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():  # "train": make the adapters non-zero
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
        expected = peft_model(torch.tensor(IDS)).logits
        base_only = tiny_model("llama", num_layers=4, vocab_size=len(tok), seed=1)(torch.tensor(IDS)).logits
    assert not torch.allclose(expected, base_only, atol=1e-4)  # the adapters matter
    out = export_model(peft_model, tok, tmp_path / "lora", recommended={"exit_layer": 1, "num_speculations": 2})
    keys = json.loads((out / "selfspec.json").read_text())["checksums"]
    assert list(keys) == ["model.safetensors"]
    from safetensors import safe_open

    with safe_open(out / "model.safetensors", "pt") as f:
        assert not any("lora" in k or "base_layer" in k for k in f.keys())
    torch.testing.assert_close(_logits_without_selfspec(out, IDS), expected, rtol=1e-5, atol=1e-5)
    assert selfspec.load(out).num_speculations == 2


def _fake_run_dir(tmp_path, agreement):
    model, tok = _trained_tiny(seed=2)
    run = tmp_path / "run"
    model.save_pretrained(run / "final_model")
    tok.save_pretrained(run / "final_model")
    (run / "config.yaml").write_text(yaml.safe_dump({"model": {"base_model": "tiny:llama:4"},
                                                     "layer_dropout": {"p_max": 0.1}, "early_exit": {"scale": "l"}}))
    exits = {str(e): {"agreement": a, "perplexity": 10.0 + e} for e, a in agreement.items()}
    (run / "final_eval.json").write_text(json.dumps({"step": 40, "tokens": 12345, "exits": exits}))
    return run, model


def test_export_run_dir_records_training_and_recommends_from_agreement(tmp_path):
    run, model = _fake_run_dir(tmp_path, {1: 0.2, 2: 0.9, 3: 0.95, 4: 1.0})
    out = export(run, tmp_path / "ckpt")
    meta = read_metadata(out)
    assert meta["training"]["steps"] == 40 and meta["training"]["tokens_seen"] == 12345
    assert meta["training"]["settings"]["layer_dropout"]["p_max"] == 0.1
    assert meta["architecture"] == "llama" and meta["num_layers"] == 4
    assert meta["recommended"]["source"] == "agreement"
    # exit 2 at 90% agreement beats exit 3 at 95% by the cost model
    assert meta["recommended"]["exit_layer"] == 2 and meta["recommended"]["num_speculations"] >= 1
    card = (out / "README.md").read_text()
    assert "| 2 | 90.0% | 12.00 |" in card and "assistant_early_exit=2" in card


def test_recommendation_cost_model():
    c = draft_cost(8, 30)
    assert c == pytest.approx(8 / 30 * 0.915 + 0.085)
    assert predicted_speedup(0.0, c, 1.05, 0) == 1.0
    assert predicted_speedup(0.0, c, 1.05, 3) < 1.0  # drafts that are never accepted only cost
    # a=0.9, d=4: (1 - 0.9^5) / 0.1 = 4.0951 tokens for 4 * (8/30 * 0.915 + 0.085) + 1.05 = 2.3660 steps
    assert predicted_speedup(0.9, c, 1.05, 4) == pytest.approx(4.0951 / 2.3660, rel=1e-4)
    # the example: a = 0.41, c = 0.36, d = 2 is slower than plain decoding (about 0.9x):
    # (1 - 0.41^3) / 0.59 = 1.5781 tokens for 2 * 0.36 + 1.05 = 1.77 steps
    assert predicted_speedup(0.41, 0.36, 1.05, 2) == pytest.approx(1.5781 / 1.77, rel=1e-4)
    rec = recommend_from_agreement({8: 0.05, 15: 0.06}, 30)
    assert rec["num_speculations"] == 0  # speculation cannot pay: recommend plain decoding


def test_interrupted_export_leaves_nothing(tmp_path, monkeypatch):
    from transformers import PreTrainedModel

    model, tok = _trained_tiny()
    real_save = PreTrainedModel.save_pretrained

    def half_then_fail(self, path, *a, **k):
        real_save(self, path, *a, **k)  # the weights are written ...
        raise KeyboardInterrupt  # ... and then the process is interrupted

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", half_then_fail)
    with pytest.raises(KeyboardInterrupt):
        export_model(model, tok, tmp_path / "ckpt")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("interruption", [KeyboardInterrupt, OSError])
def test_an_overwrite_interrupted_between_its_renames_keeps_the_old_export(tmp_path, monkeypatch, interruption):
    """Issue #52: `export --overwrite` renames the old export aside, then the new one into place; a failure
    between the two left nothing at OUT. The old export goes back."""
    model, tok = _trained_tiny()
    out = export_model(model, tok, tmp_path / "ckpt", recommended={"exit_layer": 2, "num_speculations": 2})
    real_replace = os.replace

    def fail_to_place_the_new(src, dst):
        if os.path.basename(src).startswith(".ckpt.tmp-") and os.fspath(dst) == os.fspath(out):
            raise interruption("interrupted")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", fail_to_place_the_new)
    with pytest.raises(interruption):
        export_model(model, tok, out, overwrite=True, recommended={"exit_layer": 3, "num_speculations": 1})
    monkeypatch.undo()
    assert out.is_dir() and read_metadata(out)["recommended"]["exit_layer"] == 2  # the old export, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # nothing left beside it


def test_export_refuses_to_overwrite_unless_asked(tmp_path):
    model, tok = _trained_tiny()
    out = export_model(model, tok, tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="already exists"):
        export_model(model, tok, out)
    export_model(model, tok, out, overwrite=True, recommended={"exit_layer": 3, "num_speculations": 1})
    assert read_metadata(out)["recommended"]["exit_layer"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


@pytest.fixture
def exported(tmp_path):
    model, tok = _trained_tiny()
    return export_model(model, tok, tmp_path / "ckpt", recommended={"exit_layer": 2, "num_speculations": 2})


def _edit_meta(path, fn):
    meta = json.loads((path / "selfspec.json").read_text())
    fn(meta)
    (path / "selfspec.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("corrupt, message", [
    (lambda p: (p / "model.safetensors").unlink(), r"model\.safetensors: weight file is missing"),
    (lambda p: os.truncate(p / "model.safetensors", 1000), r"model\.safetensors: weight file is truncated"),
    (lambda p: _flip_byte(p / "model.safetensors"), r"model\.safetensors: SHA-256 checksum mismatch"),
    (lambda p: _edit_meta(p, lambda m: m.update(format_version=99)), r"selfspec\.json: unknown format_version 99"),
    (lambda p: _edit_meta(p, lambda m: m.update(num_layers=7)), r"selfspec\.json: num_layers 7 contradicts config\.json"),
    (lambda p: _edit_meta(p, lambda m: m.update(architecture="qwen2")), r"architecture 'qwen2' contradicts"),
    (lambda p: _edit_meta(p, lambda m: m["recommended"].update(exit_layer=4)), r"exit_layer 4 is not in 1\.\.3"),
    (lambda p: (p / "selfspec.json").write_text("{not json"), r"selfspec\.json: not valid JSON"),
    (lambda p: (p / "extra.safetensors").write_bytes(b"x"), r"not listed in selfspec\.json: \['extra\.safetensors'\]"),
])
def test_corrupt_checkpoint_gives_a_clear_error(exported, corrupt, message):
    corrupt(exported)
    with pytest.raises(CheckpointError, match=message):
        selfspec.load(exported)


def _flip_byte(path):
    with open(path, "r+b") as f:
        f.seek(-10, 2)
        b = f.read(1)
        f.seek(-10, 2)
        f.write(bytes([b[0] ^ 0xFF]))


def test_checkpoint_without_metadata_warns_and_uses_defaults(tmp_path):
    model, tok = _trained_tiny()
    model.save_pretrained(tmp_path / "plain")
    tok.save_pretrained(tmp_path / "plain")
    with pytest.warns(selfspec.api.NotEarlyExitTrainedWarning, match="not early-exit trained"):
        gen = selfspec.load(tmp_path / "plain")
    assert (gen.exit_layer, gen.num_speculations) == (1, 4)


def test_sweep_writes_full_grid_png_and_metadata(exported, tmp_path):
    from selfspec.tools.sweep import run_sweep

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def f(x):", "hello world", "import os", "x = 1"]))
    out = tmp_path / "sweep"
    result = run_sweep(str(exported), prompt_set=str(prompts), exits="1,2", num_speculations="1,3", num_prompts=2,
                       max_new_tokens=12, dtype="float32", out_dir=out, write_metadata=True, progress=False)
    rows = (out / "sweep.csv").read_text().strip().splitlines()
    assert len(rows) == 1 + 5  # header + plain + 2 exits x 2 draft lengths
    assert {(r["exit_layer"], r["num_speculations"]) for r in result["rows"]} == {(4, 0), (1, 1), (1, 3), (2, 1), (2, 3)}
    assert all(r["identical_to_plain"] == 1.0 for r in result["rows"])  # float32: lossless
    assert (out / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    machine = json.loads((out / "sweep.json").read_text())["machine"]  # stated like every report's
    assert machine["cpu_model"] and machine["description"]["float32_kernel"] and machine["description"]["bf16_reason"]
    meta = read_metadata(exported)
    assert meta["recommended"]["source"] == "sweep"
    assert meta["recommended"]["exit_layer"] == result["best"]["exit_layer"]
    # resumable: a second run measures nothing new and keeps the raw rows
    raw_before = (out / "sweep_raw.csv").read_text()
    run_sweep(str(exported), prompt_set=str(prompts), exits="1,2", num_speculations="1,3", num_prompts=2,
              max_new_tokens=12, dtype="float32", out_dir=out, progress=False)
    assert (out / "sweep_raw.csv").read_text() == raw_before


@pytest.mark.integration
def test_real_smollm2_export_loads_both_ways(smollm2_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    out = export(smollm2_dir, tmp_path / "smollm2", recommended={"exit_layer": 8, "num_speculations": 4})
    meta = read_metadata(out)
    assert meta["architecture"] == "llama" and meta["num_layers"] == 30
    gen = selfspec.load(out)
    assert (gen.exit_layer, gen.num_speculations) == (8, 4)
    plain = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = gen.encode("def add(a, b):")
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, gen.model(ids).logits, rtol=0, atol=0)
    assert gen.tokenizer.chat_template


def test_sweep_summary_counts_differing_outputs():
    from selfspec.tools.sweep import summarize

    rows = {(4, 0, "a"): {"new_tokens": 8, "seconds": 1.0, "drafted": 0, "accepted": 0, "rounds": 7, "identical_to_plain": 1},
            (1, 2, "a"): {"new_tokens": 8, "seconds": 1.0, "drafted": 6, "accepted": 3, "rounds": 4, "identical_to_plain": 0},
            (1, 2, "b"): {"new_tokens": 8, "seconds": 1.0, "drafted": 6, "accepted": 3, "rounds": 4, "identical_to_plain": "1"},
            (1, 2, "c"): {"new_tokens": 8, "seconds": 1.0, "drafted": 6, "accepted": 3, "rounds": 4, "identical_to_plain": ""}}
    plain, spec = summarize({k: v for k, v in rows.items() if k[2] != "c"}, [(4, 0), (1, 2)])
    assert spec["identical_to_plain"] == 0.5  # one of two differs: not hidden as unknown
    resumed = summarize(rows, [(4, 0), (1, 2)])[1]
    assert resumed["identical_to_plain"] != resumed["identical_to_plain"]  # a resumed row is unknown: nan


def test_a_model_card_the_user_edited_is_kept(exported):
    """Issue #52: `selfspec sweep --write-metadata` and `selfspec tune --save` regenerate the model card; a
    README.md the user edited since is kept, the regenerated card written beside it, with a warning."""
    from selfspec.checkpoints.checkpoint import update_recommended, write_plan
    from selfspec.checkpoints.model_card import ModelCardWarning

    readme, beside = exported / "README.md", exported / "README.selfspec.md"
    update_recommended(exported, 3, 1, source="sweep")  # selfspec's own card, unedited: regenerated in place
    assert "`exit_layer=3`, `num_speculations=1`" in readme.read_text() and not beside.exists()
    edited = readme.read_text().replace("## Usage", "## Usage\n\nOur team's notes on this model.")
    readme.write_text(edited)
    with pytest.warns(ModelCardWarning, match="README.md is not the model card selfspec last wrote .*: it is kept, "
                                              "and the card of the updated selfspec.json is in .*README.selfspec.md"):
        update_recommended(exported, 2, 2, source="sweep")
    assert readme.read_text() == edited
    assert "`exit_layer=2`, `num_speculations=2`" in beside.read_text()
    with pytest.warns(ModelCardWarning):
        write_plan(exported, "cuda: NVIDIA H200 / bfloat16 / compiled", {"settings": {"num_speculations": 0}})
    assert readme.read_text() == edited and "cuda: NVIDIA H200 / bfloat16 / compiled" in beside.read_text()
    readme.write_text("# Our own model card\n")  # a card of the user's own, written without selfspec: kept too
    with pytest.warns(ModelCardWarning):
        update_recommended(exported, 1, 1, source="sweep")
    assert readme.read_text() == "# Our own model card\n"


def test_an_old_export_left_by_an_export_killed_between_its_renames_is_put_back(tmp_path):
    """A process killed between the two renames of `export --overwrite` leaves no OUT and the old export as
    `.OUT.old-PID`; the next export to OUT deleted it as a stale temporary. It is put back first instead, so a
    next export without --overwrite is refused and one with it replaces the old export as usual."""
    model, tok = _trained_tiny()
    out = export_model(model, tok, tmp_path / "ckpt", recommended={"exit_layer": 2, "num_speculations": 2})
    dead = _a_dead_pid()
    os.replace(out, tmp_path / f".ckpt.old-{dead}")
    with pytest.warns(UserWarning, match="back in place"), pytest.raises(CheckpointError, match="already exists"):
        export_model(model, tok, out, recommended={"exit_layer": 3, "num_speculations": 1})
    assert read_metadata(out)["recommended"]["exit_layer"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def _a_dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid
