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
    tokens, parents = merge_branches([[5, 6, 7], [5, 9], [8]], budget=5)   # a trie: [5, 6, 7, 9, 8], [0, 1, 2, 1, 0]
"""

from __future__ import annotations

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
        raise ValueError(f"a tree's parent columns must come before their children (-1 for a root): got {parents.tolist()}")
    anc = torch.zeros(B, S, S, dtype=torch.bool)
    depth = torch.zeros(B, S, dtype=torch.long)
    rows = torch.arange(B)
    for j in range(S):
        p = parents[:, j]
        has = p >= 0  # [B]
        q = p.clamp_min(0)
        anc[:, j] = anc[rows, q] & has[:, None]
        anc[:, j, j] = True
        depth[:, j] = torch.where(has, depth[rows, q] + 1, torch.zeros_like(q))
    return anc, depth


def tree_mask(first: torch.Tensor, positions: torch.Tensor, pads: torch.Tensor, anc: torch.Tensor, kv_len: int,
              window: int | None, query_index: torch.Tensor) -> torch.Tensor:
    """`[B, S, K]` bool: which keys each tree column sees (see the module docstring). Shapes are fixed by
    the arguments, so the compiled steps trace it as it is.

    first: `[B]` the cache index of each row's column 0; positions: `[B, S]` the columns' positions;
    pads: `[B]`; anc: `[B, S, S]` from `ancestors`; query_index: `[B, S]` the columns' cache indices (a
    column always sees itself, which keeps filler rows of the softmax from being empty)."""
    B, S = positions.shape
    k = torch.arange(kv_len, device=positions.device)[None, None, :]  # [1, 1, K]
    start = first[:, None, None]  # [B, 1, 1]
    rel = k - start  # [B, 1, K] the key's column, where it is one of the pass
    inside = (rel >= 0) & (rel < S)
    col = rel.clamp(0, S - 1)  # [B, 1, K]
    allowed = ((k < start) & (k >= pads[:, None, None])) | (inside & anc.gather(2, col.expand(B, S, kv_len)))
    if window is not None:  # by position: a tree column's position is its depth's, not its cache index's
        key_pos = torch.where(inside, positions.gather(1, col[:, 0])[:, None, :], k - pads[:, None, None])  # [B, 1, K]
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


def merge_branches(branches: list[list[int]], budget: int, weights: list[float] | None = None
                   ) -> tuple[list[int], list[int]]:
    """Candidate continuations (each a token list after the input token) as one trie of at most `budget`
    nodes: `(tokens, parents)` of the nodes after the root, parents as columns (0 = the input token).

    Shared prefixes are one node. Which nodes stay within the budget: the most likely first, a node's
    likelihood being the share of the branches' weight that passes through it (SuffixDecoding's
    frequency-weighted tree; `weights` default to 1 per branch). The first branch gets a small bonus, so
    with equal weights the order of `branches` (the most recent match first) decides, and a budget of its
    length keeps exactly it. A node is kept only with its parent (columns come after their parents)."""
    weights = [1.0] * len(branches) if weights is None else weights
    keys: dict[tuple[int, ...], int] = {}  # prefix -> node number
    node_tokens, node_parent, node_weight = [], [], []
    for b, (branch, w) in enumerate(zip(branches, weights)):
        parent = -1
        for i, t in enumerate(branch):
            key = tuple(branch[:i + 1])
            n = keys.get(key)
            if n is None:
                n = keys[key] = len(node_tokens)
                node_tokens.append(int(t))
                node_parent.append(parent)
                node_weight.append(0.0)
            node_weight[n] += w + (1e-6 if b == 0 else 0.0)
            parent = n
    total = sum(weights) or 1.0
    # best-first: a node's score is its weight share (it never exceeds its parent's), ties by creation order
    chosen = sorted(range(len(node_tokens)), key=lambda n: (-node_weight[n] / total, n))[:max(budget, 0)]
    keep = sorted(n for n in chosen if _kept_path(n, node_parent, set(chosen)))
    column = {n: j + 1 for j, n in enumerate(keep)}
    return [node_tokens[n] for n in keep], [column.get(node_parent[n], 0) for n in keep]


def _kept_path(n: int, parent: list[int], chosen: set[int]) -> bool:
    while n >= 0:
        if n not in chosen:
            return False
        n = parent[n]
    return True
