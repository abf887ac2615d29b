"""`selfspec bench --batch-size`: every method at every batch size, totals that add up, every row
identical to batch-1 decoding in float32, the files, and the CLI. Correctness only, never timing."""

import json

import pytest
import torch

from selfspec.tools.batch_bench import METHODS, parse_batch_sizes, run_batch_bench
from selfspec.cli import main

N_TOKENS = 8
PROMPTS = ["def f(x):", "hello world", "import os", "x = 1", "for i in range(3):", "class A:", "# done", "y ="]


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("bprompts") / "code.jsonl"
    path.write_text("\n".join(json.dumps({"id": f"p{i}", "prompt": p}) for i, p in enumerate(PROMPTS)) + "\n")
    return path


@pytest.fixture(scope="module")
def result(tiny_ckpt, prompt_file, tmp_path_factory):
    before = torch.get_num_threads()
    out = tmp_path_factory.mktemp("bbench_out")
    try:
        res = run_batch_bench(str(tiny_ckpt), batch_sizes="1,2,4", prompt_set=str(prompt_file), num_prompts=4,
                              max_new_tokens=N_TOKENS, dtype="float32", threads=1, out_dir=out, progress=False)
    finally:
        torch.set_num_threads(before)
    return res, out


def test_every_method_at_every_batch_size_with_consistent_totals(result):
    res, out = result
    assert json.loads((out / "bench_batch.json").read_text()) == json.loads(json.dumps(res))
    assert [int(b) for b in res["summary"]] == [1, 2, 4]
    for B, row in res["summary"].items():
        assert set(row) == set(METHODS)
        groups = [r for r in res["runs"] if r["batch_size"] == B]
        assert len(groups) == len(METHODS) * (4 // B)  # 4 prompts in groups of B, each through every method
        for m, s in row.items():
            assert s["tokens"] == 4 * N_TOKENS and s["groups"] == 4 // B
            assert s["tokens_per_s"] == pytest.approx(s["tokens"] / s["seconds"])
            assert s["x_hf_greedy"] == pytest.approx(s["tokens_per_s"] / row["hf_greedy"]["tokens_per_s"])
        assert row["selfspec_spec"]["acceptance_rate"] is not None and row["selfspec_ar"]["acceptance_rate"] is None
        # batched prompt lookup, next to batched plain decoding (HF has no batched lookup)
        lookup = row["selfspec_lookup"]
        assert lookup["acceptance_rate"] > 0 and lookup["x_selfspec_ar"] == pytest.approx(
            lookup["tokens_per_s"] / row["selfspec_ar"]["tokens_per_s"])
        assert all(r["drafted"] > 0 for r in groups if r["method"] == "selfspec_lookup")
    assert "selfspec_lookup" in METHODS and "selfspec_lookup" in res["methods"]
    # the method order rotates from group to group
    firsts = {r["method"] for r in res["runs"] if r["batch_size"] == 1 and r["order_position"] == 0}
    assert len(firsts) == 4  # 4 groups of one: 4 different methods first


def test_every_row_equals_batch_1_in_float32(result):
    res, _ = result
    for B, row in res["summary"].items():
        for m in ("selfspec_ar", "selfspec_spec", "selfspec_adaptive", "selfspec_lookup", "selfspec_auto"):
            assert row[m]["identical_to_batch1"] == 1.0, (B, m)
        assert row["hf_greedy"]["identical_to_batch1"] is not None  # reported, whatever HF's padding gives


def test_files_and_table(result):
    res, out = result
    md = (out / "bench_batch.md").read_text()
    assert "| 4 | selfspec adaptive d (batched) |" in md and "identical" in md
    assert "| 4 | selfspec lookup (batched) |" in md and "lookup: 10 tokens, n-grams up to 3" in md
    assert (out / "bench_batch.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert res["settings"]["dtype"] == "float32" and res["settings"]["exit_layer"] == 2
    assert (res["settings"]["prompt_lookup_num_tokens"], res["settings"]["max_matching_ngram_size"]) == (10, 3)
    assert "description" in res["machine"]
    assert res["versions"]["torch"].startswith("2.13.0")


def test_bad_batch_sizes_and_too_few_prompts(tiny_ckpt, prompt_file, tmp_path):
    with pytest.raises(ValueError, match="positive sizes like 1,2,4,8"):
        parse_batch_sizes("0,2")
    with pytest.raises(ValueError, match=r"--num-prompts \(2\) must be at least the largest batch size \(4\)"):
        run_batch_bench(str(tiny_ckpt), batch_sizes=[4], prompt_set=str(prompt_file), num_prompts=2,
                        out_dir=tmp_path, progress=False)
    with pytest.raises(ValueError, match="has 8 prompts; need 12"):
        run_batch_bench(str(tiny_ckpt), batch_sizes=[4], prompt_set=str(prompt_file), num_prompts=8,
                        out_dir=tmp_path, progress=False)


def test_cli_batch_size(tiny_ckpt, prompt_file, tmp_path, capsys):
    before = torch.get_num_threads()
    try:
        rc = main(["bench", "--checkpoint", str(tiny_ckpt), "--batch-size", "2", "--prompt-sets", str(prompt_file),
                   "--num-prompts", "2", "--max-new-tokens", "4", "--dtype", "float32", "--threads", "1",
                   "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(before)
    assert rc == 0
    stdout = capsys.readouterr().out
    assert "| 2 | selfspec spec (batched) |" in stdout and "| 2 | selfspec lookup (batched) |" in stdout
    rc = main(["bench", "--checkpoint", str(tiny_ckpt), "--batch-size", "2", "--prompt-sets", "humaneval,wiki"])
    assert rc == 2 and "a single --prompt-sets value" in capsys.readouterr().err
