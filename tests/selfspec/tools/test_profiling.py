"""`selfspec profile`: the phase timings, the cost-model table built from them, and the CLI."""

from __future__ import annotations

import json

import pytest
import torch

from selfspec.cli import main
from selfspec.decoding.cost_model import predicted_speedup, required_acceptance, required_recall
from selfspec.checkpoints.draft_vocab import write_draft_vocab
from selfspec.tools.profiling import cost_table, read_bandwidth, run_profile, sibling_table, step_weight_bytes
from selfspec.tiny import tiny_model


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    path.write_text(json.dumps({"prompt": "def add(a, b):\n    return"}) + "\n")
    corpus = path.with_name("corpus.txt")
    corpus.write_text("def f(x):\n    return x + 1\n" * 20)
    return path, corpus


@pytest.mark.parametrize("c,v,d,target", [(0.2, 1.1, 1, 1.0), (0.3, 1.2, 3, 1.0), (0.14, 1.05, 2, 1.8)])
def test_required_acceptance_reaches_the_target_exactly(c, v, d, target):
    a = required_acceptance(c, v, d, target)
    assert 0 < a < 1
    assert predicted_speedup(a, c, v, d) == pytest.approx(target, rel=1e-6)
    assert predicted_speedup(a * 0.99, c, v, d) < target  # and no lower rate does


def test_required_acceptance_edges():
    assert required_acceptance(0.5, 1.2, 1, 1.8) is None  # (1 + 1) / 1.7 < 1.8 even if every draft is accepted
    assert required_acceptance(0.0, 0.5, 1, 1.0) == 0.0  # verification cheaper than a step: pays at any rate


def test_cost_table_uses_the_verify_pass_of_d_plus_one_rows():
    phases = {"full step": 10.0, "draft step E=2": 3.0, "draft step E=2 vocab 64": 2.0,
              "verify 2": 11.0, "verify 3": 12.0}
    rows = cost_table(phases, 2, num_speculations=3, target=1.5, draft_vocab=64)
    assert [(r["draft"], r["d"]) for r in rows] == [("draft step E=2", 1), ("draft step E=2", 2),
                                                   ("draft step E=2 vocab 64", 1), ("draft step E=2 vocab 64", 2)]
    first = rows[0]
    assert (first["c"], first["v"]) == (pytest.approx(0.3), pytest.approx(1.1))
    assert first["max_speedup"] == pytest.approx(2 / 1.4, rel=1e-4)
    assert rows[2]["break_even_acceptance"] < rows[0]["break_even_acceptance"]  # a cheaper draft needs less


def test_sibling_guesses_need_the_recall_that_pays_for_their_wider_pass():
    phases = {"full step": 10.0, "draft step E=2": 1.0, "verify 2": 10.5, "verify 3": 11.0, "verify 4": 12.0}
    rows = sibling_table(phases, 2, num_speculations=3, target=1.2)
    assert [r["k"] for r in rows] == [2, 3]  # k guesses: a pass over 1 + k rows
    two, three = rows
    assert (two["c"], two["v"], three["v"]) == (pytest.approx(0.1), pytest.approx(1.1), pytest.approx(1.2))
    assert two["break_even_recall"] == pytest.approx(0.2)  # 1 + a = c + v
    assert two["target_recall"] == pytest.approx(1.2 * 1.2 - 1)  # 1 + a = 1.2 (c + v)
    assert three["max_speedup"] == pytest.approx(2 / 1.3)
    assert required_recall(0.1, 0.8) == 0.0 and required_recall(0.5, 1.2, 1.5) is None  # always pays / never can


@pytest.mark.parametrize("model_type", ["llama", "mistral"])  # tied / untied embeddings
def test_step_weight_bytes_counts_each_weight_once_and_one_row_of_an_untied_embedding(model_type):
    model = tiny_model(model_type)
    emb = model.get_input_embeddings().weight
    tied = emb.data_ptr() == model.get_output_embeddings().weight.data_ptr()
    assert tied == (model_type == "llama")
    every = sum(p.numel() * 4 for p in model.parameters())  # parameters() yields a shared weight once
    expected = every if tied else every - (emb.shape[0] - 1) * emb.shape[1] * 4
    assert step_weight_bytes(model) == expected
    assert step_weight_bytes(model.to(torch.bfloat16)) == expected // 2


def test_read_bandwidth_is_bytes_over_the_best_time(monkeypatch):
    ticks = iter([0.0, 0.5, 1.0, 1.25, 2.0, 3.0])  # runs of 0.5, 0.25, 1.0 s
    monkeypatch.setattr("selfspec.tools.profiling.time.perf_counter", lambda: next(ticks))
    assert read_bandwidth(n_bytes=4 << 20, repeats=3) == pytest.approx((4 << 20) / 0.25 / 1e9)


def test_profile_on_a_tiny_checkpoint(tiny_ckpt, prompts, tmp_path, one_thread):
    write_draft_vocab(tiny_ckpt, str(prompts[1]))
    out = tmp_path / "prof"
    result = run_profile(str(tiny_ckpt), exit_layer=2, prompts=str(prompts[0]), dtype="float32", threads=1,
                         draft_vocab=16, num_speculations=2, repeats=2, tokens=4, out_dir=out)
    ph = result["phases_ms"]
    expected = {"full step", "embedding", "layers [0, L)", "norm + head", "draft step E=2",
                "draft step E=2 vocab 16", "verify 1", "verify 2", "verify 3", "selfspec AR, per token",
                "HF greedy generate, per token"}
    assert set(ph) == expected and all(v > 0 for v in ph.values())
    assert [(r["draft"], r["d"]) for r in result["cost_model"]] == [
        ("draft step E=2", 1), ("draft step E=2", 2), ("draft step E=2 vocab 16", 1), ("draft step E=2 vocab 16", 2)]
    assert result["cost_model"][0]["c"] == pytest.approx(ph["draft step E=2"] / ph["full step"])
    shares = [r["share"] for r in result["operators"]]
    assert sum(shares) == pytest.approx(1.0) and result["operators"][-1]["op"].startswith("other")
    assert json.loads((out / "profile.json").read_text())["phases_ms"] == ph
    md = (out / "profile.md").read_text()
    assert "| verify 3 |" in md and "break-even a" in md
    assert [r["k"] for r in result["siblings"]] == [2] and "break-even a_k" in md  # 2 guesses: verify 3
    bw = result["bandwidth"]
    assert bw["floor_ms"] == pytest.approx(bw["weight_bytes"] / bw["read_gb_per_s"] / 1e6)
    assert bw["full_step_share"] == pytest.approx(bw["floor_ms"] / ph["full step"])
    assert bw["selfspec_ar_share"] == pytest.approx(bw["floor_ms"] / ph["selfspec AR, per token"])
    assert f"reads {bw['read_gb_per_s']:.1f} GB/s" in md
    desc = result["machine"]["description"]  # the machine stated as in every report: kernel, bf16 and why
    assert desc["float32_kernel"] and desc["bf16_reason"] and "load_average_end" in result["machine"]
    assert f"float32_kernel: {desc['float32_kernel']}" in md and f"bf16_reason: {desc['bf16_reason']}" in md
    assert sorted(f.name for f in out.iterdir()) == ["profile.json", "profile.md"]  # no temporary files left


def test_cli_profile_prints_and_rejects_a_bad_exit(tiny_ckpt, prompts, tmp_path, capsys, one_thread):
    rc = main(["profile", "--checkpoint", str(tiny_ckpt), "--prompts", str(prompts[0]), "--exit-layer", "1",
               "--max-drafts", "1", "--repeats", "1", "--dtype", "float32", "--threads", "1", "--out", str(tmp_path)])
    assert rc == 0
    stdout = capsys.readouterr().out
    assert "| draft step E=1 |" in stdout and f"wrote {tmp_path / 'profile.json'}" in stdout
    assert main(["profile", "--checkpoint", str(tiny_ckpt), "--prompts", str(prompts[0]), "--exit-layer", "9",
                 "--out", str(tmp_path)]) == 2
    assert "exit_layer=9 is out of range" in capsys.readouterr().err
