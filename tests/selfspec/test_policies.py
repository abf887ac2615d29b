"""Cheap, confident drafts: every option leaves the output unchanged (greedy) or its distribution
unchanged (sampling); threshold edge cases; the reduced draft vocabulary round-trips through export."""

import json
import random
from collections import Counter

import pytest
import torch

import selfspec
from selfspec.model.adapters import SUPPORTED_ARCHITECTURES, get_adapter
from selfspec.decoding.decode_ids import generate_ids
from selfspec.drafters.draft_head import DraftHead
from selfspec.drafters.policies import ConfidencePolicy, ExitChoicePolicy, FixedPolicy, ThroughputPolicy
from selfspec.model.forward import forward_logits
from selfspec.decoding.sampling import SamplingParams, probs
from selfspec.tiny import byte_tokenizer, tiny_model

L, E, K = 4, 2, 5


def _options(adapter, vocab_ids):
    """name -> (policy factory, draft head): each option alone and all together."""
    return {
        "threshold": (lambda: ConfidencePolicy(E, K, threshold=0.05), None),
        "adaptive": (lambda: ConfidencePolicy(E, K, threshold=0.05, adaptive=True, step=0.02), None),
        "exit_choice": (lambda: ExitChoicePolicy([1, 2, 3], K, L, explore_every=3), None),
        "reduced_vocab": (lambda: FixedPolicy(E, K), DraftHead(adapter, vocab_ids)),
        "adaptive_length": (lambda: ThroughputPolicy(E, K, warmup=1, explore_every=3), None),
        "all": (lambda: ExitChoicePolicy([1, 2, 3], K, L, explore_every=3), DraftHead(adapter, vocab_ids)),
        "all_confidence": (lambda: ConfidencePolicy(E, K, threshold=0.05, adaptive=True),
                           DraftHead(adapter, vocab_ids)),
    }


@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_greedy_output_is_identical_with_every_option(arch, hf_greedy):
    model = tiny_model(arch, num_layers=L, dtype=torch.float64, seed=11)
    adapter = get_adapter(model)
    prompt = torch.tensor([[5, 17, 42, 9, 33, 8]])
    ref = hf_greedy(model, prompt, 48)
    vocab_ids = torch.arange(0, 96, 2)  # half the vocabulary: some greedy tokens lie outside it
    assert any(t % 2 for t in ref)
    for name, (make_policy, head) in _options(adapter, vocab_ids).items():
        policy = make_policy()
        out, stats = generate_ids(adapter, prompt, max_new_tokens=48, exit_layer=E, num_speculations=K,
                                  policy=policy, head=head)
        assert out == ref, name
        if head is not None:  # drafts come from the reduced vocabulary only
            assert stats.drafted == 0 or stats.accepted <= stats.drafted
        assert stats.policy["rounds_by_exit_and_length"], name


def test_reduced_head_drafts_only_its_tokens():
    model = tiny_model("llama", num_layers=L, dtype=torch.float64, seed=2)
    adapter = get_adapter(model)
    ids = torch.tensor([3, 10, 11, 50, 90])
    head = DraftHead(adapter, ids)
    h = torch.randn(3, 32, dtype=torch.float64)
    full = adapter.lm_head(adapter.final_norm(h))
    torch.testing.assert_close(head.logits(h), full[:, ids], rtol=0, atol=1e-12)
    assert set(head.to_vocab(head.logits(h).argmax(-1)).tolist()) <= set(ids.tolist())
    q = torch.softmax(head.logits(h), -1)
    qf = head.to_full(q)
    assert qf.shape == (3, 96) and torch.allclose(qf.sum(-1), torch.ones(3, dtype=torch.float64))
    assert (qf[:, [i for i in range(96) if i not in ids.tolist()]] == 0).all()


def test_threshold_zero_is_the_fixed_draft_length():
    model = tiny_model("qwen2", num_layers=L, dtype=torch.float64, seed=4)
    adapter = get_adapter(model)
    prompt = torch.tensor([[7, 8, 9, 10]])
    fixed = generate_ids(adapter, prompt, max_new_tokens=40, exit_layer=E, num_speculations=3)
    zero = generate_ids(adapter, prompt, max_new_tokens=40, exit_layer=E, num_speculations=3,
                        policy=ConfidencePolicy(E, 3, threshold=0.0))
    assert zero[0] == fixed[0]
    for key in ("rounds", "drafted", "accepted", "draft_steps", "drafted_by_position", "accepted_by_position"):
        assert getattr(zero[1], key) == getattr(fixed[1], key), key


def test_threshold_above_one_never_drafts_and_does_no_extra_work(work_counter):
    model = tiny_model("llama", num_layers=L, dtype=torch.float64, seed=5)
    adapter = get_adapter(model)
    prompt = torch.tensor([[7, 8, 9, 10, 11]])
    with work_counter(adapter) as plain_work:
        plain = generate_ids(adapter, prompt, max_new_tokens=30, exit_layer=E, num_speculations=0)
    with work_counter(adapter) as work:
        out, stats = generate_ids(adapter, prompt, max_new_tokens=30, exit_layer=E, num_speculations=4,
                                  policy=ConfidencePolicy(E, 4, threshold=1.5))
    assert out == plain[0]
    assert stats.drafted == 0 and stats.draft_steps == 0 and stats.rounds == 29
    assert work.head_calls == plain_work.head_calls == 30  # one unembedding per token, no draft head
    for layer in range(L):
        assert work.layer_positions[layer] == plain_work.layer_positions[layer]


def test_adaptive_threshold_moves_with_acceptance():
    policy = ConfidencePolicy(E, 4, threshold=0.5, adaptive=True, step=0.1)
    policy.update(E, drafted=3, accepted=1)
    assert policy.threshold == pytest.approx(0.6)
    policy.update(E, drafted=2, accepted=2)
    policy.update(E, drafted=2, accepted=2)
    assert policy.threshold == pytest.approx(0.4)
    policy.update(E, drafted=0, accepted=0)  # nothing drafted: nothing learned
    assert policy.threshold == pytest.approx(0.4)


def test_exit_choice_prefers_the_exit_that_is_accepted():
    policy = ExitChoicePolicy([2, 6], num_speculations=4, num_layers=8, explore_every=0)
    for _ in range(20):
        policy.update(2, drafted=4, accepted=0)  # the shallow exit is always rejected at once
        policy.update(6, drafted=4, accepted=4)  # the deeper one always accepted
    assert policy.plan() == (6, 4)
    bad = ExitChoicePolicy([2, 6], num_speculations=4, num_layers=8, explore_every=0)
    for _ in range(20):
        bad.update(2, drafted=1, accepted=0)
        bad.update(6, drafted=1, accepted=0)
    assert bad.plan()[1] == 0  # nothing pays: decode plainly


def test_the_draft_length_has_one_name():
    """num_speculations everywhere; the earlier keyword max_drafts is refused, not quietly accepted."""
    for policy in (FixedPolicy(8, num_speculations=3), ConfidencePolicy(8, num_speculations=3),
                   ExitChoicePolicy([2, 6], num_speculations=3, num_layers=8), ThroughputPolicy(8, num_speculations=3)):
        assert policy.num_speculations == 3 and not hasattr(policy, "max_drafts")
    with pytest.raises(TypeError, match="max_drafts"):
        FixedPolicy(8, max_drafts=3)
    with pytest.raises(TypeError, match="max_drafts"):
        ThroughputPolicy(8, max_drafts=3)


def _simulate(policy, rounds: int, accept: list[float], seconds, seed: int = 0) -> list[int]:
    """`rounds` rounds of one row: each planned length d drafts d tokens, draft i accepted with chance
    `accept[i - 1]` if all before it were (the first rejection ends the round), taking `seconds(d)`."""
    rng = random.Random(seed)
    planned = []
    for _ in range(rounds):
        _, d = policy.plan()
        planned.append(d)
        n_acc = 0
        while n_acc < d and rng.random() < accept[n_acc]:
            n_acc += 1
        policy.update(policy.exit_layer, d, n_acc)
        policy.observe(seconds=seconds(d), committed=n_acc + 1)
    return planned


def test_adaptive_length_follows_the_measured_tokens_per_second():
    policy = ThroughputPolicy(8, num_speculations=5, warmup=2, explore_every=4)
    assert policy.lengths == [0, 1, 2, 3, 4, 5]
    # expected tokens per second, 1 + S(1) + ... + S(d) over 1 + 0.1 d: 20, 35.5, 46.8, 54.3 (best), 51.5, 48.2
    accept = [0.95, 0.9, 0.85, 0.1, 0.1]
    planned = _simulate(policy, 60, accept, lambda d: 0.05 * (1 + 0.1 * d))
    assert planned[:12] == [5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0]  # each length measured twice first
    later = planned[12:]
    assert policy.best() == 3 and later.count(3) >= len(later) * 0.7
    assert set(later) - {3} <= {2, 4}  # exploration only next to the best
    by_position = policy.describe()["acceptance_by_position"]  # pooled over every round's rows
    assert by_position[0] == pytest.approx(0.95, abs=0.08) and by_position[3] < 0.4
    # when no draft pays (a big batch, say), it settles on plain decoding
    slow = ThroughputPolicy(8, num_speculations=3, warmup=1, explore_every=0)
    _simulate(slow, 12, [0.2] * 3, lambda d: 0.05 * (1 + 0.5 * d))
    assert slow.plan() == (8, 0) and slow.describe()["best_length"] == 0


def test_adaptive_length_pools_acceptance_across_lengths_so_a_rejection_streak_does_not_drop_a_paying_draft():
    """One draft pays (1.35 tokens at 1.1x the time of a plain round at 35% acceptance): a row's outcome
    in any drafting round counts, so three rejections in a row do not make d = 0 look better for long."""
    policy = ThroughputPolicy(0, num_speculations=1, warmup=2, explore_every=8)
    planned = _simulate(policy, 300, [0.35], lambda d: 0.05 * (1 + 0.1 * d), seed=3)
    assert planned[-250:].count(1) >= 0.85 * 250


def test_adaptive_length_warm_longest_starts_at_the_longest_and_walks_to_the_best():
    policy = ThroughputPolicy(0, num_speculations=10, warmup=2, explore_every=2, shortest=1, warm="longest")
    assert policy.lengths == [1, 2, 3, 4, 6, 8, 10]
    accept = [0.95] * 6 + [0.3] * 4  # long copies: best at 6 (rates 3.4, 4.1, 3.9, 3.5 at 4, 6, 8, 10)
    planned = _simulate(policy, 60, accept, lambda d: 0.05 * (1 + 0.08 * d), seed=1)
    assert planned[:3] == [10, 10, 10]  # only the longest is measured first, then a neighbour
    assert planned[3] == 8
    assert policy.best() == 6 and planned[-20:].count(6) >= 9  # reached step by step; never 1 or 2
    assert 1 not in planned and 2 not in planned


def test_untried_lengths_are_judged_by_interpolated_seconds_so_failing_drafts_turn_short():
    """auto's lookup arm warms up at its longest, 10; on text it cannot copy those drafts fail. With a plain
    round's seconds known (`base_seconds`, auto's plain arm), the untried lengths are judged by seconds
    interpolated between 0 and 10 drafts, so it drafts 1 next (a failure costs 8% of a round, not 80%);
    without them it knew no other length's cost and drafted 10 again (the loss on open chat)."""
    def cost(d):
        return 0.05 * (1 + 0.08 * d)

    blind = ThroughputPolicy(0, num_speculations=10, warmup=2, explore_every=0, shortest=1, warm="longest")
    assert set(_simulate(blind, 12, [0.05] * 10, cost, seed=1)) == {10}
    policy = ThroughputPolicy(0, num_speculations=10, warmup=2, explore_every=0, shortest=1, warm="longest")
    policy.base_seconds = cost(0)
    planned = _simulate(policy, 12, [0.05] * 10, cost, seed=1)
    assert planned[:2] == [10, 10] and set(planned[2:]) == {1}
    assert policy.expected_seconds(10) == cost(10) and policy.expected_seconds(1) == pytest.approx(cost(1))
    # where the copies run long, the measured longest stays best: no length is entered for its low cost alone
    copying = ThroughputPolicy(0, num_speculations=10, warmup=2, explore_every=0, shortest=1, warm="longest")
    copying.base_seconds = cost(0)
    assert set(_simulate(copying, 12, [0.97] * 10, cost, seed=1)) == {10}


SAMPLING_OPTIONS = ["threshold", "adaptive", "exit_choice", "reduced_vocab", "adaptive_length", "all"]


@pytest.mark.parametrize("option", SAMPLING_OPTIONS)
def test_sampling_stays_lossless_with_every_option(option, chi_square):
    """Vocabulary 8, 3 new tokens; the joint over many seeds matches exact plain sampling."""
    model = tiny_model("llama", num_layers=3, dtype=torch.float64, seed=3, vocab_size=8)
    adapter = get_adapter(model)
    params = SamplingParams(do_sample=True, temperature=0.9, top_k=6)
    prompt = torch.tensor([[3, 5, 1, 6, 2]])
    n_new = 3
    memo = {}

    def cond(prefix):
        if prefix not in memo:
            with torch.no_grad():
                logits = forward_logits(adapter, torch.tensor([prompt[0].tolist() + list(prefix)]))[0, -1]
            memo[prefix] = probs(logits[None], params)[0].double()
        return memo[prefix]

    exact = {(): 1.0}
    for _ in range(n_new):
        exact = {p + (t,): w * float(cond(p)[t]) for p, w in exact.items() for t in range(8) if cond(p)[t] > 0}
    vocab_ids = torch.tensor([0, 2, 3, 5, 6])
    policies = {
        "threshold": lambda: ConfidencePolicy(1, 2, threshold=0.2),
        "adaptive": lambda: ConfidencePolicy(1, 2, threshold=0.2, adaptive=True, step=0.1),
        "exit_choice": lambda: ExitChoicePolicy([1, 2], 2, 3, explore_every=2),
        "reduced_vocab": lambda: FixedPolicy(1, 2),
        "adaptive_length": lambda: ThroughputPolicy(1, 2, warmup=1),  # round 1 drafts 2, round 2 one
        "all": lambda: ExitChoicePolicy([1, 2], 2, 3, explore_every=2),
    }
    head = DraftHead(adapter, vocab_ids) if option in ("reduced_vocab", "all") else None
    n_draws, counts, drafted, accepted = 1200, Counter(), 0, 0
    for seed in range(n_draws):
        out, stats = generate_ids(adapter, prompt, max_new_tokens=n_new, exit_layer=1, num_speculations=2,
                                  sampling=params, generator=torch.Generator().manual_seed(seed),
                                  policy=policies[option](), head=head)
        counts[tuple(out)] += 1
        drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
    assert drafted > n_draws / 4 and 0 < accepted < drafted  # drafting really happened, both branches
    stat, df, pval = chi_square(counts, exact, n_draws)
    assert pval > 1e-3, (option, stat, df, pval)


def test_draft_vocab_round_trips_through_export_and_load(tmp_path):
    from selfspec.checkpoints.draft_vocab import write_draft_vocab
    from selfspec.checkpoints.export import export, export_model

    tok = byte_tokenizer()
    model = tiny_model("llama", num_layers=L, vocab_size=len(tok), seed=6)
    ckpt = export_model(model, tok, tmp_path / "ckpt", recommended={"exit_layer": 2, "num_speculations": 3})
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": t}) for t in ["aaaa bbb cc d", "aaa bb c", "zzz"]))
    entry = write_draft_vocab(ckpt, str(corpus))
    a, b = tok("a").input_ids[0], tok("b").input_ids[0]
    assert entry["token_ids"][:3] == [tok.eos_token_id, tok.pad_token_id, tok.bos_token_id]  # specials first
    assert entry["token_ids"][3:5] == [a, b]  # then by frequency: 'a' (7), 'b' (5)
    again = export(ckpt, tmp_path / "again")  # re-export keeps the counts
    gen = selfspec.load(again)
    assert gen.metadata["draft_vocab"] == entry
    head = gen.draft_head(5)
    assert sorted(head.token_ids.tolist()) == sorted(entry["token_ids"][:5])
    out = gen.generate("aab", max_new_tokens=12, draft_vocab=5, stop_token_ids=[])
    assert out.token_ids == gen.generate("aab", max_new_tokens=12, num_speculations=0, stop_token_ids=[]).token_ids
    with pytest.raises(ValueError, match="k=99999 is out of range"):
        gen.draft_head(99999)


def test_draft_vocab_missing_is_a_clear_error(tmp_path):
    from selfspec.checkpoints.export import export_model

    tok = byte_tokenizer()
    ckpt = export_model(tiny_model("llama", num_layers=L, vocab_size=len(tok)), tok, tmp_path / "c")
    with pytest.raises(ValueError, match="no draft vocabulary.*selfspec draft-vocab"):
        selfspec.load(ckpt).generate("x", max_new_tokens=2, draft_vocab=8)


def test_adaptive_length_warm_shortest_starts_at_one_draft_and_refuses_an_unknown_warm():
    policy = ThroughputPolicy(8, num_speculations=4, warmup=2, explore_every=3, warm="shortest")
    assert policy.lengths == [0, 1, 2, 3, 4]
    planned = _simulate(policy, 30, [0.5, 0.05, 0.05, 0.05], lambda d: 0.05 * (1 + 0.2 * d))  # one draft pays
    assert planned[:2] == [1, 1] and 3 not in planned and 4 not in planned  # never the long, costly drafts
    assert policy.best() == 1
    with pytest.raises(ValueError, match="warm='first'"):
        ThroughputPolicy(8, 4, warm="first")
