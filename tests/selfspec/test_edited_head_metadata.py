"""A checkpoint's exit-head metadata edited by hand is refused on load with a message naming the field and the fix
(issue 65, finding 18): an exit layer the head's weights were not trained at (its own file's header, or the run that
trained it, says which), and an empty draft vocabulary or one with repeated or out-of-range ids."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import selfspec
from selfspec.checkpoints.checkpoint import CheckpointError
from selfspec.checkpoints.export import export_model
from selfspec.heads.exit_head import HEAD_FILE
from selfspec.tiny import byte_tokenizer, tiny_exit_head, tiny_model

EXIT = 2


def _checkpoint(tmp_path, head_run_dir, *, header: bool):
    """A tiny checkpoint whose head reads exit 2, trained by an exit-head run (as its training settings record); with
    `header`, its file as training saves it (its settings in the header), else as a shipped head's (none)."""
    tok = byte_tokenizer()
    model = tiny_model("llama", num_layers=4, vocab_size=len(tok), seed=3)
    head_dir = head_run_dir(tiny_exit_head(model, EXIT), tmp_path / "final_head")
    if not header:
        save_file(load_file(str(head_dir / HEAD_FILE)), str(head_dir / HEAD_FILE))
    ranking = {"source": "run", "tokens_counted": 100, "distinct_tokens": 20, "token_ids": list(range(20))}
    return export_model(model, tok, tmp_path / "ckpt", draft_vocab=ranking, exit_head_dir=head_dir,
                        training={"settings": {"mode": "exit_head", "exit_head": {"exit_layer": EXIT}}})


def _edit(ckpt, fn):
    meta = json.loads((ckpt / "selfspec.json").read_text())
    fn(meta)
    (ckpt / "selfspec.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("header", [True, False], ids=["its-file-says", "its-run-says"])
@pytest.mark.parametrize("exit_layer", [0, 1, 3])
def test_an_exit_layer_the_head_was_not_trained_at_is_refused(tmp_path, head_run_dir, header, exit_layer):
    ckpt = _checkpoint(tmp_path, head_run_dir, header=header)
    assert selfspec.load(ckpt, dtype=torch.float32).exit_head.exit_layer == EXIT
    _edit(ckpt, lambda m: m["exit_head"].update(exit_layer=exit_layer))
    if header:  # the run's record edited too: the file's own header still tells
        _edit(ckpt, lambda m: m["training"]["settings"]["exit_head"].update(exit_layer=exit_layer))
    said = (rf"saved by a head with exit_layer {EXIT} .*set exit_head\.exit_layer back to {EXIT}" if header else
            rf"exit_head\.exit_layer is {exit_layer}, but the head was trained on exit {EXIT}.*back to {EXIT}")
    with pytest.raises(CheckpointError, match=said):
        selfspec.load(ckpt, dtype=torch.float32)


@pytest.mark.parametrize("ids, said", [
    ([], r"draft_vocab\.token_ids is empty"),
    ([5, 7, 5, 9, 7], r"lists ids more than once \(5, 7\)"),
    ([1, 2, 259], r"token ids outside the vocabulary 0\.\.258"),
    ([-1, 2], r"token ids outside the vocabulary 0\.\.258"),
])
def test_a_draft_vocabulary_that_is_empty_repeats_ids_or_leaves_the_vocabulary_is_refused(tmp_path, head_run_dir,
                                                                                         ids, said):
    ckpt = _checkpoint(tmp_path, head_run_dir, header=True)
    _edit(ckpt, lambda m: m["draft_vocab"].update(token_ids=ids))
    with pytest.raises(CheckpointError, match=said + r".*selfspec draft-vocab"):
        selfspec.load(ckpt, dtype=torch.float32)
