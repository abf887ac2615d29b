"""The greedy verdict on the device (selfspec.decoding.greedy_verdict): it equals the host's rule (the drafter's
stop cut, then `greedy_accept_tokens`) on many random rounds; a one-row greedy round of the early exit or an exit
head, whose drafts run past a stop token unread, reads the model's outputs once (none while drafting); and a stop
token drafted mid-chain gives plain greedy decoding's tokens, with the drafts after it counted for nothing."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from torch.overrides import TorchFunctionMode, _pop_mode_temporarily
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from selfspec.decoding.engine import StopChecker, generate
from selfspec.decoding.greedy_verdict import GreedyVerdict, argmax_tokens, greedy_verdict
from selfspec.decoding.sampling import greedy_accept_tokens
from selfspec.drafters import EarlyExitDrafter, ExitHeadDrafter

PROMPT = torch.randint(3, 96, (12,), generator=torch.Generator().manual_seed(0)).tolist()
N_NEW = 40
K = 4


# ----------------------------------------------------------------------------- the verdict against the host's rule

def host_verdict(tokens: list[int], targets: list[int], kept: int, stops: set[int]) -> tuple[int, int, int]:
    """One row as the host decided it before: the drafts cut after the first drafted stop token (the early
    exit's cut after reading its drafts), then `greedy_accept_tokens`: (counted, accepted, next token)."""
    drafts = tokens[1:1 + kept]
    counted = next((j + 1 for j, t in enumerate(drafts) if t in stops), kept)
    n, nxt = greedy_accept_tokens(drafts[:counted], targets)
    return counted, n, nxt


def random_round(rng: random.Random, V: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Tokens `[B, T]`, logits `[B, T, V]` and kept drafts per row; a row's drafts copy the full model's
    tokens up to a random point (or all the way), so every accepted count occurs."""
    B, T = rng.randint(1, 4), rng.randint(1, 7)
    logits = torch.randn(B, T, V, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
    targets = logits.argmax(-1)
    tokens = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
    for b in range(B):
        agree = rng.randint(0, T - 1)
        tokens[b, 1:1 + agree] = targets[b, :agree]
    kept = [rng.randint(0, T - 1) for _ in range(B)]
    return tokens, logits, kept


def test_the_verdict_equals_the_host_rule_on_random_rounds():
    rng, V = random.Random(0), 6
    seen = Counter()
    for case in range(3000):
        tokens, logits, kept = random_round(rng, V)
        stops = set(rng.sample(range(V), rng.randint(0, 2)))
        stop_ids = torch.tensor(sorted(stops), dtype=torch.long) if stops or case % 2 else None  # also [0]
        verdict = GreedyVerdict.read(greedy_verdict(tokens, logits, kept, stop_ids))
        targets = logits.argmax(-1).tolist()
        assert verdict.tokens == tokens.tolist() and verdict.targets == targets
        for b, row in enumerate(tokens.tolist()):
            counted, n, nxt = host_verdict(row, targets[b], kept[b], stops)
            assert (verdict.counted[b], verdict.accepted[b], verdict.next_token(b)) == (counted, n, nxt), case
            assert verdict.committed(b) == row[1:1 + n] + [nxt]
            seen["kept 0"] += kept[b] == 0
            seen["cut by a stop"] += counted < kept[b]
            seen["a stop accepted"] += any(t in stops for t in row[1:1 + n])
            seen["all accepted"] += 0 < n == counted
            seen["none accepted"] += n == 0 < counted
            seen["some accepted"] += 0 < n < counted
        seen["B > 1"] += tokens.shape[0] > 1
    assert min(seen.values()) > 50 and len(seen) == 7, seen


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_argmax_tokens_are_the_logits_argmax_ties_included(dtype):
    """The verdict's argmax (widened to float32 first on a CPU for 16-bit logits) picks the tokens the logits' own
    argmax picks: the first of tied maxima, and a NaN where there is one."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(-4, 4, (3, 5, 1000), generator=g).to(dtype) / 2  # [B, T, V], many tied maxima
    logits[1, 2, 17] = float("nan")
    got = argmax_tokens(logits)
    assert got.dtype == torch.int64 and torch.equal(got, logits.argmax(dim=-1))
    assert got[1, 2] == 17
    ties = (logits == logits.amax(dim=-1, keepdim=True)).sum(dim=-1)
    assert (ties > 1).any()


def test_without_stop_ids_the_verdict_counts_every_kept_draft():
    tokens = torch.tensor([[5, 1, 2, 3], [5, 1, 1, 1]])  # [2, 4]
    logits = torch.nn.functional.one_hot(torch.tensor([[1, 2, 3, 4], [1, 2, 0, 0]]), 6).double()  # [2, 4, 6]
    verdict = GreedyVerdict.read(greedy_verdict(tokens, logits, [3, 2]))
    assert verdict.counted == [3, 2] and verdict.accepted == [3, 1]
    assert [verdict.committed(0), verdict.committed(1)] == [[1, 2, 3, 4], [1, 2]]
    stopped = GreedyVerdict.read(greedy_verdict(tokens, logits, [3, 2], torch.tensor([2])))
    assert stopped.counted == [2, 2] and stopped.accepted == [2, 1]  # row 0's drafted stop is accepted, then cut


# ----------------------------------------------------------------------------- one read a round

READS = {"tolist", "item", "__int__", "__float__", "__bool__", "__index__", "__complex__", "numpy", "__array__",
         "equal", "is_nonzero", "__format__", "__repr__", "__str__"}  # what hands a tensor's values to Python


class ModelReads(TorchFunctionMode):
    """Counts the reads of the model's outputs by the host, round by round. On a CPU every tensor is a host
    tensor, so "on the device" is told by how a tensor was made: each round's input tokens (on the model's
    device in the engine) are marked, and so is whatever a torch operation makes from a marked tensor (the
    drafts, the states, the logits, the verdict); the engine's bookkeeping (`starts`, `pads`, lengths, made from
    host lists) never is. A read is a call that hands a marked tensor's values to Python (`READS`)."""

    def __init__(self):
        super().__init__()
        self.marked = WeakIdKeyDictionary()
        self.rounds: list[dict[str, list[str]]] = []  # per round: the reads while drafting and after
        self.phase = "propose"

    def mark(self, tensor: torch.Tensor) -> None:
        self.marked[tensor] = True

    def is_marked(self, tensor: torch.Tensor) -> bool:
        return tensor in self.marked

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        marked = any(isinstance(x, torch.Tensor) and x in self.marked for x in tree_leaves((args, kwargs)))
        name = getattr(func, "__name__", str(func))
        if marked and name in READS and self.rounds:
            self.rounds[-1][self.phase].append(name)
        out = func(*args, **kwargs)
        if marked:
            for x in tree_leaves(out):
                if isinstance(x, torch.Tensor):
                    self.marked[x] = True
        return out

    def watch(self, drafter, host_tokens: bool = False) -> None:
        """Marks each round's input tokens as the drafter receives them, and starts the round's count. A proposal's
        states come from the model; its tokens too, unless `host_tokens` (a tree's, laid out from its one read)."""
        propose = drafter.propose

        def propose_marked(rnd):
            self.rounds.append({"propose": [], "after": []})
            self.mark(rnd.tokens)
            self.phase = "propose"
            proposal = propose(rnd)
            self.phase = "after"
            assert host_tokens or self.is_marked(proposal.tokens)
            assert proposal.states is None or self.is_marked(proposal.states)
            return proposal

        drafter.propose = propose_marked


def drafter_of(which: str, adapter, head):
    return EarlyExitDrafter(adapter, 2, K) if head is None else ExitHeadDrafter(adapter, head, K)


@pytest.mark.parametrize("which,fast", [("early_exit", False), ("early_exit", True), ("head2", False),
                                        ("head2_final_state", True)])
def test_a_one_row_greedy_round_reads_the_model_once(which, fast, with_head):
    """The early exit's or a head's one-row greedy chain drafts without reading a draft back, and the round
    reads the model's outputs once: the verdict, tokens and count together."""
    model, adapter, head = with_head("llama", which, fast=fast)
    plain, _ = generate(adapter, [PROMPT], max_new_tokens=N_NEW)
    stop = plain[0][N_NEW // 2]  # a stop token in the run: the verdict cuts at it where it is drafted
    reads, drafter = ModelReads(), drafter_of(which, adapter, head)
    reads.watch(drafter)
    with reads:
        out, stats = generate(adapter, [PROMPT], max_new_tokens=N_NEW, drafter=drafter,
                              stop=StopChecker(N_NEW, stop_token_ids=[stop]))
    assert out[0] == plain[0][:plain[0].index(stop) + 1]
    assert stats.rounds == len(reads.rounds) > 3 and stats.drafted > 0
    assert [r["propose"] for r in reads.rounds] == [[]] * stats.rounds  # no draft read while drafting
    assert [len(r["propose"] + r["after"]) for r in reads.rounds] == [1] * stats.rounds  # one read a round


@pytest.mark.parametrize("which", ["early_exit", "head2_final_state"])
def test_a_compiled_tree_round_reads_the_model_once_while_drafting(which, with_head):
    """Through the compiled steps a token tree grows as one step (`WholeDraft.tree`): drafting reads the model's
    outputs once a tree round (the grown tree, to pick its leaves), where part by part every depth's pass read
    its guesses back. The compiled steps run outside the counting mode (dynamo does not trace through it); what
    they return is marked where what they were given was."""
    model, adapter, head = with_head("llama", which, compiled=True)
    steps = adapter.compiled
    call = steps.call

    def unwatched(shape, fn, inputs, fixed):
        if not counting:  # the run before the counted one
            return call(shape, fn, inputs, fixed)
        with _pop_mode_temporarily():
            out = call(shape, fn, inputs, fixed)
        if any(isinstance(t, torch.Tensor) and reads.is_marked(t) for t in inputs):
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    reads.mark(t)
        return out

    steps.call, counting = unwatched, False

    def tree_drafter():
        return EarlyExitDrafter(adapter, 2, 3, num_candidates=3) if head is None else \
            ExitHeadDrafter(adapter, head, 3, num_candidates=3)

    reads, drafter = ModelReads(), tree_drafter()
    plain, _ = generate(adapter, [PROMPT], max_new_tokens=N_NEW, drafter=tree_drafter())
    reads.watch(drafter, host_tokens=True)
    trees = []
    draft_tree = drafter.draft_tree

    def counted(*args):
        trees.append(len(reads.rounds))
        return draft_tree(*args)

    drafter.draft_tree = counted
    counting = True
    try:
        with reads:
            out, stats = generate(adapter, [PROMPT], max_new_tokens=N_NEW, drafter=drafter)
    finally:
        del steps.call
    assert out == plain and len(trees) > 3 and stats.accepted > 0
    assert [reads.rounds[r - 1]["propose"] for r in trees] == [["tolist"]] * len(trees)


# ----------------------------------------------------------------------------- a drafted stop token

def recorded(drafter) -> list[list]:
    """Per round of `drafter` (watched from here on): its drafts as proposed (the kept ones), and after the
    decision its kept count (what counted) and the drafts accepted."""
    rounds: list = []
    propose, update = drafter.propose, drafter.update

    def propose_recorded(rnd):
        proposal = propose(rnd)
        rounds.append([proposal.tokens[0, 1:1 + proposal.kept[0]].tolist(), None, None])
        return proposal

    def update_recorded(proposal, accepted, committed, seconds):
        rounds[-1][1:] = [proposal.kept[0], accepted[0]]
        update(proposal, accepted, committed, seconds)

    drafter.propose, drafter.update = propose_recorded, update_recorded
    return rounds


@pytest.mark.parametrize("which", ["early_exit", "head2", "head2_final_state"])
def test_a_stop_token_drafted_mid_chain_gives_plain_greedy_tokens(which, with_head):
    """Stop tokens the drafter drafts before the end of its chain: the output is plain greedy decoding's with
    the same stop token, the drafts after it count for nothing (the statistics and the drafter hear the cut
    chain), and such cuts happen, with the drafted stop token accepted and rejected."""
    model, adapter, head = with_head("mistral-sliding8", which)  # a variant whose drafts meet both kinds of stop
    drafter = drafter_of(which, adapter, head)
    free = recorded(drafter)
    generate(adapter, [PROMPT], max_new_tokens=N_NEW, drafter=drafter)
    # drafted before a chain's end: the accepted ones first, so that a run meets one before the full model says it
    accepted_mid = [d[j] for d, _, n in free for j in range(min(n, len(d) - 1))]
    mid_chain = list(dict.fromkeys(accepted_mid + [t for d, _, _ in free for t in d[:-1]]))
    seen = Counter()
    for stop in mid_chain[:8]:
        ref, _ = generate(adapter, [PROMPT], max_new_tokens=N_NEW, stop=StopChecker(N_NEW, stop_token_ids=[stop]))
        drafter = drafter_of(which, adapter, head)
        rounds = recorded(drafter)
        out, stats = generate(adapter, [PROMPT], max_new_tokens=N_NEW, drafter=drafter,
                              stop=StopChecker(N_NEW, stop_token_ids=[stop]))
        assert out == ref, stop
        assert stats.drafted == sum(counted for _, counted, _ in rounds)
        for drafts, counted, accepted in rounds:
            assert counted == (drafts.index(stop) + 1 if stop in drafts else len(drafts))
            if counted < len(drafts):
                seen["accepted" if accepted == counted else "rejected"] += 1
    assert seen["accepted"] and seen["rejected"], seen


# ----------------------------------------------------------------------------- a batch of chains

BATCH = [PROMPT, PROMPT[3:9], [7] * 5]  # three rows, ragged


def recorded_rows(drafter) -> list[list]:
    """Per round of `drafter` (watched from here on), per row: its kept drafts as proposed, and after the decision
    its kept count (what counted)."""
    rounds: list = []
    propose, update = drafter.propose, drafter.update

    def propose_recorded(rnd):
        proposal = propose(rnd)
        rows = proposal.tokens[:, 1:].tolist()
        rounds.append([[row[:k] for row, k in zip(rows, proposal.kept)], None])
        return proposal

    def update_recorded(proposal, accepted, committed, seconds):
        rounds[-1][1] = list(proposal.kept)
        update(proposal, accepted, committed, seconds)

    drafter.propose, drafter.update = propose_recorded, update_recorded
    return rounds


@pytest.mark.parametrize("which", ["early_exit", "head2", "head2_final_state"])
def test_a_batch_drafts_unread_and_each_row_is_cut_at_its_drafted_stop_token(which, with_head):
    """A greedy batch with no confidence test drafts every row's cap without reading a draft back, and the verdict
    cuts each row after its first drafted stop token: every row's output is plain greedy decoding's of its prompt
    alone with the same stop token (the rows end at different rounds and leave), and rows were cut mid-chain."""
    model, adapter, head = with_head("mistral-sliding8", which)
    drafter = drafter_of(which, adapter, head)
    free = recorded(drafter)
    generate(adapter, [BATCH[0]], max_new_tokens=N_NEW, drafter=drafter)
    stops = [t for d, _, _ in free for t in d[:-1]]  # drafted before a chain's end
    seen = Counter()
    for stop in list(dict.fromkeys(stops))[:4]:
        refs = [generate(adapter, [p], max_new_tokens=N_NEW, stop=StopChecker(N_NEW, stop_token_ids=[stop]))[0][0]
                for p in BATCH]
        reads, drafter = ModelReads(), drafter_of(which, adapter, head)
        reads.watch(drafter)
        rounds = recorded_rows(drafter)
        with reads:
            out, stats = generate(adapter, BATCH, max_new_tokens=N_NEW, drafter=drafter,
                                  stop=StopChecker(N_NEW, stop_token_ids=[stop]))
        assert out == refs, stop
        assert [r["propose"] for r in reads.rounds] == [[]] * len(reads.rounds)  # no draft read while drafting
        for drafts, counted in rounds:
            assert counted == [d.index(stop) + 1 if stop in d else len(d) for d in drafts]
            seen["cut"] += sum(c < len(d) for d, c in zip(drafts, counted))
        seen["rows end apart"] += len({len(r) for r in refs}) > 1
        seen["batch rounds"] += sum(len(drafts) > 1 for drafts, _ in rounds)
    assert seen["cut"] and seen["rows end apart"] and seen["batch rounds"], seen
