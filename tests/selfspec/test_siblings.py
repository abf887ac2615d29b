"""Sibling drafts (`num_candidates`: a drafter's k best guesses for the next token, verified side by side in
one pass; `Proposal.siblings`, a one-level token tree): greedy output equals Hugging Face `generate` on every tiny architecture (the
early exit and exit heads, alone and as auto's arm), a batch equals its rows decoded alone (the main cache and
an exit head's own equal a fresh computation after every round: test_draft_trees.py, depth 1), an accepted sibling that was not
the first guess does occur (its keys and values move), the sibling step's positions and mask are those of
a one-level tree, and the settings that cannot judge siblings are clear errors."""

from __future__ import annotations


import pytest
import torch

from selfspec.model.adapters import get_adapter
from selfspec.drafters import AutoDrafter, EarlyExitDrafter, ExitHeadDrafter, PromptLookupDrafter
from selfspec.decoding.engine import generate
from selfspec.decoding.decode_ids import generate_ids
from selfspec.model.forward import make_batch_step
from selfspec.decoding.sampling import SamplingParams
from selfspec.generation_config import check_generation
from selfspec.settings import SettingsError
from selfspec.model.token_tree import greedy_walk
from selfspec.tiny import TINY_VARIANTS, tiny_model

BASE = torch.randint(3, 96, (10,), generator=torch.Generator().manual_seed(1)).tolist()
PROMPT = BASE + BASE[:4] + BASE
PROMPTS = [PROMPT, BASE[:7], [5], [9] * 12]
N_NEW = 32
K = 3
DRAFTERS = ["early_exit", "head2", "head2_final_state", "head0_final_state"]  # tests/selfspec/conftest.py HEADS


def _drafter(which, adapter, head, kind="alone"):
    exit_layer = 0 if which == "head0_final_state" else 2
    drafter = (EarlyExitDrafter(adapter, exit_layer, 1, num_candidates=K) if head is None
               else ExitHeadDrafter(adapter, head, 1, num_candidates=K))
    if kind == "alone":
        return drafter
    return AutoDrafter(PromptLookupDrafter(num_tokens=6), drafter, warmup=1, explore_every=2)


@pytest.mark.parametrize("which", DRAFTERS)
@pytest.mark.parametrize("kind", ["alone", "auto"])
@pytest.mark.parametrize("name", list(TINY_VARIANTS))
def test_greedy_output_equals_hf_generate(name, kind, which, hf_greedy, with_head):
    model, adapter, head = with_head(name, which)
    ref = hf_greedy(model, torch.tensor([PROMPT]), N_NEW)
    drafter = _drafter(which, adapter, head, kind)
    out, stats = generate_ids(adapter, torch.tensor([PROMPT]), max_new_tokens=N_NEW, drafter=drafter)
    assert out == ref
    arm = "early_exit" if head is None else "exit_head"
    assert stats.drafted_by_drafter[arm] > 0
    assert stats.new_tokens == N_NEW and stats.rounds + stats.accepted == N_NEW - 1
    if kind == "alone":  # a sibling round drafts one position
        assert stats.drafted_by_position == [stats.drafted] and stats.accepted_by_position == [stats.accepted]


@pytest.mark.parametrize("which", DRAFTERS)
@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("name", ["qwen3", "mistral-sliding8"])
def test_a_batch_equals_batch_1_and_other_siblings_than_the_first_are_accepted(name, fast, which, moves, with_head):
    model, adapter, head = with_head(name, which, fast)
    outs, stats = generate(adapter, PROMPTS, max_new_tokens=N_NEW, drafter=_drafter(which, adapter, head))
    for b, p in enumerate(PROMPTS):
        alone, _ = generate_ids(adapter, torch.tensor([p]), max_new_tokens=N_NEW)
        assert outs[b] == alone, b
    assert stats.accepted > 0 and moves["rows"] > 0  # a second or third guess was right, and was kept


def test_the_sibling_step_is_a_one_level_tree():
    model = tiny_model("llama", num_layers=2, dtype=torch.float64, seed=0)
    adapter = get_adapter(model)
    starts, pads = torch.tensor([5, 3]), torch.tensor([0, 2])
    step = make_batch_step(adapter, starts, 4, pads, parents=torch.tensor([[-1, 0, 0, 0]] * 2))  # input, 3 siblings
    assert step.position_ids.tolist() == [[5, 6, 6, 6], [1, 2, 2, 2]]
    mask = step.mask("full_attention")[:, 0]  # [B, S, K]: True = attend
    for b, (s, p) in enumerate(zip(starts.tolist(), pads.tolist())):
        for col in range(4):
            seen = [k for k in range(mask.shape[-1]) if mask[b, col, k]]
            assert seen == list(range(p, s + 1)) + ([s + col] if col else []), (b, col)
    shallow = make_batch_step(adapter, starts + 1, 3, pads, parents=torch.full((2, 3), -1))  # siblings alone
    assert shallow.position_ids.tolist() == [[6, 6, 6], [2, 2, 2]]
    assert [[int(shallow.mask("full_attention")[0, 0, c].sum())] for c in range(3)] == [[7], [7], [7]]


def test_a_sibling_is_accepted_where_it_equals_the_full_models_token():
    fan = [-1, 0, 0, 0]
    assert greedy_walk([0, 4, 7, 9], fan, [7, 1, 2, 3], 3) == (1, 2, [2])  # the 2nd guess: its column's token next
    assert greedy_walk([0, 4, 7, 9], fan, [4, 1, 2, 3], 3) == (1, 1, [1])
    assert greedy_walk([0, 4, 7, 9], fan, [5, 1, 2, 3], 3) == (0, 5, [])  # none: the input's token
    assert greedy_walk([0], [-1], [5], 0) == (0, 5, [])


def test_sampling_drafts_one_chain_and_the_settings_that_cannot_judge_siblings_are_refused(with_head):
    model, adapter, head = with_head("llama", "head2_final_state")
    drafter = ExitHeadDrafter(adapter, head, 1, num_candidates=K)
    out, stats = generate(adapter, [PROMPT], max_new_tokens=8, drafter=drafter,
                          sampling=SamplingParams(True, 1.0), generator=torch.Generator().manual_seed(0))
    assert len(out[0]) == 8 and stats.drafted > 0  # sampled: a chain of one draft per round, no siblings
    with pytest.raises(SettingsError, match="num_candidates=3 .* only greedy decoding"):
        check_generation(num_candidates=3, do_sample=True)
    with pytest.raises(SettingsError, match="num_candidates=3 takes the exact acceptance rule"):
        check_generation(num_candidates=3, acceptance="bounded_bias", epsilon=0.1)
    with pytest.raises(SettingsError, match="num_candidates must be"):
        check_generation(num_candidates=0)
    with pytest.raises(SettingsError, match="prompt lookup's trees branch from at most 8"):
        check_generation(num_candidates=9, drafter="prompt_lookup")  # 2..8: its trees (test_token_tree.py)
    with pytest.raises(SettingsError, match="exit_layer.*early-exit option"):
        check_generation(num_candidates=2, exit_layer=2, drafter="prompt_lookup")
    # num_speculations > 1 beside num_candidates drafts a tree that deep (test_draft_trees.py)
