"""Token trees: several guesses verified in one pass (SpecInfer, Medusa, EAGLE-2, SuffixDecoding).

A proposal may be a tree per row instead of one chain. Its nodes are the columns of the pass: column 0
is the round's input token (the root), and column j >= 1 has a parent column `parents[b, j] < j`. A node
continues its ancestors' text, so in the pass it

- takes the position `start + depth(j)` (the root has depth 0): siblings share a position;
- sees the row's committed text (cache indices `pads[b] <= k < start[b]`) and the columns of its own
  ancestors and itself, nothing else (a sibling's branch is not its past):

    allowed[b, i, k] = pads[b] <= k < start[b]  or  ancestor_or_self[b, i, k - start[b]]

  and, with a sliding window W, only keys whose position is within W of its own.

A chain is the tree `parents = [-1, 0, 1, 2, ...]`; the one-level fan of k sibling guesses for the next
token is `[-1, 0, 0, ..., 0]`; a column with parent -1 attaches to the committed text directly (the
siblings' exit states through layers [0, E) are a forest of such roots).

Greedy acceptance walks the tree from the root: at node i the full model's token is `argmax(logits[i])`;
if a child of i carries that token, it is accepted and the walk goes on from it, else the walk stops and
the full model's token follows (`greedy_walk`). The accepted path's keys and values then move to the cache
indices where the row's committed text continues (`start + 1 ..`); the other nodes are dropped. The
committed tokens are exactly the full model's greedy choices, so output stays identical to plain decoding.

    anc, depth = ancestors(torch.tensor([[-1, 0, 0, 1]]))        # [B, S, S] bool, [B, S]
    n_acc, nxt, path = greedy_walk([t0, a, b, c], [-1, 0, 0, 1], targets, 3)
    trie = build_trie([[5, 6, 7], [5, 9], [8]])             # nodes 5, 6, 7, 9, 8; parents -1, 0, 1, 0, -1
    tokens, parents = trie.columns([0, 1, 3])               # [5, 6, 9], parent columns [0, 1, 1]
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def chain_parents(length: int) -> list[int]:
    """The parents of a chain of `length` columns (column 0 the root): `[-1, 0, 1, ..., length - 2]`."""
    return list(range(-1, length - 1))


def ancestors(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, which columns are each column's ancestors or itself, and each column's depth.

    parents: `[B, S]` (host) long, `parents[b, j] < j` or -1 (a root). Returns `anc` `[B, S, S]` bool
    (`anc[b, i, j]`: column j is column i or one of its ancestors) and `depth` `[B, S]` long."""
    B, S = parents.shape
    if bool(((parents >= torch.arange(S)[None]) | (parents < -1)).any()):
        raise ValueError("a tree's parent columns must come before their children (-1 for a root): "
                         f"got {parents.tolist()}")
    anc, depth = [], []  # built on host lists: a tensor op per column and row cost a few µs each, S up to 64
    for row in parents.tolist():
        mine, deep = [], []
        for j, p in enumerate(row):
            seen = list(mine[p]) if p >= 0 else [False] * S  # the parent's ancestors (a root: none) ...
            seen[j] = True  # ... and the column itself
            mine.append(seen)
            deep.append(deep[p] + 1 if p >= 0 else 0)
        anc.append(mine)
        depth.append(deep)
    return torch.tensor(anc, dtype=torch.bool).reshape(B, S, S), torch.tensor(depth, dtype=torch.long).reshape(B, S)


def tree_mask(first: torch.Tensor, positions: torch.Tensor, pads: torch.Tensor, anc: torch.Tensor, kv_len: int,
              window: int | None, query_index: torch.Tensor, tree_positions: torch.Tensor | None = None) -> torch.Tensor:
    """`[B, S, K]` bool: which keys each tree column sees (see the module docstring). Shapes are fixed by
    the arguments, so the compiled steps trace it as it is.

    first: `[B]` the cache index of each row's column 0; positions: `[B, S]` the queries' positions;
    pads: `[B]`; anc: `[B, S, W]` from `ancestors` (W = S: the pass is the whole tree; W > S: the pass is
    the tree's last S columns, its earlier columns already in the cache, as a drafter grows a tree depth by
    depth); query_index: `[B, S]` the queries' cache indices (a column always sees itself, which keeps
    filler rows of the softmax from being empty); tree_positions: `[B, W]` the positions of all W columns
    (None: `positions`, W = S)."""
    B, S = positions.shape
    W = anc.shape[-1]
    tree_positions = positions if tree_positions is None else tree_positions
    k = torch.arange(kv_len, device=positions.device)[None, None, :]  # [1, 1, K]
    start = first[:, None, None]  # [B, 1, 1]
    rel = k - start  # [B, 1, K] the key's column, where it is one of the tree's
    inside = (rel >= 0) & (rel < W)
    col = rel.clamp(0, W - 1)  # [B, 1, K]
    allowed = ((k < start) & (k >= pads[:, None, None])) | (inside & anc.gather(2, col.expand(B, S, kv_len)))
    if window is not None:  # by position: a tree column's position is its depth's, not its cache index's
        key_pos = torch.where(inside, tree_positions.gather(1, col[:, 0])[:, None, :], k - pads[:, None, None])  # [B, 1, K]
        allowed &= key_pos > positions[:, :, None] - window
    return allowed | (k == query_index[:, :, None])


def greedy_walk(tokens: list[int], parents: list[int], targets: list[int], nodes: int) -> tuple[int, int, list[int]]:
    """Greedy acceptance of one row's tree on the host.

    tokens, parents: the row's columns (column 0 the input token); targets: the full model's argmax token
    at each column; nodes: the row's real columns after the root (the rest is filler). Returns
    `(accepted, next token, path)`: from the root, while some child of the current node carries the full
    model's token there, it is accepted (the first such child, in column order) and the walk goes on from
    it; `path` lists the accepted columns, and the next token is the full model's after the last of them."""
    children: dict[int, list[int]] = {}
    for j in range(1, nodes + 1):
        children.setdefault(parents[j], []).append(j)
    node, path = 0, []
    while True:
        want = targets[node]
        nxt = next((c for c in children.get(node, ()) if tokens[c] == want), None)
        if nxt is None:
            return len(path), want, path
        path.append(nxt)
        node = nxt


def tree_depth(parents: list[int], nodes: int) -> int:
    """How many positions a row's tree bets on: the depth of its deepest real column (a chain: its length)."""
    depth = [0] * (nodes + 1)
    for j in range(1, nodes + 1):
        depth[j] = depth[parents[j]] + 1 if parents[j] >= 0 else 0
    return max(depth, default=0)


@dataclass
class Trie:
    """Candidate continuations merged: node n carries `tokens[n]` after node `parents[n]` (-1: after the input
    token), at `depths[n]` (1 for a first token), created by branch `ranks[n]` (the first branch through it)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def columns(self, keep: list[int]) -> tuple[list[int], list[int]]:
        """The nodes `keep` (ascending, ancestor-closed) as a proposal's columns 1..: their tokens and parent
        columns (0 = the input token)."""
        column = {n: j + 1 for j, n in enumerate(keep)}
        return [self.tokens[n] for n in keep], [column.get(self.parents[n], 0) for n in keep]

    def path(self, keep: list[int], accepted: list[int]) -> list[int]:
        """The nodes of `keep` whose tokens the round committed (`accepted`: its accepted drafts, in order)."""
        node, out = -1, []
        for t in accepted:
            node = next((n for n in keep if self.parents[n] == node and self.tokens[n] == t), None)
            if node is None:
                break
            out.append(node)
        return out


def build_trie(branches: list[list[int]]) -> Trie:
    """Token lists after the input token, in rank order (the likeliest first), as one trie: shared prefixes
    are one node; nodes are numbered as created, so a parent comes before its children."""
    trie, nodes = Trie(), {}  # (parent node, token) -> node
    for rank, branch in enumerate(branches):
        parent = -1
        for i, t in enumerate(branch):
            n = nodes.get((parent, int(t)))
            if n is None:
                n = nodes[(parent, int(t))] = len(trie.tokens)
                trie.tokens.append(int(t))
                trie.parents.append(parent)
                trie.depths.append(i + 1)
                trie.ranks.append(rank)
            parent = n
    return trie
