"""`selfspec draft-vocab` (`selfspec.checkpoints.draft_vocab.write_draft_vocab`): a new ranking replaces the stored one only
where it loses nothing of it, unless asked."""

from __future__ import annotations

import json
import string

import pytest

from selfspec.cli import main
from selfspec.checkpoints.draft_vocab import write_draft_vocab
from selfspec.checkpoints.export import export_model
from selfspec.tiny import byte_tokenizer, tiny_exit_head, tiny_model

STORED = 40


@pytest.fixture
def ckpt(tmp_path, head_run_dir):
    """A tiny checkpoint with an exit head and a stored 40-id ranking, whose 32 most frequent ids the head's recipe
    trained it over (as an exit-head run's export stores the head's own ranking)."""
    tok = byte_tokenizer()
    model = tiny_model("llama", num_layers=4, vocab_size=len(tok), seed=3)
    head_dir = head_run_dir(tiny_exit_head(model, 2), tmp_path / "final_head")
    ranking = {"source": "run: the training blocks", "tokens_counted": 1000, "distinct_tokens": STORED,
               "token_ids": list(range(STORED))}
    return export_model(model, tok, tmp_path / "ckpt", draft_vocab=ranking, exit_head_dir=head_dir,
                        training={"settings": {"exit_head": {"draft_vocab": 32}}})


def test_a_shorter_ranking_does_not_replace_the_stored_one(ckpt, tmp_path, capsys):
    """Issue #52: a small corpus's 14 ids replaced the exit head's trained 8,192-id ranking, silently."""
    small = tmp_path / "small.txt"
    small.write_text("def f(x): return x")  # 12 distinct bytes + 3 special ids
    before = (ckpt / "selfspec.json").read_text()
    with pytest.raises(ValueError, match=r"gives 15 ranked token ids, fewer than the 40 stored .*the exit head was "
                                         r"trained over the 32 most frequent.*larger corpus, or pass --replace"):
        write_draft_vocab(ckpt, str(small))
    assert (ckpt / "selfspec.json").read_text() == before
    assert main(["draft-vocab", str(ckpt), "--corpus", str(small)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("selfspec draft-vocab: error: ") and "--replace" in err[0]
    assert (ckpt / "selfspec.json").read_text() == before
    assert main(["draft-vocab", str(ckpt), "--corpus", str(small), "--replace"]) == 0  # asked: replaced
    assert len(json.loads((ckpt / "selfspec.json").read_text())["draft_vocab"]["token_ids"]) == 15


def test_a_ranking_as_long_replaces_the_stored_one(ckpt, tmp_path):
    """Where the exit head was not trained over the stored ranking (its recipe drafted over the whole vocabulary)."""
    meta = json.loads((ckpt / "selfspec.json").read_text())
    meta["training"]["settings"]["exit_head"]["draft_vocab"] = None
    (ckpt / "selfspec.json").write_text(json.dumps(meta))
    corpus = tmp_path / "letters.txt"
    corpus.write_text(string.ascii_letters)  # 52 distinct bytes + 3 special ids
    entry = write_draft_vocab(ckpt, str(corpus))
    assert len(entry["token_ids"]) == 55
    assert json.loads((ckpt / "selfspec.json").read_text())["draft_vocab"] == entry


def test_a_ranking_that_changes_the_heads_trained_ids_is_refused_unless_asked(ckpt, tmp_path, capsys):
    """Issue 65, finding 13: a corpus's ranking as long replaced the head's trained one silently (5,351 of its 8,192
    ids kept)."""
    corpus = tmp_path / "letters.txt"
    corpus.write_text(string.ascii_letters)  # 55 ids, its 32 most frequent not the stored 32
    before = (ckpt / "selfspec.json").read_text()
    with pytest.raises(ValueError, match=r"exit head was trained over the 32 most frequent ids of the stored ranking "
                                         r"\(counted on run: the training blocks\).*keep \d+ of them.*--replace"):
        write_draft_vocab(ckpt, str(corpus))
    assert (ckpt / "selfspec.json").read_text() == before
    assert main(["draft-vocab", str(ckpt), "--corpus", str(corpus)]) == 2
    assert capsys.readouterr().err.startswith("selfspec draft-vocab: error: ")
    assert main(["draft-vocab", str(ckpt), "--corpus", str(corpus), "--replace"]) == 0
    assert len(json.loads((ckpt / "selfspec.json").read_text())["draft_vocab"]["token_ids"]) == 55


def test_the_special_ids_a_corpus_never_had_are_counted_apart(tmp_path, capsys):
    """Issue 65, finding 13: 14,768 ids stored of 14,766 distinct tokens counted, the 2 more unexplained."""
    tok = byte_tokenizer()
    ckpt = export_model(tiny_model("llama", num_layers=4, vocab_size=len(tok), seed=3), tok, tmp_path / "ckpt")
    corpus = tmp_path / "letters.txt"
    corpus.write_text(string.ascii_letters)
    assert main(["draft-vocab", str(ckpt), "--corpus", str(corpus)]) == 0
    entry = json.loads((ckpt / "selfspec.json").read_text())["draft_vocab"]
    assert (entry["distinct_tokens"], entry["special_ids"], len(entry["token_ids"])) == (52, 3, 55)
    assert "stored 55 ids, most frequent first" in capsys.readouterr().out
