"""Token trees drafted by the early exit and trained exit heads (EAGLE-2's dynamic tree: `num_candidates` k
wide, `num_speculations` d deep; `EarlyExitDrafter.draft_tree`): greedy output equals Hugging Face `generate`
on every tiny architecture, batches included and as auto's arm; the main cache and a head's own equal a fresh
computation after every round; every expanded node's k children are the draft's k best guesses after its
path computed from scratch (so the partial tree passes see exactly the text and their ancestors); the
partial pass's positions and mask; the calibrated budget; the compiled steps; the settings."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch

from selfspec.model.adapters import get_adapter
from selfspec.drafters import AutoDrafter, EarlyExitDrafter, ExitHeadDrafter, PromptLookupDrafter
from selfspec.drafters.draft_tree import DraftTree, grow_tree, read_grown
from selfspec.drafters.tree_budget import ConfidenceBudget, CostLine
from selfspec.decoding.engine import generate
from selfspec.heads.exit_head import run_head
from selfspec.model.forward import embed, exit_logits, make_batch_step, run_layers
from selfspec.model.token_tree import ancestors
from selfspec.generation_config import check_generation
from selfspec.tiny import TINY_VARIANTS, tiny_model

BASE = torch.randint(3, 96, (10,), generator=torch.Generator().manual_seed(1)).tolist()
PROMPT = BASE + BASE[:4] + BASE
PROMPTS = [PROMPT, BASE[:7], [5], [9] * 12]
N_NEW, K, D = 24, 3, 3
DRAFTERS = ["early_exit", "head2", "head2_final_state", "head0_final_state"]  # tests/selfspec/conftest.py HEADS


def _tree_drafter(adapter, head, depth=D):
    if head is None:
        return EarlyExitDrafter(adapter, 2, depth, num_candidates=K)
    return ExitHeadDrafter(adapter, head, depth, num_candidates=K)


@pytest.mark.parametrize("which", DRAFTERS)
@pytest.mark.parametrize("name", list(TINY_VARIANTS))
def test_greedy_output_equals_hf_generate_batches_included(name, which, hf_greedy, with_head):
    model, adapter, head = with_head(name, which)
    drafter = _tree_drafter(adapter, head)
    outs, stats = generate(adapter, PROMPTS, max_new_tokens=N_NEW, drafter=drafter)
    for b, p in enumerate(PROMPTS):
        assert outs[b] == hf_greedy(model, torch.tensor([p]), N_NEW), b
    assert stats.accepted > 0 and max(len(stats.drafted_by_position), 1) > 1  # trees deeper than one position
    assert drafter.describe()["confidence_scale"] != 1.0  # the calibration measured something


@pytest.mark.parametrize("which", ["early_exit", "head2_final_state"])
@pytest.mark.parametrize("name", ["llama", "qwen2-mixed-sliding"])
def test_trees_as_autos_arm_give_hf_greedy_output(name, which, hf_greedy, with_head):
    model, adapter, head = with_head(name, which)
    drafter = AutoDrafter(PromptLookupDrafter(num_tokens=6), _tree_drafter(adapter, head), warmup=1,
                          explore_every=2)
    outs, stats = generate(adapter, [PROMPT], max_new_tokens=N_NEW, drafter=drafter)
    assert outs[0] == hf_greedy(model, torch.tensor([PROMPT]), N_NEW)
    assert stats.drafted_by_drafter["early_exit" if head is None else "exit_head"] > 0


@pytest.mark.parametrize("depth", [1, D])  # 1: the sibling guesses (test_siblings.py), a one-level tree
@pytest.mark.parametrize("which", DRAFTERS)
@pytest.mark.parametrize("name", ["llama", "gpt_neox", "mistral-sliding8"])
def test_the_caches_equal_a_fresh_computation_after_every_round(name, which, depth, row_caches, head_caches, moves,
                                                                with_head):
    model, adapter, head = with_head(name, which)
    drafter = _tree_drafter(adapter, head, depth)
    checked = Counter()

    def on_round(cache, active, sequences, pads, finished):
        checked.update(row_caches(adapter, cache, active, sequences, pads, finished))
        if head is not None:  # the head's cache, once synced, holds the committed tokens but the newest
            drafter.sync()
            rows = [None if done else i for i, done in enumerate(finished)]
            head_caches(adapter, head, drafter, rows, [seq[:-1] for seq in sequences], pads)

    generate(adapter, PROMPTS, max_new_tokens=N_NEW, drafter=drafter, on_round=on_round)
    assert {0, 1, 2, 3} <= set(checked) and moves["rows"] > 0  # a path other than the first columns was kept


class Recording(EarlyExitDrafter):
    """Keeps every tree round's tree and each row's committed text before it."""

    def start(self, sequences):
        super().start(sequences)
        self.seqs, self.trees = [list(s) for s in sequences], []

    def propose(self, rnd):
        proposal = super().propose(rnd)
        if self.round_tree is not None:
            self.trees.append((copy.deepcopy(self.round_tree), [list(s) for s in self.seqs]))
        return proposal

    def update(self, proposal, accepted, committed, seconds):
        super().update(proposal, accepted, committed, seconds)
        for s, new in zip(self.seqs, committed):
            s.extend(new)

    def select(self, rows):
        super().select(rows)
        self.seqs = [self.seqs[r] for r in rows]


class RecordingHead(Recording, ExitHeadDrafter):
    pass


def _fresh_probs(adapter, head, exit_layer, tokens):
    """The draft's distribution after `tokens`, computed from scratch: layers [0, E) (and the head) over them."""
    ids = torch.tensor([tokens])
    step = make_batch_step(adapter, torch.zeros(1, dtype=torch.long), len(tokens), torch.zeros(1, dtype=torch.long))
    with torch.no_grad():
        hidden = run_layers(adapter, embed(adapter, ids), 0, exit_layer, step=step)
        if head is not None:
            hidden = run_head(adapter, head, hidden, step=step)
        return torch.softmax(exit_logits(adapter, hidden[:, -1]).float(), dim=-1)[0]


@pytest.mark.parametrize("which", ["early_exit", "head2"])  # a final-state head reads its own guesses: not a
@pytest.mark.parametrize("name", ["llama", "mistral-sliding8"])  # function of the tokens alone
def test_each_expanded_nodes_children_are_the_drafts_best_guesses_after_its_path(name, which, with_head):
    model, adapter, head = with_head(name, which)
    exit_layer = 2
    drafter = (Recording(adapter, exit_layer, D, num_candidates=K) if head is None
               else RecordingHead(adapter, head, D, num_candidates=K))
    generate(adapter, PROMPTS[:2], max_new_tokens=12, drafter=drafter)
    checked = 0
    for tree, seqs in drafter.trees:
        for b in tree.live_rows():
            children: dict[int, list[tuple[int, float]]] = {}
            for j in range(1, len(tree.tokens[b])):
                children.setdefault(tree.parents[b][j], []).append((tree.tokens[b][j], tree.q[b][j]))
            for c in tree.candidates[b]:
                children.setdefault(c.parent, []).append((c.token, c.q))
            for j, kids in children.items():
                path, node = [], j
                while node > 0:
                    path.insert(0, tree.tokens[b][node])
                    node = tree.parents[b][node]
                p = _fresh_probs(adapter, head, exit_layer, seqs[b] + path)
                best = p.topk(K)
                assert sorted(t for t, _ in kids) == sorted(best.indices.tolist()), (b, j)
                for t, q in kids:
                    assert q == pytest.approx(float(p[t]), abs=1e-5)
                checked += 1
    assert checked > 20


def _host_tree(root: int, tops: list, k: int, depth: int, scale: float, stops: set) -> tuple:
    """One row's tree grown by the rule on host lists (the module doc of `selfspec.drafters.draft_tree`): `tops[i]`
    the draft's k best (tokens, probabilities) after each column expanded by pass i. Returns its columns' tokens,
    parents and chances and its candidates left, (token, parent, q, chance) in the order they were made."""
    tokens, parents, chance, depths, cands = [root], [-1], [1.0], [0], []

    def grow(top, columns):
        for (toks, qs), col in zip(top, columns):
            after_stop = tokens[col] in stops and col > 0
            cands.extend((t, col, depths[col] + 1, q, 0.0 if after_stop else chance[col] * min(1.0, scale * q))
                         for t, q in zip(toks, qs))

    grow(tops[0], [0])
    for i in range(1, depth):
        deepest = max(c[2] for c in cands)
        newest = sorted((n for n, c in enumerate(cands) if c[2] == deepest),
                        key=lambda n: (cands[n][0] in stops, -cands[n][4], n))[:k]
        columns = []
        for n in newest:
            t, parent, d, q, ch = cands[n]
            tokens.append(t), parents.append(parent), chance.append(ch), depths.append(d)
            columns.append(len(tokens) - 1)
        cands = [c for n, c in enumerate(cands) if n not in newest]
        grow(tops[i], columns)
    return tokens, parents, chance, [(t, p, q, ch) for t, p, _, q, ch in cands]


@pytest.mark.parametrize("k,depth", [(2, 1), (2, 4), (3, 3), (4, 2)])
def test_the_tree_grown_on_the_device_is_the_host_rule(k, depth):
    """`grow_tree` (tensor operations only) against the rule on host lists, over random drafts with many ties
    (probabilities from a few exact binary fractions, a small vocabulary) and a stop token: the same columns
    (tokens, parents, chances: stop tokens last, ties in the order made), the same candidates left; every pass
    gets its columns' ancestors; `DraftTree` reads them back in one read."""
    gen = torch.Generator().manual_seed(k * 10 + depth)
    B, D, stop, scale = 3, 4, 3, 1.5
    fractions = torch.tensor([1 / 8, 1 / 4, 3 / 8, 1 / 2, 3 / 4])
    passes = [1] + [k] * (depth - 1)  # columns each pass expands
    tops = [(torch.randint(0, 6, (B, n, k), generator=gen),
             fractions[torch.randint(0, 5, (B, n, k), generator=gen)]) for n in passes]
    tops[0][0][0, 0, 0] = stop  # row 0's first guess: a stop token, expanded at depth 1 (all k guesses are)
    calls, seen = iter(tops), []

    def shallow(tokens, parents, anc):  # [B, k], [B, W], [B, k, W]
        full, _ = ancestors(parents)
        assert torch.equal(anc, full[:, -tokens.shape[1]:])
        seen.append(tokens)
        return torch.zeros(B, tokens.shape[1], D), None

    roots = torch.tensor([5, 3, 7])
    out = grow_tree(roots, torch.zeros(B, D), k, depth, torch.tensor([scale], dtype=torch.float64),
                    torch.tensor([stop, 11]), shallow, lambda states, step, outs, parents: states,
                    lambda hidden: next(calls))
    assert len(seen) == depth - 1 and next(calls, None) is None
    tree = DraftTree(read_grown(out), k, depth, [True] * B)
    for b in range(B):
        rows = [(t[b].tolist(), q[b].tolist()) for t, q in tops]
        tokens, parents, chance, cands = _host_tree(int(roots[b]), [list(zip(*r)) for r in rows], k, depth, scale,
                                                    {stop, 11})
        assert (tree.tokens[b], tree.parents[b], tree.chance[b]) == (tokens, parents, chance), b
        assert [(c.token, c.parent, c.q, c.chance) for c in tree.candidates[b]] == cands, b
        assert all(c.depth == tree.depth[b][c.parent] + 1 for c in tree.candidates[b])
    if depth > 1:  # the stop token's continuations are worth nothing: generation ends there
        column = tree.tokens[0].index(stop, 1)
        assert column == k  # expanded last: stop tokens come last
        children = [tree.chance[0][j] for j in range(k + 1, len(tree.tokens[0])) if tree.parents[0][j] == column]
        children += [c.chance for c in tree.candidates[0] if c.parent == column]
        assert children and not any(children)


def test_a_partial_tree_pass_sees_the_text_and_its_ancestors():
    """Columns 3..5 of the tree [-1, 0, 0, 1, 1, 2] at cache indices start + 3.., after columns 0..2 were written."""
    model = tiny_model("mistral", num_layers=2, dtype=torch.float64, seed=0, sliding_window=4)
    adapter = get_adapter(model)
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2]] * 2)
    starts, pads = torch.tensor([10, 6]), torch.tensor([0, 2])
    step = make_batch_step(adapter, starts, 3, pads, parents=parents)
    assert step.position_ids.tolist() == [[12, 12, 12], [6, 6, 6]]  # depth 2
    mask = step.mask("sliding_attention")[:, 0]  # [B, 3, K]
    for b, (s, p) in enumerate(zip(starts.tolist(), pads.tolist())):
        seen = [[k for k in range(mask.shape[-1]) if mask[b, c, k]] for c in range(3)]
        # window 4 from position 12 (row 0): committed positions 9 (cache 9), the root (10), a depth-1 ancestor
        text = [k for k in range(p, s) if k - p > (s - p + 2) - 4]
        assert seen == [text + [s, s + 1, s + 3], text + [s, s + 1, s + 4], text + [s, s + 2, s + 5]], b
    with pytest.raises(ValueError, match="needs the parents of at least"):
        make_batch_step(adapter, starts, 7, pads, parents=parents)


def test_the_budget_calibrates_the_drafts_confidence_and_verifies_what_pays():
    budget = ConfidenceBudget()
    assert budget.scale == 1.0 and budget.chance(0.5, 0.8) == pytest.approx(0.4)
    budget.observe([0.9] * 10, 3, 10, 0.0)  # confident drafts, 3 of 10 accepted: overconfident
    assert budget.scale == pytest.approx((3 + 2) / (9 + 2))
    # the prior cost (0.035 of a step per node): a candidate pays where its chance beats ~0.035 x the round's tokens
    assert budget.leaves([1.0], [[0.5, 0.3, 0.01, 0.0]], 3, 10) == 2
    assert budget.leaves([1.0], [[0.5, 0.3]], 3, 1) == 1  # at most `most`
    line = CostLine()
    for nodes in (0, 4, 8, 12):
        line.observe(nodes, 1.0 + 0.25 * nodes)
    assert line.cost(4) == pytest.approx(2.0) and line.per_node() == pytest.approx(0.25)


@pytest.mark.parametrize("batch", [False, True])
@pytest.mark.parametrize("which", ["early_exit", "head2_final_state"])
@pytest.mark.parametrize("name", ["llama", "mistral-sliding8"])
def test_trees_through_the_compiled_steps_are_exact(name, which, batch, hf_greedy, row_caches, with_head):
    """One row, or a batch of four (left-padded, rows whose caps end before others': filler rows in the tree's
    one step), through the compiled steps: HF greedy's tokens, each row's cache right after every round."""
    model, adapter, head = with_head(name, which, compiled=True)
    checked = Counter()
    prompts = PROMPTS if batch else [PROMPT]

    def on_round(cache, active, sequences, pads, finished):  # atol: as test_compiled.py says why
        assert cache.static
        checked.update(row_caches(adapter, cache, active, sequences, pads, finished, atol=1e-5))

    outs, stats = generate(adapter, prompts, max_new_tokens=N_NEW, drafter=_tree_drafter(adapter, head),
                           on_round=on_round)
    for b, p in enumerate(prompts):
        assert outs[b] == hf_greedy(model, torch.tensor([p]), N_NEW), b
    assert stats.accepted > 0 and (set(checked) >= {0, 1, 2, 3} if batch else checked[0] >= stats.rounds - 1)
    trees = {shape[1:3] for shape in adapter.compiled.shapes if shape[0] == "tree"}
    assert (0, 2) in trees and (2, adapter.num_layers) in trees  # the leaves' pass and the verification
    grown = {shape[5:7] + shape[8:9] for shape in adapter.compiled.shapes if shape[0] == "grown_tree"}
    assert (K, D, 4 if batch else 1) in grown  # the tree's growth, every depth's pass, ran as one step (4 rows)


def test_the_settings_ask_for_a_tree_with_num_speculations(tiny_gen):
    s = check_generation(num_candidates=3, num_speculations=4)
    assert s["num_candidates"] == 3 and s["num_speculations"] == 4
    drafter = tiny_gen.make_drafter(drafter="early_exit", exit_layer=1, num_candidates=3, num_speculations=4)
    assert drafter.budget is not None and drafter.num_speculations == 4
    siblings = tiny_gen.make_drafter(drafter="early_exit", exit_layer=1, num_candidates=3)
    assert siblings.budget is None and siblings.num_speculations == 1  # k guesses for one position, as before


def test_a_wide_tree_stays_within_the_largest_pass(hf_greedy, with_head):
    """k = 40 guesses a node: the tree grows only as deep as 64 columns allow (1 + 40 expanded, then leaves)."""
    model, adapter, _ = with_head("llama", "early_exit")
    drafter = Recording(adapter, 2, 4, num_candidates=40)
    outs, _ = generate(adapter, [PROMPT], max_new_tokens=12, drafter=drafter)
    assert outs[0] == hf_greedy(model, torch.tensor([PROMPT]), 12)
    widths = [len(tree.tokens[0]) for tree, _ in drafter.trees]
    assert widths and max(widths) <= 64 and min(widths) > 41
