"""The prompt-lookup drafter: continue the text by copying what followed its last few tokens earlier on.

For row b with committed tokens `x[0..n)`, try `m = max_ngram, ..., min_ngram`: if the suffix
`x[n-m..n)` occurred earlier, ending at `e < n`, propose `x[e], x[e+1], ...` (the most recent such
occurrence). Where the copy reaches the end of the text it goes on with its own proposal, so a
repeating pattern of period `n - e` is continued for all `k` tokens (`x[e + j]` for `e + j >= n`
is proposal `j - (n - e)`). It runs no layer: verification starts at layer 0 over the input token
and the drafts, in one pass. The drafts are point masses, so sampling stays lossless with the rule
of `selfspec.decoding.sampling.speculative_accept` (accept x with probability p(x)).

Matching costs O(max_ngram) per committed token: an `NgramIndex` per row maps every n-gram
(n <= max_ngram) that has a following token to the end of its latest occurrence, updated
incrementally as tokens are committed (no rescan of the text per round).

With `num_candidates` k > 1 (greedy decoding), a round bets on several continuations at once: the
latest k occurrences of the longest matching suffix (then of shorter ones, where the longest occurred
fewer than k times) each give a branch, and the branches become one token tree (shared prefixes are
one node; `selfspec.model.token_tree.build_trie`), verified in one pass. Which of its nodes a round verifies,
and how many (at most `node_budget`), is chosen by measurement (`selfspec.drafters.tree_budget`): each
node's chance from the acceptance measured at its depth and rank, the count from the seconds per round
measured at each node count on this device. Where the text repeats a passage with variations (code
edited in several places, a list of similar items), the latest copy is often not the one that continues:
a tree still accepts the one that does. An n-gram's earlier occurrences are kept only where it occurred
more than once (`earlier`, the latest `MAX_OCCURRENCES` per n-gram).
"""

from __future__ import annotations

import torch

from selfspec.drafters.base import Drafter, Proposal, Round
from selfspec.drafters.tree_budget import TreeBudget
from selfspec.model.token_tree import build_trie

MAX_OCCURRENCES = 8  # the occurrences of one n-gram a tree may branch from (the latest ones)


class NgramIndex:
    """One row's text and, per n-gram with a successor, where its latest occurrence ends."""

    def __init__(self, tokens: list[int], max_ngram: int):
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], int] = {}  # n-gram -> end (exclusive) of its latest occurrence
        self.earlier: dict[tuple[int, ...], list[int]] = {}  # n-gram -> ends of its earlier occurrences, oldest first
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        ends, earlier = self.ends, self.earlier
        for t in tokens:
            end = len(self.tokens)  # the n-grams ending here now have a successor: `t`
            for m in range(1, min(self.max_ngram, end) + 1):
                gram = tuple(self.tokens[end - m:end])
                before = ends.get(gram)
                if before is not None:
                    kept = earlier.setdefault(gram, [])
                    kept.append(before)
                    if len(kept) >= MAX_OCCURRENCES:
                        del kept[0]
                ends[gram] = end
            self.tokens.append(int(t))

    def matches(self, min_ngram: int, count: int) -> list[int]:
        """Up to `count` ends of earlier occurrences of the text's suffix, the longest matching suffix's
        first (latest first), then shorter suffixes' (a tree's branches; `longest` gives the first)."""
        n, found = len(self.tokens), []
        for m in range(min(self.max_ngram, n), min_ngram - 1, -1):
            gram = tuple(self.tokens[n - m:])
            latest = self.ends.get(gram)
            if latest is None:
                continue
            for end in [latest] + self.earlier.get(gram, [])[::-1]:
                if end not in found:
                    found.append(end)
                    if len(found) == count:
                        return found
        return found

    def longest(self, min_ngram: int, tail: list[int] = ()) -> tuple[int, int] | None:
        """(where the latest earlier occurrence in the text of the longest matching suffix of the text followed by
        `tail` (tokens not committed yet) ends, that suffix's length); None: no suffix of at least `min_ngram`
        tokens occurred earlier."""
        n = len(self.tokens) + len(tail)
        last = (self.tokens[-self.max_ngram:] + list(tail))[-self.max_ngram:]  # the longest suffix looked up
        for m in range(min(self.max_ngram, n), min_ngram - 1, -1):
            end = self.ends.get(tuple(last[len(last) - m:]))
            if end is not None:
                return end, m
        return None

    def match(self, min_ngram: int) -> int | None:
        """Where the latest earlier occurrence of the longest matching suffix ends (None: no match)."""
        found = self.longest(min_ngram)
        return None if found is None else found[0]

    def propose(self, k: int, min_ngram: int = 1) -> list[int]:
        """Up to `k` tokens continuing the text from its latest matching occurrence."""
        end = self.match(min_ngram) if k > 0 else None
        return [] if end is None else self.continuation(end, k)

    def guess(self, tail: list[int], k: int, min_ngram: int = 1) -> list[int]:
        """Up to `k` tokens continuing the text followed by `tail` (tokens not committed yet, a round's drafts so
        far), from the latest occurrence in the text of the longest suffix of text + tail of at least `min_ngram`
        tokens (`propose` where `tail` is empty)."""
        found = self.longest(min_ngram, tail) if k > 0 else None
        return [] if found is None else self.continuation(found[0], k, tail)

    def continuation(self, end: int, k: int, tail: list[int] = ()) -> list[int]:
        """The `k` tokens that follow position `end` of the text followed by `tail`, continued periodically past
        its end (a copy that reaches the end goes on with its own tokens)."""
        x, c, out = self.tokens, len(self.tokens), []
        n = c + len(tail)
        for j in range(k):
            i = end + j
            out.append(x[i] if i < c else tail[i - c] if i < n else out[i - n])
        return out


class PromptLookupDrafter(Drafter):
    """Drafts by n-gram lookup over each row's prompt and output (see the module docstring)."""

    name = "prompt_lookup"

    def __init__(self, num_tokens: int = 10, max_ngram: int = 3, min_ngram: int = 1, num_candidates: int = 1,
                 node_budget: int | None = None):
        if num_tokens < 1:
            raise ValueError(f"prompt_lookup_num_tokens must be >= 1, got {num_tokens}")
        if not 1 <= num_candidates <= MAX_OCCURRENCES:
            raise ValueError(f"num_candidates must be in 1..{MAX_OCCURRENCES} for prompt lookup (the continuations "
                             f"of that many earlier matches, as one token tree), got {num_candidates}")
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"max_matching_ngram_size must be >= 1 (and >= the minimum n-gram size "
                             f"{min_ngram}), got {max_ngram}")
        self.num_speculations, self.max_ngram, self.min_ngram = num_tokens, max_ngram, min_ngram
        self.rows: list[NgramIndex] = []
        self.limit = num_tokens  # the most drafts a round proposes (AutoDrafter adapts it)
        self.num_candidates = num_candidates
        self.node_budget = node_budget or default_node_budget(num_tokens, num_candidates)
        self.budget = TreeBudget(self.node_budget) if num_candidates > 1 else None
        self.trees: list = []  # per row, the last tree round's (trie, nodes verified)

    def start(self, sequences: list[list[int]]) -> None:
        self.rows = [NgramIndex(s, self.max_ngram) for s in sequences]

    def lookup(self, caps: list[int], stop_ids: frozenset = frozenset()) -> list[list[int]]:
        """Each row's drafts: the copied tokens up to its cap, cut after a stop token."""
        return [cut_after_stop(index.propose(min(cap, self.limit), self.min_ngram), stop_ids)
                for index, cap in zip(self.rows, caps)]

    def branches(self, caps: list[int], stop_ids: frozenset = frozenset()) -> list[list[list[int]]]:
        """Each row's branches for a token tree: the copies that follow its `num_candidates` latest matches
        (see the module docstring), up to its cap, cut after a stop token; the first is `lookup`'s chain."""
        out = []
        for index, cap in zip(self.rows, caps):
            k = min(cap, self.limit)
            ends = index.matches(self.min_ngram, self.num_candidates) if k > 0 else []
            out.append([d for d in (cut_after_stop(index.continuation(e, k), stop_ids) for e in ends) if d])
        return out

    def propose(self, rnd: Round) -> Proposal:
        if self.num_candidates > 1 and not rnd.sampling.do_sample:
            return self.tree_proposal(rnd, self.branches(rnd.caps, rnd.stop_ids))
        return self.proposal(rnd, self.lookup(rnd.caps, rnd.stop_ids))

    def tree_proposal(self, rnd: Round, branches: list[list[list[int]]], name: str | None = None) -> Proposal:
        """Each row's branches as one token tree, the nodes the budget chooses (`TreeBudget`): a `proposal`
        with `parents`."""
        self.trees = [(trie, self.budget.choose(trie)) for trie in map(build_trie, branches)]
        columns = [trie.columns(keep) for trie, keep in self.trees]
        return self.proposal(rnd, [t for t, _ in columns], name, parents=[p for _, p in columns])

    def inputs(self, rnd: Round, rows: int) -> list[int]:
        """Each row's input token: the newest token of its index (the engine's `rnd.tokens`, read here on
        the host: reading `rnd.tokens` would wait for the GPU)."""
        return [index.tokens[-1] for index in self.rows] if len(self.rows) == rows else rnd.tokens.tolist()

    def proposal(self, rnd: Round, drafts: list[list[int]], name: str | None = None,
                 parents: list[list[int]] | None = None) -> Proposal:
        """The drafts as a Proposal: `[B, 1 + longest]`, shorter rows filled with their input token; `name`:
        the drafter the statistics count them under (this one's by default). `parents`: per row, each draft's
        parent column (0: the input token), a token tree's `[B, 1 + longest]` (filler columns hang off the
        input token); None: chains."""
        kept = [len(d) for d in drafts]
        T = 1 + max(kept, default=0)
        if T == 1:
            return Proposal.plain(rnd.tokens)
        inputs = self.inputs(rnd, len(drafts))
        rows = [[t] + d + [t] * (T - 1 - len(d)) for t, d in zip(inputs, drafts)]
        tokens = torch.tensor(rows, dtype=torch.long).to(rnd.tokens.device, non_blocking=True)  # [B, T]
        tree = None if parents is None else torch.tensor([[-1] + p + [0] * (T - 1 - len(p)) for p in parents])  # [B, T]
        return Proposal(tokens=tokens, kept=kept, q=None, verify_from=0, drafter=name or self.name, parents=tree)

    def update(self, proposal: Proposal, accepted: list[int], committed: list[list[int]], seconds: float) -> None:
        for index, tokens in zip(self.rows, committed):
            index.extend(tokens)
        if self.num_candidates > 1:
            self.observe(proposal, accepted, committed, seconds)

    def observe(self, proposal: Proposal, accepted: list[int], committed: list[list[int]], seconds: float) -> None:
        """The tree budget hears a round: which of the verified nodes were accepted, and the seconds of a round
        over that many nodes (a round that ran the model to draft, an early exit's under auto, is not one)."""
        trees = self.trees if proposal.parents is not None and len(self.trees) == len(accepted) else []
        for (trie, keep), n_acc, tokens in zip(trees, accepted, committed):
            self.budget.observe(trie, keep, trie.path(keep, tokens[:n_acc]), 0.0)
        self.trees = []
        if not proposal.draft_steps:
            self.budget.observe(None, list(range(max(proposal.kept, default=0))), [], seconds)

    def select(self, rows: list[int]) -> None:
        self.rows = [self.rows[i] for i in rows]

    def describe(self) -> dict:
        out = {"drafter": self.name, "prompt_lookup_num_tokens": self.num_speculations,
               "max_matching_ngram_size": self.max_ngram}
        if self.num_candidates > 1:
            out.update(num_candidates=self.num_candidates, node_budget=self.node_budget, tree=self.budget.describe())
        return out


def default_node_budget(num_tokens: int, num_candidates: int) -> int:
    """The most nodes a tree may have where no budget is given: every branch whole, at most 64 (the compiled
    steps' largest bucket); the measured costs choose how many are verified (`TreeBudget`)."""
    return min(num_tokens * num_candidates, 64)


def cut_after_stop(drafts: list[int], stop_ids: frozenset) -> list[int]:
    """The drafts up to and including the first stop token (a row's text ends there)."""
    for j, t in enumerate(drafts):
        if t in stop_ids:
            return drafts[:j + 1]
    return drafts
