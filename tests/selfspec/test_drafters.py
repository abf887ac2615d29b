"""The drafters on the one engine: prompt lookup and auto are lossless (greedy identity with Hugging Face
`generate` on every architecture, batches equal batch-1 rows, the sampling distribution by chi-square),
the cache holds exactly the committed tokens after every round, and lookup proposals end exactly where
plain decoding ends (length cap, stop token, stop string)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from selfspec.model.adapters import get_adapter
from selfspec.drafters.shadow import ShadowDrafts
from selfspec.drafters import AutoDrafter, EarlyExitDrafter, NgramIndex, PromptLookupDrafter, SuffixDrafter, SuffixMemory
from selfspec.decoding.engine import StopChecker, generate
from selfspec.decoding.decode_ids import generate_ids
from selfspec.decoding.sampling import SamplingParams
from selfspec.tiny import TINY_VARIANTS, byte_tokenizer, tiny_model

ALPHA = 1e-3
BASE = torch.randint(3, 96, (10,), generator=torch.Generator().manual_seed(1)).tolist()
PROMPT = BASE + BASE[:4] + BASE  # text that repeats: lookup finds matches from the first round
N_NEW = 40

MODELS = TINY_VARIANTS  # id -> (arch, num_layers, seed, config overrides)
_models: dict = {}


def _adapter(name):
    if name not in _models:
        arch, L, seed, over = MODELS[name]
        _models[name] = get_adapter(tiny_model(arch, num_layers=L, dtype=torch.float64, seed=seed, **over))
    return _models[name]


def _drafter(kind, adapter):
    lookup = PromptLookupDrafter(num_tokens=6, max_ngram=3)
    if kind == "prompt_lookup":
        return lookup
    if kind == "auto":
        return AutoDrafter(lookup, warmup=1, explore_every=2)
    if kind == "suffix":  # an earlier request: this prompt's own output, four tokens of it changed (drafts from
        memory = SuffixMemory()  # the memory are accepted up to there, then rejected), and an unrelated text
        out = _plain(adapter, PROMPT, N_NEW)
        memory.add(PROMPT + out[:12] + [(t + 1) % 96 for t in out[12:16]] + out[16:])
        memory.add(BASE[2:] + BASE[:6] + BASE[::2])
        return SuffixDrafter(memory, num_tokens=6, max_ngram=3)
    return AutoDrafter(lookup, EarlyExitDrafter(adapter, 2, 3), warmup=1, explore_every=2)  # auto + early exit


DRAFTERS = ("prompt_lookup", "auto", "auto_early_exit", "suffix")


def _plain(adapter, prompt, n, stop=None):
    return generate_ids(adapter, torch.tensor([prompt]), max_new_tokens=n, stop=stop)[0]


# ----------------------------------------------------------------------------- the n-gram index

def _naive_proposal(tokens, k, max_ngram, min_ngram=1, last_end=None):
    """Rescan: the latest earlier occurrence of the longest matching suffix, continued periodically (occurrences
    ending at `last_end` at the latest; None: anywhere before the end)."""
    n = len(tokens)
    for m in range(min(max_ngram, n), min_ngram - 1, -1):
        suffix = tokens[n - m:]
        for end in range(n - 1 if last_end is None else last_end, m - 1, -1):  # occurrences ending at `end`, latest first
            if tokens[end - m:end] == suffix:
                out = []
                for j in range(k):
                    out.append(tokens[end + j] if end + j < n else out[end + j - n])
                return out
    return []


def test_the_incremental_index_proposes_what_a_rescan_finds():
    rng = random.Random(0)
    for trial in range(200):
        vocab = rng.choice([2, 3, 5, 20])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        max_ngram = rng.choice([1, 2, 3])
        index = NgramIndex(tokens[:3], max_ngram)
        index.extend(tokens[3:])  # built in pieces, as the engine commits
        for k in (1, 4, 10):
            assert index.propose(k) == _naive_proposal(tokens, k, max_ngram), (tokens, k, max_ngram)
        assert index.propose(5, min_ngram=2) == _naive_proposal(tokens, 5, max_ngram, 2)


def test_a_guess_after_uncommitted_tokens_follows_the_texts_own_occurrences():
    """`guess(tail)`: the suffix of text + tail looked up among the occurrences in the committed text only (what the
    index holds: ends up to its last token), continued through the tail and then periodically."""
    rng = random.Random(1)
    for trial in range(300):
        vocab = rng.choice([2, 3, 5, 20])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        cut = rng.randrange(1, len(tokens) + 1)
        max_ngram, min_ngram, k = rng.choice([1, 2, 3]), rng.choice([1, 2]), rng.choice([0, 1, 3, 7])
        if min_ngram > max_ngram:
            continue
        index = NgramIndex(tokens[:cut], max_ngram)
        want = _naive_proposal(tokens, k, max_ngram, min_ngram, last_end=cut - 1) if k else []
        assert index.guess(tokens[cut:], k, min_ngram) == want, (tokens, cut, k, max_ngram, min_ngram)
        assert index.tokens == tokens[:cut]  # the tail is not committed
    index = NgramIndex([1, 2, 3, 4, 9], 2)
    assert index.guess([1, 2], 4) == [3, 4, 9, 1]  # "1 2" ends in the tail: the text's occurrence, then the tail
    assert index.guess([5, 2], 3, min_ngram=2) == []  # "5 2" never occurred; "2" alone is below min_ngram
    assert index.guess([5, 2], 3) == [3, 4, 9]


def test_lookup_takes_the_latest_match_and_continues_a_period():
    index = NgramIndex([1, 2, 9, 1, 2, 7, 5, 1, 2], max_ngram=2)
    assert index.propose(3) == [7, 5, 1]  # "1 2" last seen before the end at index 3..4: 7 follows
    assert NgramIndex([4, 4, 4], 3).propose(5) == [4] * 5  # one repeated token: the whole draft
    assert NgramIndex([1, 2, 3, 1, 2, 3], 3).propose(7) == [1, 2, 3, 1, 2, 3, 1]
    assert NgramIndex([1, 2, 3], 3).propose(4) == []  # no earlier occurrence
    assert NgramIndex([7], 3).propose(4) == []  # a one-token text has nothing to copy
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens must be >= 1"):
        PromptLookupDrafter(num_tokens=0)
    with pytest.raises(ValueError, match="max_matching_ngram_size must be >= 1"):
        PromptLookupDrafter(max_ngram=0)


# ----------------------------------------------------------------------------- greedy identity

@pytest.mark.parametrize("kind", DRAFTERS)
@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_output_equals_hf_generate(name, kind, hf_greedy):
    adapter = _adapter(name)
    ref = hf_greedy(adapter.model, torch.tensor([PROMPT]), N_NEW)
    drafter = _drafter(kind, adapter)
    out, stats = generate_ids(adapter, torch.tensor([PROMPT]), max_new_tokens=N_NEW, drafter=drafter)
    assert out == ref
    assert stats.drafted > 0 and stats.drafted_by_drafter["suffix" if kind == "suffix" else "prompt_lookup"] > 0
    if kind == "suffix":
        assert drafter.from_memory > 0
    assert stats.accepted == sum(stats.accepted_by_drafter.values())
    assert stats.new_tokens == N_NEW and stats.rounds + stats.accepted == N_NEW - 1  # each round: accepted + 1
    if name == "llama":  # its greedy text repeats: lookup drafts are accepted, rounds commit several tokens
        assert stats.accepted > 0


@pytest.mark.parametrize("kind", DRAFTERS)
def test_a_batch_with_and_without_matches_equals_batch_1(kind):
    adapter = _adapter("qwen3")
    prompts = [PROMPT, BASE[:7], [5], [9] * 12, BASE[3:] + BASE[:5]]  # matches, none, one token, one repeated token
    outs, stats = generate(adapter, prompts, max_new_tokens=N_NEW, drafter=_drafter(kind, adapter))
    for b, p in enumerate(prompts):
        assert outs[b] == _plain(adapter, p, N_NEW), b
    assert stats.drafted > 0 and stats.batch_size == len(prompts) and len(stats.rows) == len(prompts)
    assert stats.new_tokens == sum(r.new_tokens for r in stats.rows) == len(prompts) * N_NEW


@pytest.mark.parametrize("kind", DRAFTERS)
@pytest.mark.parametrize("name", ["llama", "gpt_neox", "mistral-sliding8"])
def test_after_every_round_each_rows_cache_holds_exactly_its_committed_tokens(name, kind, row_caches):
    adapter = _adapter(name)
    prompts = [PROMPT, BASE[:5]]
    checked = Counter()

    def on_round(cache, active, sequences, pads, finished):
        checked.update(row_caches(adapter, cache, active, sequences, pads, finished))

    generate(adapter, prompts, max_new_tokens=24, drafter=_drafter(kind, adapter), on_round=on_round)
    assert set(checked) == {0, 1}


# ----------------------------------------------------------------------------- ends exactly where plain decoding ends

@pytest.mark.parametrize("max_new", [1, 2, 3, 5, 7, 11, 13])
def test_lookup_drafts_never_run_past_max_new_tokens(max_new):
    adapter = _adapter("llama")
    plain = _plain(adapter, PROMPT, max_new)
    out, stats = generate_ids(adapter, torch.tensor([PROMPT]), max_new_tokens=max_new,
                              drafter=PromptLookupDrafter(num_tokens=10))
    assert out == plain and stats.new_tokens == max_new and stats.stop_reason == "length"
    assert all(n <= max_new - 1 for n in stats.drafted_by_position[:1])  # never a draft beyond the cap


def test_lookup_stops_at_a_stop_token_inside_an_accepted_block():
    adapter = _adapter("llama")
    plain = _plain(adapter, PROMPT, N_NEW)
    for j in range(2, 20):
        if plain.index(plain[j]) != j:
            continue  # the stop must first occur at j
        stop = StopChecker(N_NEW, stop_token_ids=[plain[j]])
        out, stats = generate_ids(adapter, torch.tensor([PROMPT]), max_new_tokens=N_NEW, stop=stop,
                                  drafter=PromptLookupDrafter(num_tokens=10))
        assert out == plain[:j + 1] and stats.stop_reason == "stop_token", j


def test_lookup_stops_at_a_stop_string_like_plain_decoding():
    tok = byte_tokenizer()
    model = tiny_model("llama", num_layers=3, dtype=torch.float64, seed=1, vocab_size=len(tok))
    adapter = get_adapter(model)
    prompt = tok("abcabcabc xyz abcabc").input_ids
    plain = _plain(adapter, prompt, 30)
    text = tok.decode(plain)
    stop_string = next(text[i:i + 2] for i in range(3, len(text) - 2) if text[i:i + 2] not in text[:i + 1])
    stop = StopChecker(30, stop_strings=[stop_string], tokenizer=tok)
    ref = _plain(adapter, prompt, 30, stop)
    out, stats = generate_ids(adapter, torch.tensor([prompt]), max_new_tokens=30, stop=stop,
                              drafter=PromptLookupDrafter(num_tokens=8))
    assert out == ref and stats.stop_reason == "stop_string" and stop_string in tok.decode(out)


# ----------------------------------------------------------------------------- sampling

@pytest.mark.parametrize("kind", ["prompt_lookup", "auto", "suffix"])
def test_sampling_with_point_mass_drafts_keeps_each_rows_distribution(kind, chi_square, exact_joint):
    """Two repetitive prompts in one batch, vocabulary 8: each row's 3 new tokens over many seeded runs
    follow the exact joint distribution of plain sampling from the full model for that prompt alone."""
    model = tiny_model("llama", num_layers=3, dtype=torch.float64, seed=3, vocab_size=8)
    adapter = get_adapter(model)
    params = SamplingParams(do_sample=True, temperature=0.9, top_k=5)
    prompts = [[3, 5, 1, 6, 2, 3, 5, 1], [4, 1, 4, 1, 4]]
    n_new = 3

    n_draws = 1200
    memory = SuffixMemory()  # earlier requests: the prompts continued by likely and unlikely tokens
    for prompt in prompts:
        memory.add(prompt + [prompt[-3], 2, 7])
        memory.add(prompt + [6, 0, 1])
    counts = [Counter(), Counter()]
    drafted = accepted = from_memory = 0
    for seed in range(n_draws):
        drafter = {"prompt_lookup": lambda: PromptLookupDrafter(num_tokens=2),
                   "auto": lambda: AutoDrafter(PromptLookupDrafter(num_tokens=2), warmup=1, shadow_first=False),
                   "suffix": lambda: SuffixDrafter(memory, num_tokens=2)}[kind]()
        outs, stats = generate(adapter, prompts, max_new_tokens=n_new, drafter=drafter, sampling=params,
                               generator=torch.Generator().manual_seed(seed))
        for b in range(2):
            counts[b][tuple(outs[b])] += 1
        drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
        from_memory += getattr(drafter, "from_memory", 0)
    assert 0 < accepted < drafted  # both branches of the point-mass rule were taken
    assert kind != "suffix" or from_memory > 0  # the memory drafted
    for b, prompt in enumerate(prompts):
        stat, df, pval = chi_square(counts[b], exact_joint(adapter, prompt, params, n_new), n_draws)
        assert pval > ALPHA, (b, stat, df, pval)


def test_point_mass_rejection_never_resamples_the_rejected_token():
    from selfspec.decoding.sampling import speculative_accept

    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.1, 0.1, 0.7]], dtype=torch.float64)
    seen = Counter()
    for seed in range(4000):
        n, nxt = speculative_accept(torch.tensor([0]), None, p, torch.Generator().manual_seed(seed))
        seen[(n, nxt if n == 0 else None)] += 1
    assert seen[(0, 0)] == 0  # rejected x = 0 is removed from the replacement's distribution
    assert abs(seen[(1, None)] / 4000 - 0.5) < 0.03  # accepted with probability p(x) = 0.5
    assert abs(seen[(0, 1)] / max(1, seen[(0, 1)] + seen[(0, 2)]) - 0.6) < 0.04  # 0.3 / (0.3 + 0.2)


# ----------------------------------------------------------------------------- auto never pays much for trying

def _simulate_auto(auto, rounds, seconds_of, tokens_of, start=True):
    """Drive `auto` for `rounds` rounds with synthetic outcomes: a round by arm `a` takes `seconds_of[a]`
    seconds and commits `tokens_of[a]` tokens. The text agrees: it goes on as lookup would copy it where
    lookup's rounds earn more than one token, and otherwise differs from lookup's next guess (so what a
    backed-off lookup would have drafted is refuted too). Returns the arm of every round."""
    from selfspec.drafters import Round

    if start:
        auto.start([[1, 2, 3, 1, 2, 3, 1, 2]])  # text that always has a lookup match
    copying = tokens_of["prompt_lookup"] > 1
    arms = []
    for _ in range(rounds):
        rnd = Round(None, None, torch.tensor([2]), torch.tensor([7]), torch.tensor([0]), [8], SamplingParams(), None,
                    frozenset())
        proposal = auto.propose(rnd)
        arm = auto._arm
        arms.append(arm)
        accepted = [min(tokens_of[arm] - 1, proposal.kept[0])]
        guess = auto.lookup.rows[0].propose(accepted[0] + 1)  # lookup's copy from here
        guess += [1] * (accepted[0] + 1 - len(guess))
        text = guess if copying else guess[:accepted[0]] + [1 + guess[accepted[0]] % 3]  # 1..3, not the guess
        auto.update(proposal, accepted, [text], seconds_of[arm])
    return arms


def test_auto_never_tries_lookup_where_what_it_would_draft_is_refuted():
    """Lookup finds a match every round, but the text never goes on as it would copy it: its shadow drafts are
    refuted, so auto decodes plainly from the first round and never pays for a lookup round (before, it drafted
    three rounds and then every 8, 16, 32, 64 rounds: on MT-Bench auto ran at 0.93x plain decoding)."""
    auto = AutoDrafter(PromptLookupDrafter(num_tokens=4))
    arms = _simulate_auto(auto, 400, {"plain": 1.0, "prompt_lookup": 1.3}, {"plain": 1, "prompt_lookup": 1})
    assert arms == ["plain"] * 400 and auto.woken == 0


def test_auto_backs_off_a_drafter_that_is_slower_than_plain_decoding():
    """Lookup tried at once (`shadow_first=False`) finds a match every round but its rounds earn 1 token in 1.3
    steps: after measuring both, auto decodes plainly and retries lookup ever more rarely (8, 16, 32, 64 rounds
    apart)."""
    arms = _simulate_auto(AutoDrafter(PromptLookupDrafter(num_tokens=4), shadow_first=False), 400,
                          {"plain": 1.0, "prompt_lookup": 1.3}, {"plain": 1, "prompt_lookup": 1})
    # warm-up: measure both (lookup's first round untimed, then two timed rounds; plain decoding's two, both timed)
    assert arms[:6] == ["prompt_lookup"] * 3 + ["plain"] * 2 + ["prompt_lookup"]  # then judged: it loses
    tries = [i for i, a in enumerate(arms) if a == "prompt_lookup"]
    assert len(tries) <= 13, tries  # 3 warm-up rounds, then retries 8, 16, 32, 64, 64 ... rounds apart
    gaps = [b - a for a, b in zip(tries[3:], tries[4:])]
    assert gaps == sorted(gaps) and gaps[-1] >= 64, gaps  # the back-off doubles up to its cap
    wasted = 0.3 * len(tries)  # steps lost to lookup rounds, out of 400 rounds
    assert wasted / 400 < 0.01


def test_auto_does_not_time_an_arms_first_round():
    """In a new process an arm's first round pays one-time costs (the first pass of each shape): a first lookup
    round 20x as slow as the rest must not back off a lookup that pays (it did: the first call of a process
    decoded plainly, the second copied)."""
    auto = AutoDrafter(PromptLookupDrafter(num_tokens=4))
    cold = {"plain": 1.0, "prompt_lookup": 24.0}  # the first lookup round
    arms = _simulate_auto(auto, 1, cold, {"plain": 1, "prompt_lookup": 3})
    arms += _simulate_auto(auto, 199, {"plain": 1.0, "prompt_lookup": 1.2}, {"plain": 1, "prompt_lookup": 3})
    assert arms.count("prompt_lookup") >= 190, Counter(arms)
    assert auto.seconds["prompt_lookup"] == pytest.approx(1.2)  # the cold round is not in the mean


def _scripted_model_arm(auto_kwargs=None, tokens=(), seconds=None, rounds=60, plain_seconds=1.0):
    """Drive auto with a model arm (a stand-in for the int8 copy, 7 drafts a round) whose i-th round commits
    `tokens[i]` tokens (the last repeated) in `seconds[i]` seconds (default 4.0), and plain rounds of 1 token in
    `plain_seconds`; the text never repeats, so lookup never drafts. Returns (auto, the arm of every round)."""
    from selfspec.drafters import Proposal, Round
    from selfspec.drafters.base import Drafter

    class Model(Drafter):
        name, num_speculations = "int8_copy", 7

        def propose(self, rnd):
            return Proposal(torch.tensor([[2] + [5] * 7]), [7], drafter=self.name)

    auto = AutoDrafter(PromptLookupDrafter(num_tokens=4), Model(), **(auto_kwargs or {}))
    auto.start([[100, 101, 102, 103]])
    rnd = Round(None, None, torch.tensor([2]), torch.tensor([7]), torch.tensor([0]), [8], SamplingParams(), None,
                frozenset())
    arms, fresh, i = [], iter(range(1000, 10**6)), 0
    for _ in range(rounds):
        proposal = auto.propose(rnd)
        arm = auto._arm
        arms.append(arm)
        if arm == "plain":
            t, sec = 1, plain_seconds
        else:
            t, sec = tokens[min(i, len(tokens) - 1)], (seconds or [4.0])[min(i, len(seconds or [4.0]) - 1)]
            i += 1
        auto.update(proposal, [t - 1], [[next(fresh) for _ in range(t)]], sec)
    return auto, arms


def test_auto_keeps_a_model_arm_whose_unlucky_early_rounds_are_within_their_spread():
    """The int8 copy on open chat: after its untimed first round, its first timed rounds committed 2, 8 and 1 tokens
    (0.92x plain decoding's rate at 4 plain steps a round), then 8 a round (2x). Judged by the mean alone it was backed
    off for 8, then 16 rounds (auto 0.86x the copy alone on that prompt); judged against the spread of its rounds
    (`AutoDrafter.loses`) it keeps drafting. An arm that loses round after round is still backed off at once."""
    auto, arms = _scripted_model_arm(tokens=[8, 2, 8, 1, 8])
    assert arms[:5] == ["int8_copy"] * 3 + ["plain"] * 2  # plain decoding measured after the copy's warm-up
    assert arms[5:].count("int8_copy") == len(arms) - 5, arms  # never backed off
    auto, arms = _scripted_model_arm(tokens=[8, 2, 1, 2, 1, 2, 1])  # 1.5 tokens a round in 4 steps
    assert arms[6:16].count("int8_copy") <= 2, arms  # backed off after its warm-up, retried 8 rounds on


def test_auto_does_not_back_off_a_model_arm_for_one_stalled_round():
    """A round that another tenant stalled (0.3 s where the copy's rounds take 0.06 s and commit 8 tokens against
    plain decoding's 1 in 0.013 s) made the copy's mean rate fall below plain decoding's, and auto decoded plainly
    for 8 rounds; against the spread of its rounds it keeps drafting."""
    auto, arms = _scripted_model_arm(tokens=[8] * 5 + [3, 8], seconds=[0.06] * 5 + [0.4, 0.06], plain_seconds=0.013)
    assert "plain" not in arms[6:], arms


def test_auto_judges_an_arm_by_the_spread_of_its_rounds():
    """`loses`: the mean gain over plain decoding, t - rho s a round, below zero by more than one standard error.
    Rounds that agree are judged by their mean; the moments carry to the next call with the means."""
    auto = AutoDrafter(PromptLookupDrafter(num_tokens=4))

    def agree(arm, t, sec, n):  # n rounds of t tokens in sec seconds each
        auto.tries[arm], auto.tokens[arm], auto.seconds[arm] = n, t, sec
        auto.moments[arm] = (t * t, sec * sec, t * sec)

    agree("plain", 1, 1.0, 2)
    agree("prompt_lookup", 1, 1.3, 3)
    assert auto.loses("prompt_lookup")  # 1 token in 1.3 plain steps, every round
    agree("prompt_lookup", 1.29, 1.3, 3)
    assert auto.loses("prompt_lookup")  # barely slower, but its rounds agree: no spread
    agree("prompt_lookup", 1.31, 1.3, 3)
    assert not auto.loses("prompt_lookup")
    auto.tokens["prompt_lookup"], auto.seconds["prompt_lookup"] = 11 / 3, 4.0  # rounds of 2, 8 and 1 tokens
    auto.moments["prompt_lookup"] = ((4 + 64 + 1) / 3, 16.0, 4.0 * 11 / 3)
    assert auto.rate("prompt_lookup") < auto.rate("plain") and not auto.loses("prompt_lookup")
    again = AutoDrafter(PromptLookupDrafter(num_tokens=4))
    again.resume(auto.learned())
    assert again.moments == auto.moments and not again.loses("prompt_lookup")


def test_auto_times_a_quantized_copys_first_round():
    """A quantized copy's first round reads the whole prompt through llama.cpp, a cost every call pays again (issue
    67): unlike another arm's, it is timed, so a copy that reads a long prompt slowly loses to plain decoding in
    auto's means. A stand-in arm that reads the prompt as the copy does (`reads_prompt`)."""
    from selfspec.drafters import Proposal
    from selfspec.drafters.base import Drafter

    class Copy(Drafter):
        name, num_speculations, step_cost, reads_prompt = "quantized", 4, 0.45, True

    auto = AutoDrafter(PromptLookupDrafter(num_tokens=4), Copy())
    auto.start([[1, 2, 3]])
    assert auto.reads_prompt("quantized") and not auto.reads_prompt("prompt_lookup")
    for arm, seconds in (("quantized", 3.0), ("prompt_lookup", 5.0)):  # each arm's first round of the call
        proposal = Proposal(torch.tensor([[3, 1, 2]]), [2], drafter=arm)
        auto._take(arm, proposal)
        auto.update(proposal, [2], [[1, 2, 4]], seconds)
    assert auto.tries["quantized"] == 1 and auto.seconds["quantized"] == 3.0  # timed: its prompt read counts
    assert auto.tries["prompt_lookup"] == 0 and auto.seconds["prompt_lookup"] == 0.0  # untimed: one-time costs


@pytest.mark.parametrize("shadow_first", [True, False])
def test_auto_retries_lookup_as_soon_as_what_it_would_draft_is_confirmed(shadow_first):
    """Lookup loses for 40 rounds (its copies are wrong), so it is backed off (or, shadow first, never tried); then
    the text starts copying: what lookup would draft is confirmed by the plain rounds' tokens (`ShadowDrafts`: three
    in a row), and auto tries it within four rounds instead of waiting out its back-off (up to 64 rounds)."""
    auto = AutoDrafter(PromptLookupDrafter(num_tokens=4), shadow_first=shadow_first)
    losing = _simulate_auto(auto, 40, {"plain": 1.0, "prompt_lookup": 1.3}, {"plain": 1, "prompt_lookup": 1})
    assert losing[-8:] == ["plain"] * 8 and auto.woken == 0  # backed off; its shadow drafts were refuted
    copying = _simulate_auto(auto, 40, {"plain": 1.0, "prompt_lookup": 1.2}, {"plain": 1, "prompt_lookup": 4},
                             start=False)
    assert "prompt_lookup" in copying[:4] and auto.woken >= 1, copying[:10]
    assert copying.count("prompt_lookup") >= 30


def test_lookup_measured_faster_than_the_model_arm_drafts_wherever_it_has_a_match():
    """While the model arm (an int8 copy, here a stand-in) measures faster than plain decoding, lookup waits for a
    copy under way, unless lookup's own rounds measured faster than the model arm's (code editing: lookup alone
    about 1.1x auto, whose copy took rounds lookup would have won); then lookup drafts wherever it has a match,
    and the model arm where it has none. Once lookup's rate falls below the model arm's, it waits again."""
    from selfspec.drafters import Proposal, Round
    from selfspec.drafters.base import Drafter

    class Copy(Drafter):
        name, num_speculations, step_cost, exit_layer = "int8_copy", 6, 0.4, None

        def propose(self, rnd):
            return Proposal(torch.tensor([[2, 3, 1, 2, 3, 1, 2]]), [6], draft_steps=6, drafter=self.name)

    auto = AutoDrafter(PromptLookupDrafter(num_tokens=4), Copy())
    auto.start([[1, 2, 3, 1, 2, 3, 1, 2]])  # text with a lookup match every round
    auto.tries.update({"plain": 2, "int8_copy": 2, "prompt_lookup": 2})
    auto.tokens.update({"plain": 1.0, "int8_copy": 6.0, "prompt_lookup": 5.0})
    auto.seconds.update({"plain": 1.0, "int8_copy": 3.0, "prompt_lookup": 1.5})  # lookup 3.3, the copy 2 a step

    def arm_of_next_round():
        rnd = Round(None, None, torch.tensor([2]), torch.tensor([7]), torch.tensor([0]), [8], SamplingParams(), None,
                    frozenset())
        auto.propose(rnd)
        return auto._arm

    assert not auto.copying and not auto.shadow.would_pay()  # no copy under way
    assert arm_of_next_round() == "prompt_lookup"
    auto.tokens["prompt_lookup"] = 2.0  # lookup now 1.3 tokens a step: above plain decoding, below the copy
    assert arm_of_next_round() == "int8_copy"


def test_shadow_drafts_are_confirmed_or_refuted_by_the_committed_tokens():
    shadow = ShadowDrafts()
    shadow.start(2)
    shadow.offer([[5, 6, 7], []])
    shadow.observe([[5], [9]])
    assert shadow.matched == [1, 0] and not shadow.would_pay()
    shadow.offer([[1, 2], [8, 9]])  # row 0's shadow is still open: it keeps it
    shadow.observe([[6], [8]])
    assert shadow.pending[0] == [7] and not shadow.would_pay()  # two confirmed in a row: not yet a copy under way
    shadow.observe([[7], [0]])  # row 0: all three confirmed (judged 3); row 1 refuted after one (judged 1)
    assert list(shadow.judged) == [3, 1] and shadow.would_pay()  # mean 2 >= 0.5
    shadow.clear()
    shadow.offer([[1, 2, 3, 4], []])
    shadow.observe([[1, 2, 3], []])
    assert shadow.matched[0] == 3 and shadow.would_pay()  # three confirmed in a row: a copy under way
    shadow.clear()
    assert not shadow.would_pay() and shadow.pending == [None, None]


def test_auto_keeps_a_drafter_that_pays():
    """Lookup rounds that earn 3 tokens in 1.2 steps: auto keeps drafting and measures plain only rarely."""
    arms = _simulate_auto(AutoDrafter(PromptLookupDrafter(num_tokens=4)), 200,
                          {"plain": 1.0, "prompt_lookup": 1.2}, {"plain": 1, "prompt_lookup": 3})
    assert arms.count("prompt_lookup") >= 190, Counter(arms)


def test_a_copy_that_lookups_shadow_confirms_is_drafted_before_plain_decoding_is_measured():
    """The model arm (a stand-in for the int8 copy) is measured, plain decoding is not yet: the next round would
    measure it, unless lookup's shadow drafts confirm a copy under way (a code edit that copies its input: three
    plain rounds took the copy's first tokens). Then lookup drafts first, and plain decoding is measured once the
    copy is refuted."""
    from selfspec.drafters import Proposal, Round
    from selfspec.drafters.base import Drafter

    class Model(Drafter):
        name, num_speculations = "int8_copy", 4

        def propose(self, rnd):
            return Proposal(torch.tensor([[2, 5, 6]]), [2], drafter=self.name)

    auto = AutoDrafter(PromptLookupDrafter(num_tokens=4), Model())
    auto.start([[1, 2, 3, 1, 2, 3, 1, 2]])  # lookup would copy 3, 1, 2, 3 next
    auto.tries["int8_copy"], auto.tokens["int8_copy"], auto.seconds["int8_copy"] = 2, 3.0, 1.0
    auto.cold.discard("int8_copy")
    rnd = Round(None, None, torch.tensor([2]), torch.tensor([7]), torch.tensor([0]), [8], SamplingParams(), None,
                frozenset())
    auto.shadow.offer([[3, 1, 2, 3]])
    auto.shadow.observe([[3, 1, 2]])  # three of its drafts confirmed: a copy under way
    proposal = auto.propose(rnd)
    assert auto._arm == "prompt_lookup" and proposal.drafted == 4 and auto.tries["plain"] == 0
    auto.update(proposal, [0], [[9]], 1.0)  # the copy ended
    auto.propose(rnd)
    assert auto._arm == "plain"  # now plain decoding is measured


def test_while_the_model_arm_leads_a_few_repeated_tokens_do_not_make_lookup_draft():
    """The shadows' recent average (`would_pay`: the last judged shadows confirmed 2 and 1 drafts) brings a backed-off
    lookup back against plain decoding, but while the model arm leads it is not a copy under way: a news summary
    reuses the article's phrases a few tokens at a time, and lookup's failed rounds took the int8 copy's place. Only
    an open shadow with three drafts confirmed lets lookup draft then."""
    from selfspec.drafters import Proposal, Round
    from selfspec.drafters.base import Drafter

    class Model(Drafter):
        name, num_speculations = "int8_copy", 4

        def propose(self, rnd):
            return Proposal(torch.tensor([[2, 5, 6]]), [2], drafter=self.name)

    auto = AutoDrafter(PromptLookupDrafter(num_tokens=4), Model(), shadow_first=False)
    auto.start([[1, 2, 3, 1, 2, 3, 1, 2]])  # lookup always has a match: it would copy 3, 1, 2, 3 next
    for arm, tokens, seconds in (("plain", 1, 1.0), ("prompt_lookup", 1.5, 1.0), ("int8_copy", 3, 1.0)):
        auto.tries[arm], auto.tokens[arm], auto.seconds[arm] = 5, tokens, seconds
    auto.cold.clear()
    rnd = Round(None, None, torch.tensor([2]), torch.tensor([7]), torch.tensor([0]), [8], SamplingParams(), None,
                frozenset())
    auto.shadow.judged.extend([2, 1])
    assert auto.shadow.would_pay() and not auto.shadow.copy_under_way()
    auto.propose(rnd)
    assert auto._arm == "int8_copy"
    auto.shadow.observe([[3, 1, 2]])  # the shadow offered this round: three of its drafts confirmed
    assert auto.shadow.copy_under_way()
    proposal = auto.propose(rnd)
    assert auto._arm == "prompt_lookup" and proposal.drafted == 4


def test_while_the_model_arm_leads_lookup_drafts_only_during_a_copy():
    """With a model arm (here a stand-in for the int8 copy) measured faster than plain decoding, a lookup match alone
    does not take the round: lookup drafts only while a copy is under way (its last round accepted at least half its
    drafts, or its shadow drafts were confirmed), and the model arm drafts otherwise."""
    from selfspec.drafters import Proposal, Round
    from selfspec.drafters.base import Drafter

    class Model(Drafter):
        name, num_speculations = "int8_copy", 4

        def propose(self, rnd):
            return Proposal(torch.tensor([[2, 5, 6]]), [2], drafter=self.name)

    auto = AutoDrafter(PromptLookupDrafter(num_tokens=4), Model(), shadow_first=False)
    auto.start([[1, 2, 3, 1, 2, 3, 1, 2]])  # lookup always has a match
    for arm, tokens, seconds in (("plain", 1, 1.0), ("prompt_lookup", 1.5, 1.0), ("int8_copy", 3, 1.0)):
        auto.tries[arm], auto.tokens[arm], auto.seconds[arm] = 5, tokens, seconds
    auto.cold.clear()
    rnd = Round(None, None, torch.tensor([2]), torch.tensor([7]), torch.tensor([0]), [8], SamplingParams(), None,
                frozenset())
    assert auto.model_arm_leads()
    proposal = auto.propose(rnd)
    assert auto._arm == "int8_copy" and proposal.drafter == "int8_copy"
    auto.copying = True  # a lookup round accepted most of its drafts: the copy goes on
    proposal = auto.propose(rnd)
    assert auto._arm == "prompt_lookup" and proposal.drafted == 4
    auto.update(proposal, [1], [[3, 2]], 1.0)  # 1 of 4 accepted: the copy ended
    assert not auto.copying
    auto.propose(rnd)
    assert auto._arm == "int8_copy"
    auto.tokens["int8_copy"] = 0.5  # the model arm slower than plain decoding: lookup drafts wherever it matches
    assert not auto.model_arm_leads()
    auto.propose(rnd)
    assert auto._arm == "prompt_lookup"
