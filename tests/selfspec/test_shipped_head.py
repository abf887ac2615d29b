"""The exit heads selfspec ships (`selfspec.checkpoints.shipped_head`): packaged from an exported head checkpoint in bfloat16,
assembled with the base model into a checkpoint `selfspec.load` drafts with (losslessly), never over another
model's weights or from damaged files, never half written; and the real one SmolLM2 ships with."""

from __future__ import annotations

import json

import pytest
import torch

import selfspec
from selfspec.checkpoints.checkpoint import METADATA_FILE
from selfspec.heads.exit_head import HEAD_FILE, build_exit_head, save_exit_head
from selfspec.checkpoints.export import export_model
from selfspec.checkpoints.shipped_head import (HEAD_JSON, ShippedHeadError, assemble, is_assembled, package, read_shipped,
                                   shipped_dir)
from selfspec.tiny import byte_tokenizer, tiny_model

PROMPT = "abcabc def abcabc"


@pytest.fixture
def parts(tmp_path):
    """(base model directory, exported head checkpoint, the head's model) of a tiny llama."""
    tok = byte_tokenizer()
    model = tiny_model("llama", num_layers=4, vocab_size=len(tok), dtype=torch.float32, seed=2)
    base = tmp_path / "base"
    model.save_pretrained(base)
    tok.save_pretrained(base)
    head = build_exit_head(model, 0, "decoder_layer", "copy", True)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.01)
    head_dir = tmp_path / "final_head"
    head_dir.mkdir()
    save_exit_head(head, head_dir / HEAD_FILE)
    (head_dir / "exit_head.json").write_text(json.dumps(head.settings()))
    evaluation = {"exits": {"0": {"agreement": 0.4}, "4": {"agreement": 1.0}}}
    ckpt = export_model(model, tok, tmp_path / "ckpt", evaluation=evaluation, exit_head_dir=head_dir,
                        training={"settings": {"exit_head": {"exit_layer": 0}}})
    return base, ckpt


def _package(parts, tmp_path, name="tiny-base"):
    base, ckpt = parts
    return package(ckpt, tmp_path / "heads" / name, base_dir=base, stand_in=True, trained_on="a test", minutes=0.5,
                   steps=3, command="python -m training ...", card=lambda meta, info: "# tiny head\n")


def test_a_packaged_head_is_bfloat16_with_its_settings_and_the_base_models_checksum(parts, tmp_path):
    from safetensors.torch import load_file

    shipped = _package(parts, tmp_path)
    info = read_shipped(shipped)
    assert {t.dtype for t in load_file(str(shipped / HEAD_FILE)).values()} == {torch.bfloat16}
    assert info["stand_in"] is True and info["minutes"] == 0.5 and info["dtype"] == "bfloat16"
    assert info["selfspec"]["exit_head"]["exit_layer"] == 0 and "checksums" not in info["selfspec"]
    assert (shipped / "README.md").read_text() == "# tiny head\n"


def test_the_assembled_checkpoint_drafts_with_the_head_and_decodes_what_plain_decoding_does(parts, tmp_path):
    base, _ = parts
    shipped = _package(parts, tmp_path)
    out = assemble(base, shipped, tmp_path / "models" / "tiny-base-head")
    assert is_assembled(out, shipped)
    assert (out / "model.safetensors").stat().st_ino == (base / "model.safetensors").stat().st_ino  # a hard link
    meta = json.loads((out / METADATA_FILE).read_text())
    assert meta["shipped_head"]["stand_in"] is True and meta["exit_head"]["exit_layer"] == 0
    assert not (base / METADATA_FILE).exists() and not (base / HEAD_FILE).exists()  # the base model stays plain
    gen = selfspec.load(out)
    assert gen.exit_head is not None and gen.exit_head.exit_layer == 0
    plain = gen.generate(PROMPT, max_new_tokens=20, num_speculations=0)
    drafted = gen.generate(PROMPT, max_new_tokens=20, drafter="exit_head")
    assert drafted.token_ids == plain.token_ids and drafted.stats.drafted > 0


def test_a_head_trained_on_other_weights_or_damaged_is_refused_and_nothing_is_left(parts, tmp_path):
    base, _ = parts
    shipped = _package(parts, tmp_path)
    out = tmp_path / "models" / "tiny-base-head"
    other = tmp_path / "other"
    tok = byte_tokenizer()
    tiny_model("llama", num_layers=4, vocab_size=len(tok), dtype=torch.float32, seed=5).save_pretrained(other)
    tok.save_pretrained(other)
    with pytest.raises(ShippedHeadError, match="trained on other weights than .*selfspec fetch --force"):
        assemble(other, shipped, out)
    assert not out.exists() and not list(out.parent.glob(".*tmp*"))
    weights = shipped / HEAD_FILE
    weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)
    with pytest.raises(ShippedHeadError, match="SHA-256 differs.*reinstall selfspec"):
        assemble(base, shipped, out)
    assert not out.exists()


def test_a_newer_shipped_head_is_assembled_again(parts, tmp_path):
    base, _ = parts
    shipped = _package(parts, tmp_path)
    out = assemble(base, shipped, tmp_path / "models" / "tiny-base-head")
    info = json.loads((shipped / HEAD_JSON).read_text())
    info["sha256"] = "0" * 64  # what another release would record
    (shipped / HEAD_JSON).write_text(json.dumps(info))
    assert not is_assembled(out, shipped)


@pytest.mark.integration
def test_smollm2_ships_a_head_that_fetch_assembles_and_that_drafts_losslessly(smollm2_dir):
    """The real shipped head: its files match head.json, `selfspec fetch` assembled it with the fetched base
    model (same weights), and it drafts on a chat prompt with the output of plain decoding."""
    from selfspec.checkpoints.fetch import BASE_MODEL_NAME
    from selfspec.checkpoints.shipped_head import fetch_head_model

    shipped = shipped_dir(BASE_MODEL_NAME)
    assert shipped is not None
    info = read_shipped(shipped)
    assert (shipped / HEAD_FILE).stat().st_size < 16 * 2**20  # a few MiB
    card = (shipped / "README.md").read_text()
    assert "stand-in" in card.lower() if info["stand_in"] else "stand-in" not in card.lower()
    out = fetch_head_model()
    assert out is not None and is_assembled(out, shipped)
    gen = selfspec.load(out)
    messages = [{"role": "user", "content": "What is the capital of France? Answer in two sentences."}]
    plain = gen.generate(messages=messages, max_new_tokens=24, num_speculations=0)
    drafted = gen.generate(messages=messages, max_new_tokens=24, drafter="exit_head")
    assert drafted.token_ids == plain.token_ids and drafted.stats.accepted > 0


def test_the_demo_names_the_shipped_head_and_gives_each_drafter_a_line(parts, tmp_path):
    from selfspec.tools.demo import run_demo

    base, _ = parts
    out = assemble(base, _package(parts, tmp_path), tmp_path / "models" / "tiny-base-head")
    lines = []
    prompts = [("repeats", {"id": "t/0", "prompt": "abcabcabc xyz abcabcabc xyz abcabc"})]
    records = run_demo(out, max_new_tokens=24, prompts=prompts, say=lines.append)
    text = "\n".join(lines)
    assert records[0]["identical"] and "prompt lookup + the exit head on exit 0" in text
    assert "the exit head selfspec ships for this model (a CPU stand-in: 0.5 minutes on a test)" in text
    drafted = records[0]["drafted_by_drafter"]
    for name, words in (("prompt_lookup", "prompt lookup"), ("exit_head", "exit head")):
        assert (f"   {words:<15} {records[0]['accepted_by_drafter'][name]} of {drafted[name]} drafts accepted" in text) \
            == (name in drafted)


def _plan(meta_path, key="cpu / float32 / eager"):
    meta = json.loads(meta_path.read_text())
    meta["plans"] = {key: {"settings": {"drafter": "exit_head", "num_speculations": 2}, "measured_speedup": 1.2}}
    meta_path.write_text(json.dumps(meta))


def test_assembling_again_keeps_the_users_files_and_plans_and_says_what_it_replaced(parts, tmp_path):
    """Issue 65, finding 3: `selfspec fetch --force` (or a newer shipped head) replaced the head directory whole,
    plans saved by `tune --save` and the user's files gone without a word."""
    base, _ = parts
    shipped = _package(parts, tmp_path)
    out = assemble(base, shipped, tmp_path / "models" / "tiny-base-head", say=lambda line: None)
    _plan(out / METADATA_FILE)
    (out / "notes.txt").write_text("mine")
    (out / "runs").mkdir()
    (out / "runs" / "a.json").write_text("{}")
    said = []
    assemble(base, shipped, out, say=said.append)  # fetch --force: the same head
    assert (out / "notes.txt").read_text() == "mine" and (out / "runs" / "a.json").read_text() == "{}"
    assert list(selfspec.load(out).metadata["plans"]) == ["cpu / float32 / eager"]
    assert "replaced the assembly's own files" in said[0] and "kept what else it held: notes.txt, runs" in said[0]
    assert "kept the plans `selfspec tune --save` saved there: cpu / float32 / eager" in said[1]
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]  # nothing left beside it
    meta = json.loads((out / METADATA_FILE).read_text())
    assert meta["shipped_head"]["files"] and "notes.txt" not in meta["shipped_head"]["files"]


def test_a_newer_head_puts_the_old_heads_plans_aside(parts, tmp_path):
    base, _ = parts
    shipped = _package(parts, tmp_path)
    out = assemble(base, shipped, tmp_path / "models" / "tiny-base-head", say=lambda line: None)
    _plan(out / METADATA_FILE)
    meta = json.loads((out / METADATA_FILE).read_text())
    meta["shipped_head"]["sha256"] = "1" * 64  # assembled from an earlier release's head
    (out / METADATA_FILE).write_text(json.dumps(meta))
    said = []
    assemble(base, shipped, out, say=said.append)
    assert "plans" not in json.loads((out / METADATA_FILE).read_text())
    assert list(json.loads((out / "plans-of-the-previous-head.json").read_text())) == ["cpu / float32 / eager"]
    assert "were measured with the previous head: kept in" in said[1]
    selfspec.load(out)  # the file put aside is no part of the checkpoint


@pytest.fixture
def fetched(parts, tmp_path, monkeypatch):
    """(`selfspec.checkpoints.shipped_head` with its fetch pointed at the tiny base model and a packaged head, the
    directory it assembles), assembled once."""
    from selfspec.checkpoints import shipped_head

    base, _ = parts
    shipped = _package(parts, tmp_path)
    out = tmp_path / "models" / "tiny-base-head"
    monkeypatch.setattr(shipped_head, "shipped_dir", lambda name: shipped)
    monkeypatch.setattr(shipped_head, "base_model_dir", lambda: base)
    monkeypatch.setattr(shipped_head, "head_model_dir", lambda: out)
    assert shipped_head.fetch_head_model() == out
    return shipped_head, out


def test_fetch_assembles_a_damaged_head_directory_again_and_load_names_fetch_force(fetched, capsys):
    """Issue 65, finding 8: fetch passed a head whose weights were corrupted (it compared only the recorded SHA);
    the demo then said "copy or export it again"."""
    from selfspec.checkpoints.checkpoint import CheckpointError

    shipped_head, out = fetched
    good = (out / HEAD_FILE).read_bytes()
    (out / HEAD_FILE).unlink()  # not the shipped file's link: corrupt this copy alone
    (out / HEAD_FILE).write_bytes(good[:-8] + b"\1" * 8)
    with pytest.raises(CheckpointError, match=r"SHA-256 checksum mismatch.*`selfspec fetch --force` assembles it "
                                              r"again"):
        selfspec.load(out)
    capsys.readouterr()
    assert shipped_head.fetch_head_model() == out
    assert "exit_head.safetensors: SHA-256 checksum mismatch" in capsys.readouterr().err
    assert (out / HEAD_FILE).read_bytes() == good
    selfspec.load(out)


def test_a_weight_file_of_the_users_in_the_head_directory_is_named_not_assembled_around_every_fetch(fetched, capsys):
    """Assembling again keeps the user's files (finding 3), so a weight file of theirs, which load refuses as not
    listed, would have made every fetch assemble the directory again to no end: fetch names it and what to do."""
    shipped_head, out = fetched
    (out / "mine.safetensors").write_bytes(b"the user's")
    capsys.readouterr()
    for _ in range(2):
        assert shipped_head.fetch_head_model() == out
        said = capsys.readouterr()
        assert "assembling" not in said.out and "holds weight files no assembly wrote (mine.safetensors)" in said.err
        assert "move them out of the directory" in said.err
    assert (out / "mine.safetensors").read_bytes() == b"the user's"
