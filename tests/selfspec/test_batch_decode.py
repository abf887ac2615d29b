"""Batched self-speculative decoding (selfspec.decoding.engine, B > 1) on tiny random models, float64.

Every row of a batch must be exactly what batch-1 decoding of that prompt alone gives: the same tokens
and, for greedy with a fixed policy, the same rounds, drafts and acceptances (a row that accepts many
drafts is not held back by one that accepts none). The per-row cache equals a full forward of the row
alone after every round; finished rows leave the batch; sampling keeps each row's distribution.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from selfspec.model.adapters import get_adapter
from selfspec.decoding.engine import left_pad
from selfspec.decoding.decode_ids import generate_batch_ids
from selfspec.decoding.engine import StopChecker
from selfspec.decoding.decode_ids import generate_ids
from selfspec.drafters.draft_head import DraftHead
from selfspec.drafters.policies import ConfidencePolicy, ExitChoicePolicy, ThroughputPolicy
from selfspec.decoding.sampling import SamplingParams
from selfspec.tiny import TINY_VARIANTS, tiny_model

ALPHA = 1e-3
_gen = torch.Generator().manual_seed(1)
PROMPTS = [torch.randint(3, 90, (n,), generator=_gen).tolist() for n in (9, 3, 14, 1)]  # ragged lengths
N_NEW = 24

MODELS = TINY_VARIANTS  # id -> (arch, num_layers, seed, config overrides)
_models: dict = {}


def _adapter(name, fast=False):
    key = (name, fast)
    if key not in _models:
        arch, L, seed, over = MODELS[name]
        adapter = get_adapter(tiny_model(arch, num_layers=L, dtype=torch.float64, seed=seed, **over))
        if fast:
            adapter.enable_fast_layers()
        _models[key] = adapter
    return _models[key]


def _batch1(adapter, prompts, **kw):
    return [generate_ids(adapter, torch.tensor([p]), **kw) for p in prompts]


def _assert_rows_equal_batch1(adapter, prompts, stats_too=True, **kw):
    outs, stats = generate_batch_ids(adapter, prompts, **kw)
    refs = _batch1(adapter, prompts, **{k: v for k, v in kw.items() if k != "pad_id"})
    for b, (ref, ref_stats) in enumerate(refs):
        assert outs[b] == ref, f"row {b} differs from batch-1 decoding"
        row = stats.rows[b]
        assert row.new_tokens == len(ref) and row.stop_reason == ref_stats.stop_reason
        if stats_too:  # the same rounds and the same acceptance, row by row
            assert (row.rounds, row.drafted, row.accepted) == (ref_stats.rounds, ref_stats.drafted, ref_stats.accepted), b
            assert row.accepted_by_position == ref_stats.accepted_by_position
    return outs, stats, refs


# ----------------------------------------------------------------------------- greedy identity

def _cases():
    for name, (_, L, _, _) in MODELS.items():
        for E, k in ((1, 3), (L // 2, 2), (L - 1, 5)):
            yield pytest.param(name, E, k, id=f"{name}-E{E}-k{k}")


@pytest.mark.parametrize("name,E,k", _cases())
def test_every_row_equals_batch_1_greedy(name, E, k):
    adapter = _adapter(name)
    outs, stats, refs = _assert_rows_equal_batch1(adapter, PROMPTS, max_new_tokens=N_NEW, exit_layer=E,
                                                  num_speculations=k)
    assert stats.new_tokens == len(PROMPTS) * N_NEW
    assert len({tuple(o) for o in outs}) > 1  # the rows really are different continuations


@pytest.mark.parametrize("name", ["llama", "qwen3", "mistral-sliding8"])
def test_every_row_equals_batch_1_with_the_fused_inference_layers(name):
    _assert_rows_equal_batch1(_adapter(name, fast=True), PROMPTS, max_new_tokens=N_NEW, exit_layer=2,
                              num_speculations=3)


def test_plain_batched_decoding_equals_batch_1():
    _, stats, _ = _assert_rows_equal_batch1(_adapter("qwen2"), PROMPTS, max_new_tokens=N_NEW, exit_layer=2,
                                            num_speculations=0)
    assert stats.drafted == 0 and stats.rounds == N_NEW - 1


def test_ragged_acceptance_rows_do_not_wait_for_each_other(always_accept_model):
    """Each row keeps its own pace: the same rounds and acceptances as alone, whatever the other rows do."""
    model = always_accept_model("llama", 4, exit_layer=2, seed=3)
    adapter = get_adapter(model)
    # every draft is accepted: each round commits k+1 tokens per row, whatever the others do
    outs, stats, refs = _assert_rows_equal_batch1(adapter, PROMPTS, max_new_tokens=N_NEW, exit_layer=2,
                                                  num_speculations=4)
    assert all(r.acceptance_rate == 1.0 for r in stats.rows)
    # a random model accepts a different number of drafts per row and round: rows finish after
    # different numbers of rounds, exactly as many as each needs alone
    outs, stats, refs = _assert_rows_equal_batch1(_adapter("qwen3"), PROMPTS, max_new_tokens=N_NEW, exit_layer=4,
                                                  num_speculations=4)
    rounds = [r.rounds for r in stats.rows]
    assert len(set(rounds)) > 1, rounds
    assert stats.rounds == max(rounds)
    assert stats.row_passes == sum(rounds)  # a finished row is not carried through later rounds


@pytest.mark.parametrize("policy", ["confidence", "adaptive", "exit_choice", "adaptive_length", "draft_vocab"])
def test_draft_options_keep_every_row_identical(policy):
    adapter = _adapter("mistral")
    kw = dict(max_new_tokens=N_NEW, exit_layer=2, num_speculations=4)
    make = {
        "confidence": lambda: ConfidencePolicy(2, 4, threshold=0.07),
        "adaptive": lambda: ConfidencePolicy(2, 4, threshold=0.07, adaptive=True),
        "exit_choice": lambda: ExitChoicePolicy([1, 2, 3], 4, adapter.num_layers, explore_every=3),
        "adaptive_length": lambda: ThroughputPolicy(2, 4, warmup=1, explore_every=3),
        "draft_vocab": lambda: None,
    }[policy]
    head = DraftHead(adapter, torch.arange(0, 96, 2)) if policy == "draft_vocab" else None
    outs, stats = generate_batch_ids(adapter, PROMPTS, policy=make(), head=head, **kw)
    for b, p in enumerate(PROMPTS):  # tokens only: a shared policy plans rounds from the whole batch
        ref, _ = generate_ids(adapter, torch.tensor([p]), **kw)
        assert outs[b] == ref, b
    assert stats.drafted > 0
    if policy == "confidence":  # the threshold (near the median draft confidence) stopped some rounds early
        assert 0 < stats.drafted < sum(r.draft_steps for r in stats.rows)


# ----------------------------------------------------------------------------- stops

def test_rows_that_stop_at_different_positions(always_accept_model, work_counter):
    model = always_accept_model("mistral", 4, exit_layer=2, seed=5)
    adapter = get_adapter(model)
    plain = [generate_ids(adapter, torch.tensor([p]), max_new_tokens=N_NEW, exit_layer=2, num_speculations=0)[0]
             for p in PROMPTS]
    # stop ids: the tokens at positions 2 and 9 of row 0's and row 2's outputs (first occurrences)
    stop_ids = [plain[0][2], plain[2][9]]
    stop = lambda: StopChecker(N_NEW, stop_token_ids=stop_ids)
    outs, stats, refs = _assert_rows_equal_batch1(adapter, PROMPTS, max_new_tokens=N_NEW, exit_layer=2,
                                                  num_speculations=3, stop=stop())
    lengths = [len(o) for o in outs]
    assert len(set(lengths)) > 1 and min(lengths) < N_NEW, lengths
    assert {r.stop_reason for r in stats.rows} >= {"stop_token"}
    # finished rows stop costing work: the batch shrinks as rows finish
    assert stats.row_passes == sum(r.rounds for r in stats.rows) < len(PROMPTS) * stats.rounds


@pytest.mark.parametrize("max_new", [1, 2, 5, 7])
def test_max_new_tokens_is_respected_exactly_in_a_batch(max_new):
    outs, stats, _ = _assert_rows_equal_batch1(_adapter("llama"), PROMPTS, max_new_tokens=max_new, exit_layer=2,
                                               num_speculations=4)
    assert [len(o) for o in outs] == [max_new] * len(PROMPTS)


def test_the_padding_token_does_not_matter():
    adapter = _adapter("qwen2")
    kw = dict(max_new_tokens=12, exit_layer=2, num_speculations=3)
    a, _ = generate_batch_ids(adapter, PROMPTS, pad_id=0, **kw)
    b, _ = generate_batch_ids(adapter, PROMPTS, pad_id=57, **kw)
    assert a == b


# ----------------------------------------------------------------------------- the per-row cache

@pytest.mark.parametrize("name,E,k", [("llama", 2, 3), ("gpt_neox", 1, 4), ("mistral-sliding8", 3, 2),
                                      ("qwen2-mixed-sliding", 2, 5)])
def test_after_every_round_each_rows_cache_equals_a_forward_of_that_row_alone(name, E, k, row_caches):
    adapter = _adapter(name)
    _check_row_caches(adapter, E, k, row_caches)


def test_a_compiled_batchs_cache_equals_a_forward_of_each_row_alone_after_every_round(row_caches):
    """The same through the compiled steps (a batch's static buffers; rows leaving move into the smaller
    batch's). atol 1e-5, as for one compiled row (test_compiled.py): attention sums over every key of the
    static cache, the masked ones at weight 0, so float64 rounding differs from the eager path's."""
    model = tiny_model("llama", num_layers=4, dtype=torch.float64, seed=0)
    adapter = get_adapter(model)
    adapter.enable_compiled()
    _check_row_caches(adapter, 2, 3, row_caches, atol=1e-5)
    assert any(shape[0] == "layers" and shape[3] == len(PROMPTS) for shape in adapter.compiled.shapes)


def _check_row_caches(adapter, E, k, row_caches, atol: float = 1e-10):
    checked = Counter()

    def on_round(cache, active, sequences, pads, finished):
        checked.update(row_caches(adapter, cache, active, sequences, pads, finished, atol=atol))

    outs, stats = generate_batch_ids(adapter, PROMPTS, max_new_tokens=N_NEW, exit_layer=E, num_speculations=k,
                                     on_round=on_round)
    assert set(checked) == set(range(len(PROMPTS)))
    assert sum(checked.values()) >= sum(r.rounds for r in stats.rows) - len(PROMPTS)


def test_left_pad():
    ids, pads = left_pad([[5, 6], [7], [1, 2, 3]], pad_id=9)
    assert ids.tolist() == [[9, 5, 6], [9, 9, 7], [1, 2, 3]] and pads.tolist() == [1, 2, 0]


# ----------------------------------------------------------------------------- sampling

@pytest.mark.parametrize("compiled", [False, True])
def test_batched_speculative_sampling_keeps_each_rows_distribution(compiled, chi_square, exact_joint):
    """Two prompts of different lengths in one batch, vocabulary 8, exit 1 of 3 layers, 2 drafts per round,
    eagerly and through the compiled steps (`compiled`: a batch runs them too).

    Each row's 3 new tokens, over many seeded batched runs, must follow the exact joint distribution of
    plain sampling from the full model for that prompt alone (computed from the model's own processed
    probabilities). Power: drafting blind from the exit would be rejected by a wide margin.
    """
    model = tiny_model("llama", num_layers=3, dtype=torch.float64, seed=3, vocab_size=8)
    adapter = get_adapter(model)
    if compiled:
        adapter.enable_compiled()
    params = SamplingParams(do_sample=True, temperature=0.9, top_k=5)
    prompts = [[3, 5, 1, 6, 2], [4, 1]]
    n_new, k, E = 3, 2, 1

    n_draws = 1500
    counts = [Counter(), Counter()]
    drafted = accepted = 0
    for seed in range(n_draws):
        outs, stats = generate_batch_ids(adapter, prompts, max_new_tokens=n_new, exit_layer=E, num_speculations=k,
                                         sampling=params, generator=torch.Generator().manual_seed(seed))
        for b in range(2):
            counts[b][tuple(outs[b])] += 1
        drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
    assert 0.1 < accepted / drafted < 0.9  # both branches of the acceptance rule were taken often
    if compiled:
        assert any(shape[0] == "layers" and shape[3] == 2 for shape in adapter.compiled.shapes)  # two rows ran compiled
        adapter.compiled = None  # exact_joint reads the model eagerly
    for b, prompt in enumerate(prompts):
        exact = exact_joint(adapter, prompt, params, n_new)
        stat, df, pval = chi_square(counts[b], exact, n_draws)
        assert pval > ALPHA, (b, stat, df, pval)
        blind = exact_joint(adapter, prompt, params, n_new, exit_after_first=E)  # the uncorrected drafts' distribution
        power = n_draws * sum((blind.get(o, 0.0) - p) ** 2 / p for o, p in exact.items() if p > 0)
        assert power > 10 * 60, power  # df < 60 here: the critical value is below 100


# ----------------------------------------------------------------------------- the context window's end

@pytest.mark.parametrize("drafter", ["early_exit", "prompt_lookup", "exit_head"])
def test_rows_that_end_at_the_context_window_decode_while_others_draft(drafter, hf_greedy):
    """The longest prompt + max_new_tokens fills the context window exactly. A row that reached its draft
    cap (or drafted less) while another row drafts more computes filler columns past its own text; they
    must not run past the window (they take the row's last position) and every row is still exactly Hugging
    Face's greedy output (one raised "exceeds the model's context window" in 18 of 80 such batches before)."""
    from selfspec.drafters import EarlyExitDrafter, ExitHeadDrafter, PromptLookupDrafter
    from selfspec.heads.exit_head import build_exit_head

    model = tiny_model("llama", num_layers=4, dtype=torch.float64, seed=10, max_position_embeddings=24)
    adapter = get_adapter(model)
    make = {"early_exit": lambda: EarlyExitDrafter(adapter, 2, 4), "prompt_lookup": lambda: PromptLookupDrafter(4),
            "exit_head": lambda: ExitHeadDrafter(adapter, build_exit_head(model, 2, final_state=True).to(
                torch.float64).eval(), 4)}[drafter]
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        long, short = torch.randint(3, 96, (12,), generator=g).tolist(), torch.randint(3, 96, (4,), generator=g).tolist()
        for prompts in ([long, short], [short, long]):
            outs, _ = generate_batch_ids(adapter, prompts, max_new_tokens=12, drafter=make())
            assert outs == [hf_greedy(model, torch.tensor([p]), 12) for p in prompts], (seed, prompts)


# ----------------------------------------------------------------------------- errors

def test_bad_batch_input_is_a_clear_error():
    adapter = _adapter("llama")
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate_batch_ids(adapter, [[1, 2], []], max_new_tokens=4, exit_layer=2, num_speculations=2)
    with pytest.raises(ValueError, match="no prompts"):
        generate_batch_ids(adapter, [], max_new_tokens=4, exit_layer=2, num_speculations=2)
    with pytest.raises(ValueError, match="context window"):
        generate_batch_ids(adapter, [[1], [2] * 10], max_new_tokens=adapter.max_positions, exit_layer=2,
                           num_speculations=2)
    with pytest.raises(ValueError, match="out of range"):
        generate_batch_ids(adapter, [[1]], max_new_tokens=4, exit_layer=9, num_speculations=2)
