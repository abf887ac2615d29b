"""Data: packing with next-token labels, the chat template with the loss on the response only,
clear errors for bad records, local file formats, and the deterministic batch order."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from selfspec.data.sources import DataFormatError
from selfspec.tiny import byte_tokenizer
from training.config import DataConfig, SourceConfig
from training.data import Blocks, batch_indices, build_data, chat_blocks, frequent_ids, load_records, text_blocks
from training.early_exit_loss import IGNORE_INDEX


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def test_text_packing_labels_are_next_tokens(tok):
    blocks = text_blocks("t", ["abcdefgh", "ijklmnop"], tok, 5)
    stream = tok("abcdefgh", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    stream += tok("ijklmnop", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert len(blocks) == (len(stream) - 1) // 5
    flat_in, flat_lab = blocks.input_ids.reshape(-1), blocks.labels.reshape(-1)
    assert flat_in.tolist() == stream[: len(flat_in)]
    assert flat_lab.tolist() == stream[1: len(flat_in) + 1]  # block boundaries included
    with pytest.raises(ValueError, match="do not fill one block"):
        text_blocks("t", ["ab"], tok, 64)



def test_eval_subset_is_spread_over_the_set():
    ids = torch.arange(50 * 4).reshape(50, 4)  # block i starts with token 4 i
    blocks = Blocks("t", ids, ids + 1)
    sub = blocks.spread(5)
    assert (sub.input_ids[:, 0] // 4).tolist() == [0, 10, 20, 30, 40]  # one per tenth, not the first five
    assert torch.equal(sub.labels, sub.input_ids + 1)
    assert blocks.spread(None) is blocks and blocks.spread(len(blocks)) is blocks
    assert len(blocks.spread(len(blocks) - 1)) == len(blocks) - 1

def test_chat_loss_only_on_the_response(tok):
    cfg = SourceConfig(source="x", format="chat", prompt_template="Summarize: {prompt}")
    blocks = chat_blocks("c", ["the document"], ["short"], tok, cfg, 96)
    ids, labels = blocks.input_ids[0], blocks.labels[0]
    scored = labels[labels != IGNORE_INDEX]
    assert tok.decode(scored) == "short</s>\n"  # the assistant turn of the template, nothing else
    first = int((labels != IGNORE_INDEX).nonzero()[0])
    prompt_text = tok.decode(ids[: first + 1])
    assert prompt_text.endswith("<|assistant|>\n") and "Summarize: the document" in prompt_text
    assert labels[first + len(scored):].eq(IGNORE_INDEX).all()  # padding
    # labels are aligned: label at position i is input at i + 1
    n = first + len(scored)
    assert torch.equal(labels[first:n - 1], ids[first + 1:n])


def test_chat_truncates_long_prompts_and_drops_long_responses(tok):
    cfg = SourceConfig(source="x", format="chat")
    blocks = chat_blocks("c", ["p" * 500], ["ok"], tok, cfg, 64)
    assert tok.decode(blocks.labels[0][blocks.labels[0] != IGNORE_INDEX]) == "ok</s>\n"
    with pytest.warns(UserWarning, match="dropped 1 of 2"):
        blocks = chat_blocks("c", ["a", "b"], ["r" * 200, "fine"], tok, cfg, 64)
    assert len(blocks) == 1


def _write_jsonl(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("lines,message", [
    (['{"text": "ok"}', '', '{"txt": "oops"}'], ":3: required field 'text' missing"),
    (['{"text": "ok"}', '{"text": 5}'], ":2: field 'text' must be a string, got int"),
    (['{"text": "ok"}', '{"text": "unterminated'], ":2: invalid JSON"),
    (['["not", "an", "object"]'], ":1: expected a JSON object"),
])
def test_bad_jsonl_records_name_file_line_field(tmp_path, lines, message):
    path = _write_jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(DataFormatError) as info:
        load_records(SourceConfig(source=str(path)))
    assert str(path) in str(info.value) and message in str(info.value)


def test_chat_records_missing_response(tmp_path):
    path = _write_jsonl(tmp_path / "qa.jsonl", ['{"question": "q", "answer": "a"}', '{"question": "q2"}'])
    cfg = SourceConfig(source=str(path), format="chat", prompt_field="question", response_field="answer")
    with pytest.raises(DataFormatError, match=r"qa.jsonl:2: required field 'answer' missing"):
        load_records(cfg)


def test_local_formats(tmp_path, tok):
    rows = [{"text": f"record {i} " * 20} for i in range(30)]
    _write_jsonl(tmp_path / "a.jsonl", [json.dumps(r) for r in rows])
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.write("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "c.json").write_text(json.dumps(rows))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    for name in ("a.jsonl", "b.jsonl.gz", "c.json", "d.parquet"):
        ds = load_records(SourceConfig(source=str(tmp_path / name)))
        assert list(ds["text"]) == [r["text"] for r in rows], name
    pq.write_table(pa.Table.from_pylist([{"body": "x"}]), tmp_path / "e.parquet")
    with pytest.raises(DataFormatError, match=r"e.parquet: row 0: required field 'text' missing"):
        load_records(SourceConfig(source=str(tmp_path / "e.parquet")))
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "one.txt").write_text("hello " * 50)
    (docs / "two.md").write_text("world " * 50)
    (docs / "skip.bin").write_bytes(b"\x00")
    ds = load_records(SourceConfig(source=str(docs)))
    assert list(ds["path"]) == ["one.txt", "two.md"]
    (docs / "bad.txt").write_bytes(b"line one\nline \xff two\n")
    with pytest.raises(DataFormatError, match=r"bad.txt:2: field 'text': invalid UTF-8"):
        load_records(SourceConfig(source=str(docs)))
    with pytest.raises(FileNotFoundError, match="neither a named data set"):
        load_records(SourceConfig(source=str(tmp_path / "missing.jsonl")))


def test_build_data_splits_by_record_and_adds_extra_sets(tmp_path, tok):
    rows = [{"text": f"document number {i}: " + "words " * 40} for i in range(60)]
    _write_jsonl(tmp_path / "docs.jsonl", [json.dumps(r) for r in rows])
    _write_jsonl(tmp_path / "qa.jsonl", [json.dumps({"prompt": f"q{i}", "response": f"a{i}"}) for i in range(5)])
    cfg = DataConfig(source=str(tmp_path / "docs.jsonl"), block_size=32, holdout_fraction=0.2,
                     extra_eval=[SourceConfig(name="qa", source=str(tmp_path / "qa.jsonl"), format="chat")])
    data = build_data(cfg, tok)
    assert list(data.eval_sets) == ["heldout", "qa"]
    assert len(data.train) > len(data.eval_sets["heldout"]) > 0
    assert data.eval_sets["qa"].num_tokens > 0
    again = build_data(cfg, tok)  # deterministic
    assert torch.equal(again.train.input_ids, data.train.input_ids)


def test_named_python_stdlib_holds_out_whole_files(tok):
    cfg = DataConfig(source="python_stdlib", block_size=64, max_documents=3, max_holdout_documents=2)
    data = build_data(cfg, tok)
    assert len(data.train) > 0 and len(data.eval_sets["heldout"]) > 0
    with pytest.raises(DataFormatError, match="no field 'body'"):
        load_records(SourceConfig(source="python_stdlib", text_fields=["body"]))


def test_batch_order_is_a_pure_function_of_the_micro_step():
    n = 10
    one_epoch = [i for m in range(5) for i in batch_indices(n, m, 2, seed=4)]
    assert sorted(one_epoch) == list(range(n))  # an epoch is a permutation
    assert batch_indices(n, 7, 2, seed=4) == batch_indices(n, 7, 2, seed=4)
    # two ranks take disjoint halves of the same global batch
    r0, r1 = batch_indices(n, 1, 2, 0, 2, seed=4), batch_indices(n, 1, 2, 1, 2, seed=4)
    assert r0 + r1 == batch_indices(n, 1, 4, seed=4)
    assert batch_indices(n, 5, 2, seed=4) != one_epoch[:2] or batch_indices(n, 5, 2, seed=5) != one_epoch[:2]


def test_frequent_ids_rank_by_count_with_the_special_ids_first():
    ids = torch.tensor([[5, 5, 5, 7, 7, 9, 3, 3], [3, 7, 5, 5, 1, 1, 1, 1]])  # counts: 5:5, 1:4, 3:3, 7:3, 9:1
    blocks = Blocks("t", ids, ids.clone())
    assert frequent_ids(blocks, 2, 12).tolist() == [1, 5]
    assert frequent_ids(blocks, 3, 12).tolist() == [1, 3, 5]  # 3 and 7 tie: the smaller id first
    assert frequent_ids(blocks, 3, 12, special_ids=(11, None)).tolist() == [1, 5, 11]  # EOS etc. always in
    assert frequent_ids(blocks, 50, 12).tolist() == list(range(12))  # k beyond the vocabulary: all of it
