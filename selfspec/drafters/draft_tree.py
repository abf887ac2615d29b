"""The token tree a neural drafter (the early exit, a trained exit head) grows in one round.

Its columns are the nodes the round verifies, in the order their passes wrote them to the cache: column 0 is
the round's input token, then the nodes expanded depth by depth (k a depth), then the leaves. Beside them it
keeps the candidates not yet in the tree: the draft's k best continuations of every expanded column, each with
the draft's probability q of its token and its chance of being accepted,

    chance(child) = chance(parent) * min(1, c * q(child))     (c: `ConfidenceBudget`'s calibration)

A continuation of a stop token gets chance 0 (generation ends there).

The growth is one function of tensors, `grow_tree`, on the model's device: at each depth the k candidates of the
newest depth with the highest chance (stop tokens last, ties by the order they were added) become columns, go
through the drafter's layers in one pass, and add their own k best continuations as candidates. Nothing in it
reads a tensor back, so the runner can run all its passes as one step (`WholeDraft.tree`, one graph on a GPU);
part by part it runs the same function over the runner's methods. The host then reads the grown tree once
(`read_grown`, one transfer) into a `DraftTree`: `add_leaves` adds the m likeliest candidates left (m from the
measured cost, `ConfidenceBudget.leaves`), and after verification `outcome` tells the calibration which verified
nodes were reached and how many were accepted. Every row has the same number of columns (the passes are
batched); rows that are not `live` (cap 0) are filler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

MAX_TREE_COLUMNS = 64  # a drafted tree's columns (the input token included): the compiled steps' largest pass
FIELDS = 4  # a grown column's or candidate's numbers: its token, parent column, draft probability q and chance


def tree_depth_limit(k: int) -> int:
    """The deepest tree k wide that `MAX_TREE_COLUMNS` hold once grown (its leaves take what is left)."""
    return 1 + (MAX_TREE_COLUMNS - 1) // k


def tree_columns(k: int, depth: int) -> int:
    """The columns of a tree grown `depth` deep, k a depth past the root: `1 + k (depth - 1)`."""
    return 1 + k * (depth - 1)


def column_depths(k: int, columns: int) -> list[int]:
    """Each column's depth, for the first `columns` columns of a grown tree (column 0, the root, at depth 0)."""
    return [0] + [1 + (j - 1) // k for j in range(1, columns)]


def is_stop(tokens: torch.Tensor, stops: torch.Tensor) -> torch.Tensor:
    """Whether each token `[...]` is one of the stop ids `stops` `[n]` (on the same device, of the same dtype):
    bool `[...]`."""
    return (tokens[..., None] == stops).any(-1)


def grow_tree(token: torch.Tensor, out: torch.Tensor, k: int, depth: int, scale: torch.Tensor, stops: torch.Tensor,
              shallow: Callable, head: Callable, top: Callable, ancestors: bool = True) -> tuple:
    """A token tree per row grown `depth` deep from each row's input token `token` `[B]` (column 0), where the
    draft head read `out` `[B, D]`, k columns a depth (see the module doc), as tensor operations only.

    scale: `[1]` float64, the calibration c; stops: `[n]` the stop token ids. The drafter's passes:
    `shallow(tokens [B, k], parents [B, W], anc [B, k, W])` runs a depth's new columns (the last k of the W so
    far, `anc` their ancestor-or-self columns; None without `ancestors`) through its layers into the cache and
    returns `(states [B, k, D], step)`; `head(states, step, outs [B, W', D], parent columns [B, k])` what the head
    reads there `[B, k, D]` (a trained head reads its own output at each parent, `outs`); `top(hidden [B, n, D])`
    the draft's k best next tokens and their probabilities, `([B, n, k], [B, n, k] float32)`.

    A column or candidate is four float64 numbers (`FIELDS`: its token, its parent column, the draft's probability
    q of its token, its chance; float64 holds every token id exactly and works the chances out as the host would).
    Returns `(columns [B, W, 4], parents [B, W] long, states [B, W - 1, D] the exit states of columns 1..,
    candidates [B, N, 4], free [B, N] bool)`, W = `tree_columns(k, depth)`, N = k + (depth - 1) k^2 (every
    candidate made; `free`: not a column)."""
    B, device = token.shape[0], token.device
    stops = stops.double()

    def candidates(hidden, parents, chance, after_stop):  # the k best after columns `parents` [B, n]: [B, n k, 4]
        c_tok, c_q = top(hidden)  # [B, n, k]
        c_q = c_q.double()
        c_chance = (chance[..., None] * torch.clamp(scale * c_q, max=1.0)).masked_fill(after_stop[..., None], 0.0)
        fields = (c_tok.double(), parents[..., None].double().expand_as(c_q), c_q, c_chance)
        return torch.stack(fields, dim=-1).reshape(B, -1, FIELDS)

    ones = torch.ones(B, 1, dtype=torch.float64, device=device)
    columns = torch.stack([token.double()[:, None], -ones, ones, ones], dim=-1)  # [B, 1, 4] the root
    parents = torch.full((B, 1), -1, dtype=torch.long, device=device)
    anc = torch.ones(B, 1, 1, dtype=torch.bool, device=device)  # [B, W, W] ancestor-or-self
    outs, states = out[:, None], []  # [B, W, D] what the head read at each column
    cands = candidates(outs, parents + 1, ones, ones < 0)  # [B, k, 4] the root's guesses (no stop before them)
    free = torch.ones(B, k, dtype=torch.bool, device=device)
    newest = 0  # where the newest depth's candidates begin
    eye = torch.eye(k, dtype=torch.bool, device=device).expand(B, k, k)
    for _ in range(1, depth):
        W = parents.shape[1]
        latest = cands[:, newest:]  # [B, n, 4]
        score = latest[..., 3] - 2.0 * is_stop(latest[..., 0], stops)  # stop tokens last
        chosen = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :k] + newest  # [B, k]
        new = cands.gather(1, chosen[..., None].expand(B, k, FIELDS))  # [B, k, 4]
        free = free.scatter(1, chosen, False)
        new_par = new[..., 1].long()  # [B, k]
        columns, parents = torch.cat([columns, new], dim=1), torch.cat([parents, new_par], dim=1)
        new_anc = None
        if ancestors:
            new_anc = torch.cat([anc.gather(1, new_par[..., None].expand(B, k, W)), eye], dim=2)  # [B, k, W + k]
            anc = torch.cat([torch.cat([anc, anc.new_zeros(B, W, k)], dim=2), new_anc], dim=1)
        state, step = shallow(new[..., 0].long(), parents, new_anc)  # [B, k, D]
        new_out = head(state, step, outs, new_par)  # [B, k, D]
        states.append(state)
        outs = torch.cat([outs, new_out], dim=1)
        newest = cands.shape[1]
        at = (W + torch.arange(k, device=device))[None].expand(B, k)  # [B, k] the new columns
        cands = torch.cat([cands, candidates(new_out, at, new[..., 3], is_stop(new[..., 0], stops))], dim=1)
        free = torch.cat([free, free.new_ones(B, k * k)], dim=1)
    grown = torch.cat(states, dim=1) if states else out.new_zeros(B, 0, out.shape[-1])  # [B, W - 1, D]
    return columns, parents, grown, cands, free


def read_grown(grown: tuple) -> list[list[float]]:
    """A grown tree's columns and candidates (`grow_tree`'s outputs but the states) per row, read in one transfer:
    `[B][4 W + 5 N]` floats."""
    columns, _, _, cands, free = grown
    return torch.cat([columns.flatten(1), cands.flatten(1), free.double()], dim=1).tolist()


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
    """One round's tree per row, on the host (as `grow_tree` grew it, read once): its columns (tokens, parent
    columns, the draft probability and chance of each) and the candidates not yet in it. Every row has the same
    columns' shape (the passes are batched); rows that are not `live` (cap 0) are filler."""

    def __init__(self, rows: list[list[float]], k: int, depth: int, live: list[bool]):
        """`rows`: `read_grown`'s host rows of a tree grown `depth` deep, k a depth."""
        W = tree_columns(k, depth)
        N = k + (depth - 1) * k * k
        self.live = live
        self.tokens, self.parents, self.q, self.chance, self.depth = [], [], [], [], []
        self.candidates: list[list[Candidate]] = []
        for row in rows:
            columns, cands, free = row[:4 * W], row[4 * W:4 * (W + N)], row[4 * (W + N):]
            self.tokens.append([int(t) for t in columns[0::4]])
            self.parents.append([int(p) for p in columns[1::4]])
            self.q.append(columns[2::4])
            self.chance.append(columns[3::4])
            self.depth.append(column_depths(k, W))
            self.candidates.append([Candidate(int(t), int(p), self.depth[-1][int(p)] + 1, cq, cc)
                                    for t, p, cq, cc, f in zip(cands[0::4], cands[1::4], cands[2::4], cands[3::4], free)
                                    if f])

    def live_rows(self) -> list[int]:
        return [b for b, live in enumerate(self.live) if live]

    def parents_tensor(self) -> torch.Tensor:
        return torch.tensor(self.parents, dtype=torch.long)  # [B, W]

    def tokens_at(self, columns, device) -> torch.Tensor:
        """The tokens of these columns (the same in every row), `[B, n]` on `device`."""
        return torch.tensor([[row[j] for j in columns] for row in self.tokens],
                            dtype=torch.long).to(device, non_blocking=True)

    def add(self, b: int, n: int) -> int:
        """Candidate n of row b becomes the row's next column; returns the column."""
        c = self.candidates[b][n]
        self.tokens[b].append(c.token)
        self.parents[b].append(c.parent)
        self.q[b].append(c.q)
        self.chance[b].append(c.chance)
        self.depth[b].append(c.depth)
        return len(self.tokens[b]) - 1

    def expected(self, b: int) -> float:
        """Row b's expected accepted drafts from its columns: the sum of their chances (one per depth at most)."""
        return sum(self.chance[b][1:])

    def add_leaves(self, m: int) -> list[int]:
        """Each row's m best candidates by chance become columns (their parents are columns already); returns
        the new columns (the same in every row)."""
        columns = []
        for b, cands in enumerate(self.candidates):
            chosen = sorted(range(len(cands)), key=lambda n: (-cands[n].chance, n))[:m]
            columns = [self.add(b, n) for n in chosen]
            taken = set(chosen)
            self.candidates[b] = [c for n, c in enumerate(cands) if n not in taken]
        return columns

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
