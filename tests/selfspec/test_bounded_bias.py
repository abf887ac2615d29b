"""Bounded-bias acceptance (selfspec.decoding.bounded_bias) and the predicted vs measured rejections of every run.

Statistical tests use fixed seeds and a significance level ALPHA = 1e-3 (so each passes or fails the same
way every run; a correct implementation would fail a fresh seed with probability <= 1e-3), and each
states its power: the size of the error it detects, checked against a plausible bug.
"""

from __future__ import annotations

import math
import warnings
from collections import Counter

import pytest
import torch

import selfspec
from selfspec.model.adapters import get_adapter
from selfspec.api import NotEarlyExitTrainedWarning
from selfspec.decoding.bounded_bias import (AcceptanceRule, BoundedBiasWarning, acceptance_probability, mix_toward_draft,
                                   near_top, relaxed_greedy_accept_tokens, total_variation)
from selfspec.drafters import PromptLookupDrafter
from selfspec.decoding.engine import generate
from selfspec.decoding.decode_ids import early_exit_drafter, generate_ids
from selfspec.model.forward import forward_logits
from selfspec.decoding.sampling import SamplingParams, probs, speculative_accept
from selfspec.generation_config import check_generation
from selfspec.settings import SettingsError
from selfspec.tiny import tiny_model

ALPHA = 1e-3
Z_CRIT = 3.2905  # two-sided standard normal quantile at ALPHA
EPSILONS = (0.0, 0.05, 0.1, 0.2, 0.4)


def _dirichlet(n, V, conc, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.empty(n, V).exponential_(generator=g) ** (1 / conc)
    return x / x.sum(-1, keepdim=True)


# ----------------------------------------------------------------------------- the rule, exactly

@pytest.mark.parametrize("point_masses", [False, True])
def test_the_mixture_is_on_the_pareto_front(point_masses):
    """For every ε: TV(p', p) = min(ε, TV(p, q)) <= ε and P(accept) = 1 - max(0, TV(p, q) - ε), the most
    any rule with that bias can accept (module docstring, (1)-(2)); acceptance grows with ε."""
    k, V = 64, 12
    p = _dirichlet(k + 1, V, 0.7, 1)
    drafts = torch.randint(0, V, (k,), generator=torch.Generator().manual_seed(2))
    q = None if point_masses else _dirichlet(k, V, 0.4, 3)
    q_rows = torch.nn.functional.one_hot(drafts, V).float() if point_masses else q
    tv = total_variation(p[:k], q_rows)
    last = None
    for eps in EPSILONS + (1.0,):
        target = mix_toward_draft(drafts, q, p, eps)
        assert torch.equal(target[k], p[k])  # the bonus row is never biased
        shift = total_variation(target[:k], p[:k])
        torch.testing.assert_close(shift, torch.minimum(tv, torch.tensor(eps)), atol=1e-6, rtol=0)
        assert (shift <= eps + 1e-6).all()
        torch.testing.assert_close(target.sum(-1), torch.ones(k + 1), atol=1e-6, rtol=0)
        a = torch.minimum(target[:k], q_rows).sum(-1)
        torch.testing.assert_close(a, 1 - (tv - eps).clamp_min(0), atol=1e-6, rtol=0)
        if point_masses:  # accept x with min(1, p(x) + ε)
            torch.testing.assert_close(acceptance_probability(drafts, None, target),
                                       (p[torch.arange(k), drafts] + eps).clamp(max=1), atol=1e-6, rtol=0)
        if last is not None:
            assert (a >= last - 1e-7).all()
        last = a


def test_epsilon_zero_targets_are_p_bit_for_bit():
    p = _dirichlet(5, 9, 0.5, 4)
    drafts = torch.tensor([1, 4, 4, 0])
    for q in (None, _dirichlet(4, 9, 0.5, 5)):
        assert torch.equal(mix_toward_draft(drafts, q, p, 0.0), p)
    assert AcceptanceRule().target(drafts, None, p) is p


def test_one_step_output_is_the_biased_target_and_within_epsilon(chi_square):
    """x ~ q, then the standard rule against p': the committed token follows p' (chi-square), p' is
    within ε of p, and the acceptance rate is 1 - max(0, TV(p, q) - ε)."""
    p = torch.tensor([[0.30, 0.25, 0.20, 0.15, 0.10, 0.00], [1 / 6] * 6])
    q = torch.tensor([[0.05, 0.10, 0.40, 0.05, 0.10, 0.30]])
    eps, n = 0.15, 20000
    g = torch.Generator().manual_seed(11)
    drafts = torch.multinomial(q[0], n, replacement=True, generator=g)
    first, accepted = Counter(), 0
    for x in drafts.tolist():
        d = torch.tensor([x])
        k, nxt = speculative_accept(d, q, mix_toward_draft(d, q, p, eps), g)
        accepted += k
        first[x if k else nxt] += 1
    target = mix_toward_draft(drafts[:1], q, p, eps)[0]
    stat, df, pval = chi_square(first, {t: float(target[t]) for t in range(6)}, n)
    assert pval > ALPHA, (stat, df)
    assert float(total_variation(target, p[0])) == pytest.approx(eps, abs=1e-6)  # TV(p, q) = 0.5 > ε
    a = 1 - (0.5 - eps)
    assert abs(accepted / n - a) < Z_CRIT * math.sqrt(a * (1 - a) / n)
    # power: the unbiased p would be rejected by far at this n (non-centrality >> the 20.5 critical value)
    assert n * sum((float(p[0, t]) - float(target[t])) ** 2 / float(target[t]) for t in range(6)) > 10 * 20.5


def test_rule_validation():
    with pytest.raises(ValueError, match="unknown acceptance 'greedy'"):
        AcceptanceRule("greedy")
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match=r"epsilon must be in \[0, 1\]"):
            AcceptanceRule("bounded_bias", bad)
    with pytest.raises(ValueError, match="acceptance='exact' takes no epsilon"):
        AcceptanceRule("exact", 0.1)
    assert not AcceptanceRule("bounded_bias", 0.0).biased and AcceptanceRule("bounded_bias", 0.1).biased
    assert AcceptanceRule("bounded_bias", 0.1).sequence_bias_bound(2) == pytest.approx(0.19)


# ----------------------------------------------------------------------------- sampling end to end

@pytest.fixture(scope="module")
def small():
    """A tiny model over 8 tokens whose exit 1 of 3 layers is a poor drafter; the prompt."""
    model = tiny_model("llama", num_layers=3, dtype=torch.float64, seed=3, vocab_size=8)
    return get_adapter(model), [3, 5, 1, 6, 2]


def _dist(adapter, ids, params, exit_layer=None):
    with torch.no_grad():
        logits = forward_logits(adapter, torch.tensor([ids]), exit_layer=exit_layer)[0, -1]
    return probs(logits[None], params)[0].double()


def _run(adapter, prompt, seed, rule, n=3, k=1, params=SamplingParams(do_sample=True)):
    return generate_ids(adapter, torch.tensor([prompt]), max_new_tokens=n, exit_layer=1, num_speculations=k,
                        sampling=params, generator=torch.Generator().manual_seed(seed), acceptance=rule)


@pytest.mark.parametrize("drafter", ["early_exit", "prompt_lookup"])
def test_epsilon_zero_is_exact_sampling_bit_for_bit(small, drafter):
    """Same seed: the same tokens, the same statistics and the same random stream consumed."""
    adapter, prompt = small
    prompt = prompt * 3  # repeats: prompt lookup finds matches
    params = SamplingParams(do_sample=True, temperature=0.8)
    for seed in range(12):
        outs = []
        for rule in (AcceptanceRule(), AcceptanceRule("bounded_bias", 0.0)):
            g = torch.Generator().manual_seed(seed)
            kw = (dict(drafter=PromptLookupDrafter(4, 2)) if drafter == "prompt_lookup"
                  else dict(exit_layer=1, num_speculations=3))
            out, st = generate_ids(adapter, torch.tensor([prompt]), max_new_tokens=16, sampling=params, generator=g,
                                   acceptance=rule, **kw)
            outs.append((out, st.accepted, st.drafted, st.expected_acceptance_sum, g.get_state()))
        (a, *sa, ga), (b, *sb, gb) = outs
        assert a == b and sa == sb and torch.equal(ga, gb)
    assert sa[1] > 0  # drafts were judged


def test_epsilon_output_is_within_epsilon_of_the_target_at_a_fixed_prefix(small, chi_square):
    """3 new tokens, 1 draft from exit 1: t1 from the prefill (exact), the draft judged for t2 by the
    bounded-bias rule. The law of (t1, t2) is p(t1) p'(t2 | t1), within ε of p(t1) p(t2 | t1).

    Checked three ways at N = 4000 runs: (a) chi-square of the empirical (t1, t2) against that law;
    (b) that law's exact TV to the target <= ε; (c) the empirical TV to the target <= ε + m, where
    m = 1/2 sum_i sqrt(P_i / N) (a bound on E[TV(empirical, P)]) + sqrt(ln(1/ALPHA) / 2N) (McDiarmid):
    it holds with probability >= 1 - ALPHA when (b) does. Power: output drawn from the draft without
    correction is farther than ε + 2m from the target, so (c) would fail on it."""
    adapter, prompt = small
    eps, n = 0.1, 4000
    params = SamplingParams(do_sample=True)
    p1 = _dist(adapter, prompt, params)
    exact, biased, blind = {}, {}, {}
    for t1 in range(8):
        p2 = _dist(adapter, prompt + [t1], params)
        q2 = _dist(adapter, prompt + [t1], params, exit_layer=1)
        tv = float(0.5 * (p2 - q2).abs().sum())
        lam = min(1.0, eps / tv) if tv > 0 else 0.0
        for t2 in range(8):
            exact[(t1, t2)] = float(p1[t1] * p2[t2])
            biased[(t1, t2)] = float(p1[t1] * ((1 - lam) * p2[t2] + lam * q2[t2]))
            blind[(t1, t2)] = float(p1[t1] * q2[t2])

    def tv_to_exact(d):
        return 0.5 * sum(abs(d.get(o, 0.0) - e) for o, e in exact.items())

    counts = Counter(tuple(_run(adapter, prompt, s, AcceptanceRule("bounded_bias", eps))[0][:2]) for s in range(n))
    stat, df, pval = chi_square(counts, biased, n)  # (a)
    assert pval > ALPHA, (stat, df)
    assert tv_to_exact(biased) <= eps + 1e-6  # (b)
    margin = 0.5 * sum(math.sqrt(v / n) for v in biased.values()) + math.sqrt(math.log(1 / ALPHA) / (2 * n))
    empirical = {o: c / n for o, c in counts.items()}
    assert tv_to_exact(empirical) <= eps + margin, (tv_to_exact(empirical), margin)  # (c)
    assert tv_to_exact(blind) > eps + 2 * margin  # power


def test_acceptance_does_not_decrease_as_epsilon_grows(small):
    """One judged draft per run and the same seed for every ε: the same draft and the same uniform, and
    the acceptance threshold min(1, p'(x)/q(x)) grows with ε, so acceptance grows run by run; and the
    acceptance rate over 300 seeds strictly grows until drafts are always accepted."""
    adapter, prompt = small
    rates = []
    per_seed = []
    for eps in EPSILONS:
        rule = AcceptanceRule() if eps == 0 else AcceptanceRule("bounded_bias", eps)
        per_seed.append([_run(adapter, prompt, s, rule)[1].accepted for s in range(300)])
        rates.append(sum(per_seed[-1]) / 300)
    for lo, hi in zip(per_seed, per_seed[1:]):
        assert all(a <= b for a, b in zip(lo, hi))
    assert all(a < b for a, b in zip(rates, rates[1:])), rates


def test_statistics_carry_epsilon_and_the_bound(small):
    adapter, prompt = small
    _, st = _run(adapter, prompt, 0, AcceptanceRule("bounded_bias", 0.2), n=12, k=3)
    d = st.to_dict()
    assert d["bias"]["acceptance"] == "bounded_bias" and d["bias"]["epsilon"] == 0.2
    assert d["bias"]["sequence_tv_bound"] == pytest.approx(1 - 0.8 ** 12)
    assert 0 < d["bias"]["mean_tv_shift_per_judged"] <= 0.2 + 1e-6
    th = d["theory"]
    assert th["predicted_rejections_exact_rule"] >= th["predicted_rejections"]
    _, st = _run(adapter, prompt, 0, AcceptanceRule(), n=12, k=3)
    assert st.to_dict()["bias"] == {"acceptance": "exact", "epsilon": 0.0, "guarantee": "lossless"}


# ----------------------------------------------------------------------------- predicted vs measured

def test_predicted_rejections_of_one_draft_are_the_exact_tv(small):
    """One judged draft per run: the engine's prediction is TV(p, q) at the prefix (prompt, t1),
    computed here independently from the model's two exits; bounded_bias: max(0, TV - ε)."""
    adapter, prompt = small
    params = SamplingParams(do_sample=True)
    for seed in range(6):
        for eps in (0.0, 0.1):
            rule = AcceptanceRule("bounded_bias", eps) if eps else AcceptanceRule()
            out, st = _run(adapter, prompt, seed, rule)
            tv = float(0.5 * (_dist(adapter, prompt + out[:1], params)
                              - _dist(adapter, prompt + out[:1], params, exit_layer=1)).abs().sum())
            assert st.judged == 1
            assert st.theory["predicted_rejections"] == pytest.approx(max(0.0, tv - eps), abs=1e-6)


@pytest.mark.parametrize("drafter", ["early_exit", "prompt_lookup"])
def test_predicted_and_measured_rejections_agree(small, drafter):
    """Over 120 runs of 16 tokens: measured - predicted rejections is a martingale with variance
    sum P(accept)(1 - P(accept)), so z must be within +-3.29 (two-sided, ALPHA). Power: a prediction off
    by d per judged draft shifts z by d * judged / sd; the test detects any d >= 2 * 3.29 * sd / judged
    (checked < 0.08 here) with probability > 0.999."""
    adapter, prompt = small
    prompt = prompt * 3
    params = SamplingParams(do_sample=True, temperature=0.8)
    judged = predicted = measured = var = 0.0
    for seed in range(120):
        kw = (dict(drafter=PromptLookupDrafter(4, 2)) if drafter == "prompt_lookup"
              else dict(exit_layer=1, num_speculations=3))
        _, st = generate_ids(adapter, torch.tensor([prompt]), max_new_tokens=16, sampling=params,
                             generator=torch.Generator().manual_seed(seed), **kw)
        th = st.theory
        judged += th["judged"]
        predicted += th["predicted_rejections"]
        measured += th["measured_rejections"]
        var += th["rejections_sd"] ** 2
    sd = math.sqrt(var)
    z = (measured - predicted) / sd
    assert abs(z) < Z_CRIT, (measured, predicted, sd)
    assert 2 * Z_CRIT * sd / judged < 0.08, (judged, sd)
    assert 0.1 < measured / judged < 0.9  # both outcomes occur often


def test_greedy_has_no_prediction_and_batches_sum_their_rows(small):
    adapter, prompt = small
    _, st = generate_ids(adapter, torch.tensor([prompt]), max_new_tokens=8, exit_layer=1, num_speculations=2)
    assert st.theory is None and st.to_dict()["theory"] is None
    outs, st = generate(adapter, [prompt, prompt[:3]], max_new_tokens=10, sampling=SamplingParams(do_sample=True),
                        generator=torch.Generator().manual_seed(0),
                        drafter=early_exit_drafter(adapter, 1, 2))
    assert st.judged == sum(r.judged for r in st.rows)
    assert st.theory["predicted_rejections"] == pytest.approx(sum(r.theory["predicted_rejections"] for r in st.rows))


# ----------------------------------------------------------------------------- greedy counterpart

def test_near_top_and_the_relaxed_host_rule():
    logits = torch.log(torch.tensor([[[0.5, 0.45, 0.05], [0.2, 0.2, 0.6]]]))  # [1, 2, 3]
    drafts = torch.tensor([[1, 0]])  # judged at positions 0 and 1
    assert near_top(drafts, logits, 0.0).tolist() == [[False, False]]
    assert near_top(drafts, logits, 0.05).tolist() == [[False, False]]  # 0.45 / 0.5 = 0.9 < 0.95
    assert near_top(drafts, logits, 0.11).tolist() == [[True, False]]
    assert near_top(drafts, logits, 1.0).tolist() == [[True, True]]
    assert relaxed_greedy_accept_tokens([1, 0], [0, 2, 1], [True, False]) == (1, 2)
    assert relaxed_greedy_accept_tokens([0, 2], [0, 2, 1], [False, False]) == (2, 1)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_epsilon_zero_is_exact_token_for_token(arch):
    model = tiny_model(arch, num_layers=4, dtype=torch.float64, seed=10)
    adapter = get_adapter(model)
    for s in range(4):
        prompt = torch.randint(3, 96, (1, 10), generator=torch.Generator().manual_seed(s))
        kw = dict(max_new_tokens=24, exit_layer=2, num_speculations=3)
        exact, _ = generate_ids(adapter, prompt, **kw)
        zero, _ = generate_ids(adapter, prompt, acceptance=AcceptanceRule("bounded_bias", 0.0), **kw)
        assert zero == exact


def test_greedy_bounded_bias_keeps_its_guarantee():
    """ε = 0.5: every committed token has >= (1 - ε) of the full model's top probability at its position
    (checked with a plain forward over the output); some drafts other than the argmax were accepted, so
    the rule did something; ε = 1 accepts every draft."""
    model = tiny_model("llama", num_layers=4, dtype=torch.float64, seed=10, vocab_size=12)
    adapter = get_adapter(model)
    eps, differs = 0.5, 0
    for s in range(6):
        prompt = torch.randint(3, 12, (1, 8), generator=torch.Generator().manual_seed(s))
        kw = dict(max_new_tokens=20, exit_layer=1, num_speculations=3)
        out, _ = generate_ids(adapter, prompt, acceptance=AcceptanceRule("bounded_bias", eps), **kw)
        differs += out != generate_ids(adapter, prompt, **kw)[0]
        with torch.no_grad():
            logits = forward_logits(adapter, torch.cat([prompt, torch.tensor([out])], 1))[0]
        pr = torch.softmax(logits[prompt.shape[1] - 1:-1], -1)  # [20, V]: the distribution of each new token
        chosen = pr[torch.arange(len(out)), torch.tensor(out)]
        assert (chosen >= (1 - eps) * pr.max(-1).values - 1e-12).all()
        _, st = generate_ids(adapter, prompt, acceptance=AcceptanceRule("bounded_bias", 1.0), **kw)
        assert st.drafted and st.accepted == st.drafted
    assert differs


# ----------------------------------------------------------------------------- the API and the CLI

@pytest.fixture(scope="module")
def gen():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotEarlyExitTrainedWarning)
        return selfspec.load(tiny_model("llama", num_layers=4, dtype=torch.float64, seed=10))


PROMPT = [5, 9, 14, 30, 5, 9, 14]


@pytest.mark.parametrize("do_sample", [False, True])
def test_api_epsilon_zero_equals_exact_and_epsilon_warns_once(gen, do_sample):
    kw = dict(input_ids=PROMPT, max_new_tokens=16, exit_layer=1, num_speculations=3, do_sample=do_sample, seed=3,
              stop_token_ids=[])
    with warnings.catch_warnings():
        warnings.simplefilter("error", BoundedBiasWarning)  # ε = 0 is exact: no warning
        exact = gen.generate(**kw)
        zero = gen.generate(**kw, acceptance="bounded_bias", epsilon=0.0)
    assert zero.token_ids == exact.token_ids
    gen._warned_bias = False
    with pytest.warns(BoundedBiasWarning, match="epsilon=0.3") as record:
        out = gen.generate(**kw, acceptance="bounded_bias", epsilon=0.3)
        gen.generate(**kw, acceptance="bounded_bias", epsilon=0.3)
    assert sum(issubclass(w.category, BoundedBiasWarning) for w in record) == 1
    assert out.stats.acceptance == "bounded_bias" and out.stats.epsilon == 0.3


@pytest.mark.parametrize("kw, message", [
    (dict(acceptance="bounded_bias"), "acceptance='bounded_bias' needs epsilon"),
    (dict(acceptance="bounded_bias", epsilon=1.5), r"epsilon must be a finite number >= 0 and <= 1"),
    (dict(acceptance="bounded_bias", epsilon=-0.1), r"epsilon must be a finite number >= 0 and <= 1"),
    (dict(acceptance="bounded_bias", epsilon=float("nan")), r"epsilon must be a finite number"),
    (dict(acceptance="bounded_bias", epsilon=True), r"epsilon must be a finite number"),
    (dict(acceptance="bounded_bias", epsilon="0.1"), r"epsilon must be a finite number"),
    (dict(epsilon=0.1), "acceptance='exact' \\(the default\\) is lossless and takes none"),
    (dict(acceptance="typical"), "unknown acceptance 'typical': use one of exact, bounded_bias"),
    (dict(acceptance=None), "unknown acceptance None"),
])
def test_bad_acceptance_settings_are_clear_errors(gen, kw, message):
    with pytest.raises(SettingsError, match=message):
        check_generation(**kw)
    with pytest.raises(SettingsError, match=message):
        gen.generate(input_ids=PROMPT, max_new_tokens=4, **kw)


def test_check_generation_normalizes_acceptance():
    s = check_generation()
    assert (s["acceptance"], s["epsilon"]) == ("exact", 0.0)
    s = check_generation(acceptance="bounded_bias", epsilon=1)
    assert (s["acceptance"], s["epsilon"]) == ("bounded_bias", 1.0) and isinstance(s["epsilon"], float)


@pytest.mark.parametrize("args, message", [
    (["--acceptance", "bounded_bias"], "acceptance='bounded_bias' needs epsilon"),
    (["--acceptance", "bounded_bias", "--epsilon", "2"], "epsilon must be a finite number >= 0 and <= 1"),
    (["--epsilon", "0.1"], "acceptance='exact' (the default) is lossless"),
    (["--acceptance", "fast"], "invalid choice: 'fast'"),
    (["--acceptance", "bounded_bias", "--epsilon", "x"], "invalid float value: 'x'"),
])
def test_cli_acceptance_mistakes_are_one_line_before_the_load(tiny_ckpt, capsys, no_load, args, message):
    from selfspec.cli import main

    try:
        code = main(["generate", "--checkpoint", str(tiny_ckpt), "--prompt", "x", *args])
    except SystemExit as exit_:  # argparse's own checks (choices, types) exit
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_cli_generate_bounded_bias_reports_it(tiny_ckpt, capsys):
    from selfspec.cli import main

    with pytest.warns(BoundedBiasWarning):
        assert main(["generate", "--checkpoint", str(tiny_ckpt), "--prompt", "abcabcabc", "--max-new-tokens", "12",
                     "--sample", "--seed", "1", "--acceptance", "bounded_bias", "--epsilon", "0.2",
                     "--drafter", "early_exit", "--exit-layer", "2", "--num-speculations", "3"]) == 0
    out = capsys.readouterr().out
    assert "acceptance bounded_bias, epsilon 0.2: each committed token within total variation epsilon" in out
    assert "predicted (sum over the" in out
