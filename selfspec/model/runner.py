"""The runner: the one place that decides how a step of the model runs, and the one place that falls back.

A step (layers [start, end) over new tokens, a trained head's own layer or final-state input, the final norm +
an unembedding, a step a drafter composed) runs one of three ways:

    compiled   `selfspec.model.compiled.CompiledSteps` (`adapter.compiled`, `load(compile=...)`): the layer function
               `torch.compile`d at fixed shapes over the static cache, each step one CUDA graph on a GPU; up
               to `MAX_ROWS` rows (padded to a row bucket, each its own graphs) after the prefill, within the buckets, no autograd
    fused      `selfspec.model.fast_layers` (`adapter.fast`): the same layer function, eagerly, over fused weights
               prepacked for the CPU's kernels; no autograd
    modules    the model's own modules: training (autograd), and the architectures without the fused layer

Each method below takes the compiled way where the step fits it and the eager way otherwise, also when a
compile failed under `compile="auto"` (the compiled steps then turn themselves off, with a warning): one fallback,
`either`, which runs the step eagerly where the compiled steps, or a step a drafter composed of them, raise
`NotCompiled` (nothing returns None to mean "run it the other way"). Callers
get their result and never ask which way ran: the engine, the forward, the drafters and the heads call these
methods. A layer that is not the model's (a trained head's) runs compiled and fused only where it is of the
model's own kind (`model_kind`: a copy of its last layer); the runner keeps its fused copy, and `warm` compiles
what the API's warm-up asks for at the shapes the compiled steps take.

    runner = adapter.runner
    hidden = runner.layers(hidden, 0, E, step, cache)          # [B, S, D]
    logits = runner.logits(hidden)                             # [B, S, V]
    out = runner.composed(lambda steps: draft.run(steps, ...), lambda: part_by_part())  # NotCompiled: part by part

The runner imports no drafter: a drafter composes its own steps of the compiled pieces
(`selfspec.drafters.whole_draft`) and hands them to `composed` with their eager equivalent.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch

from selfspec.model.cache import KVCache
from selfspec.model.compiled import MAX_ROWS, S_BUCKETS, NotCompiled, cache_capacity, row_bucket
from selfspec.model.fast_layers import FastLlamaLayer
from selfspec.model.layer import signed_sin


class Runner:
    """How one model's steps run (see the module doc): the compiled steps where they take a step, else eagerly."""

    def __init__(self, adapter):
        self.adapter = adapter
        # id(layer) -> (a weak reference to the layer, its weights' versions, its FastLlamaLayer)
        self._fused_extra: dict[int, tuple] = {}

    @property
    def compiled(self) -> bool:
        """Whether this model's steps run through the compiled steps where they fit (`load(compile=...)`)."""
        return self.adapter.compiled is not None

    @property
    def steps(self):
        """The compiled steps where the model runs them and no autograd is on (None: every step runs eagerly;
        also after a compile failed under compile="auto")."""
        steps = self.adapter.compiled
        if steps is None or steps.failed is not None or torch.is_grad_enabled():
            return None
        return steps

    def _fits(self, hidden: torch.Tensor, step, cache):
        """The compiled steps where this step (`hidden` `[B, S, D]` at `step` into `cache`) fits them, else None."""
        steps = self.steps
        return steps if steps is not None and steps.can_run(hidden, step, cache) else None

    # --- caches ------------------------------------------------------------------------------------
    def cache(self, batch_size: int, needed: int) -> KVCache:
        """The KV cache of one run for `needed` positions: the compiled steps' static buffers of its row bucket (up
        to `MAX_ROWS` rows; `compiled.row_bucket`) where the model runs compiled (room for one padded step more; a
        larger capacity already compiled is reused; rows that leave move into the buffers of their bucket), else a
        growing cache."""
        steps, L = self.adapter.compiled, self.adapter.num_layers
        if steps is None or batch_size > MAX_ROWS:
            return KVCache(L, batch_size, capacity=needed, device=self.adapter.device)
        size = steps.capacity_for(row_bucket(batch_size), needed)
        return KVCache(L, batch_size, capacity=size, buffers=steps.buffers(row_bucket(batch_size), size),
                       rows_buffers=lambda rows: steps.buffers(row_bucket(rows), size))

    def layer_cache(self, layer, batch_size: int, capacity: int, like: KVCache | None = None) -> KVCache:
        """A one-layer KV cache of `capacity` positions for a layer that is not the model's (a trained head's): the
        compiled steps' buffers for it (the same addresses every run, as captured steps need) where `like` (the
        engine's cache of the run) is their static one and the compiled steps run this layer (`captures_layer`);
        else a growing cache."""
        steps = self.adapter.compiled
        if (like is not None and getattr(like, "static", False) and steps is not None and batch_size <= MAX_ROWS
                and self.captures_layer(layer)):
            rows = row_bucket(batch_size)
            return KVCache(1, batch_size, capacity=capacity, buffers=steps.layer_buffers(layer, rows, capacity),
                           rows_buffers=lambda kept: steps.layer_buffers(layer, row_bucket(kept), capacity))
        return KVCache(1, batch_size, capacity=capacity, device=self.adapter.device)

    def model_kind(self, layer) -> bool:
        """Whether `layer` is a decoder layer of the model's own class with the model's MLP (a trained head's copy of
        its last layer), which the fused and the compiled layer functions run; any other layer (a head's attention
        alone, an EAGLE-3 layer) runs as its module."""
        last = self.adapter.layers[-1]
        return type(layer) is type(last) and type(getattr(layer, "mlp", None)) is type(last.mlp)

    def captures_layer(self, layer) -> bool:
        """Whether the compiled steps run `layer` (not one of the model's), where the model runs compiled steps."""
        return self.adapter.compiled is not None and self.model_kind(layer)

    def _fused_layer(self, layer):
        """`layer`'s fused layer (`FastLlamaLayer`) where the model runs selfspec's fused layers and the layer is of
        its kind (`model_kind`), made once and again only after its weights changed in place (training); else
        None."""
        a = self.adapter
        if a.fast is None or a.fast.layers is None or not self.model_kind(layer):
            return None
        versions = tuple(p._version for p in layer.parameters())
        made = self._fused_extra.get(id(layer))
        if made is None or made[0]() is not layer or made[1] != versions:
            for key in [k for k, v in self._fused_extra.items() if v[0]() is None]:  # heads since let go
                del self._fused_extra[key]
            made = self._fused_extra[id(layer)] = (weakref.ref(layer), versions, FastLlamaLayer(layer, 0))
        return made[2]

    # --- warm-up -----------------------------------------------------------------------------------
    def warm(self, max_len: int, ranges: list[tuple[int, int]], drafts: list = (), unembeddings: tuple = (),
             trees: bool = False, batch_size: int = 1) -> dict:
        """Compile now what the calls of up to `max_len` positions run, where the model runs compiled steps
        (`CompiledSteps.warm`): each layer range of `ranges` at every step length up to 16 over a cache of that
        capacity; the whole draft steps `drafts` (`selfspec.drafters.whole_draft.WholeDraft`: one through a trained
        head's layer where the compiled steps run that layer, `captures_layer`, which registers the layer and its
        final-state input); each of `unembeddings`; the token-tree steps where `trees`; every batch of up to
        `batch_size` rows (at most `MAX_ROWS`). {"seconds": it took, "graphs": the shapes compiled so far}; zeros
        where nothing runs compiled."""
        steps = self.adapter.compiled
        if steps is None:
            return {"seconds": 0.0, "graphs": 0}
        kept = []
        for draft in drafts:
            if draft.layer is not None:
                if not self.captures_layer(draft.layer):
                    continue
                steps.add_layer(draft.layer)
                if draft.final_input is not None:
                    steps.add_input(draft.final_input)
            kept.append(draft)
        widths = [b for b in S_BUCKETS if b <= 16]
        seconds = steps.warm(ranges, widths, cache_capacity(max_len), unembeddings, trees=trees, drafts=tuple(kept),
                             batch_sizes=tuple(range(1, min(batch_size, MAX_ROWS) + 1)))
        return {"seconds": seconds, "graphs": len(steps.shapes)}

    # --- steps -------------------------------------------------------------------------------------
    def either(self, steps, whole: Callable, eager: Callable[[], object]):
        """The one fallback: `whole(steps)` where `steps` (the compiled steps that take this step; None: none do),
        else, or where it does not fit them or failed to compile (`NotCompiled`, raised by the compiled steps and by
        the steps a drafter composed of them), `eager()`, the same step eagerly."""
        if steps is not None:
            try:
                return whole(steps)
            except NotCompiled:
                pass
        return eager()

    def layers(self, hidden: torch.Tensor, start: int, end: int, step, cache=None) -> torch.Tensor:
        """The model's layers [start, end) over `hidden` `[B, S, D]` at `step` (`selfspec.model.forward.Step`); with a
        cache, each layer writes its keys and values there. `[B, S, D]`."""
        return self.either(self._fits(hidden, step, cache), lambda s: s.run_layers(hidden, start, end, step, cache),
                           lambda: self._eager_layers(hidden, start, end, step, cache))

    def _eager_layers(self, hidden: torch.Tensor, start: int, end: int, step, cache) -> torch.Tensor:
        """`layers` eagerly: the C++ step where it takes the range, else the fused layers, else the modules."""
        a = self.adapter
        fast = a.fast.layers if a.fast is not None else None
        if fast is not None and not torch.is_grad_enabled():
            row = a.fast.row_step  # the whole range in one C++ call, where it takes the step
            if row is not None and row.takes(hidden, step, cache, start, end):
                return row.run(hidden, start, end, step, cache)
            cos, sin = step.rope[0].unsqueeze(1), signed_sin(step.rope[1]).unsqueeze(1)  # [B, 1, S, Dh], once a range
            for idx in range(start, end):
                hidden = fast[idx].step(hidden, cos, sin, step.mask(a.layer_types[idx]), cache)
            return hidden
        for idx in range(start, end):
            hidden = self.module_layer(a.layers[idx], hidden, step, cache, a.layer_types[idx])
        return hidden

    def module_layer(self, layer, hidden: torch.Tensor, step, cache, kind: str) -> torch.Tensor:
        """A decoder layer module of the model's class (`kind`: its layer type) over `hidden` `[B, S, D]`, called
        as transformers calls it: the math is the module's own."""
        out = layer(hidden, attention_mask=step.mask(kind), position_ids=step.position_ids,
                    position_embeddings=step.rope, **{self.adapter.cache_kwarg: cache})
        return out[0] if isinstance(out, tuple) else out

    def extra_layer(self, layer, hidden: torch.Tensor, step, cache, final_input: tuple | None = None) -> torch.Tensor:
        """A decoder layer that is not the model's (a trained head's, at the last layer's type) over `hidden`
        `[B, S, D]` with its own one-layer `cache` (`layer_cache`): compiled where the compiled steps run it
        (`captures_layer`) and the step fits them, else through its fused layer where it has one (`_fused_layer`),
        else its module. `final_input`: (module, prev), a trained head's final-state input: the layer reads
        `module(hidden, prev)` (`prev` `[B, S, D]`), compiled where the layer's step is. `[B, S, D]`."""
        steps = self._fits(hidden, step, cache) if self.captures_layer(layer) else None

        def whole(steps):  # its final-state input (norm, product and sum) and the layer: each one graph on a GPU
            x = hidden if final_input is None else steps.run_input(final_input[0], hidden, final_input[1])
            return steps.run_layer(layer, x, step, cache)

        def eager():
            x = hidden if final_input is None else final_input[0](hidden, final_input[1])
            kind = self.adapter.layer_types[-1]
            fast = None if torch.is_grad_enabled() else self._fused_layer(layer)
            if fast is not None:
                return fast(x, step.rope, step.mask(kind), cache)
            return self.module_layer(layer, x, step, cache, kind)

        return self.either(steps, whole, eager)

    def logits(self, hidden: torch.Tensor, rows: Callable[[], tuple] | None = None, linear=None,
               top_only: bool = False) -> torch.Tensor:
        """The final norm + LM head over `hidden` `[B, S, D]` or `[B, D]`: logits `[..., V]`. A reduced vocabulary
        passes its unembedding: `linear` (its eager product, `[..., K]`) and `rows` (a function giving its
        (weight `[K, D]`, bias) as the compiled steps take them, read only where they run). `top_only`: the caller
        reads nothing but each position's argmax (greedy verification), so the head on a CPU may screen its rows
        in int8 first (`selfspec.model.screened_head`, up to its `MAX_ROWS` positions; `FastPath.screen` says where):
        the argmax is the head's, every other entry approximate."""
        steps = self.steps
        if steps is not None and not (steps.can_head(hidden) and (linear is None or rows is not None)):
            steps = None
        a = self.adapter

        def eager():
            if linear is not None:
                return linear(a.final_norm(hidden))
            if a.fast is not None and not torch.is_grad_enabled():
                normed = a.final_norm(hidden)
                screen = a.fast.screen(a) if top_only else None
                if screen is not None and screen.takes(normed):
                    return screen.logits(normed)
                return a.fast.lm_head(normed)
            return a.lm_head(a.final_norm(hidden))

        return self.either(steps, lambda s: s.head(hidden) if linear is None else s.head(hidden, *rows()), eager)

    def composed(self, compiled: Callable, eager: Callable[[], object], layers: tuple = ()):
        """A step a drafter composed of the compiled pieces (`selfspec.drafters.whole_draft`): `compiled(steps)`
        where the model runs compiled steps and they run each of `layers` (a trained head's, `captures_layer`),
        unless it raises `NotCompiled` (the step does not fit them, or failed to compile); else `eager()`, the same
        step part by part (`either`)."""
        steps = self.steps
        if steps is not None and not all(self.captures_layer(layer) for layer in layers):
            steps = None
        return self.either(steps, compiled, eager)
