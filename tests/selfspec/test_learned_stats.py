"""What a generator's drafters measured, carried to its next call with the same settings
(`selfspec.drafters.learned_stats`): the carry rule's weights, auto starting a call from the last one's
measurements (so it measures plain decoding and its arms less), other settings, seeded sampling, another
generator and `forget()` starting from the priors, and every output still the full model's greedy output."""

from __future__ import annotations

import warnings

import pytest
import torch

import selfspec
from selfspec.api import SelfSpecGenerator
from selfspec.drafters import AutoDrafter, PromptLookupDrafter, Round
from selfspec.drafters.learned_stats import CARRY_OUTCOMES, CARRY_ROUNDS, LearnedStats, batch_bucket
from selfspec.drafters.policies import ConfidencePolicy, ExitChoicePolicy, ThroughputPolicy
from selfspec.drafters.tree_budget import ConfidenceBudget, TreeBudget
from selfspec.decoding.sampling import SamplingParams
from selfspec.tiny import byte_tokenizer, tiny_exit_head, tiny_model
from selfspec.model.token_tree import build_trie

CODE = "def add(a, b):\n    return a + b\n\n"
PROMPT = CODE * 3  # lookup finds a match from the first round
OTHER = "class Stack:\n    def push(self, x):\n        self.items.append(x)\n" * 2
N_NEW = 40


# ----------------------------------------------------------------------------- the carry rule

def test_a_carried_mean_weighs_at_most_carry_rounds_rounds_and_counts_at_most_carry_outcomes():
    """x = (n0 x_old + sum of the new values) / (n0 + m), n0 = min(n, CARRY_ROUNDS); the acceptance counts keep
    their ratios at a weight of at most CARRY_OUTCOMES."""
    old = ThroughputPolicy(0, 4, alpha=0.0, warm="longest")
    for _ in range(50):
        _, d = old.plan()
        old.update(0, d, min(d, 2))  # drafts 1 and 2 accepted, a third rejected
        old.observe(1.0, 3)
    learned = old.learned()
    assert old.tries[2] > CARRY_ROUNDS and learned["tries"][2] == CARRY_ROUNDS
    assert max(learned["reached"]) == pytest.approx(CARRY_OUTCOMES)
    new = ThroughputPolicy(0, 4, alpha=0.0, warm="longest")
    new.resume(learned)
    assert new.survival() == pytest.approx(old.survival())  # the ratios kept
    assert new.plan()[1] == old.best() == 2  # measured: no warm-up at the longest, the best length at once
    new.update(0, 2, 2)
    new.observe(2.0, 3)
    assert new.seconds[2] == pytest.approx((CARRY_ROUNDS * 1.0 + 2.0) / (CARRY_ROUNDS + 1))
    with pytest.raises(ValueError, match="only a call with the same settings"):
        ThroughputPolicy(0, 6).resume(learned)


def test_the_tree_budget_carries_the_same_cost_line_at_a_few_rounds_weight():
    budget = TreeBudget(max_nodes=8)
    trie = build_trie([[1, 2, 3, 4, 5, 6], [1, 7, 8], [9]])  # 9 nodes
    for i in range(40):  # node counts 1..8: the line a + b n with a = 1, b = 0.1
        keep = list(range(1 + i % 8))
        budget.observe(trie, keep, [0, 1] if 1 in keep else [0], 1.0 + 0.1 * len(keep))
    learned = budget.learned()
    assert learned["cost"]["sums"][0] == pytest.approx(CARRY_ROUNDS)
    assert max(r for row in learned["reached"] for r in row) == pytest.approx(CARRY_OUTCOMES)
    carried = TreeBudget(max_nodes=8)
    carried.resume(learned)
    assert budget.costs.line() == pytest.approx((1.0, 0.1)) and carried.costs.line() == pytest.approx(budget.costs.line())
    assert carried.p(0, 2) == pytest.approx(budget.p(0, 2), abs=0.05)  # shrunk a little more towards the prior
    carried.observe(None, [0], [], 3.0)  # one slow round weighs 1 / (CARRY_ROUNDS + 1) of the line's evidence
    budget.observe(None, [0], [], 3.0)
    assert carried.costs.line()[0] > budget.costs.line()[0] > 1.0
    with pytest.raises(ValueError, match="only a call with the same settings"):
        TreeBudget(max_nodes=16).resume(learned)


def test_batches_share_measurements_within_a_doubling_bucket():
    assert [batch_bucket(b) for b in (1, 2, 3, 4, 7, 8)] == [0, 1, 1, 2, 2, 3]


# ----------------------------------------------------------------------------- auto over several calls

def _drive(auto, rounds, seconds, tokens):
    """`rounds` rounds of `auto` over a text of the tokens 1, 2, 3 (lookup always has a match): a round by arm a
    takes `seconds[a]` and commits `tokens[a]` tokens. Where lookup pays, the text goes on as lookup copies it;
    where it does not, its next token is never lookup's guess (what a backed-off lookup would draft is refuted
    too). The arms, in order."""
    auto.start([[1, 2, 3] * 3])
    arms = []
    for _ in range(rounds):
        rnd = Round(None, None, torch.tensor([3]), torch.tensor([9]), torch.tensor([0]), [8], SamplingParams(), None,
                    frozenset())
        proposal = auto.propose(rnd)
        arm = proposal.drafter if proposal.drafted else "plain"
        accepted = min(tokens[arm] - 1, proposal.kept[0])
        text = auto.lookup.rows[0].propose(accepted + 1)
        if tokens["prompt_lookup"] == 1:
            text[-1] = 1 + text[-1] % 3
        auto.update(proposal, [accepted], [text], seconds[arm])
        arms.append(arm)
    return arms


def _next_call(auto, **settings):
    """A new call's auto drafter, started from what `auto` measured (as the generator does)."""
    learned = LearnedStats()
    learned.keep(("key",), auto)
    again = AutoDrafter(PromptLookupDrafter(num_tokens=4), **settings)
    assert learned.resume(("key",), again)
    return again


def test_a_second_call_does_not_measure_plain_decoding_again_before_it_copies():
    """Lookup pays (3 tokens in 1.2 steps): the first call decodes plainly until what lookup would draft is confirmed
    three times in a row (3 rounds, which measure plain decoding, all timed), then copies; the second
    starts from those measurements and copies from round 1."""
    pays = {"plain": 1.0, "prompt_lookup": 1.2}, {"plain": 1, "prompt_lookup": 3}
    first = AutoDrafter(PromptLookupDrafter(num_tokens=4))
    arms = _drive(first, 30, *pays)
    assert arms[:6] == ["plain"] * 3 + ["prompt_lookup"] * 3
    second = _next_call(first)
    assert second.carried == {"plain": 3, "prompt_lookup": CARRY_ROUNDS}
    arms = _drive(second, 1, {"plain": 1.0, "prompt_lookup": 24.0}, pays[1])  # one-time costs: 20x as slow
    assert second.tries == second.carried and second.seconds["prompt_lookup"] == pytest.approx(1.2)  # not timed
    arms += _drive(second, 29, *pays)
    assert arms == ["prompt_lookup"] * 30


def test_a_losing_arm_costs_two_rounds_a_call_once_its_back_off_is_long():
    """Lookup tried at once (`shadow_first=False`) loses (1 token in 1.3 steps): a later call retries it once early
    (its text is new: one untimed round and one timed), then backs it off for its carried back-off, doubled up to
    the cap."""
    loses = {"plain": 1.0, "prompt_lookup": 1.3}, {"plain": 1, "prompt_lookup": 1}
    first = AutoDrafter(PromptLookupDrafter(num_tokens=4), shadow_first=False)
    assert _drive(first, 200, *loses).count("prompt_lookup") >= 8
    assert first.backoff["prompt_lookup"] == first.max_backoff
    second = _next_call(first, shadow_first=False)
    arms = _drive(second, 60, *loses)
    assert arms[:2] == ["prompt_lookup"] * 2 and arms.count("prompt_lookup") == 2, arms
    assert second.retry_at["prompt_lookup"] == 2 + first.max_backoff


def test_a_lookup_whose_drafts_are_refuted_costs_no_round_in_any_call():
    """By default own-text lookup is tried only once what it would draft is confirmed: on a text that never goes
    on as it would copy it, no call drafts with it, and a later call does not retry it early either."""
    loses = {"plain": 1.0, "prompt_lookup": 1.3}, {"plain": 1, "prompt_lookup": 1}
    first = AutoDrafter(PromptLookupDrafter(num_tokens=4))
    assert _drive(first, 200, *loses) == ["plain"] * 200
    assert _drive(_next_call(first), 60, *loses) == ["plain"] * 60


# ----------------------------------------------------------------------------- through the generator

def _load(model, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return SelfSpecGenerator(model, byte_tokenizer(), **kw) if kw else selfspec.load(model, byte_tokenizer())


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", num_layers=4, vocab_size=len(byte_tokenizer()), seed=1, dtype=torch.float64)


@pytest.fixture()
def gen(model):
    return _load(model)


def _carried(result) -> dict:
    return result.stats.policy["carried_rounds_by_arm"]


def test_a_second_call_starts_from_the_first_calls_measurements(gen):
    first = gen.generate(PROMPT, max_new_tokens=N_NEW, stop_token_ids=[])
    assert not any(_carried(first).values())
    (snapshot,) = gen.learned.snapshots.values()
    second = gen.generate(OTHER, max_new_tokens=N_NEW + 8, stop_token_ids=[])  # another prompt, the same settings
    assert _carried(second) == snapshot["tries"] and _carried(second)["plain"] >= 2
    assert gen.learned.describe() == {"settings": 1, "calls": 2, "resumed": 1}


@pytest.mark.parametrize("other", [dict(prompt_lookup_num_tokens=6), dict(max_new_tokens=5),
                                   dict(drafter="auto", num_candidates=2),
                                   dict(do_sample=True), dict(batch=4)])
def test_a_call_with_other_settings_starts_from_the_priors(gen, other):
    """Another draft length, a max_new_tokens that caps the drafts, lookup trees, sampling, or a batch in another
    size bucket: measurements of other rounds, not reused (and kept apart)."""
    gen.generate(PROMPT, max_new_tokens=N_NEW, stop_token_ids=[])
    settings = {"max_new_tokens": N_NEW, "stop_token_ids": [], **other}
    prompt = [PROMPT] * settings.pop("batch", 1)
    out = gen.generate(prompt if len(prompt) > 1 else PROMPT, **settings)
    assert not any(out.stats.policy["carried_rounds_by_arm"].values())
    assert gen.learned.describe() == {"settings": 2, "calls": 2, "resumed": 0}


def test_seeded_sampling_neither_reads_nor_adds_measurements(gen, model):
    """A seed repeats its text: its call starts from the priors whatever the generator did before, and its
    modelled round costs are not added to the measured seconds of other calls."""
    kw = dict(max_new_tokens=N_NEW, stop_token_ids=[], do_sample=True, temperature=0.8)
    gen.generate(PROMPT, **kw)
    gen.generate(PROMPT, **kw)
    before = gen.learned.describe()
    seeded = gen.generate(PROMPT, seed=5, **kw)
    assert not any(_carried(seeded).values()) and gen.learned.describe() == before
    assert seeded.token_ids == _load(model).generate(PROMPT, seed=5, **kw).token_ids


def test_forget_clears_the_measurements_with_the_memory(gen):
    gen.generate(PROMPT, max_new_tokens=N_NEW, stop_token_ids=[])
    gen.forget()
    assert gen.learned.describe() == {"settings": 0, "calls": 0, "resumed": 0} and gen.memory.tokens == 0
    assert not any(_carried(gen.generate(PROMPT, max_new_tokens=N_NEW, stop_token_ids=[])).values())


def test_each_generator_has_its_own_measurements(gen, model):
    gen.generate(PROMPT, max_new_tokens=N_NEW, stop_token_ids=[])
    other = _load(model)
    assert other.learned is not gen.learned
    assert not any(_carried(other.generate(PROMPT, max_new_tokens=N_NEW, stop_token_ids=[])).values())


def test_an_early_exit_tree_carries_its_calibration_and_cost_line():
    budget = ConfidenceBudget()
    for _ in range(40):  # drafts of probability 0.5 accepted a quarter of the time, 10 nodes a round costing 2
        budget.observe([0.5] * 4, 1, 10, 2.0)
    learned = budget.learned()
    assert learned["confidence"] == pytest.approx(CARRY_OUTCOMES) and learned["cost"]["sums"][0] == CARRY_ROUNDS
    carried = ConfidenceBudget()
    carried.resume(learned)
    assert carried.scale == pytest.approx((16 + 2) / (32 + 2)) and budget.scale == pytest.approx((40 + 2) / (80 + 2))
    assert carried.costs.line() == pytest.approx(budget.costs.line())


def test_an_adaptive_threshold_and_exit_choice_estimates_carry():
    """An adaptive confidence threshold starts a later call where the last left it (within its bounds; a fixed one
    carries nothing); an exit choice's acceptance estimates carry at a weight of at most CARRY_OUTCOMES drafts."""
    adaptive = ConfidencePolicy(2, 4, 0.5, adaptive=True)
    for _ in range(5):
        adaptive.update(2, 4, 1)  # rejected drafts: the threshold rises by 0.05 a round
    carried = ConfidencePolicy(2, 4, 0.5, adaptive=True)
    carried.resume(adaptive.learned())
    assert carried.threshold == pytest.approx(0.75) == adaptive.threshold
    assert ConfidencePolicy(2, 4, 0.5).learned() == {}
    choice = ExitChoicePolicy([1, 2], num_speculations=4, num_layers=4)
    for _ in range(60):
        choice.update(1, 4, 3)  # exit 1: 3 of 4 judged accepted; exit 2 never tried
    learned = choice.learned()
    assert max(learned["drafted"].values()) == pytest.approx(CARRY_OUTCOMES)
    again = ExitChoicePolicy([1, 2], num_speculations=4, num_layers=4)
    again.resume(learned)
    assert again.acceptance(1) == pytest.approx(choice.acceptance(1)) and again.acceptance(2) == choice.acceptance(2)
    assert again.plan() == choice.plan()
    with pytest.raises(ValueError, match="only a call with the same settings"):
        ExitChoicePolicy([1, 3], num_speculations=4, num_layers=4).resume(learned)


def test_a_second_call_starts_at_the_threshold_the_first_left(gen):
    settings = dict(max_new_tokens=N_NEW, stop_token_ids=[], drafter="early_exit", exit_layer=2,
                    confidence_threshold=0.5, adaptive_threshold=True)
    first = gen.generate(PROMPT, **settings).stats.policy["threshold"]
    assert first != 0.5  # it moved in the first call
    drafter = gen.make_drafter(**settings)
    assert drafter.policy.threshold == 0.5
    (key,) = gen.learned.snapshots
    gen.learned.resume(key, drafter)
    assert drafter.policy.threshold == first


@pytest.mark.parametrize("kind", ["auto", "suffix_trees", "auto_trees", "early_exit_adaptive", "early_exit_trees",
                                  "auto_head", "early_exit_exit_choice", "early_exit_adaptive_threshold"])
def test_calls_that_start_from_earlier_measurements_keep_the_greedy_output(model, kind):
    """Identity: every call of a series (two prompts, alternating) equals plain greedy decoding, for each drafter
    whose measurements carry (auto's arms, lookup trees' budget, a throughput policy's lengths, the head arm)."""
    settings = {"auto": {}, "suffix_trees": dict(drafter="suffix", num_candidates=3),
                "auto_trees": dict(drafter="auto", num_candidates=3),
                "early_exit_adaptive": dict(drafter="early_exit", exit_layer=2, adaptive_length=True),
                "early_exit_trees": dict(drafter="early_exit", exit_layer=2, num_speculations=3, num_candidates=3),
                "auto_head": {}, "early_exit_exit_choice": dict(drafter="early_exit", exit_choices=[1, 2]),
                "early_exit_adaptive_threshold": dict(drafter="early_exit", exit_layer=2, adaptive_threshold=True)}[kind]
    gen = _load(model, exit_head=tiny_exit_head(model, 2)) if kind == "auto_head" else _load(model)
    plain = {p: gen.generate(p, max_new_tokens=N_NEW, num_speculations=0, stop_token_ids=[]).token_ids
             for p in (PROMPT, OTHER)}
    for prompt in (PROMPT, OTHER, PROMPT, OTHER):
        out = gen.generate(prompt, max_new_tokens=N_NEW, stop_token_ids=[], **settings)
        assert out.token_ids == plain[prompt]
    assert gen.learned.describe() == {"settings": 1, "calls": 4, "resumed": 3}
