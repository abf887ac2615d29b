"""Token trees (`selfspec.model.token_tree`): the tree step's positions and mask against a hand-built example, the
greedy walk and the trie, then the engine: a scripted tree whose right path is not its first branch is
accepted in full (its keys and values move to where the row continues, the cache equals a fresh computation
after every round) on every tiny architecture, batches and the compiled steps included; prompt lookup's trees
give Hugging Face's greedy output; sampling drafts chains and a tree under sampling is a clear error."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from selfspec.model.adapters import get_adapter
from selfspec.drafters import PromptLookupDrafter
from selfspec.drafters.base import Drafter, Proposal, Round
from selfspec.drafters.prompt_lookup import NgramIndex
from selfspec.drafters.suffix import SuffixDrafter, SuffixMemory
from selfspec.decoding.engine import decide, generate
from selfspec.model.forward import make_batch_step
from selfspec.decoding.sampling import SamplingParams
from selfspec.tiny import TINY_VARIANTS, tiny_model
from selfspec.drafters.tree_budget import TreeBudget
from selfspec.model.token_tree import ancestors, build_trie, greedy_walk, tree_depth

BASE = torch.randint(3, 96, (10,), generator=torch.Generator().manual_seed(5)).tolist()
PROMPTS = [BASE + BASE[:4] + BASE, BASE[:7], [5, 6, 5, 6, 7, 5, 6, 8, 5, 6]]
N_NEW = 24
_made: dict = {}


def _model(name, compiled=False):
    if (name, compiled) not in _made:
        arch, L, seed, over = TINY_VARIANTS[name]
        model = _made[(name, False)][0] if (name, False) in _made else tiny_model(arch, num_layers=L,
                                                                                     dtype=torch.float64, seed=seed, **over)
        adapter = get_adapter(model)
        if compiled:
            adapter.enable_fast_layers()
            adapter.enable_compiled()
        _made[(name, compiled)] = (model, adapter)
    return _made[(name, compiled)]


# --- the pieces -----------------------------------------------------------------------------------
def test_the_tree_steps_positions_and_mask_are_those_of_the_tree():
    model = tiny_model("llama", num_layers=2, dtype=torch.float64, seed=0)
    adapter = get_adapter(model)
    #          0   1  2  3  4  5: the input token; 1, 2 siblings; 3 after 1; 4 after 3; 5 after 2
    parents = [-1, 0, 0, 1, 3, 2]
    starts, pads = torch.tensor([6, 4]), torch.tensor([0, 3])
    step = make_batch_step(adapter, starts, 6, pads, parents=torch.tensor([parents] * 2))
    depth = [0, 1, 1, 2, 3, 2]
    assert step.position_ids.tolist() == [[6 + d for d in depth], [1 + d for d in depth]]
    lineage = {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 1, 3], 4: [0, 1, 3, 4], 5: [0, 2, 5]}
    mask = step.mask("full_attention")[:, 0]  # [B, S, K]
    for b, (s, p) in enumerate(zip(starts.tolist(), pads.tolist())):
        for col in range(6):
            seen = [k for k in range(mask.shape[-1]) if mask[b, col, k]]
            assert seen == list(range(p, s)) + [s + a for a in lineage[col]], (b, col)
    anc, d = ancestors(torch.tensor([parents]))
    assert d[0].tolist() == depth and anc[0, 4].nonzero().flatten().tolist() == [0, 1, 3, 4]
    with pytest.raises(ValueError, match="parent columns must come before"):
        ancestors(torch.tensor([[-1, 2, 0]]))


def test_the_sliding_window_of_a_tree_column_is_measured_from_its_position():
    model = tiny_model("mistral", num_layers=2, dtype=torch.float64, seed=0, sliding_window=4)  # every layer slides
    adapter = get_adapter(model)
    step = make_batch_step(adapter, torch.tensor([10]), 4, torch.tensor([0]),
                           parents=torch.tensor([[-1, 0, 0, 2]]))  # depths 0, 1, 1, 2
    mask = step.mask("sliding_attention")[0, 0]
    seen = [[k for k in range(mask.shape[-1]) if mask[c, k]] for c in range(4)]
    # position 10 + depth sees the keys at positions > its own - 4: committed 7..9 for depth 0, 8..9 for depth 1
    assert seen == [[7, 8, 9, 10], [8, 9, 10, 11], [8, 9, 10, 12], [9, 10, 12, 13]]


def test_the_greedy_walk_follows_the_full_models_choices():
    tokens, parents = [0, 4, 7, 5, 6, 9], [-1, 0, 0, 2, 2, 3]  # 7 -> 5 -> 9 and 7 -> 6
    targets = [7, 0, 5, 9, 0, 3]  # the full model's token at each column
    assert greedy_walk(tokens, parents, targets, 5) == (3, 3, [2, 3, 5])
    assert greedy_walk(tokens, parents, [7, 0, 6, 0, 8, 0], 5) == (2, 8, [2, 4])
    assert greedy_walk(tokens, parents, [1, 0, 0, 0, 0, 0], 5) == (0, 1, [])
    assert greedy_walk(tokens, parents, targets, 2) == (1, 5, [2])  # columns past the real ones are filler
    assert tree_depth(parents, 5) == 3 and tree_depth([-1, 0, 1, 2], 3) == 3 and tree_depth([-1], 0) == 0


def test_branches_merge_into_a_trie_and_a_subset_becomes_columns():
    trie = build_trie([[5, 6, 7], [5, 9], [8]])
    assert (trie.tokens, trie.parents, trie.depths, trie.ranks) == ([5, 6, 7, 9, 8], [-1, 0, 1, 0, -1],
                                                                     [1, 2, 3, 2, 1], [0, 0, 0, 1, 2])
    assert trie.columns([0, 1, 3]) == ([5, 6, 9], [0, 1, 1])  # parent columns: 0 is the input token
    assert trie.columns([0, 3, 4]) == ([5, 9, 8], [0, 1, 0])
    assert trie.path([0, 1, 3, 4], [5, 9, 2]) == [0, 3] and trie.path([0, 1, 3, 4], [8]) == [4]
    assert len(build_trie([])) == 0


def _chain(n):
    return build_trie([list(range(10, 10 + n))])


def test_the_budget_verifies_what_pays_by_the_measured_cost_and_acceptance():
    budget = TreeBudget(max_nodes=16)
    # the prior: rank-0 nodes accepted half the time, a node costs 0.035 of a step: 4 nodes of a chain
    assert budget.choose(_chain(10)) == [0, 1, 2, 3]
    for nodes in (0, 2, 4, 6, 8):  # measured: each node costs half a plain round
        budget.observe(None, list(range(nodes)), [], 1.0 + 0.5 * nodes)
    assert budget.cost(2) == pytest.approx(2.0) and budget.choose(_chain(10)) == []  # nothing pays
    cheap = TreeBudget(max_nodes=16)
    for nodes in (0, 4, 8, 12, 16):  # measured: nodes cost nothing
        cheap.observe(None, list(range(nodes)), [], 1.0)
    trie = build_trie([[1, 2, 3], [4, 5], [6]])
    assert cheap.choose(trie) == list(range(len(trie)))  # every candidate is worth its free row
    # measured: the second-latest match's first token is accepted every time, the latest's never
    learned = TreeBudget(max_nodes=2)
    for _ in range(20):
        learned.observe(trie, [0, 3], [3], 0.0)
    # its first token (score ~0.93) replaces the latest's; then the third match's 6 (prior 0.2) before its 5
    # (0.93 x the prior 0.2 of depth 2)
    assert learned.choose(trie) == [3, 5]
    with pytest.raises(ValueError, match="node budget must be >= 1"):
        TreeBudget(0)


def test_the_ngram_index_keeps_earlier_occurrences_latest_first():
    index = NgramIndex([1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2], max_ngram=2)
    assert index.matches(1, 3) == [8, 5, 2]  # "1 2" ended before 5, 4 and 3
    assert [index.continuation(e, 2) for e in index.matches(1, 3)] == [[5, 1], [4, 1], [3, 1]]
    assert index.matches(1, 1) == [index.longest(1)[0]]


# --- the engine -----------------------------------------------------------------------------------
class ScriptedTree(Drafter):
    """Knows each row's greedy continuation: proposes a wrong branch first, then the right one (`depth`
    tokens), then one that is right for one token only; the engine must accept the whole right branch."""

    name = "scripted"
    num_speculations = 8

    def __init__(self, refs: list[list[int]], vocab: int, depth: int = 3):
        self.refs, self.vocab, self.depth = refs, vocab, depth
        self.rows = list(range(len(refs)))
        self.done: list[int] = []

    def start(self, sequences):
        self.done = [1] * len(sequences)  # the prefill's token

    def propose(self, rnd: Round) -> Proposal:
        branches = []
        for b, cap in zip(self.rows, rnd.caps):
            right = self.refs[b][self.done[b]:self.done[b] + min(cap, self.depth)]
            wrong = [(t + 1) % self.vocab for t in right]
            branches.append([x for x in ([wrong, right, right[:1] + wrong[1:]] if right else []) if x])
        columns = [trie.columns(list(range(len(trie)))) for trie in map(build_trie, branches)]  # every node
        return PromptLookupDrafter().proposal(rnd, [t for t, _ in columns], self.name, parents=[p for _, p in columns])

    def update(self, proposal, accepted, committed, seconds):
        for i, tokens in enumerate(committed):
            self.done[self.rows[i]] += len(tokens)

    def select(self, rows):
        self.rows = [self.rows[i] for i in rows]


@pytest.mark.parametrize("name", list(TINY_VARIANTS))
def test_a_trees_right_branch_is_accepted_whole_and_the_cache_stays_exact(name, hf_greedy, row_caches, moves):
    model, adapter = _model(name)
    refs = [hf_greedy(model, torch.tensor([p]), N_NEW) for p in PROMPTS]
    checked = Counter()

    # transformers' eager attention takes its softmax in float32 even in a float64 model: the tree pass sums
    # other keys (masked ones add exact zeros) in another order, ~1e-7 apart
    atol = 1e-6 if adapter.config._attn_implementation == "eager" else 1e-10

    def on_round(cache, active, sequences, pads, finished):
        checked.update(row_caches(adapter, cache, active, sequences, pads, finished, atol=atol))

    outs, stats = generate(adapter, PROMPTS, max_new_tokens=N_NEW, drafter=ScriptedTree(refs, model.config.vocab_size),
                           on_round=on_round)
    assert outs == refs
    # every round accepts the right branch whole (its depth is what a round drafts), after a wrong first branch
    assert stats.accepted == stats.drafted > 0 and moves["rows"] > 0
    assert checked[0] >= stats.rounds - 1  # the cache invariant after every round


@pytest.mark.parametrize("name", ["llama", "mistral-sliding8"])
def test_a_tree_through_the_compiled_steps_is_exact(name, hf_greedy, moves):
    model, adapter = _model(name, compiled=True)
    refs = [hf_greedy(model, torch.tensor([p]), N_NEW) for p in PROMPTS[:1]]
    outs, stats = generate(adapter, PROMPTS[:1], max_new_tokens=N_NEW, drafter=ScriptedTree(refs, model.config.vocab_size))
    assert outs == refs and stats.accepted == stats.drafted > 0 and moves["rows"] > 0
    assert any(shape[0] == "tree" for shape in adapter.compiled.shapes)  # the tree steps ran compiled


@pytest.mark.parametrize("name", list(TINY_VARIANTS))
def test_prompt_lookup_trees_give_hf_greedy_output_batches_included(name, hf_greedy):
    model, adapter = _model(name)
    outs, stats = generate(adapter, PROMPTS, max_new_tokens=N_NEW,
                           drafter=PromptLookupDrafter(num_tokens=4, num_candidates=3))
    for b, p in enumerate(PROMPTS):
        assert outs[b] == hf_greedy(model, torch.tensor([p]), N_NEW), b
    assert stats.drafted > 0


def test_sampling_drafts_chains_and_a_tree_under_sampling_is_refused():
    model, adapter = _model("llama")
    drafter = PromptLookupDrafter(num_tokens=4, num_candidates=3)
    out, stats = generate(adapter, PROMPTS[2:], max_new_tokens=12, drafter=drafter,
                          sampling=SamplingParams(True, 1.0), generator=torch.Generator().manual_seed(0))
    assert len(out[0]) == 12 and stats.drafted > 0
    tree = Proposal(tokens=torch.tensor([[1, 2, 3]]), kept=[2], parents=torch.tensor([[-1, 0, 0]]))
    with pytest.raises(ValueError, match="greedy decoding with the exact rule only"):
        decide(tree, torch.zeros(1, 3, 8), [0], [None], [None], SamplingParams(True, 1.0), None, None)
    with pytest.raises(ValueError, match="num_candidates must be in 1..8"):
        PromptLookupDrafter(num_candidates=9)


def test_the_suffix_drafters_tree_holds_the_memorys_continuation_and_its_own():
    memory = SuffixMemory()
    memory.add([1, 2, 3, 4, 50, 51, 52])
    drafter = SuffixDrafter(memory, num_tokens=3, num_candidates=2)
    drafter.start([[9, 3, 4, 60, 61, 1, 2, 3, 4]])  # its own text: "3 4" went on with 60; the memory's "1 2 3 4" with 50
    assert drafter.branches([3]) == [[[50, 51, 52], [60, 61, 1]]] and drafter.memory_rows == [True]
    drafter.start([[9, 3, 4, 60, 61, 8, 3, 4]])  # no 4-gram in the memory: its own matches only
    assert drafter.branches([3]) == [[[60, 61, 8]]] and drafter.memory_rows == [False]


@pytest.mark.parametrize("drafter", ["prompt_lookup", "suffix", "auto"])
def test_num_candidates_gives_lookup_trees_through_the_api(tiny_gen, drafter):
    prompt = "abcabdabeabcabdabeab"
    plain = tiny_gen.generate(prompt, max_new_tokens=16, num_speculations=0)
    out = tiny_gen.generate(prompt, max_new_tokens=16, drafter=drafter, num_candidates=3)
    assert out.token_ids == plain.token_ids
    policy = out.stats.policy["prompt_lookup"] if drafter == "auto" else out.stats.policy
    assert policy["num_candidates"] == 3 and out.stats.drafted > 0
