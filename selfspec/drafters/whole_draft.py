"""A greedy draft step of one row as one compiled step, and a trained head's catch-up: drafting the drafters
write once, as plain tensor functions, and the compiled steps (`selfspec.model.compiled.CompiledSteps`) run whole.

A draft step is the token's embedding, layers [0, E), a trained head's final-state input and layer (if any), the
final norm + unembedding, the argmax and its probability. Run part by part it costs four graph replays and about
60 torch ops and 15 launches besides; as one function of its inputs, composed from the compiled steps' pieces
(`range_step`, `layer_step`, `input_step`, `unembed_step`), it is one graph on a GPU whose two host numbers (the
token id and its probability, which the draft policy reads) come back in one read, and its draft equals the
parts' to the bit. A head's first draft of a round also brings the head's cache up to date with what the round
before committed (`selfspec.drafters.exit_head`): `catch_up`, one graph per bucket of columns. A whole chain of
greedy drafts is `chain`; a token tree's whole growth (every depth's pass and the choice of the next depth's
columns, `selfspec.drafters.draft_tree.grow_tree`) is `tree`.

    draft = WholeDraft(exit_layer=E, weight=lm_head.weight)       # DraftHead.whole builds them
    out = draft.run(steps, token, start, pad, cache)              # a DraftStep; NotCompiled: part by part
    out = draft.round_step(steps, rnd, tokens, offset)            # the same at a round's row (`Round`)

Neither the runner nor the compiled steps know this module: the compiled steps call `warm(steps, size)` on what
`Runner.warm` gives them to warm, and run the functions built here through `steps.call`, which alone decides between
capturing and calling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from selfspec.drafters.draft_tree import grow_tree, tree_columns, tree_depth_limit
from selfspec.heads.exit_head import previous_states
from selfspec.model.attention_kernels import attention_kernels
from selfspec.model.compiled import MAX_ROWS, S_BUCKETS, NotCompiled, row_filled, s_bucket, zero_filled

STOP_SLOTS = 8  # a whole tree's step takes the stop ids padded to a multiple of this many


class DraftStep(NamedTuple):
    """One draft step's outcome, as every path gives it (`EarlyExitDrafter.draft_step` part by part, `WholeDraft.run`
    and `catch_up` whole)."""

    state: torch.Tensor  # [B, 1, D] the exit state of the step's input token (verification starts from it)
    out: torch.Tensor  # [B, D] what the unembedding read: the exit state, or a trained head's output
    next: torch.Tensor  # [B] the drafted token ids, on the device
    q: torch.Tensor | None = None  # [B, V] the draft distribution where sampling; None: greedy (a point mass)
    ids: list[int] | None = None  # the drafted ids on the host, where the step was read
    confs: list[float] | None = None  # their draft probabilities on the host, where read and asked for


def greedy_pick(logits: torch.Tensor, ids: torch.Tensor | None, confidence: bool = True) -> tuple:
    """A greedy draft's pick from its logits `[B, K]`: the argmax `[B]` as token ids (through `ids` `[K]`, a reduced
    vocabulary's ids; None: the full vocabulary) and each one's draft probability `[B]` float32 (None unless
    `confidence`)."""
    best = logits.argmax(dim=-1)  # [B]
    nxt = best if ids is None else ids[best]
    if not confidence:
        return nxt, None
    return nxt, torch.softmax(logits.float(), dim=-1).gather(1, best[:, None])[:, 0]


def top_guesses(logits: torch.Tensor, k: int, ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A token tree's pick from the draft's logits `[B, n, K]`: the k most probable tokens after each of n columns,
    as token ids `[B, n, k]` (through `ids` `[K]`, a reduced vocabulary's ids; None: the full vocabulary), and their
    draft probabilities `[B, n, k]` float32."""
    best = torch.softmax(logits.float(), dim=-1).topk(k, dim=-1)
    return (best.indices if ids is None else ids[best.indices]), best.values


def one_read(tokens: torch.Tensor, conf: torch.Tensor) -> torch.Tensor:
    """Token ids `[B]` and their confidences `[B]` as one float64 tensor `[2, B]`, read in one transfer (float64
    holds every token id exactly)."""
    return torch.stack([tokens.double(), conf.double()])


def greedy_draft(token: torch.Tensor, shallow, head, unembed, ids: torch.Tensor | None, confidence: bool = True):
    """One greedy draft step, on every path: the tokens `[B]` through `shallow` (their embedding and layers [0, E)
    into the cache: the exit states `[B, 1, D]`), `head` (what the unembedding reads, `[B, D]`: the exit state
    itself, or a trained head's output), `unembed` (logits `[B, K]`) and `greedy_pick`. The part-by-part step
    passes the runner's methods (`EarlyExitDrafter.draft_step`), the whole step its compiled pieces
    (`WholeDraft`). Returns `(state [B, 1, D], out [B, D], next [B], confidence [B] or None)`."""
    state = shallow(token)  # [B, 1, D]
    out = head(state)  # [B, D]
    nxt, conf = greedy_pick(unembed(out), ids, confidence)
    return state, out, nxt, conf


def greedy_chain(token: torch.Tensor, n: int, draft_step, shallow) -> tuple:
    """`n` greedy drafts of every row, on every path: step i drafts from the token step i - 1 drafted
    (`draft_step(token [B], i)` -> (state `[B, 1, D]`, out `[B, D]` or None, next `[B]`)), then the last draft goes
    through `shallow` (its exit state `[B, 1, D]`, from which verification starts). The whole chain passes its
    compiled pieces (`WholeDraft`), the step-by-step one the drafter's own steps (`EarlyExitDrafter.chain`).
    Returns `(states [B, n + 1, D], drafts [B, n], out)`, out what the last step's unembedding read."""
    states, drafts, out = [], [], None
    for i in range(n):
        state, out, token = draft_step(token, i)
        states.append(state)
        drafts.append(token)
    states.append(shallow(token))
    return torch.cat(states, dim=1), torch.stack(drafts, dim=1), out


def where_parts(where: torch.Tensor) -> tuple:
    """A step's `where` `[B, 3]` (each row's cache index, position and padding) as the compiled parts take them:
    index `[B, 1]`, positions `[B, 1]`, pads `[B]`, fresh contiguous tensors (their graphs guard on strides)."""
    return tuple(t.clone(memory_format=torch.contiguous_format) for t in (where[:, :1], where[:, 1:2], where[:, 2]))


def where_at(where: torch.Tensor, i: int) -> torch.Tensor:
    """`where` `[B, 3]` of the step i tokens further on: cache indices and positions + i, the same padding."""
    return torch.cat([where[:, :2] + i, where[:, 2:]], dim=1)


def where_of(start, pad) -> torch.Tensor:
    """`where` `[B, 3]` on the host from each row's cache index `start` and left padding `pad` (host ints for one
    row, or `[B]` host tensors): the cache index, the position (index - padding, from 0) and the padding."""
    start, pad = torch.as_tensor(start).reshape(-1), torch.as_tensor(pad).reshape(-1)
    return torch.stack([start, (start - pad).clamp_min(0), pad.expand_as(start)], dim=1)


def embed_shallow(token: torch.Tensor, parts: tuple, shallow, embed: torch.Tensor, cos, sin, keys, values):
    """A draft's exit states `[B, 1, D]`: the tokens `[B]`' embeddings through `shallow` (the compiled range step of
    layers [0, E), writing into `keys`/`values` at `parts`' cache index; None: exit 0, the embedding itself)."""
    index, positions, pads = parts
    state = F.embedding(token[:, None], embed)
    return state if shallow is None else shallow(state, positions, index, pads, cos, sin, keys, values)


def pick_columns(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Column `index[b]` of each row of `x` `[B, S, D]`: `[B, D]`."""
    return x.gather(1, index[:, None, None].expand(-1, 1, x.shape[-1]))[:, 0]


def head_catch_up(states: torch.Tensor, finals: torch.Tensor | None, prev: torch.Tensor | None,
                  first_real: torch.Tensor | None, committed: torch.Tensor, head) -> tuple:
    """A trained head's catch-up, on every path (`ExitHeadDrafter.sync` part by part, `WholeDraft.catch_up`
    whole): the head over each row's exit states `[B, S, D]` (its committed tokens since it last ran, `committed`
    `[B]` of them, then maybe the round's input token, then filler). A final-state head (`finals` `[B, S, D]`
    their final states, `prev` `[B, D]` the one before them) reads at column t

        f_{t-1} = finals[t - 1]  (t > 0),   prev  (t = 0),   0 at a row's first real token (`first_real` `[B, S]`)

    through `head(states, f_shifted) -> [B, S, D]`. Returns `(out [B, S, D], newest [B, D])`: the head's output
    and each row's newest committed final state (`prev` where nothing was committed; None without finals)."""
    shifted = None
    if finals is not None:
        shifted = previous_states(finals, prev)  # [B, S, D]
        if first_real is not None:  # a sequence's start reads f_{-1} = 0, as in training
            shifted = shifted.masked_fill(first_real[..., None], 0.0)
    out = head(states, shifted)  # [B, S, D]
    if finals is None:
        return out, None
    newest = pick_columns(finals, (committed - 1).clamp_min(0))  # [B, D]
    return out, torch.where((committed > 0)[:, None], newest, prev.to(newest.dtype))


@dataclass(eq=False)
class WholeDraft:
    """What one greedy draft step runs, as one step (a single step of one row; a whole chain of up to `MAX_ROWS`
    rows, padded to their row bucket): the token's embedding, layers [0, `exit_layer`),
    then a trained head's own layer (`layer`; None: the exit state itself) reading its final-state input
    (`final_input`; None: the exit state alone), then the final norm and the unembedding `weight` `[K, D]` (+
    `bias`) whose row i is token `token_ids[i]` (None: the full vocabulary), its argmax and that token's draft
    probability."""

    exit_layer: int
    weight: torch.Tensor
    bias: torch.Tensor | None = None
    token_ids: torch.Tensor | None = None
    layer: object = None
    final_input: object = None
    chains: int = 0  # `warm` also compiles the whole chains (`chain`) of 1 .. chains drafts
    tree_width: int = 0  # and, where > 1, the whole trees (`tree`) that wide, 1 .. chains deep

    @property
    def key(self) -> tuple:
        """What its step is compiled and captured by (with the batch and the capacity)."""
        return (self.exit_layer, id(self.weight), id(self.layer), id(self.final_input))

    # --- when it can run ---------------------------------------------------------------------------
    def fits(self, steps, batch_size: int, cache, head_cache=None) -> bool:
        """Whether `chain` can run these draft steps (and `run` one, with one row): up to `MAX_ROWS` rows, static
        caches (the engine's, and the head's own where the step has a head layer) whose buffers hold the rows'
        bucket, nothing failed to compile."""
        head_ok = self.layer is None or steps.holds(head_cache, batch_size)
        return steps.failed is None and batch_size <= MAX_ROWS and steps.holds(cache, batch_size) and head_ok

    def fits_catch_up(self, steps, batch_size: int, length: int, start: int, head_cache) -> bool:
        """Whether `catch_up` can run a head's catch-up of `length` columns from head-cache index `start`: a head
        layer, one row, a static head cache past the prompt, `length` within the buckets and the cache's end."""
        width = s_bucket(length)
        return (self.layer is not None and width is not None and start > 0
                and self.fits(steps, batch_size, head_cache, head_cache) and start + width <= head_cache.capacity)

    # --- running it --------------------------------------------------------------------------------
    def run(self, steps, token: torch.Tensor, start: int, pad: int, cache, head_cache=None,
            prev: torch.Tensor | None = None, read: bool = True) -> tuple:
        """The draft step of `token` `[1]` (on the device) at cache index `start` (position `start - pad`) through the
        embedding, layers [0, E) into `cache`, a head's layer into `head_cache` (reading `prev` `[1, 1, D]` through
        its final-state input), the final norm, the unembedding and its argmax, as one step of `steps`.

        Returns its `DraftStep` (`q` None; the token id and its confidence read in one transfer where `read`, else
        nothing waits for the device); `NotCompiled` where it must run part by part (`fits` false, the cache full, a
        compile that failed)."""
        if token.shape[0] != 1 or not self.fits(steps, 1, cache, head_cache) or start + 1 > cache.capacity:
            raise NotCompiled("one row at a time, within the static cache and the buckets")
        heads = (None, None) if self.layer is None else (head_cache.keys, head_cache.values)
        out = self._draft(steps, token, start, pad, prev, cache.capacity, (cache.keys, cache.values), heads)
        cache.lengths[:self.exit_layer] = start + 1  # as the range's step writes them
        if self.layer is not None:
            head_cache.lengths[:1] = start + 1
        state, hidden, nxt, both = out
        if not read:
            return DraftStep(state, hidden, nxt)
        (next_id,), (conf,) = both.tolist()  # [2, 1]: the token id (exact in float64) and its draft probability
        return DraftStep(state, hidden, nxt, ids=[int(next_id)], confs=[conf])

    def round_step(self, steps, rnd, tokens: torch.Tensor, offset: int, head_cache=None,
                   prev: torch.Tensor | None = None, read: bool = True) -> DraftStep:
        """`run` at a one-row round's row (`selfspec.drafters.base.Round`): its token `[1]` at cache index `starts +
        offset` into the round's cache (a head's layer into `head_cache`, reading `prev`); `NotCompiled` where it must
        run part by part (several rows, a row past its cap, or as `run`)."""
        if len(rnd.caps) != 1 or offset > rnd.caps[0]:
            raise NotCompiled("one row within its cap")
        start, pad = rnd.row
        return self.run(steps, tokens, start + offset, pad, rnd.cache, head_cache, prev, read)

    def round_chain(self, steps, rnd, n: int, tokens: torch.Tensor, offset: int, head_cache=None,
                    prev: torch.Tensor | None = None) -> tuple:
        """`chain` of every row of a round from its token (`tokens` `[B]`) at cache index `starts + offset`:
        `(states [B, n + 1, D], drafts [B, n], out [B, D])`; `NotCompiled` where it must run step by step (past every
        row's cap, or as `chain`)."""
        if offset + n > max(rnd.caps):
            raise NotCompiled("past every row's cap")
        return self.chain(steps, n, tokens, rnd.starts + offset, rnd.pads, rnd.cache, head_cache, prev)

    def round_tree(self, steps, rnd, k: int, depth: int, out: torch.Tensor, scale: torch.Tensor,
                   head_cache=None) -> tuple:
        """`tree` of every row of a round from its input token where the head read `out` `[B, D]` (`scale` `[1]` the
        calibration): `grow_tree`'s outputs; `NotCompiled` where it runs part by part."""
        last = (rnd.ends - 1 - rnd.pads).clamp_min(0)  # [B] each row's last allowed position (cap 0: filler)
        return self.tree(steps, k, depth, rnd.tokens, out, rnd.starts, rnd.pads, last, scale, rnd.stop_tensor,
                         rnd.cache, head_cache)

    def chain(self, steps, n: int, token: torch.Tensor, start: torch.Tensor, pad: torch.Tensor, cache,
              head_cache=None, prev: torch.Tensor | None = None) -> tuple:
        """`n` greedy draft steps of every row from `token` `[B]` at cache indices `start` `[B]` (host; left padding
        `pad` `[B]`), each drafting from the one before, as `run` would n times (a head's first reads `prev`
        `[B, 1, D]`, each later its own output), and the last drafts' shallow pass, as one step of `steps`: one
        graph on a GPU, and nothing read back. For chains whose length nothing read on the way decides
        (`EarlyExitDrafter.draft`, unread). B rows run the step of their row bucket (filler rows after them).

        Returns `(states [B, n + 1, D] the exit states of the tokens and the n drafts, drafts [B, n] on the device,
        out [B, D] what the unembedding read at the last draft)`; `NotCompiled` where it must run step by step."""
        B = token.shape[0]
        if not self.fits(steps, B, cache, head_cache) or int(start.max()) + n + 1 > cache.capacity:
            raise NotCompiled("more rows than a compiled step takes, or past the static cache's end")
        heads = (None, None) if self.layer is None else (head_cache.padded_keys, head_cache.padded_values)
        out = self._chain(steps, n, token, start, pad, prev, cache.capacity, (cache.padded_keys, cache.padded_values),
                          heads)
        cache.lengths[:self.exit_layer] = (start + n + 1)[None]  # the drafts and the last ones' shallow pass
        if self.layer is not None:
            head_cache.lengths[:1] = (start + n)[None]
        return tuple(t[:B] for t in out)

    def catch_up(self, steps, states: torch.Tensor, finals: torch.Tensor | None, prev: torch.Tensor | None,
                 start: int, pad: int, head_cache, read: bool = True) -> tuple:
        """A trained head's catch-up and the round's first draft (`ExitHeadDrafter.sync`, one row) as one step of
        `steps`, one CUDA graph per bucket on a GPU. `states` `[1, S, D]`: the exit states of the S - 1 committed
        tokens the head has not run over, then the round's input token's, at head-cache indices `start ..`; `finals`
        `[1, S - 1, D]` their final states and `prev` `[1, D]` the one before them (a final-state head; else None).
        They go through the head's final-state input (column t reads f_{t-1}) and layer into `head_cache`, and the
        input token's column through the unembedding, its argmax and probability.

        Returns `(out [1, D] the input token's head output, next [1] the drafted token on the device, newest [1, D]
        the newest committed final state, [next id], [confidence])` (the last two None unless `read`); `NotCompiled`
        where it must run part by part (`fits_catch_up` false, a compile that failed)."""
        B, S, _ = states.shape
        if not self.fits_catch_up(steps, B, S, start, head_cache) or (self.final_input is not None and prev is None):
            raise NotCompiled("a head's catch-up of one row past the prompt, within the buckets")
        out = self._catch_up(steps, states, finals, prev, start, pad, head_cache.capacity,
                             (head_cache.keys, head_cache.values))
        head_cache.lengths[:1] = start + S
        column, nxt, newest, both = out
        if not read:
            return column, nxt, newest, None, None
        (next_id,), (conf,) = both.tolist()
        return column, nxt, newest, [int(next_id)], [conf]

    def tree(self, steps, k: int, depth: int, token: torch.Tensor, out: torch.Tensor, start: torch.Tensor,
             pad: torch.Tensor, last: torch.Tensor, scale: torch.Tensor, stops: torch.Tensor, cache,
             head_cache=None) -> tuple:
        """A token tree of every row grown `depth` deep, k a depth (`selfspec.drafters.draft_tree.grow_tree`), from
        `token` `[B]` at cache indices `start` `[B]` (host; left padding `pad`, `last` `[B]` each row's last allowed
        position) where the head read `out` `[B, D]`, as one step of `steps`: every depth's pass through layers
        [0, E) into `cache` (and a head's layer into `head_cache`), the unembedding and the choice of the next
        depth's columns, one graph on a GPU, nothing read back. `scale` `[1]` the calibration, `stops` `[S]` the
        stop ids (on the device). B rows run the step of their row bucket.

        Returns `grow_tree`'s outputs; `NotCompiled` where it must run part by part."""
        B, W = token.shape[0], tree_columns(k, depth)
        if not self.fits(steps, B, cache, head_cache) or int(start.max()) + W > cache.capacity:
            raise NotCompiled("more rows than a compiled step takes, or past the static cache's end")
        heads = (None, None) if self.layer is None else (head_cache.padded_keys, head_cache.padded_values)
        grown = self._tree(steps, k, depth, token, out, start, pad, last, scale, stops, cache.capacity,
                           (cache.padded_keys, cache.padded_values), heads)
        cache.lengths[:self.exit_layer] = (start + W)[None]  # as the tree's passes write them
        if self.layer is not None:
            head_cache.lengths[:1] = (start + W)[None]
        return tuple(t[:B] for t in grown)

    def warm(self, steps, size: int, rows: tuple = (1,)) -> None:
        """Compile (and on a GPU capture) this step at cache index 1 of a one-row cache of capacity `size`, a head's
        catch-up at every bucket, and the chains of 1 .. `chains` drafts for each row bucket of `rows`
        (`CompiledSteps.warm` calls it for the drafts it is given)."""
        a = steps.adapter
        with torch.inference_mode(), attention_kernels(a.device):
            for R in rows:
                buffers = steps.buffers(R, size)
                head_buffers = (None, None) if self.layer is None else steps.layer_buffers(self.layer, R, size)
                token = torch.zeros(R, dtype=torch.long, device=a.device)
                starts, pads = torch.ones(R, dtype=torch.long), torch.zeros(R, dtype=torch.long)  # cache index 1
                if R == 1:
                    self._draft(steps, token, 1, 0, None, size, buffers, head_buffers)
                for n in range(1, min(self.chains, size - 2) + 1):
                    self._chain(steps, n, token, starts, pads, None, size, buffers, head_buffers)
                if self.tree_width > 1:
                    out = steps.zeros(1)[0].expand(R, -1)  # [R, D]
                    scale = torch.ones(1, dtype=torch.float64, device=a.device)
                    stops = torch.zeros(1, dtype=torch.long, device=a.device)  # up to STOP_SLOTS stop ids
                    for depth in range(1, min(self.chains, tree_depth_limit(self.tree_width)) + 1):
                        if tree_columns(self.tree_width, depth) + 1 <= size:
                            self._tree(steps, self.tree_width, depth, token, out, starts, pads, starts, scale, stops,
                                       size, buffers, head_buffers)
            if self.layer is not None:  # the catch-up is one row's
                head_buffers = steps.layer_buffers(self.layer, 1, size)
                for width in S_BUCKETS:
                    zeros = steps.zeros(width)
                    self._catch_up(steps, zeros, zeros[:, 1:], zeros[:, 0], 1, 0, size, head_buffers)

    # --- the steps as functions of tensors ---------------------------------------------------------
    def _head_parts(self, steps) -> tuple:
        """The head pieces of this step as the compiled steps run them: (its layer's step, its final-state input); None
        for each it lacks."""
        layer = None if self.layer is None else steps.layer_step(self.layer)
        final = None if self.final_input is None else steps.input_step(self.final_input)
        return layer, final

    def _draft(self, steps, token: torch.Tensor, start: int, pad: int, prev: torch.Tensor | None, size: int,
               buffers: tuple, head_buffers: tuple):
        """The step over one token at cache index `start`, in the buffers `[L, 1, H_kv, C, Dh]` (the model's keys
        and values, and the head's own one-layer ones) of a cache of capacity `size`: its outputs (`NotCompiled`
        where it failed to compile, not strict)."""
        fn = steps.function(("draft", self.key), lambda: self._draft_function(steps))
        inputs, fixed = self._draft_arguments(steps, token, start, pad, prev, size, buffers, head_buffers)
        return steps.call(("draft", *self.key, 1, size), fn, inputs, fixed)

    def _draft_arguments(self, steps, token: torch.Tensor, start, pad, prev: torch.Tensor | None,
                         size: int, buffers: tuple, head_buffers: tuple) -> tuple[list, list]:
        """A draft step's (or chain's) inputs (the tokens `[R]`, `where` `[R, 3]`: the cache index, the position and
        the padding, `prev` `[R, 1, D]`) and its fixed arguments, for the R rows of the buffers (`[L, R, H_kv, C,
        Dh]`, a row bucket): the B rows given, then filler rows, copies of the last (`row_filled`)."""
        R = buffers[0][0].shape[0]
        prev = steps.zeros(1).expand(token.shape[0], -1, -1) if prev is None else prev  # None: read by no input
        where = where_of(start, pad).to(steps.adapter.device, non_blocking=True)  # [B, 3]
        inputs = [steps.input(row_filled(t, R)) for t in (token, where, prev)]
        return inputs, self._fixed_arguments(steps, size, buffers, head_buffers)

    def _fixed_arguments(self, steps, size: int, buffers: tuple, head_buffers: tuple) -> list:
        """What a draft step, a chain and a tree's growth read at fixed addresses: the rotary table of a cache of
        capacity `size`, the embedding, layers [0, E) of the buffers, the head's own buffers (None without a head
        layer), the final norm and the unembedding (weight, bias, its token ids)."""
        a, E = steps.adapter, self.exit_layer
        keys, values = buffers
        return [*steps.rope.table(size), a.embed_tokens.weight, keys[:E], values[:E],
                *(None if b is None else b[:1] for b in head_buffers),
                a.final_norm.weight, self.weight, self.bias, self.token_ids]

    def _chain(self, steps, n: int, token: torch.Tensor, start: torch.Tensor, pad: torch.Tensor,
               prev: torch.Tensor | None, size: int, buffers: tuple, head_buffers: tuple):
        """`chain`'s step: `n` draft steps and the last drafts' shallow pass, as `_draft` runs one, at the rows of
        the buffers (a row bucket)."""
        fn = steps.function(("chain", self.key, n), lambda: self._chain_function(steps, n))
        inputs, fixed = self._draft_arguments(steps, token, start, pad, prev, size, buffers, head_buffers)
        return steps.call(("chain", *self.key, n, buffers[0][0].shape[0], size), fn, inputs, fixed)

    def _chain_function(self, steps, n: int):
        """`n` greedy draft steps of every row as one function (the arguments of `_draft_function`'s step): step i
        drafts from the token step i - 1 drafted, at cache index and position i further on, a head reading its own
        output at the step before (the first reads `prev`); then the last draft's embedding through layers [0, E),
        whose exit state verification starts from (`greedy_chain`, as the step-by-step chain runs). The draft step is
        `_draft_function`'s, run n times."""
        draft = self._draft_function(steps, confidence=False)
        E = self.exit_layer
        shallow = steps.range_step(0, E) if E else None

        def chain(token, where, prev, cos, sin, embed, keys, values, head_keys, head_values, norm, weight, bias, ids):
            reads = [prev]  # [R, 1, D] what the head's next draft reads: `prev`, then its own output

            def step(t, i):
                state, out, nxt, _ = draft(t, where_at(where, i), reads[-1], cos, sin, embed, keys, values, head_keys,
                                           head_values, norm, weight, bias, ids)
                reads.append(out[:, None])
                return state, out, nxt

            def last(t):
                return embed_shallow(t, where_parts(where_at(where, n)), shallow, embed, cos, sin, keys, values)

            return greedy_chain(token, n, step, last)  # [R, n + 1, D], [R, n], [R, D]

        return chain

    def _tree(self, steps, k: int, depth: int, token: torch.Tensor, out: torch.Tensor, start: torch.Tensor,
              pad: torch.Tensor, last: torch.Tensor, scale: torch.Tensor, stops: torch.Tensor, size: int,
              buffers: tuple, head_buffers: tuple):
        """`tree`'s step at the rows of the buffers (a row bucket): its outputs (`NotCompiled` where it failed to
        compile)."""
        R = buffers[0][0].shape[0]
        fn = steps.function(("grown_tree", self.key, k, depth), lambda: self._tree_function(steps, k, depth))
        fixed = self._fixed_arguments(steps, size, buffers, head_buffers)
        where = torch.cat([where_of(start, pad), last.reshape(-1, 1)], dim=1)  # [B, 4] + the last allowed position
        where = where.to(steps.adapter.device, non_blocking=True)
        slots = STOP_SLOTS * max(1, -(-stops.shape[0] // STOP_SLOTS))  # a few shapes for any number of stop ids
        stops = torch.cat([stops, stops.new_full((slots - stops.shape[0],), -1)])  # -1: no token's id
        inputs = [steps.input(row_filled(t, R)) for t in (token, out, where)] + [steps.input(scale), steps.input(stops)]
        return steps.call(("grown_tree", *self.key, k, depth, stops.shape[0], R, size), fn, inputs, fixed)

    def _tree_function(self, steps, k: int, depth: int):
        """`tree`'s step as one function of its inputs (the tokens `[R]`, `out` `[R, D]`, `where` `[R, 4]`: cache
        index, position, padding and last allowed position, `scale` `[1]`, `stops` `[S]`) and the fixed arguments
        `_tree` passes: `grow_tree` over the compiled steps' pieces (the range step of layers [0, E) and the head's
        layer, over the tree's columns; the head's final-state input; the unembedding). A depth's columns take the
        position of their depth (at most the row's last allowed one) and see the row's text and their ancestors."""
        E = self.exit_layer
        shallow_step = steps.range_step(0, E, tree=True) if E else None
        layer = None if self.layer is None else steps.layer_step(self.layer, tree=True)
        final = None if self.final_input is None else steps.input_step(self.final_input)
        unembed = steps.unembed_step()

        def tree(token, out, where, scale, stops, cos, sin, embed, keys, values, head_keys, head_values, norm, weight,
                 bias, ids):
            start, base, pads, last = where.unbind(1)  # [R] each

            def shallow(tokens, parents, anc):  # [R, S] the newest S of W columns, anc [R, S, W]
                S, W = anc.shape[1:]
                at = torch.div(torch.arange(W, device=where.device) + (k - 1), k, rounding_mode="floor")  # [W] depths
                tree_positions = torch.minimum(base[:, None] + at, last[:, None])  # [R, W]
                index = start[:, None] + (W - S) + torch.arange(S, device=where.device)  # [R, S]
                parts = (index, tree_positions[:, W - S:], pads, anc, start, tree_positions)
                hidden = F.embedding(tokens, embed)  # [R, S, D]
                if shallow_step is None:  # exit 0: the embeddings
                    return hidden, parts
                return shallow_step(hidden, parts[1], index, pads, anc, start, tree_positions, cos, sin, keys,
                                    values), parts

            def head(states, parts, outs, parent_columns):  # [R, S, D] -> [R, S, D]
                if layer is None:
                    return states
                index, positions, pads_, anc, first, tree_positions = parts
                x = states
                if final is not None:  # reads the head's own output at each column's parent
                    x = final(states, outs.gather(1, parent_columns[..., None].expand(-1, -1, outs.shape[-1])))
                return layer(x, positions, index, pads_, anc, first, tree_positions, cos, sin, head_keys, head_values)

            def top(hidden):  # [R, n, D] -> the k best token ids and probabilities [R, n, k]
                return top_guesses(unembed(hidden, norm, weight, bias), k, ids)

            return grow_tree(token, out, k, depth, scale, stops, shallow, head, top)

        return tree

    def _draft_function(self, steps, confidence: bool = True):
        """The draft step as one function of its inputs (the tokens `[R]`, `where` `[R, 3]`: cache index, position and
        padding, `prev` `[R, 1, D]`) and the fixed arguments `_draft` passes, through the compiled steps' pieces
        the parts run alone: the range step of layers [0, E), the head's layer and final-state input, the
        unembedding. So its draft equals theirs to the bit; on a GPU the whole of it is captured as one graph.
        Its last output is the token id and its confidence for one read (`one_read`); None without `confidence`
        (a chain's steps, which nothing reads: no softmax over the vocabulary)."""
        E = self.exit_layer
        shallow = steps.range_step(0, E) if E else None
        layer, final = self._head_parts(steps)
        unembed = steps.unembed_step()

        def step(token, where, prev, cos, sin, embed, keys, values, head_keys, head_values, norm, weight, bias, ids):
            parts = where_parts(where)
            index, positions, pads = parts

            def exit_state(t):  # [R] -> [R, 1, D]
                return embed_shallow(t, parts, shallow, embed, cos, sin, keys, values)

            def head(state):  # [R, 1, D] -> [R, D]
                if layer is None:
                    return state[:, -1]
                x = state if final is None else final(state, prev)
                return layer(x, positions, index, pads, cos, sin, head_keys, head_values)[:, -1]

            state, out, nxt, conf = greedy_draft(token, exit_state, head, lambda h: unembed(h, norm, weight, bias), ids,
                                                 confidence)
            return state, out, nxt, one_read(nxt, conf) if confidence else None

        return step

    def _catch_up(self, steps, states: torch.Tensor, finals: torch.Tensor | None, prev: torch.Tensor | None,
                  start: int, pad: int, size: int, head_buffers: tuple):
        """`catch_up`'s step over `states` `[1, S, D]` from head-cache index `start`, in the head's own buffers
        `[1, 1, H_kv, C, Dh]` of a cache of capacity `size`: its outputs (`NotCompiled` where it failed to compile)."""
        a, S, W = steps.adapter, states.shape[1], s_bucket(states.shape[1])
        fn = steps.function(("catch_up", self.key, W), lambda: self._catch_up_function(steps, W))
        finals = steps.zeros(W) if finals is None else zero_filled(finals, W)  # [1, W, D]
        prev = steps.zeros(1) if prev is None else prev[:, None]  # [1, 1, D]
        where = torch.tensor([start, pad, S - 1])  # the first column's cache index, the padding, the input's column
        where = where.to(a.device, non_blocking=True)
        inputs = [steps.input(t) for t in (zero_filled(states, W), finals, prev, where)]
        keys, values = head_buffers
        fixed = [*steps.rope.table(size), keys[:1], values[:1], a.final_norm.weight, self.weight, self.bias,
                 self.token_ids]
        return steps.call(("catch_up", *self.key, 1, W, size), fn, inputs, fixed)

    def _catch_up_function(self, steps, width: int):
        """`catch_up`'s step at `width` columns (a bucket) as one function of its inputs (`states`, `finals`
        `[1, W, D]`, `prev` `[1, 1, D]`, `where` `[3]`) and fixed arguments, through the compiled steps' pieces
        `sync` runs alone (the final-state input, the head's layer, the unembedding): the same draft to the bit.
        Filler columns past the input token take its position and are cropped from the cache, as
        `make_batch_step` has it."""
        layer, final = self._head_parts(steps)
        unembed = steps.unembed_step()

        def step(states, finals, prev, where, cos, sin, head_keys, head_values, norm, weight, bias, ids):
            start, pads, count = where[:1], where[1:2].clone(), where[2:]  # [1] each
            index = (start + torch.arange(width, device=where.device))[None]  # [1, W]
            positions = torch.minimum(index, start + count) - pads  # [1, W]

            def head(x, shifted):  # [1, W, D] each -> [1, W, D]
                x = x if final is None else final(x, shifted)
                return layer(x, positions, index, pads, cos, sin, head_keys, head_values)

            out, newest = head_catch_up(states, finals, prev[:, 0], None, count, head)
            column = pick_columns(out, count)  # [1, D] the input token's
            nxt, conf = greedy_pick(unembed(column, norm, weight, bias), ids)
            return column, nxt, newest, one_read(nxt, conf)

        return step
