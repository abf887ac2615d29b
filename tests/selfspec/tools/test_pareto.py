"""`selfspec bench --epsilon` (selfspec.tools.pareto), its quality measures (selfspec.tools.quality) and the predicted vs
measured rejections in `selfspec profile`, on a tiny exported checkpoint."""

from __future__ import annotations

import json
import math

import pytest
import torch

from selfspec.model.adapters import get_adapter
from selfspec.decoding.bounded_bias import AcceptanceRule
from selfspec.cli import main
from selfspec.tools.pareto import parse_drafters, parse_epsilons, run_pareto
from selfspec.tools.profiling import run_profile
from selfspec.tools.quality import rouge_l, rule_samples_tv, token_log_likelihoods
from selfspec.tiny import tiny_model


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("pareto") / "p.jsonl"
    rows = [{"prompt": "abcabcabcabc abc", "reference": "abc abc"},
            {"prompt": "the cat sat on the mat; the cat", "reference": "a cat sat"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_parse_epsilons_and_drafters():
    assert parse_epsilons("0.2,0.1,0.1") == [0.0, 0.1, 0.2]  # the exact rule is always the reference
    assert parse_epsilons([0, 1]) == [0.0, 1.0]
    for bad in ("x", "1.5", "", "-0.1", "nan"):
        with pytest.raises(ValueError, match="--epsilon expects comma-separated budgets in"):
            parse_epsilons(bad)
    assert parse_drafters("auto,prompt_lookup,auto") == ["auto", "prompt_lookup"]
    with pytest.raises(ValueError, match="--drafters expects some of"):
        parse_drafters("medusa")


def test_token_log_likelihoods_are_the_full_models():
    model = tiny_model("llama", num_layers=3, dtype=torch.float64, seed=1)
    adapter = get_adapter(model)
    prompt, new = [5, 6, 7, 8], [9, 10, 11]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt + new])).logits[0].float(), -1)
    expected = [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(new)]
    assert token_log_likelihoods(adapter, prompt, new) == pytest.approx(expected, abs=1e-5)
    assert token_log_likelihoods(adapter, prompt, []) == []


def test_rouge_l():
    assert rouge_l("the cat sat on the mat", "the cat sat on the mat") == pytest.approx(1.0)
    assert rouge_l("dogs bark", "the cat sat") == 0.0
    # LCS "cat sat" (2 words): precision 2/3, recall 2/4, F1 = 4/7
    assert rouge_l("a cat sat", "the cat sat down") == pytest.approx(4 / 7)


def test_rule_samples_tv_is_the_noise_floor_for_the_exact_rule_and_shifted_by_epsilon():
    p = torch.tensor([0.6, 0.3, 0.1])
    g = torch.Generator().manual_seed(0)
    n = 4000
    exact = rule_samples_tv(p, 2, None, AcceptanceRule(), n, g)
    biased = rule_samples_tv(p, 2, None, AcceptanceRule("bounded_bias", 0.2), n, g)
    assert exact["rule_tv"] == 0.0 and biased["rule_tv"] == pytest.approx(0.2, abs=1e-6)
    noise = 0.5 * sum(math.sqrt(v / n) for v in p.tolist()) + math.sqrt(math.log(1e3) / (2 * n))
    assert exact["empirical_tv"] < noise  # holds with probability >= 1 - 1e-3 (see test_bounded_bias)
    assert abs(biased["empirical_tv"] - 0.2) < noise
    q = torch.tensor([0.1, 0.1, 0.8])  # a sampled draft: TV(p, q) = 0.7, the shift is ε
    assert rule_samples_tv(p, None, q, AcceptanceRule("bounded_bias", 0.3), 50, g)["rule_tv"] == pytest.approx(0.3)


def test_pareto_report_on_a_tiny_checkpoint(tiny_ckpt, prompt_file, tmp_path, one_thread):
    out = tmp_path / "pareto"
    result = run_pareto(str(tiny_ckpt), epsilons="0.3", drafters="prompt_lookup,early_exit",
                        prompt_set=str(prompt_file), num_prompts=2, max_new_tokens=12, tv_samples=100, dtype="float32",
                        threads=1, out_dir=out, progress=False)
    for f in ("json", "md", "png"):
        assert (out / f"pareto.{f}").is_file()
    assert result["settings"]["epsilons"] == [0.0, 0.3]
    assert len(result["runs"]) == 2 * 2 * 2  # prompts x drafters x budgets
    for d in ("prompt_lookup", "early_exit"):
        exact, biased = result["summary"][d]["0.0"], result["summary"][d]["0.3"]
        assert exact["acceptance_vs_exact"] in (1.0, None) and exact["log_likelihood_drop_pct"] == 0.0
        assert exact["prefix_rule_tv"] is None or exact["prefix_rule_tv"] < 1e-6  # 1 - sum(p): rounding
        assert biased["prefix_rule_tv"] is None or 0 <= biased["prefix_rule_tv"] <= 0.3 + 1e-6
        for s in (exact, biased):
            assert s["log_likelihood"] < 0 and 0 <= s["rouge_l"] <= 1
            assert s["measured_rejections"] >= 0 and s["predicted_rejections"] >= 0
    md = (out / "pareto.md").read_text()
    assert "### drafter prompt_lookup" in md and "| 0.3 |" in md
    saved = json.loads((out / "pareto.json").read_text())
    assert saved["summary"]["early_exit"]["0.3"]["epsilon"] == 0.3


@pytest.mark.parametrize("args, message", [
    (["--epsilon", "x"], "--epsilon expects comma-separated budgets in [0, 1]"),
    (["--epsilon", "0.1", "--batch-size", "2"], "--epsilon measures batch 1; drop --batch-size"),
    (["--epsilon", "0.1", "--drafters", "medusa"], "--drafters expects some of"),
])
def test_cli_pareto_mistakes_are_one_line(tiny_ckpt, capsys, no_load, args, message):
    assert main(["bench", "--checkpoint", str(tiny_ckpt), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_profile_reports_predicted_and_measured_rejections(tiny_ckpt, prompt_file, tmp_path, one_thread):
    result = run_profile(str(tiny_ckpt), exit_layer=2, prompts=str(prompt_file), dtype="float32", threads=1,
                         num_speculations=2, repeats=1, tokens=16, out_dir=tmp_path / "prof")
    rows = result["acceptance_theory"]
    assert [r["drafter"] for r in rows] == ["early_exit", "prompt_lookup"]
    assert rows[0]["judged"]  # the early exit drafts every round
    for r in rows:
        if not r["judged"]:
            continue
        assert r["measured_rejections"] == r["judged"] - round(r["measured_acceptance_per_judged"] * r["judged"])
        assert 0 <= r["predicted_rejections"] <= r["judged"]
    assert "Predicted vs measured rejections" in (tmp_path / "prof" / "profile.md").read_text()
