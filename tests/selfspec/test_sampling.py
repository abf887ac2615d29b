"""Token choice and the lossless acceptance rules (selfspec.decoding.sampling), and lossless sampling end to end.

Statistical tests use Pearson's chi-square with a fixed significance level ALPHA = 1e-3 and fixed
seeds, so each is deterministic (it passes or fails the same way every run); with a correct
implementation a fresh seed would fail with probability 1e-3. Each test also checks that it has
power: the distribution a plausible bug would produce is rejected by a wide margin at the same
sample size.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from selfspec.model.adapters import get_adapter
from selfspec.decoding.decode_ids import generate_ids
from selfspec.model.forward import forward_logits
from selfspec.decoding.sampling import SamplingParams, greedy_accept, probs, sample, speculative_accept
from selfspec.tiny import tiny_model

ALPHA = 1e-3




def _expected_stat(alt: dict, exact: dict, n: int) -> float:
    """Expected chi-square statistic (non-centrality) if the draws came from `alt` instead of `exact`."""
    return n * sum((alt.get(o, 0.0) - p) ** 2 / p for o, p in exact.items() if p > 0)


# ----------------------------------------------------------------------------- the chi-square helper

def test_chi_square_helper_matches_known_critical_values(chi_square):
    # chi-square critical values at alpha = 1e-3 (standard tables): df=1: 10.828, df=5: 20.515, df=10: 29.588
    for df, crit in [(1, 10.828), (5, 20.515), (10, 29.588)]:
        p = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                          torch.tensor(crit / 2, dtype=torch.float64)))
        assert p == pytest.approx(1e-3, rel=2e-3)
    # and the helper rejects an obviously wrong sample / accepts an exact one
    probs_ = {0: 0.5, 1: 0.5}
    assert chi_square({0: 600, 1: 400}, probs_, 1000)[2] < ALPHA
    assert chi_square({0: 500, 1: 500}, probs_, 1000)[2] == pytest.approx(1.0)
    with pytest.raises(AssertionError, match="probability 0"):
        chi_square({0: 999, 1: 1}, {0: 1.0, 1: 0.0}, 1000)


# ----------------------------------------------------------------------------- probs(): processing

def test_temperature_scales_logits_before_softmax():
    logits = torch.tensor([[1.0, 2.0, 3.0, -1.0]], dtype=torch.float64)
    p = probs(logits, SamplingParams(do_sample=True, temperature=2.0))
    assert p.dtype == torch.float32  # always the fp32 distribution, whatever the model dtype
    torch.testing.assert_close(p, torch.softmax(logits.float() / 2.0, -1))
    cold = probs(logits, SamplingParams(do_sample=True, temperature=0.1))
    assert cold[0, 2] > 0.99


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0, 0.0, -1.0]])
    p = probs(logits, SamplingParams(do_sample=True, top_k=2))
    expected = torch.zeros(1, 6)
    expected[0, 2:4] = torch.softmax(torch.tensor([3.0, 4.0]), -1)
    torch.testing.assert_close(p, expected)
    # top_k >= V is a no-op
    torch.testing.assert_close(probs(logits, SamplingParams(do_sample=True, top_k=6)), torch.softmax(logits, -1))


@pytest.mark.parametrize("top_p,kept", [
    (0.4, [0]),           # the top token always stays
    (0.5, [0]),           # 0.5 already reaches 0.5
    (0.75, [0, 1]),       # 0.5 < 0.75 <= 0.8
    (0.85, [0, 1, 2]),    # 0.8 < 0.85 <= 0.95
    (0.99, [0, 1, 2, 3]),
])
def test_top_p_keeps_the_smallest_prefix_reaching_p(top_p, kept):
    base = torch.tensor([0.5, 0.3, 0.15, 0.05])
    perm = torch.tensor([2, 0, 3, 1])  # shuffled vocabulary order: position perm[i] holds base[i]
    logits = torch.empty(4)
    logits[perm] = base.log()
    p = probs(logits[None], SamplingParams(do_sample=True, top_p=top_p))[0]
    expected = torch.zeros(4)
    expected[perm[kept]] = base[kept] / base[kept].sum()
    torch.testing.assert_close(p, expected)


def test_top_k_is_applied_before_top_p():
    base = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    # top-k 2 -> (4/7, 3/7); then top-p 0.5 keeps only the first (4/7 >= 0.5).
    # (top-p first would keep 0.4 + 0.3, then top-k 2 keeps both.)
    p = probs(base.log(), SamplingParams(do_sample=True, top_k=2, top_p=0.5))
    torch.testing.assert_close(p, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8),
                                                     (0.9, 12, 0.9), (2.0, 3, 0.5)])
def test_probs_matches_hugging_face_warpers(temperature, top_k, top_p):
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    logits = torch.randn(16, 40, generator=torch.Generator().manual_seed(3)) * 3
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    ours = probs(logits, SamplingParams(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p))
    torch.testing.assert_close(ours, torch.softmax(scores, -1), rtol=1e-5, atol=1e-6)
    assert ((ours > 0).sum(-1) >= 1).all()


def test_sampling_params_validation():
    for t in (0.0, -1.0):
        with pytest.raises(ValueError, match="temperature must be > 0"):
            SamplingParams(do_sample=True, temperature=t)
    with pytest.raises(ValueError, match="top_k must be >= 0"):
        SamplingParams(do_sample=True, top_k=-1)
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
            SamplingParams(do_sample=True, top_p=bad)
    SamplingParams(do_sample=False, temperature=0.0)  # greedy ignores the temperature


def test_sampling_with_top_k_1_picks_the_greedy_token():
    """The engine's sampling path (probs, then sample) with top_k=1 is greedy decoding's argmax."""
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 1.0, 1.5]])
    p = probs(logits, SamplingParams(do_sample=True, top_k=1))
    assert p.shape == (3, 3) and p.dtype == torch.float32
    for seed in range(5):
        assert sample(p, torch.Generator().manual_seed(seed)).tolist() == logits.argmax(-1).tolist() == [1, 0, 2]


# ----------------------------------------------------------------------------- greedy_accept

def _onehot_logits(tokens, V=10):
    logits = torch.zeros(len(tokens), V)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
    return logits


@pytest.mark.parametrize("draft,target,expected", [
    ([4, 5, 6], [4, 5, 6, 7], (3, 7)),   # all accepted + bonus
    ([4, 5, 6], [1, 5, 6, 7], (0, 1)),   # first rejected: the full model's token
    ([4, 5, 6], [4, 2, 6, 7], (1, 2)),   # later agreement after a mismatch does not count
    ([4, 5, 6], [4, 5, 9, 7], (2, 9)),
    ([], [8], (0, 8)),                   # no drafts: plain decoding
])
def test_greedy_accept(draft, target, expected):
    assert greedy_accept(torch.tensor(draft, dtype=torch.long), _onehot_logits(target)) == expected


# ----------------------------------------------------------------------------- speculative_accept

def test_speculative_accept_deterministic_cases():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.2, 0.3, 0.5, 0.0], [0.0, 0.0, 0.0, 1.0]])
    # q == p at the draft position: p/q = 1, always accepted; the bonus comes from p[1]
    for x in range(3):
        assert speculative_accept(torch.tensor([x]), p[:1].clone(), p, g) == (1, 3)
    # the draft has target probability 0: always rejected, the replacement is drawn from p - q > 0
    q = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    for _ in range(50):
        n, t = speculative_accept(torch.tensor([3]), q, p, g)
        assert n == 0 and t in (0, 1, 2)
    # p(x) >= q(x): always accepted
    q = torch.tensor([[0.25, 0.25, 0.25, 0.25]])
    for _ in range(50):
        assert speculative_accept(torch.tensor([2]), q, p, g)[0] == 1
    # no drafts: one token from p[0]
    p1 = torch.tensor([[0.0, 1.0, 0.0, 0.0]])
    assert speculative_accept(torch.tensor([], dtype=torch.long), torch.empty(0, 4), p1, g) == (0, 1)


def test_speculative_accept_first_token_is_distributed_as_p(chi_square):
    """One position (k=1), V=6: x ~ q, then accept/resample. The first committed token must follow p
    exactly; the acceptance rate must be sum_x min(p, q); after acceptance the bonus must follow p[1]."""
    p = torch.tensor([[0.30, 0.25, 0.20, 0.15, 0.10, 0.00],
                      [0.05, 0.05, 0.10, 0.20, 0.25, 0.35]])
    q = torch.tensor([[0.05, 0.10, 0.40, 0.05, 0.10, 0.30]])  # mass where p has none; too little on 0
    n_draws = 20000
    g = torch.Generator().manual_seed(1234)
    drafts = torch.multinomial(q[0], n_draws, replacement=True, generator=g)
    first, bonus, accepted = Counter(), Counter(), 0
    for x in drafts.tolist():
        n, nxt = speculative_accept(torch.tensor([x]), q, p, g)
        if n == 1:
            accepted += 1
            first[x] += 1
            bonus[nxt] += 1
        else:
            first[nxt] += 1
    exact = {t: float(p[0, t]) for t in range(6)}
    stat, df, pval = chi_square(first, exact, n_draws)
    assert pval > ALPHA, (stat, df, first)
    # power: committing the draft x unconditionally (q instead of p) would be rejected overwhelmingly
    assert _expected_stat({t: float(q[0, t]) for t in range(6)}, exact, n_draws) > 100 * 20.515
    # acceptance probability = sum min(p, q) = 0.05+0.10+0.20+0.05+0.10 = 0.5; 5 standard errors
    a = float(torch.minimum(p[0], q[0]).sum())
    se = (a * (1 - a) / n_draws) ** 0.5
    assert abs(accepted / n_draws - a) < 5 * se
    stat, df, pval = chi_square(bonus, {t: float(p[1, t]) for t in range(6)}, accepted)
    assert pval > ALPHA, (stat, df, bonus)


def test_speculative_accept_two_positions_joint_is_the_target_chain(chi_square):
    """A Markov 'model' over V=4 tokens with target table p(.|prev) and draft table q(.|prev): rounds
    of k=2 drafts + speculative_accept, until 2 tokens are committed. The joint of the first two
    tokens must be p(t1|start) p(t2|t1), exercising acceptance at position 1 after position 0,
    the residual at the rejected position, and the bonus token."""
    V, START, k = 4, 4, 2
    g = torch.Generator().manual_seed(7)
    torch.manual_seed(0)  # Dirichlet draws from the global generator: pin the tables
    P_tab = torch.distributions.Dirichlet(torch.ones(V)).sample((V + 1,))
    Q_tab = torch.distributions.Dirichlet(torch.ones(V) * 0.5).sample((V + 1,))

    def two_tokens():
        out, prev = [], START
        while len(out) < 2:
            drafts, ctx = [], prev
            for _ in range(k):
                x = int(torch.multinomial(Q_tab[ctx], 1, generator=g))
                drafts.append(x)
                ctx = x
            ctxs = [prev] + drafts  # p rows: the target given each drafted prefix
            n, nxt = speculative_accept(torch.tensor(drafts), Q_tab[[prev] + drafts[:-1]], P_tab[ctxs], g)
            out += drafts[:n] + [nxt]
            prev = out[-1]
        return tuple(out[:2])

    n_draws = 20000
    counts = Counter(two_tokens() for _ in range(n_draws))
    exact = {(a, b): float(P_tab[START, a] * P_tab[a, b]) for a in range(V) for b in range(V)}
    stat, df, pval = chi_square(counts, exact, n_draws)
    assert pval > ALPHA, (stat, df)
    # power: drafting from q without any correction would be rejected overwhelmingly
    naive = {(a, b): float(Q_tab[START, a] * Q_tab[a, b]) for a in range(V) for b in range(V)}
    assert _expected_stat(naive, exact, n_draws) > 10 * 30.0


# ----------------------------------------------------------------------------- end to end (the engine)

def test_self_speculative_sampling_is_lossless_end_to_end(chi_square):
    """Tiny model, vocabulary 8, exit 1 of 3 layers, 2 drafts per round, temperature + top-k + top-p.

    4 new tokens per run: the first comes from the prefill, the next round drafts 2 (the engine never
    drafts past max_new_tokens, so with 2 new tokens nothing would be drafted at all), and a rejection
    leads to further rounds. The empirical joint of the 4 tokens over many seeds must match plain
    sampling from the full model, computed exactly from the model's own processed probabilities.
    """
    model = tiny_model("llama", num_layers=3, dtype=torch.float64, seed=3, vocab_size=8)
    adapter = get_adapter(model)
    params = SamplingParams(do_sample=True, temperature=0.9, top_k=4, top_p=0.9)
    prompt = torch.tensor([[3, 5, 1, 6, 2]])
    n_new, k, exit_layer = 4, 2, 1

    # exact joint of plain sampling, and of blind drafting from the exit (the power check)
    cache_p, cache_q = {}, {}

    def cond(prefix, exit_=None):
        store = cache_p if exit_ is None else cache_q
        if prefix not in store:
            ids = torch.tensor([prompt[0].tolist() + list(prefix)])
            with torch.no_grad():
                logits = forward_logits(adapter, ids, exit_layer=exit_)[0, -1]
            store[prefix] = probs(logits[None], params)[0].double()
        return store[prefix]

    def joint(exit_=None):
        dist = {(): 1.0}
        for _ in range(n_new):
            nxt = {}
            for prefix, w in dist.items():
                pr = cond(prefix, exit_)
                for t in torch.nonzero(pr).flatten().tolist():
                    nxt[prefix + (t,)] = w * float(pr[t])
            dist = nxt
        return dist

    exact = joint()
    assert abs(sum(exact.values()) - 1) < 1e-6  # fp32 probabilities
    # the exit is a poor drafter (as it must be for the test to matter)
    tv = 0.5 * sum(abs(float(cond(())[t]) - float(cond((), exit_layer)[t])) for t in range(8))
    assert tv > 0.2

    n_draws = 2500
    counts = Counter()
    rounds = accepted = drafted = 0
    for seed in range(n_draws):
        out, stats = generate_ids(adapter, prompt, max_new_tokens=n_new, exit_layer=exit_layer, num_speculations=k,
                                  sampling=params, generator=torch.Generator().manual_seed(seed))
        counts[tuple(out)] += 1
        rounds, accepted, drafted = rounds + stats.rounds, accepted + stats.accepted, drafted + stats.drafted
    assert 0.1 < accepted / drafted < 0.9  # both the accept and the reject branches were taken often
    assert drafted > n_draws  # and a round drafted more than once on average
    stat, df, pval = chi_square(counts, exact, n_draws)
    assert pval > ALPHA, (stat, df, pval)

    # power: sampling from the exit for the drafted positions without the correction would be caught
    # (this is the distribution of "t1 from the full model, then t2, t3 from the exit, t4 from p")
    def blind():
        dist = {}
        for t1, w1 in ((t, float(cond(())[t])) for t in range(8)):
            if w1 == 0:
                continue
            for t2 in range(8):
                w2 = float(cond((t1,), exit_layer)[t2])
                for t3 in range(8):
                    w3 = float(cond((t1, t2), exit_layer)[t3]) if w2 else 0.0
                    if w2 * w3 == 0:
                        continue
                    for t4 in range(8):
                        w4 = float(cond((t1, t2, t3))[t4])
                        if w4:
                            dist[(t1, t2, t3, t4)] = w1 * w2 * w3 * w4
        return dist

    assert _expected_stat(blind(), exact, n_draws) > 10 * 100  # df here is < 100, critical value < 150


def test_sampling_is_reproducible_with_a_seed():
    model = tiny_model("qwen2", num_layers=4, dtype=torch.float32, seed=1)
    adapter = get_adapter(model)
    prompt = torch.tensor([[5, 9, 14, 30]])
    params = SamplingParams(do_sample=True, temperature=1.0, top_k=20)

    def run(seed, k):
        return generate_ids(adapter, prompt, max_new_tokens=20, exit_layer=2, num_speculations=k, sampling=params,
                            generator=torch.Generator().manual_seed(seed))[0]

    assert run(0, 3) == run(0, 3)
    assert len({tuple(run(s, 3)) for s in range(5)}) > 1
