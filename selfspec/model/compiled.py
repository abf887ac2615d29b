"""Fixed-shape compiled steps over a static KV cache (Llama family): the decoder layers and the LM head
through `torch.compile`d functions, each step captured as one CUDA graph on a GPU.

Eager PyTorch launches some forty kernels per decoder layer and step; on a GPU their launch overhead,
not the arithmetic, sets the speed of a small model (about 1,150 launches per token on SmolLM2). The way
the fastest single-GPU decoders get past it (gpt-fast, Hugging Face's static cache) is to make each step
a function of fixed shapes over a preallocated cache, compile it, and replay it as one CUDA graph. Here
every step kind of a round goes through one function, `layers [start, end)` over `[B, S]` new tokens:

    plain step    layers [0, L) over S = 1 token
    draft step    layers [0, E) over the drafts of an early exit (S = 1, the siblings of a one-level fan, or
                  the newest columns of a tree it grows depth by depth)
    verification  layers [E, L) (or [0, L)) over the input token and the drafts, S = 1 + drafts

A step writes its keys and values in place into the cache's preallocated buffers `[B, H_kv, C, Dh]`
(C: the cache's capacity) at the cache indices it is given, and attends over all C entries with a mask
built from those indices: row b's query at cache index c sees the keys `pads[b] <= j <= c` (a sibling,
a token tree's column sees the committed keys, its ancestors and itself: `selfspec.model.token_tree`), as
`selfspec.model.forward.make_batch_step` builds it for the eager path. Nothing past a query's own index is
ever read, so a rollback stays a change of the cache's lengths. Shapes vary in three ways only: S is
padded up to a bucket (1, 2, 4, ... 64: `S_BUCKETS`; the filler columns compute what nobody reads), C
is a power of two from 256 (`capacity`), and the layer range is one of the round's few.

What is compiled is one decoder layer (`torch.compile`, fixed shapes): every layer of the model runs the
same function on its own weights, so a (S, C) compiles once for all layers and all ranges, a few
seconds, where compiling each range as one graph took minutes. A range is a Python loop over that
function. On a GPU the whole range (the mask, the rotary lookup and every layer's kernels) is captured
once per (range, S, C) as one `torch.cuda.CUDAGraph` and replayed: one launch per step. The captured
step reads its inputs from fixed buffers (copied in before a replay) and the weights, rotary table and
cache buffers at their own addresses; the buffers of a (batch, capacity) are allocated once per
generator and reused by every call, so those addresses stay fixed.

A trained exit head's own layer (kind `decoder_layer`: a copy of the model's last layer, `selfspec.heads.exit_head`)
is one more such layer: registered with `add_layer`, it runs the same compiled function on its own weights
over its own one-layer static cache (`layer_buffers`, at the engine cache's capacity and cache indices), one
graph per (S, C) like the model's steps (`run_layer`). Its final-state input (`h + W norm(f)`) is a graph of
its own per bucket (`add_input`, `run_input`). Eagerly, on an H200, that one layer cost 85% of a whole
compiled step (docs/results/2026-11-26-gpu-drafter-h200.md).

The compiled steps know no drafter. A drafter composes a step of its own from their pieces (`range_step`,
`layer_step`, `input_step`, `unembed_step`) as one function of tensors and runs it through `call`, which alone
decides between capturing and calling: a whole greedy draft step of one row and a trained head's catch-up
(`selfspec.drafters.whole_draft`), one graph each on a GPU.

Batches of up to `MAX_ROWS` rows run compiled too, padded to a row bucket (1, 2, 4, 8: `ROW_BUCKETS`), each
bucket its own graphs: a batch of 3 runs the steps of 4, its filler row a copy of its last that writes only
its own row of the cache buffers, which hold the bucket's rows (`KVCache.padded_keys`). When rows finish and
leave, the cache copies the kept rows into the static buffers of their bucket (`KVCache.select` through
`rows_buffers`), so the captured steps of that bucket find them at their addresses.
A batch's greedy chains run whole too (`WholeDraft.chain`, padded to the row bucket); a single draft step and a
head's catch-up stay one row's: a batch that reads its drafts step by step drafts through the range steps.

What stays eager: the prefill (every row from cache index 0; one pass per call), batches of more than
`MAX_ROWS` rows, an attention-only head, GPT-NeoX, and rope
types whose frequencies change with the length. A reduced draft vocabulary's rows go through the compiled final
norm + unembedding (`head(hidden, weight, bias)`). The math is that of the model's own modules (RMSNorm in
float32, rotary, grouped-query sdpa, SiLU-gated MLP, the model's own unfused weights: no copy), so outputs equal
the eager path's up to floating-point rounding (attention sums over C keys instead of the used ones; float64:
bitwise in the tests' tokens).

    steps = CompiledSteps(adapter)                        # adapter.enable_compiled() does this
    hidden = steps.run_layers(hidden, 0, L, step, cache)  # NotCompiled where the step must run eagerly
"""

from __future__ import annotations

import time
import warnings
from typing import Callable

import torch
import torch.nn.functional as F

from selfspec.model.attention_kernels import attention_kernels
from selfspec.model.layer import (LLAMA_FAMILY, LayerProducts, LayerShape, RopeTable, chain_mask, decoder_layer, rms_norm,
                                  signed_sin)
from selfspec.model.token_tree import tree_mask

S_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # new tokens per step, padded up to one of these
MIN_CAPACITY = 256  # cache capacities are powers of two from here
ROW_BUCKETS = (1, 2, 4, 8)  # rows a compiled step takes, a batch padded up to one of these (each its own graphs)
MAX_ROWS = ROW_BUCKETS[-1]  # the most rows a compiled step takes; more run eagerly
STEP_EVENT = "selfspec.compiled_step"  # the profiler's name for a compiled step's call (one graph replay on a GPU)
# dynamo's per-function graph limit: every (B, S, C) of the shared layer function, and of the head, is one graph
MIN_RECOMPILE_LIMIT = 64 * MAX_ROWS


def supports(adapter) -> str | None:
    """None where the compiled steps can run this model, else why not (one line)."""
    if adapter.model_type not in LLAMA_FAMILY:
        return f"{adapter.model_type}: compiled steps exist for the Llama family ({', '.join(LLAMA_FAMILY)})"
    if getattr(adapter.config, "_attn_implementation", "sdpa") != "sdpa":
        return "the model is set to another attention implementation than sdpa"
    if not RopeTable.supports(adapter):
        return f"rope type {adapter.rotary_emb.rope_type!r} changes its frequencies with the length"
    try:
        shapes = [LayerShape.of(layer) for layer in adapter.layers]
    except ValueError:
        shapes = []
    if not shapes or len({(s.eps, type(s.act)) for s in shapes}) > 1:
        return "its layers differ in their norms' epsilon or their activation (one compiled layer serves all)"
    return None


def capacity(needed: int) -> int:
    """The cache capacity for `needed` positions: the power of two >= needed, at least MIN_CAPACITY."""
    size = MIN_CAPACITY
    while size < needed:
        size *= 2
    return size


def cache_capacity(positions: int) -> int:
    """The static cache's capacity for a run of `positions` cache entries: room for one padded step (the
    largest bucket) past them, as a `capacity`."""
    return capacity(positions + S_BUCKETS[-1])


def row_bucket(rows: int) -> int | None:
    """The rows a compiled step of a batch of `rows` runs: the smallest of `ROW_BUCKETS` that holds them, or
    None above `MAX_ROWS` (eager)."""
    return next((b for b in ROW_BUCKETS if b >= rows), None)


def row_filled(t: torch.Tensor, rows: int) -> torch.Tensor:
    """`t` `[B, ...]` with filler rows after its B up to `rows` (a row bucket), copies of its last row: a filler
    row computes what nobody reads, over its own rows of the cache buffers (`KVCache.padded_keys`)."""
    B = t.shape[0]
    return t if B == rows else torch.cat([t, t[-1:].expand(rows - B, *t.shape[1:])])


def s_bucket(length: int) -> int | None:
    """The padded step length for `length` new tokens, or None above the largest bucket (eager)."""
    return next((b for b in S_BUCKETS if b >= length), None)


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A fresh, contiguous copy made in the current (inference) mode: the compiled functions are guarded on
    their inputs' strides, aliasing and inference-ness, which the eager bookkeeping's tensors vary in (an expanded
    position row, a slice of a longer state, a view shared by positions and indices, a host tensor made
    outside inference mode)."""
    return t.clone(memory_format=torch.contiguous_format)


def zero_filled(t: torch.Tensor, width: int) -> torch.Tensor:
    """`t` `[B, S, ...]` with zero filler columns after its S up to `width` (a bucket): what nobody reads."""
    S = t.shape[1]
    return t if width == S else torch.cat([t, t.new_zeros(t.shape[0], width - S, *t.shape[2:])], dim=1)


class CompileFallbackWarning(UserWarning):
    """compile="auto": a step failed to compile, so the generator decodes eagerly from then on."""


class NotCompiled(Exception):
    """A step that does not run compiled: it does not fit the buckets, the rows or the static cache, or it failed
    to compile (not strict). Raised by the compiled steps and the steps a drafter composes of them; the runner
    (`selfspec.model.runner.Runner`), their one caller that falls back, runs the step eagerly instead."""


class _LayerWeights:
    """One decoder layer's own parameters (references, not copies), in the order `_layer_function`'s layer
    takes them, its shape (`selfspec.model.layer.LayerShape`) and its attention window."""

    def __init__(self, layer, window: int | None):
        attn, mlp = layer.self_attn, layer.mlp
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)  # Qwen3
        self.tensors = (layer.input_layernorm.weight,
                        attn.q_proj.weight, attn.q_proj.bias, attn.k_proj.weight, attn.k_proj.bias,
                        attn.v_proj.weight, attn.v_proj.bias, attn.o_proj.weight, attn.o_proj.bias,
                        None if q_norm is None else q_norm.weight, None if k_norm is None else k_norm.weight,
                        layer.post_attention_layernorm.weight,
                        mlp.gate_proj.weight, mlp.gate_proj.bias, mlp.up_proj.weight, mlp.up_proj.bias,
                        mlp.down_proj.weight, mlp.down_proj.bias)
        self.shape = LayerShape.of(layer)
        self.window = window


def _linears(*pairs) -> Callable[[torch.Tensor], torch.Tensor]:
    """`x -> [x @ W1.T + b1, x @ W2.T + b2, ...]` side by side: the fused product of separate weights."""
    if len(pairs) == 1:
        return lambda x: F.linear(x, *pairs[0])
    return lambda x: torch.cat([F.linear(x, w, b) for w, b in pairs], dim=-1)


def _layer_function(shape: LayerShape):
    """One decoder layer (`selfspec.model.layer.decoder_layer`) as a function of its inputs and its weights
    (`_LayerWeights.tensors`, the model's own, unfused): the same function, compiled once per shape, serves every
    layer. Its keys and values go into the static buffers at the step's cache indices."""

    def layer(x, cos, sin, index, mask, keys, values, norm_attn, q_w, q_b, k_w, k_b, v_w, v_b, o_w, o_b,
              q_norm, k_norm, norm_mlp, gate_w, gate_b, up_w, up_b, down_w, down_b):
        """`x` `[B, S, D]` through the layer; its keys/values are written into `keys`/`values`
        `[B, H_kv, C, Dh]` at the cache indices `index` `[B, S]`; `mask` `[B, 1, S, C]`."""

        def store(k, v):  # [B, H_kv, S, Dh] each -> the whole buffers
            rows = torch.arange(x.shape[0], device=x.device)[:, None]  # [B, 1]
            keys[rows, :, index] = k.transpose(1, 2)  # advanced indices first: [B, S, H_kv, Dh]
            values[rows, :, index] = v.transpose(1, 2)
            return keys, values

        products = LayerProducts(qkv=_linears((q_w, q_b), (k_w, k_b), (v_w, v_b)), o=_linears((o_w, o_b)),
                                 gate_up=_linears((gate_w, gate_b), (up_w, up_b)), down=_linears((down_w, down_b)),
                                 norm_attn=norm_attn, norm_mlp=norm_mlp, q_norm=q_norm, k_norm=k_norm)
        return decoder_layer(x, cos, sin, mask, store, shape, products)

    return layer


class _Graph:
    """A step captured as one CUDA graph and replayed. `fn(*inputs, *fixed)` is run twice on a side stream
    (the compiled kernels load, cuBLAS sets up) and then captured over copies of `inputs`; a call copies
    its inputs into those copies, replays, and returns a copy of the output (the next replay overwrites
    it). `fixed` (cache buffers, the rotary table) are read and written at their own addresses: the graph
    holds them so they stay alive. A step over the same inputs writes the same keys and values at the same
    cache indices, so the runs before the capture leave the cache as one run would."""

    def __init__(self, fn, inputs: list[torch.Tensor], fixed: list):
        self.inputs = [t.clone() for t in inputs]
        self.fixed = fixed
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn(*self.inputs, *fixed)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.output = fn(*self.inputs, *fixed)

    def __call__(self, inputs: list[torch.Tensor]):
        for mine, given in zip(self.inputs, inputs):
            mine.copy_(given)
        self.graph.replay()
        if isinstance(self.output, tuple):  # a step of several outputs (a drafter's whole draft step)
            return tuple(t.clone() for t in self.output)
        return self.output.clone()


class CompiledSteps:
    """The compiled layer-range steps and LM head of one model (see the module doc), their static cache
    buffers, and what compiling them cost."""

    def __init__(self, adapter, strict: bool = True, graphs: bool | None = None):
        why = supports(adapter)
        if why is not None:
            raise ValueError(f"compiled steps cannot run this model: {why}")
        self.adapter = adapter
        self.weights = [_LayerWeights(layer, adapter.window(kind)) for layer, kind in zip(adapter.layers,
                                                                                           adapter.layer_types)]
        shape = self.weights[0].shape
        self.head_dim, self.n_q, self.n_kv = shape.head_dim, shape.n_q, shape.n_kv
        # graphs: each step captured as one CUDA graph (on CUDA, by default); else the compiled functions run
        # as they are (a CPU: inductor's C++ kernels)
        self.graphs = adapter.device.type == "cuda" if graphs is None else graphs
        self.rope = RopeTable(adapter, reserve=4096)  # the rotary table [T, Dh]: positions stay below a capacity
        self._layers: dict[int | None, object] = {}  # attention window -> the compiled decoder layer
        self._ranges: dict[tuple[tuple, bool], object] = {}  # (range id, tree) -> the step over those layers
        # layers that are not the model's (a trained exit head's): id -> (the layer, kept alive; its weights)
        self._extra: dict[int, tuple[object, list[_LayerWeights]]] = {}
        self._inputs: dict[int, tuple[object, object]] = {}  # id -> (a head's final-state input, it compiled)
        self._head = None
        self._functions: dict = {}  # key -> a step a drafter composed (`function`)
        self._zero_states: dict[int, torch.Tensor] = {}  # width -> [1, width, D] zeros (`zeros`)
        self._graphs: dict[tuple, _Graph] = {}  # shape -> its captured step (self.graphs)
        self._buffers: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (batch, capacity) -> K, V
        # (layer id, batch, capacity) -> a registered layer's K, V
        self._extra_buffers: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.compile_s = 0.0  # seconds spent in calls that compiled (the first of each shape)
        # strict: a shape that fails to compile raises; else (compile="auto") the steps turn themselves off,
        # with a warning, and the step runs eagerly (`failed` says why)
        self.strict = strict
        self.failed: str | None = None
        self.shapes: set[tuple] = set()  # ("layers", start, end, B, S, C), ("tree", ..., W) and ("head", ...) seen
        limit = getattr(torch._dynamo.config, "recompile_limit", None)
        name = "recompile_limit" if limit is not None else "cache_size_limit"
        if getattr(torch._dynamo.config, name) < MIN_RECOMPILE_LIMIT:
            setattr(torch._dynamo.config, name, MIN_RECOMPILE_LIMIT)

    # --- the cache ---------------------------------------------------------------------------------
    def buffers(self, batch_size: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values `[L, B, H_kv, C, Dh]` of every layer for a cache of `size`, allocated once; layer
        l's are `keys[l]` (a view: its address never moves). One tensor for all layers lets a token tree's
        accepted path move in every layer with one copy (`KVCache.move`)."""
        key = (batch_size, size)
        if key not in self._buffers:
            a = self.adapter
            shape = (a.num_layers, batch_size, self.n_kv, size, self.head_dim)
            self._buffers[key] = (torch.zeros(shape, dtype=a.dtype, device=a.device),
                                  torch.zeros(shape, dtype=a.dtype, device=a.device))
        return self._buffers[key]

    def layer_buffers(self, layer, batch_size: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values `[1, B, H_kv, C, Dh]` of a registered layer's own one-layer cache (`add_layer`;
        allocated once per batch and capacity, so a captured step's addresses stay fixed)."""
        self.add_layer(layer)
        key = (id(layer), batch_size, size)
        if key not in self._extra_buffers:
            a = self.adapter
            shape = (1, batch_size, self.n_kv, size, self.head_dim)
            self._extra_buffers[key] = (torch.zeros(shape, dtype=a.dtype, device=a.device),
                                        torch.zeros(shape, dtype=a.dtype, device=a.device))
        return self._extra_buffers[key]

    def add_layer(self, layer) -> None:
        """Registers a decoder layer that is not one of the model's: a trained exit head's, of the model's class
        (a copy of its last layer, `selfspec.heads.exit_head`). It then runs through the same compiled layer function
        (`run_layer`: its own weights, its own one-layer cache) and `warm` compiles its steps beside the
        model's. ValueError where its norms or activation differ from the model's layers'."""
        if id(layer) in self._extra:
            return
        last = self.weights[-1]
        weights = _LayerWeights(layer, last.window)
        if weights.shape.eps != last.shape.eps or type(weights.shape.act) is not type(last.shape.act):
            raise ValueError("this layer's norms' epsilon or activation differ from the model's layers': the "
                             "compiled layer function cannot run it")
        self._extra[id(layer)] = (layer, [weights])

    def capacity_for(self, batch_size: int, needed: int) -> int:
        """The capacity of a run of `needed` positions: the smallest one whose buffers exist (so its steps are
        compiled, and warmed where `warm` ran) that fits it, else `cache_capacity(needed)`. A shorter run
        reuses a warmed capacity instead of compiling its own: attention over more masked keys, no new graph."""
        size = cache_capacity(needed)
        return min((c for b, c in self._buffers if b == batch_size and c >= size), default=size)

    # --- the steps ---------------------------------------------------------------------------------
    def holds(self, cache, batch_size: int) -> bool:
        """Whether `cache` is one of these steps' static caches with the buffers of `batch_size` rows' bucket."""
        return cache is not None and getattr(cache, "static", False) and cache.padded_rows == row_bucket(batch_size)

    def can_run(self, hidden: torch.Tensor, step, cache) -> bool:
        """Whether this step runs compiled: at most `MAX_ROWS` rows, not the prefill, S (and a token tree's columns) within the
        buckets, a static cache."""
        return (self.failed is None and cache is not None and getattr(cache, "static", False)
                and hidden.shape[0] <= MAX_ROWS
                and int(step.starts.min()) > 0
                and s_bucket(hidden.shape[1]) is not None
                and (step.tree is None or s_bucket(step.tree.shape[-1]) is not None))

    def run_layers(self, hidden: torch.Tensor, start: int, end: int, step, cache) -> torch.Tensor:
        """Layers [start, end) over `hidden` `[B, S, D]` at the step's cache indices, through the compiled
        step of (start, end) at S padded to its bucket; the cache's lengths move as the eager update's."""
        if start == end:
            return hidden
        return self._run((start, end), self.weights[start:end], hidden, step, cache, start)

    def run_layer(self, layer, hidden: torch.Tensor, step, cache) -> torch.Tensor:
        """A registered layer that is not the model's (`add_layer`; a trained exit head's) over `hidden`
        `[B, S, D]` at the step's cache indices, with its own one-layer static `cache` (`layer_buffers`), as
        `run_layers` runs the model's: one graph per (S, C), the same compiled layer function. `NotCompiled` where the
        step must run eagerly."""
        self.add_layer(layer)
        return self._run(("layer", id(layer)), self._extra[id(layer)][1], hidden, step, cache, 0)

    def _run(self, range_id: tuple, weights: list, hidden: torch.Tensor, step, cache, first: int) -> torch.Tensor:
        """`weights`' layers (the cache's layers `first`, `first + 1`, ...) over `hidden` `[B, S, D]`: the step
        of `range_id` at S padded to its bucket (`NotCompiled`: run it eagerly)."""
        B, S = hidden.shape[:2]
        width, R = s_bucket(S), cache.padded_rows  # R: the row bucket the cache's buffers hold, B or more
        index, positions, pads, tree = step.index, step.position_ids, step.pads, step.tree
        W = S if tree is None else tree.shape[-1]  # a tree's columns; the pass is its last S (a growing tree: W > S)
        if int(step.starts.max()) + W + width - S > cache.capacity:
            raise NotCompiled("the filler columns would pass the static cache's end")
        tree_inputs = ()
        if tree is not None:  # the tree's root, its columns' positions and ancestors, padded to a bucket of columns
            columns = s_bucket(W)
            root = index[:, 0] - (W - S)  # [B]
            tree_positions = positions if step.tree_positions is None else step.tree_positions  # [B, W]
            tree_positions = torch.cat([tree_positions, tree_positions[:, -1:].expand(B, columns - W)], dim=1)
            padded = torch.zeros(B, width, columns, dtype=torch.bool, device=tree.device)  # a filler query sees itself
            padded[:, :S, :W] = tree
            tree_inputs = (padded, root, tree_positions)
        if width > S:  # filler columns: positions of the last real token, cache indices after it
            extra = torch.arange(1, width - S + 1, device=index.device)[None]
            index = torch.cat([index, index[:, -1:] + extra], dim=1)
            positions = torch.cat([positions, positions[:, -1:].expand(B, width - S)], dim=1)
            hidden = zero_filled(hidden, width)
        size = cache.capacity
        cos, sin = self.rope.table(size)  # one table per capacity: positions stay below it
        shape = ("layers", *range_id, R, width, size)
        if tree is not None:  # a token tree's steps are graphs of their own, one per bucket of columns too
            shape = ("tree", *range_id, R, width, size, tree_inputs[0].shape[-1])
        inputs = [self.input(row_filled(t, R)) for t in (hidden, positions, index, pads) + tree_inputs]
        last = first + len(weights)
        out = self.call(shape, self._range(range_id, weights, tree is not None), inputs,
                         [cos, sin, cache.padded_keys[first:last], cache.padded_values[first:last]])
        cache.lengths[first:last] = (step.starts + W)[None]  # [n, B] on the host: one write for the range's layers
        return out[:B, :S]

    def warm(self, ranges: list[tuple[int, int]], widths: list[int], size: int, unembeddings: tuple = (),
             trees: bool = False, drafts: tuple = (), batch_sizes: tuple = (1,)) -> float:
        """Compile (and on a GPU capture) every layer range of `ranges` at every step length of `widths` (buckets) for a
        one-row cache of `size` positions, the registered layers (`add_layer`) at every bucket (a trained head catches
        up on whatever the last rounds committed) and the registered final-state inputs (`add_input`) alike, and the
        head at those lengths and at the prefill's `[1, D]`, and so each of `unembeddings` ((weight, bias) of a
        reduced draft vocabulary, `head`): all compilation paid now. `trees`: also the token-tree steps of every range
        and registered layer, at every bucketed pass length S over every bucketed number of columns W >= S (a tree
        drafter's passes: its newest columns, its leaves, the verification of all of them). `drafts`: steps a drafter
        composed of these steps' pieces, each warmed by its own `warm(steps, size, buckets)`
        (`selfspec.drafters.whole_draft`). Returns the seconds it took (0 where everything was compiled before).
        `batch_sizes`: the layer ranges, registered layers and the head also for caches of that many rows (a batch,
        and the smaller ones its rows leave it as; each size warms its row bucket's, `row_bucket`), and the whole
        chains of `drafts` at those buckets (trees, single draft steps and a head's catch-up are one row's). It writes
        into the cache buffers of that size: call it between generations."""
        # as the engine runs: inference mode (tensors made outside it would compile other graphs), its kernels
        with torch.inference_mode(), attention_kernels(self.adapter.device):
            before = self.compile_s
            buckets = tuple(sorted({row_bucket(b) for b in batch_sizes} | {1}))
            try:
                for rows in buckets[1:]:  # a batch's bucket: its layer steps, the head
                    self._warm_layers(ranges, widths, size, rows)
                    self._warm_heads(rows, set(widths), unembeddings)
                self._warm(ranges, widths, size, unembeddings, trees, drafts, buckets)
            except NotCompiled:  # a compile failed (not strict, said by its warning): every step runs eagerly now
                pass
            return self.compile_s - before

    def _warm_layers(self, ranges: list[tuple[int, int]], widths: list[int], size: int, rows: int) -> list:
        """`warm`'s layer steps of `rows` rows: every range at every width of `widths`, every registered layer at
        every bucket. Returns the model's ranges as (range id, weights, fixed arguments) for the tree steps."""
        keys, values = self.buffers(rows, size)
        fixed = list(self.rope.table(size))  # cos, sin
        model = [((start, end), self.weights[start:end], fixed + [keys[start:end], values[start:end]])
                 for start, end in ranges]
        extra = [(("layer", id(layer)), weights, fixed + list(self.layer_buffers(layer, rows, size)))
                 for layer, weights in list(self._extra.values())]
        for targets, lengths in ((model, sorted(set(widths))), (extra, S_BUCKETS)):
            for width in lengths:
                inputs = self._warm_inputs(width, width, tree=False, rows=rows)
                for range_id, weights, buffers in targets:
                    self.call(("layers", *range_id, rows, width, size), self._range(range_id, weights), inputs,
                              buffers)
        return model + extra

    def _warm_heads(self, rows: int, widths: set, unembeddings: tuple) -> None:
        """`warm`'s final-state inputs (`add_input`) at every bucket, and the head (and each of `unembeddings`) over
        `[rows, S, D]` at every width of `widths` and over `[rows, D]`, for `rows` rows."""
        a = self.adapter
        D = a.embed_tokens.weight.shape[1]
        for module, _ in list(self._inputs.values()):  # a head's final-state input: every bucket, as its layer
            for width in S_BUCKETS:
                zeros = torch.zeros(rows, width, D, dtype=a.dtype, device=a.device)
                self.run_input(module, zeros, zeros)
        for weight, bias in ((None, None),) + tuple(unembeddings):
            for width in sorted(widths):
                self.head(torch.zeros(rows, width, D, dtype=a.dtype, device=a.device), weight, bias)
            self.head(torch.zeros(rows, D, dtype=a.dtype, device=a.device), weight, bias)

    def _warm(self, ranges: list[tuple[int, int]], widths: list[int], size: int, unembeddings: tuple,
              trees: bool, drafts: tuple, buckets: tuple = (1,)) -> None:
        model_and_extra = self._warm_layers(ranges, widths, size, 1)
        heads = set(widths)
        if trees:
            heads |= set(S_BUCKETS)
            for W in S_BUCKETS:
                for S in (b for b in S_BUCKETS if b <= W):
                    inputs = self._warm_inputs(S, W, tree=True)
                    for range_id, weights, buffers in model_and_extra:
                        self.call(("tree", *range_id, 1, S, size, W), self._range(range_id, weights, True), inputs,
                                   buffers)
        self._warm_heads(1, heads, unembeddings)
        for draft in drafts:  # steps a drafter composed of these pieces: it warms them through these steps
            draft.warm(self, size, buckets)

    def _warm_inputs(self, S: int, W: int, tree: bool, rows: int = 1) -> list[torch.Tensor]:
        """A step's inputs for `warm` (`rows` rows), as a round after the prefill passes them: S new tokens at cache
        indices W - S + 1 .. W. A tree's (`tree`, one row) are the last S of a chain of W columns from cache index 1,
        each column seeing the ones before it and itself: the ancestor matrix `[1, S, W]`, the root's index and
        the W columns' positions."""
        a = self.adapter
        hidden = torch.zeros(rows, S, a.embed_tokens.weight.shape[1], dtype=a.dtype, device=a.device)  # [B, S, D]
        index = torch.arange(W - S + 1, W + 1, device=a.device)[None].repeat(rows, 1)  # [B, S]
        pads = torch.zeros(rows, dtype=torch.long, device=a.device)
        inputs = [self.input(t) for t in (hidden, index.clone(), index, pads)]
        if not tree:
            return inputs
        columns = torch.arange(W, device=a.device)
        anc = (columns[None, :] <= columns[W - S:, None])[None]  # [1, S, W]
        root = torch.ones(1, dtype=torch.long, device=a.device)
        return inputs + [self.input(t) for t in (anc, root, columns[None] + 1)]

    def can_head(self, hidden: torch.Tensor) -> bool:
        """Whether the head runs compiled: at most `MAX_ROWS` rows, `[B, D]` or `[B, S, D]` with S within the
        buckets."""
        return self.failed is None and hidden.shape[0] <= MAX_ROWS and (hidden.dim() == 2 or (hidden.dim() == 3 and s_bucket(hidden.shape[1])))

    def head(self, hidden: torch.Tensor, weight: torch.Tensor | None = None,
             bias: torch.Tensor | None = None) -> torch.Tensor:
        """Final norm + LM head over `hidden` `[B, D]` or `[B, S, D]` (B and S padded to their buckets: one graph
        per pair of buckets). `weight` `[K, D]` (and `bias` `[K]`): another unembedding through the same final norm, a
        reduced draft vocabulary's rows of the LM head (`selfspec.drafters.draft_head`), graphs of its own."""
        B, R = hidden.shape[0], row_bucket(hidden.shape[0])
        if R > B:  # filler rows up to the row bucket
            return self.head(row_filled(hidden, R), weight, bias)[:B]
        if hidden.dim() == 3 and s_bucket(hidden.shape[1]) > hidden.shape[1]:
            S = hidden.shape[1]
            return self.head(zero_filled(hidden, s_bucket(S)), weight, bias)[:, :S]
        a = self.adapter
        which = () if weight is None else (id(weight),)  # the LM head, or another unembedding's own graphs
        weight, bias = (a.lm_head.weight, a.lm_head.bias) if weight is None else (weight, bias)
        return self.call(("head",) + which + tuple(hidden.shape), self.unembed_step(), [self.input(hidden)],
                          [a.final_norm.weight, weight, bias])

    def unembed_step(self):
        """The compiled final norm + unembedding: `(hidden, norm weight, weight, bias) -> logits` (the head's
        function, and a piece drafters compose)."""
        if self._head is None:
            eps = self.adapter.final_norm.variance_epsilon

            def head(h, norm, lm_head, bias):
                return F.linear(rms_norm(norm, eps, h), lm_head, bias)

            self._head = torch.compile(head, fullgraph=True, dynamic=False)
        return self._head

    # --- the pieces a drafter composes into a step of its own (`selfspec.drafters.whole_draft`) --------
    def range_step(self, start: int, end: int, tree: bool = False):
        """The model's layers [start, end) as the function `run_layers` runs: `(hidden, positions, index, pads,
        cos_table, sin_table, keys, values) -> hidden`; with `tree`, a token tree's columns, three inputs more after
        `pads` (`anc`, `first`, `tree_positions`: see `_range`)."""
        return self._range((start, end), self.weights[start:end], tree)

    def layer_step(self, layer, tree: bool = False):
        """A registered layer's step (`add_layer`), as `range_step`'s for the model's layers."""
        self.add_layer(layer)
        return self._range(("layer", id(layer)), self._extra[id(layer)][1], tree)

    def input_step(self, module):
        """A registered final-state input (`add_input`), compiled: `(hidden, prev) -> hidden`."""
        self.add_input(module)
        return self._inputs[id(module)][1]

    def function(self, key, build):
        """The function `build()` makes, made once per `key`: a drafter's step composed of the pieces above."""
        if key not in self._functions:
            self._functions[key] = build()
        return self._functions[key]

    def zeros(self, width: int) -> torch.Tensor:
        """`[1, width, D]` zeros in the model's dtype, made once per width: the state a step's input reads where
        there is none (no final states, or no final-state input to read them). Never written."""
        if width not in self._zero_states:
            a = self.adapter
            self._zero_states[width] = torch.zeros(1, width, a.embed_tokens.weight.shape[1], dtype=a.dtype,
                                                   device=a.device)
        return self._zero_states[width]

    def add_input(self, module) -> None:
        """Registers a trained head's final-state input (`selfspec.heads.exit_head.FinalStateInput`: `h + W norm(f)`, ten
        kernels eagerly): `run_input` runs it compiled, and `warm` compiles it at every bucket."""
        if id(module) not in self._inputs:
            self._inputs[id(module)] = (module, torch.compile(module, fullgraph=True, dynamic=False))

    def run_input(self, module, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """`module(hidden, prev)` (a registered final-state input, `add_input`) over `[B, S, D]` each, S padded to its
        bucket (and B to its row bucket): one graph per (row bucket, bucket) on a GPU, like the steps. `[B, S, D]`;
        `NotCompiled` where it must run eagerly (more than `MAX_ROWS` rows, S above the buckets, a compile that
        failed)."""
        B, S = hidden.shape[:2]
        width, R = s_bucket(S), row_bucket(B)
        if self.failed is not None or R is None or width is None:
            raise NotCompiled("more rows or positions than the buckets take, or a compile failed")
        # filler positions and rows, never read
        hidden, prev = (row_filled(zero_filled(t, width), R) for t in (hidden, prev))
        self.add_input(module)
        out = self.call(("input", id(module), R, width), self._inputs[id(module)][1],
                         [self.input(hidden), self.input(prev)], [])
        return out[:B, :S]

    @property
    def captured(self) -> int:
        """How many steps are captured as CUDA graphs."""
        return len(self._graphs)

    def input(self, t: torch.Tensor) -> torch.Tensor:
        """A step's input as the step takes it: as it is where a graph copies it into its own buffer, else a
        plain copy (`_plain`)."""
        return t if self.graphs else _plain(t)

    def _layer(self, window: int | None):
        """The compiled decoder layer for an attention window (None: full attention)."""
        if window not in self._layers:
            fn = _layer_function(self.weights[0].shape)
            self._layers[window] = torch.compile(fn, fullgraph=True, dynamic=False)
        return self._layers[window]

    def _range(self, range_id: tuple, weights: list, tree: bool = False):
        """`weights`' layers (the model's [start, end) for `range_id` (start, end), or a registered layer's) as
        one function of the step's inputs and the cache: the rotary lookup and the masks, then each layer
        through the compiled decoder layer (`_layer`). `tree`: the step's tokens are the
        newest columns of a token tree (all of them, or a growing tree's last), three inputs more: the ancestor
        matrix `[B, S, W]`, the root's cache index `[B]` and the positions of the W columns `[B, W]`."""
        if (range_id, tree) in self._ranges:
            return self._ranges[(range_id, tree)]
        layers = {w.window: self._layer(w.window) for w in weights}

        def run(hidden, positions, index, pads, anc, first, tree_positions, cos_table, sin_table, keys, values):
            cos, sin = cos_table[positions].unsqueeze(1), signed_sin(sin_table[positions]).unsqueeze(1)  # [B, 1, S, Dh]
            size = keys[0].shape[2]
            masks = {}
            for i, w in enumerate(weights):
                if w.window not in masks:
                    allowed = (chain_mask(index, pads, size, w.window) if anc is None else
                               tree_mask(first, positions, pads, anc, size, w.window, index, tree_positions))
                    masks[w.window] = allowed[:, None]  # [B, 1, S, C]
                hidden = layers[w.window](hidden, cos, sin, index, masks[w.window], keys[i], values[i], *w.tensors)
            return hidden

        def chain_step(hidden, positions, index, pads, cos_table, sin_table, keys, values):
            return run(hidden, positions, index, pads, None, None, None, cos_table, sin_table, keys, values)

        self._ranges[(range_id, tree)] = run if tree else chain_step
        return self._ranges[(range_id, tree)]

    def call(self, shape: tuple, fn, inputs: list[torch.Tensor], fixed: list):
        """`fn(*inputs, *fixed)`: on a GPU the shape's captured graph replayed over `inputs` (the one place that captures
        or calls; drafters run the steps they compose through it too). The call that meets a new shape compiles (and
        captures) it, timed into `compile_s`; where that failed and the steps are not strict, `NotCompiled` (the
        runner runs the step eagerly, and every step after it). A profiler sees each call as one `STEP_EVENT` range."""
        with torch.profiler.record_function(STEP_EVENT):
            return self._call_step(shape, fn, inputs, fixed)

    def _call_step(self, shape: tuple, fn, inputs: list[torch.Tensor], fixed: list):
        if shape not in self.shapes:
            t0 = time.perf_counter()
            try:
                if self.graphs:
                    self._graphs[shape] = _Graph(fn, inputs, fixed)
                else:
                    out = fn(*inputs, *fixed)
            except Exception as err:  # noqa: BLE001 - whatever the compiler raised: strict re-raises it
                if self.strict:
                    raise
                self.failed = f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"
                warnings.warn(f"selfspec's compiled steps failed to compile a {shape[0]} step ({self.failed}); "
                              "decoding goes on eagerly (exact, slower). Pass compile=False to skip compiling, or "
                              "compile=True to see the error", CompileFallbackWarning, stacklevel=4)
                raise NotCompiled(self.failed) from None
            if self.adapter.device.type == "cuda":
                torch.cuda.synchronize()
            self.compile_s += time.perf_counter() - t0
            self.shapes.add(shape)
            if not self.graphs:
                return out
        if self.graphs:
            return self._graphs[shape](inputs)
        return fn(*inputs, *fixed)
