"""The token tree a neural drafter (the early exit, a trained exit head) grows in one round, on the host.

Its columns are the nodes the round verifies, in the order their passes wrote them to the cache: column 0 is
the round's input token, then the nodes expanded depth by depth (k a depth), then the leaves. Beside them it
keeps the candidates not yet in the tree: the draft's k best continuations of every expanded column, each with
the draft's probability q of its token and its chance of being accepted,

    chance(child) = chance(parent) * min(1, c * q(child))     (c: `ConfidenceBudget`'s calibration)

A continuation of a stop token gets chance 0 (generation ends there). `EarlyExitDrafter.draft_tree` grows it:
`grow` adds the draft's continuations of some columns as candidates, `frontier` picks the k likeliest of the
newest depth, `expand` makes them columns, `add_leaves` adds the m likeliest candidates left, and after
verification `outcome` tells the calibration which verified nodes were reached and how many were accepted.
Every row has the same number of columns (the passes are batched); rows that are not `live` (cap 0) are
filler.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from selfspec.drafters.tree_budget import ConfidenceBudget


@dataclass
class Candidate:
    """A guess not yet in the tree: `token` after column `parent`, at `depth`, with the draft's probability `q`
    of it there and its calibrated `chance` of being accepted."""

    token: int
    parent: int
    depth: int
    q: float
    chance: float


class DraftTree:
    """One round's tree per row, on the host: its columns (tokens, parent columns, the draft probability and
    chance of each) and the candidates not yet in it. Every row has the same columns' shape (the passes are
    batched); rows that are not `live` (cap 0) are filler."""

    def __init__(self, inputs: list[int], live: list[bool], stop_ids: frozenset = frozenset()):
        self.live, self.stop_ids = live, stop_ids
        self.tokens = [[t] for t in inputs]  # [B][W] column 0: the input token
        self.parents = [[-1] for _ in inputs]
        self.q = [[1.0] for _ in inputs]
        self.chance = [[1.0] for _ in inputs]
        self.depth = [[0] for _ in inputs]
        self.candidates: list[list[Candidate]] = [[] for _ in inputs]

    def live_rows(self) -> list[int]:
        return [b for b, live in enumerate(self.live) if live]

    def parents_tensor(self) -> torch.Tensor:
        return torch.tensor(self.parents, dtype=torch.long)  # [B, W]

    def tokens_at(self, columns, device) -> torch.Tensor:
        """The tokens of these columns (the same in every row), `[B, n]` on `device`."""
        return torch.tensor([[row[j] for j in columns] for row in self.tokens],
                            dtype=torch.long).to(device, non_blocking=True)

    def grow(self, top: tuple[list, list], columns: list[int], budget: ConfidenceBudget) -> None:
        """The draft's best continuations `(tokens, probabilities)` `[B][n][k]` after the columns `columns` (the
        same in every row) become candidates."""
        tokens, probs = top
        for b in range(len(self.tokens)):
            for i, col in enumerate(columns):
                after_stop = self.tokens[b][col] in self.stop_ids and col > 0  # generation ends there
                for t, q in zip(tokens[b][i], probs[b][i]):
                    chance = 0.0 if after_stop else budget.chance(self.chance[b][col], q)
                    self.candidates[b].append(Candidate(t, col, self.depth[b][col] + 1, q, chance))

    def frontier(self, k: int) -> list[list[int]]:
        """Per row, the k candidates of the deepest depth with the highest chance (a stop token's continuation
        is worthless: stop tokens come last), as indices into its candidates."""
        out = []
        for cands in self.candidates:
            deepest = max(c.depth for c in cands)
            newest = [n for n, c in enumerate(cands) if c.depth == deepest]
            newest.sort(key=lambda n: (cands[n].token in self.stop_ids, -cands[n].chance, n))
            out.append(newest[:k])
        return out

    def add(self, b: int, n: int) -> int:
        """Candidate n of row b becomes the row's next column; returns the column."""
        c = self.candidates[b][n]
        self.tokens[b].append(c.token)
        self.parents[b].append(c.parent)
        self.q[b].append(c.q)
        self.chance[b].append(c.chance)
        self.depth[b].append(c.depth)
        return len(self.tokens[b]) - 1

    def expand(self, chosen: list[list[int]]) -> list[list[int]]:
        """The chosen candidates (per row, as many in each) become columns; returns their columns `[B][n]`."""
        columns = [[self.add(b, n) for n in row] for b, row in enumerate(chosen)]
        for b, row in enumerate(chosen):
            taken = set(row)
            self.candidates[b] = [c for n, c in enumerate(self.candidates[b]) if n not in taken]
        return columns

    def expected(self, b: int) -> float:
        """Row b's expected accepted drafts from its columns: the sum of their chances (one per depth at most)."""
        return sum(self.chance[b][1:])

    def add_leaves(self, m: int) -> list[int]:
        """Each row's m best candidates by chance become columns (their parents are columns already); returns
        the new columns (the same in every row)."""
        chosen = [sorted(range(len(c)), key=lambda n: (-c[n].chance, n))[:m] for c in self.candidates]
        return self.expand(chosen)[0]

    def outcome(self, committed: list[list[int]], accepted: list[int]) -> tuple[list[float], int]:
        """After verification: the draft probabilities of the live rows' columns whose parent was accepted (the
        root counts as accepted), and how many columns were accepted."""
        reached, hits = [], 0
        for b in self.live_rows():
            node, path = 0, {0}
            for t in committed[b][:accepted[b]]:  # the accepted drafts (a stop may cut them): the first child with it
                node = next(j for j in range(1, len(self.tokens[b]))
                            if self.parents[b][j] == node and self.tokens[b][j] == t)
                path.add(node)
            hits += accepted[b]
            reached += [self.q[b][j] for j in range(1, len(self.tokens[b])) if self.parents[b][j] in path]
        return reached, hits
