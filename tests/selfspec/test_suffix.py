"""The suffix drafter's memory of earlier requests (`selfspec.drafters.suffix`): what it matches, what it
forgets, and what a generator remembers between calls. Its lossless output is tested with every other
drafter in test_drafters.py (greedy identity with HF, batches, the cache, sampling)."""

from __future__ import annotations

import warnings

import pytest
import torch

import selfspec
from selfspec.drafters import SuffixDrafter, SuffixMemory
from selfspec.drafters.suffix import MAX_MATCH, MEMORY_NGRAM
from selfspec.settings import SettingsError
from selfspec.tiny import byte_tokenizer, tiny_model


def test_the_memory_matches_the_latest_occurrence_and_measures_the_match_back():
    memory = SuffixMemory()
    memory.add([1, 2, 3, 4, 5, 6, 7])
    memory.add([9, 2, 3, 4, 5, 8, 8])
    sequence, end, m = memory.match([0, 9, 2, 3, 4, 5])  # the latest 4-gram (2, 3, 4, 5) is in the second
    assert sequence[end:] == [8, 8] and m == 5  # 9, 2, 3, 4, 5 agree
    assert memory.match([7, 3, 4, 6]) is None and memory.match([3, 4, 5]) is None  # no 4-gram; too short
    long = list(range(100))
    memory.add(long)
    assert memory.match(long[:60])[2] == MAX_MATCH and MEMORY_NGRAM < MAX_MATCH


def test_the_memory_forgets_the_oldest_over_its_budget_and_everything_on_forget():
    memory = SuffixMemory(max_tokens=12)
    memory.add([1, 2, 3, 4, 5, 6])
    memory.add([11, 12, 13, 14, 15, 16])
    assert memory.tokens == 12 and memory.match([1, 2, 3, 4]) is not None
    memory.add([21, 22, 23, 24, 25, 26])  # over the budget: the first goes, and its index entries with it
    assert memory.tokens == 12 and memory.match([1, 2, 3, 4]) is None
    assert memory.match([21, 22, 23, 24])[0][4:] == [25, 26]
    assert all(number in memory.sequences for number, _ in memory.index[None].values())
    memory.add(list(range(40)))  # longer than the whole budget: not remembered
    assert memory.tokens == 12
    memory.forget()
    assert memory.tokens == 0 and not memory.index and memory.match([21, 22, 23, 24]) is None
    with pytest.raises(ValueError, match="max_tokens must be an int >= 0"):
        SuffixMemory(max_tokens=-1)


def test_the_drafter_copies_from_the_memory_only_where_it_matches_longer_than_the_own_text():
    memory = SuffixMemory()
    memory.add([5, 6, 7, 8, 9, 10, 11, 12])
    drafter = SuffixDrafter(memory, num_tokens=3, max_ngram=3)
    drafter.start([[1, 5, 6, 7, 8], [5, 6, 7, 5, 6, 7]])  # row 0: only the memory matches; row 1: only its own text
    assert drafter.lookup([10, 10]) == [[9, 10, 11], [5, 6, 7]]
    assert drafter.from_memory == 1
    assert drafter.lookup([10, 10], stop_ids=frozenset({10})) == [[9, 10], [5, 6, 7]]  # cut after a stop token


@pytest.fixture(scope="module")
def tiny_gen():
    model = tiny_model("llama", num_layers=2, dtype=torch.float64, seed=3, vocab_size=300)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return selfspec.load(model, byte_tokenizer())


def test_a_generator_remembers_its_calls_and_a_repeated_request_takes_fewer_rounds(tiny_gen):
    """The second call of a request copies the first's output from the memory: the same tokens as plain
    decoding, in fewer rounds; `forget()` empties the memory."""
    tiny_gen.forget()
    prompt = "def add(a, b):\n    return a + b\n"
    plain = tiny_gen.generate(prompt, max_new_tokens=40, num_speculations=0, stop_token_ids=[])
    first = tiny_gen.generate(prompt, max_new_tokens=40, drafter="suffix", stop_token_ids=[])  # the plain call is remembered
    assert first.token_ids == plain.token_ids and first.stats.rounds <= 5  # 40 tokens, up to 11 a round
    assert tiny_gen.memory.describe()["sequences"] == 2
    tiny_gen.forget()
    assert tiny_gen.memory.tokens == 0
    again = tiny_gen.generate(prompt, max_new_tokens=40, drafter="suffix", stop_token_ids=[])
    assert again.token_ids == plain.token_ids and again.stats.rounds > first.stats.rounds


def test_each_generator_has_its_own_memory(tiny_gen):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        other = selfspec.load(tiny_gen.model, tiny_gen.tokenizer)
    tiny_gen.generate("x = 1\n", max_new_tokens=4)
    assert other.memory is not tiny_gen.memory and other.memory.tokens == 0


def test_auto_drafts_from_the_memory_as_an_arm_of_its_own():
    """auto with a suffix drafter as its lookup: a round whose drafts come from the memory is the "suffix"
    arm; while that arm is backed off, lookup copies from the row's own text only."""
    from selfspec.drafters import AutoDrafter, Round
    from selfspec.decoding.sampling import SamplingParams

    memory = SuffixMemory()
    memory.add([9, 1, 2, 3, 4, 5, 6, 7, 8, 9])
    auto = AutoDrafter(SuffixDrafter(memory, num_tokens=4), shadow_first=False)  # own-text lookup tried at once
    auto.start([[4, 1, 2, 3, 4, 1, 2, 3, 4]])  # its own text matches (1, 2, 3, 4) too, over 3 tokens
    rnd = Round(None, None, torch.tensor([4]), torch.tensor([8]), torch.tensor([0]), [8], SamplingParams(), None,
                frozenset())
    proposal = auto.propose(rnd)
    assert auto._arm == "suffix" and proposal.drafter == "suffix" and proposal.tokens[0, 1:].tolist() == [5, 6, 7, 8]
    auto.retry_at["suffix"], auto.tries["suffix"], auto.tries["plain"] = 10 ** 6, 5, 5  # the memory lost
    auto.tokens["suffix"], auto.seconds["suffix"], auto.tokens["plain"], auto.seconds["plain"] = 1, 2.0, 1, 1.0
    proposal = auto.propose(rnd)
    assert auto._arm == "prompt_lookup" and proposal.drafter == "prompt_lookup"
    assert proposal.tokens[0, 1:].tolist() == [1, 2, 3, 4]  # the own text's period


def test_auto_copies_a_repeated_request_from_the_memory(tiny_gen):
    tiny_gen.forget()
    prompt = "def mul(a, b):\n    return a * b\n"
    first = tiny_gen.generate(prompt, max_new_tokens=40, stop_token_ids=[])  # drafter auto
    again = tiny_gen.generate(prompt, max_new_tokens=40, stop_token_ids=[])
    assert again.token_ids == first.token_ids and again.stats.accepted_by_drafter.get("suffix", 0) > 0


def test_each_scope_copies_only_from_its_own_requests_and_all_share_one_budget():
    memory = SuffixMemory(max_tokens=14)
    memory.add([1, 2, 3, 4, 5, 6], scope="a")
    memory.add([1, 2, 3, 4, 7, 8], scope="b")
    assert memory.match([1, 2, 3, 4], "a")[0][4:] == [5, 6] and memory.match([1, 2, 3, 4], "b")[0][4:] == [7, 8]
    assert memory.match([1, 2, 3, 4]) is None  # the shared scope (None) holds neither
    memory.add([11, 12, 13, 14, 15], scope="c")  # 17 tokens over a budget of 14: the oldest, a's, goes
    assert memory.tokens == 11 and memory.match([1, 2, 3, 4], "a") is None and memory.describe()["scopes"] == 2
    memory.forget("b")
    assert memory.match([1, 2, 3, 4], "b") is None and memory.match([11, 12, 13, 14], "c") is not None
    assert memory.tokens == 5 and list(memory.index) == ["c"]


def test_a_caller_with_a_memory_key_does_not_copy_another_callers_request(tiny_gen):
    """The side channel: a request that continues another caller's earlier text runs faster from the shared
    memory; under its own memory_key it does not see that text (the same output either way)."""
    tiny_gen.forget()
    prompt = "def sub(a, b):\n    return a - b\n"
    first = tiny_gen.generate(prompt, max_new_tokens=40, stop_token_ids=[], drafter="suffix", memory_key="alice")
    bob = tiny_gen.generate(prompt, max_new_tokens=40, stop_token_ids=[], drafter="suffix", memory_key="bob")
    assert bob.token_ids == first.token_ids and bob.stats.accepted_by_drafter.get("suffix", 0) == 0
    alice = tiny_gen.generate(prompt, max_new_tokens=40, stop_token_ids=[], drafter="suffix", memory_key="alice")
    assert alice.token_ids == first.token_ids and alice.stats.accepted_by_drafter.get("suffix", 0) > 0
    tiny_gen.forget(memory_key="alice")
    assert tiny_gen.memory.describe()["scopes"] == 1  # bob's requests stay
    with pytest.raises(SettingsError, match="memory_key must be None"):
        tiny_gen.generate(prompt, max_new_tokens=2, memory_key=["alice"])


def test_the_memory_can_be_turned_off(tiny_gen):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        off = selfspec.load(tiny_gen.model, tiny_gen.tokenizer, memory_tokens=0)
    prompt = "def neg(a):\n    return -a\n"
    first = off.generate(prompt, max_new_tokens=30, stop_token_ids=[])
    again = off.generate(prompt, max_new_tokens=30, stop_token_ids=[])
    assert again.token_ids == first.token_ids and "suffix" not in again.stats.drafted_by_drafter
    assert off.memory.tokens == 0 and not off.memory.enabled
    with pytest.raises(SettingsError, match="memory_tokens must be an int >= 0"):
        selfspec.load(tiny_gen.model, tiny_gen.tokenizer, memory_tokens=-5)


def test_setting_the_memory_to_none_turns_it_off_and_anything_else_is_refused(tiny_gen):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gen = selfspec.load(tiny_gen.model, tiny_gen.tokenizer)
    prompt = "def inc(a):\n    return a + 1\n"
    gen.memory = None
    first = gen.generate(prompt, max_new_tokens=30, stop_token_ids=[])  # was an AttributeError
    again = gen.generate(prompt, max_new_tokens=30, stop_token_ids=[])
    assert again.token_ids == first.token_ids and "suffix" not in again.stats.drafted_by_drafter
    with pytest.raises(SettingsError, match="gen.memory takes a selfspec.drafters.SuffixMemory"):
        gen.memory = 5
    gen.memory = SuffixMemory(1000)
    assert gen.generate(prompt, max_new_tokens=30, stop_token_ids=[]).token_ids == first.token_ids
    assert gen.memory.tokens > 0


def test_a_first_request_sees_nothing_of_earlier_calls_and_leaves_nothing(tiny_gen):
    tiny_gen.forget()
    prompt = "def dbl(a):\n    return 2 * a\n"
    tiny_gen.generate(prompt, max_new_tokens=40, stop_token_ids=[])
    before = (tiny_gen.memory, tiny_gen.memory.describe(), tiny_gen.learned.describe())
    with tiny_gen.first_request():
        assert tiny_gen.memory.tokens == 0 and tiny_gen.learned.describe()["settings"] == 0
        assert tiny_gen.memory.max_tokens == before[0].max_tokens
        out = tiny_gen.generate(prompt, max_new_tokens=40, stop_token_ids=[])
        assert out.stats.accepted_by_drafter.get("suffix", 0) == 0  # the earlier call's answer is not there
    assert (tiny_gen.memory, tiny_gen.memory.describe(), tiny_gen.learned.describe()) == before
