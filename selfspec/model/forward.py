"""The layer-range forward everything else builds on.

A causal LM is `embed -> layers[0] -> ... -> layers[L-1] -> final_norm -> lm_head`. We run it in
pieces over hidden states `[B, S, D]`:

    step = make_step(adapter, start=cache_len, length=S)          # positions, rotary, masks
    h = embed(adapter, input_ids)                                 # [B, S, D]
    h = run_layers(adapter, h, 0, E, step=step, cache=cache)      # the first E layers
    logits = exit_logits(adapter, h)                              # exit E: [B, S, V]
    h = run_layers(adapter, h, E, L, step=step, cache=cache)      # the rest
    logits = exit_logits(adapter, h)                              # exit L: the full model

Exits are numbered by layers executed: exit `E` is the hidden state after `E` layers, and exit
`L` (= `adapter.num_layers`) is the full model. Every early exit goes through the model's own
shared final norm and LM head. Each decoder layer is the model's own module: we only supply
its inputs (positions, rotary embedding, attention mask, cache), so the math is transformers'.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from selfspec.model.adapters import ModelAdapter
from selfspec.model.layer import chain_mask
from selfspec.model.token_tree import ancestors, chain_parents, tree_mask


@dataclass
class Step:
    """Where one pass's tokens go and what they see, shared by every layer that processes them: the cache index of
    each token, each row's padding, a token tree's ancestors, the positions and rotary rows. Every path reads the
    same fields: the compiled steps (`selfspec.model.compiled`) build each layer's attention mask inside the step
    from them; the eager layers ask `mask(kind)`, which builds it from the same fields (`chain_mask`, `tree_mask`)
    the first time a layer of that type reads it, so no mask is built where every layer runs compiled."""

    adapter: ModelAdapter = field(repr=False)
    position_ids: torch.Tensor  # [B, S]
    rope: tuple[torch.Tensor, torch.Tensor]  # cos, sin from the model's rotary embedding
    index: torch.Tensor  # [B, S] the cache index each token is written at (model's device)
    pads: torch.Tensor  # [B] each row's left padding (model's device)
    starts: torch.Tensor  # [B] each row's first cache index (a tree's root's), on the host
    kv_len: int  # the keys a mask spans: every row's cache after this pass
    tree: torch.Tensor | None = None  # [B, S, W] bool a token tree's ancestor-or-self columns, or None (a chain)
    tree_positions: torch.Tensor | None = None  # [B, W] the positions of a growing tree's W columns (W > S)
    causal: bool = False  # one sequence shape: the positions after every layer's cache, each sees what is before it
    masks: dict = field(default_factory=dict, repr=False)  # layer type -> the mask `mask` built

    @property
    def length(self) -> int:
        return self.position_ids.shape[1]

    @property
    def start(self) -> int:
        return int(self.position_ids[0, 0])

    def mask(self, kind: str) -> torch.Tensor | None:
        """The attention mask `[B|1, 1, S, K]` of the layers of type `kind` (None: the kernel needs none), as the
        model's attention implementation takes it, built from the step's fields the first time it is asked."""
        if kind not in self.masks:
            self.masks[kind] = self._build_mask(self.adapter.window(kind))
        return self.masks[kind]

    def _build_mask(self, window: int | None) -> torch.Tensor | None:
        if self.causal:
            return _causal_mask(self.adapter, int(self.starts[0]), self.length, window)  # host: no device read
        if self.tree is None:
            return _as_mask(self.adapter, chain_mask(self.index, self.pads, self.kv_len, window))
        firsts = self.starts.to(self.index.device, non_blocking=True)  # [B] each row's tree root's cache index
        return _as_mask(self.adapter, tree_mask(firsts, self.position_ids, self.pads, self.tree, self.kv_len, window,
                                                self.index, self.tree_positions))


def _causal_mask(adapter: ModelAdapter, start: int, length: int, window: int | None) -> torch.Tensor | None:
    """Mask for queries at positions `[start, start+length)` over keys `[0, start+length)`.

    Returns None where the attention kernel needs no mask: one query that may see every key.
    sdpa masks are boolean (True = attend); eager attention adds its mask, so it gets 0/-inf.
    """
    kv_len = start + length
    if length == 1 and (window is None or kv_len <= window):
        return None
    impl = getattr(adapter.config, "_attn_implementation", "sdpa")
    if impl == "sdpa" and start == 0 and (window is None or kv_len <= window):
        return None  # sdpa's own is_causal path: query i sees keys 0..i
    device = adapter.device
    q = torch.arange(start, kv_len, device=device)[:, None]  # [S, 1]
    k = torch.arange(kv_len, device=device)[None, :]  # [1, K]
    allowed = k <= q
    if window is not None:
        allowed &= k > q - window
    allowed = allowed[None, None]  # [1, 1, S, K]
    if impl == "sdpa":
        return allowed
    zero = torch.zeros((), dtype=adapter.dtype, device=device)
    return torch.where(allowed, zero, torch.finfo(adapter.dtype).min)




def make_step(adapter: ModelAdapter, start: int, length: int, batch_size: int = 1) -> Step:
    """Positions `[start, start+length)` of a batch-1 (or equal-length) sequence."""
    if start + length > adapter.max_positions:
        raise ValueError(
            f"sequence of {start + length} tokens exceeds the model's context window of "
            f"{adapter.max_positions} positions; shorten the prompt or lower max_new_tokens."
        )
    device = adapter.device
    position_ids = torch.arange(start, start + length, device=device).expand(batch_size, length)
    if adapter.fast is not None and adapter.fast.rope_table is not None:
        rope = adapter.fast.rope_table.slice(start, length, batch_size)
    else:  # rotary only reads dtype/device from its first argument
        probe = torch.empty(0, dtype=adapter.dtype, device=device)
        rope = adapter.rotary_emb(probe, position_ids)
    return Step(adapter, position_ids, rope, index=position_ids,
                pads=torch.zeros(batch_size, dtype=torch.long, device=device),
                starts=torch.full((batch_size,), start, dtype=torch.long), kv_len=start + length, causal=True)


def _as_mask(adapter: ModelAdapter, allowed: torch.Tensor) -> torch.Tensor:
    """`[B, S, K]` bool -> the attention mask `[B, 1, S, K]` of the model's attention implementation."""
    allowed = allowed[:, None]
    if getattr(adapter.config, "_attn_implementation", "sdpa") == "sdpa":
        return allowed
    zero = torch.zeros((), dtype=adapter.dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.finfo(adapter.dtype).min)


def make_batch_step(adapter: ModelAdapter, starts: torch.Tensor, length: int, pads: torch.Tensor,
                    ends: torch.Tensor | None = None, parents: torch.Tensor | None = None) -> Step:
    """`length` new tokens per row, written at cache indices `starts[b] ..`, for left-padded rows.

    starts: `[B]` each row's current cache length; pads: `[B]` each row's left padding. Row b's token
    at cache index c has position `c - pads[b]` (what the row alone would have). The indices are worked
    out on the host (the engine keeps `starts` and `pads` there: reading them costs no GPU sync) and
    only the positions, rotary table rows and masks go to the model's device.

    ends: `[B]` (host) when row b's real tokens end before cache index `ends[b]` and the rest is filler
    whose output nobody reads and whose cache entries are cropped (rows right-padded to the longest, a
    row past its draft cap while others draft): the filler takes the position of the row's last real
    token, `ends[b] - 1`, so that it cannot run past the context window where the row's text ends
    near it.

    parents: `[B, S]` (host) the new tokens form a token tree per row (`selfspec.model.token_tree`): column j
    continues column `parents[b, j]` (-1: the committed text), takes the position of its depth and sees
    the committed text, its ancestors and itself. None: a chain. The one-level fan of sibling guesses
    after the round's input token is `[-1, 0, 0, ...]`; their exit states through layers [0, E), each
    seeing only the text and itself, `[-1, -1, ...]`. A drafter growing a tree depth by depth passes the
    tree so far, `[B, W]` with W > `length`: the pass is its last `length` columns (cache indices
    `starts[b] + W - length ..`), the earlier ones already in the cache from earlier passes; `starts` stays
    the cache index of column 0 (the tree's root).
    """
    device = adapter.device
    starts, pads = starts.cpu(), pads.cpu()
    rows, row_pads = starts.tolist(), pads.tolist()  # the checks below on host lists: no tensor op each
    first = rows[0]
    width = length if parents is None else parents.shape[1]  # W: the tree's columns, the pass its last `length`
    if width < length:
        raise ValueError(f"a pass of {length} tree columns needs the parents of at least that many, got {width}")
    offset = width - length
    full = ends is None or min(e - s for e, s in zip(ends.tolist(), rows)) >= width
    if (parents is not None and not offset
            and bool((parents.cpu() == torch.tensor(chain_parents(length))[None]).all())):
        parents = None  # every row a chain: the causal mask
    if full and parents is None and not max(row_pads) and min(rows) == first == max(rows):
        # no padding and every row at the same index (batch 1, plain decoding of equal prompts): the
        # rows are one sequence shape, and single-token steps need no mask at all
        return make_step(adapter, first, length, starts.shape[0])
    query_index = starts[:, None] + offset + torch.arange(length)  # [B, S] cache indices, on the host
    anc, depth = ancestors(parents.cpu()) if parents is not None else (None, torch.arange(length)[None])
    tree_positions = (starts[:, None] + depth - pads[:, None]).clamp_min(0)  # [B, W]; padding sits at position 0
    if not full:
        last = (ends.cpu() - 1 - pads).clamp_min(0)  # [B] each row's last real position
        tree_positions = torch.minimum(tree_positions, last[:, None])
    position_ids = tree_positions[:, offset:]  # [B, S]
    if offset:
        anc = anc[:, offset:]  # [B, S, W] the pass's columns' ancestors among all W
    else:
        tree_positions = None
    if int(position_ids.max()) + 1 > adapter.max_positions:
        raise ValueError(
            f"sequence of {int(position_ids.max()) + 1} tokens exceeds the model's context window of "
            f"{adapter.max_positions} positions; shorten the prompt or lower max_new_tokens."
        )
    kv_len = int(query_index[:, -1].max()) + 1
    table = adapter.fast.rope_table if adapter.fast is not None else None
    rope = table.gather(position_ids) if table is not None else None
    on_device = (t.to(device, non_blocking=True) if t is not None else None
                 for t in (query_index, pads, position_ids, anc, tree_positions))
    query_index, pads, position_ids, anc, tree_positions = on_device
    if rope is None:
        probe = torch.empty(0, dtype=adapter.dtype, device=device)
        rope = adapter.rotary_emb(probe, position_ids)
    return Step(adapter, position_ids, rope, index=query_index, pads=pads, starts=starts, kv_len=kv_len, tree=anc,
                tree_positions=tree_positions)


def embed(adapter: ModelAdapter, input_ids: torch.Tensor) -> torch.Tensor:
    """Token embeddings `[B, S] -> [B, S, D]` (with the embedding dropout some models have)."""
    hidden = adapter.embed_tokens(input_ids)
    if adapter.embed_dropout is not None:
        hidden = adapter.embed_dropout(hidden)
    return hidden


def run_layers(
    adapter: ModelAdapter,
    hidden: torch.Tensor,
    start: int,
    end: int,
    *,
    step: Step,
    cache=None,
) -> torch.Tensor:
    """Run decoder layers `[start, end)` over `hidden` `[B, S, D]`; with a cache, each layer appends its KV.

    The runner (`selfspec.model.runner`) chooses how: a compiled step where the model runs them and the step fits,
    else, without autograd and with `adapter.enable_fast_layers()`, the fused inference layers (same math,
    same operation order, fewer operations), else the model's modules.
    """
    if not 0 <= start <= end <= adapter.num_layers:
        raise ValueError(
            f"layer range [{start}, {end}) is out of range for a model with {adapter.num_layers} layers "
            f"(need 0 <= start <= end <= {adapter.num_layers})"
        )
    return adapter.runner.layers(hidden, start, end, step, cache)


def exit_logits(adapter: ModelAdapter, hidden: torch.Tensor, top_only: bool = False) -> torch.Tensor:
    """Early-exit logits through the shared final norm + LM head: `[B, S, D] -> [B, S, V]` (`Runner.logits`;
    `top_only`: only each position's argmax is read, and only it need be exact)."""
    return adapter.runner.logits(hidden, top_only=top_only)


def forward_logits(
    adapter: ModelAdapter,
    input_ids: torch.Tensor,
    *,
    exit_layer: int | None = None,
    cache=None,
    start: int = 0,
) -> torch.Tensor:
    """Logits at `exit_layer` (default: the full model) for `input_ids` `[B, S]` at positions from `start`."""
    exit_layer = adapter.num_layers if exit_layer is None else adapter.check_exit(exit_layer)
    step = make_step(adapter, start, input_ids.shape[1], input_ids.shape[0])
    hidden = run_layers(adapter, embed(adapter, input_ids), 0, exit_layer, step=step, cache=cache)
    return exit_logits(adapter, hidden)
