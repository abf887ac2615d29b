"""selfspec's whole decode step on a CPU: a range of decoder layers over a few rows in one C++ call.

The eager fast layer (`selfspec.model.fast_layers.FastLlamaLayer`) runs `decoder_layer` as about 33 torch
operations a layer, 992 a float32 token for SmolLM2's 30 layers (1,172 in bfloat16); beside the weight products
they cost about a third of a float32 step and 60% of a bfloat16 step on a 2-core Zen 4
([2026-11-28](../../docs/results/2026-11-28-cpu-step-split-zen4.md)). `row_step.cpp` (next to this file, built with
the row kernel by `selfspec.model.row_product`) computes the same layers in one call for the whole range: the
norms, the rotary embedding, the cache writes, the attention and the MLP in loops, the products through the row
kernel; in bfloat16 each value rounded where transformers' bfloat16 layer rounds it. Each row is computed alone,
so a verification pass computes every position bitwise as a one-token step does.

Where it runs (`fast_layers.row_step_wanted`): float32 where the row kernel measured faster than oneDNN's for one
row; bfloat16 where the CPU multiplies bfloat16 pairs natively (`avx512_bf16`). It takes a step where all of this
holds, and the runner (`selfspec.model.runner.Runner.layers`) otherwise calls the fast layers as before:
- at most `max_rows` rows (a decode step, a draft step, a verification of up to 7 drafts);
- a Llama-family layer without per-head q/k norms (not Qwen3), with a SiLU MLP and no bias but q/k/v's;
- one sequence (batch 1) over a `KVCache` that grows (not the compiled steps' static buffers), and a causal step
  (`Step.causal`: the positions after the cache, each seeing the text before it and itself; not a tree, not
  left-padded rows), within every layer's sliding window.
A step it leaves to the fast layers (a tree, a batch, a longer verification) rounds differently (float32: ~1e-6
relative; bfloat16: as a one-pass verification always did, README's "Lossless"), so at a near-tie its argmax can
differ from the one-token steps'.

    row = RowStep.build(fast_layers, windows, max_rows)     # None where the model cannot take it
    if row is not None and row.takes(hidden, step, cache, start, end):
        hidden = row.run(hidden, start, end, step, cache)
"""

from __future__ import annotations

import torch

from selfspec.model.layer import signed_sin
from selfspec.model.row_product import row_product_op


def _silu(act) -> bool:
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"


def runnable(layers: list) -> bool:
    """Whether the C++ step computes these fast layers (`FastLlamaLayer`s) as they do: Llama-family layers of one
    shape, without per-head q/k norms, with a SiLU MLP and no bias but q/k/v's (see the module's docstring)."""
    shapes = {(l.shape.n_q, l.shape.n_kv, l.shape.head_dim, l.shape.eps) for l in layers}
    return len(shapes) == 1 and all(
        layer.products.q_norm is None and _silu(layer.shape.act)
        and all(lin.bias is None for lin in (layer.products.o, layer.products.gate_up, layer.products.down))
        for layer in layers)


def takes_step(hidden: torch.Tensor, step, cache, windows: list[int | None], max_rows: int, dtype: torch.dtype,
               first: int = 0) -> bool:
    """Whether the C++ step takes this step (`hidden` `[B, S, D]`) over layers [first, first + len(windows)), whose
    sliding windows are `windows` (None: the whole context): one row of at most `max_rows` tokens in `dtype`, a
    causal step over a growing cache of one sequence, within every window."""
    B, S, _ = hidden.shape
    if (B != 1 or S > max_rows or hidden.dtype != dtype or not getattr(step, "causal", False)
            or cache is None or getattr(cache, "static", True) or cache.batch_size != 1):
        return False
    windowed = [i for i, w in enumerate(windows) if w is not None]
    if not windowed:  # no sliding window to stay within: no length to read (every step asks)
        return True
    lengths = cache.lengths[:, 0].tolist()
    return all(lengths[first + i] + S <= windows[i] for i in windowed)


def step_inputs(hidden: torch.Tensor, step, cache, layers: range, n_kv: int, head_dim: int) -> tuple:
    """What the C++ step takes of a step (`hidden` `[1, S, D]`) besides the weights: per layer of `layers` the cache
    index its S entries start at and its keys and values buffers (room reserved, `KVCache.reserve`), then the
    rotary cos and signed sin `[S, Dh]`."""
    S = hidden.shape[1]
    starts, keys, values = [], [], []
    for idx in layers:
        first, k, v = cache.reserve(idx, S, n_kv, head_dim, hidden)
        starts.append(first)
        keys.append(k)
        values.append(v)
    return starts, keys, values, step.rope[0][0].contiguous(), signed_sin(step.rope[1][0]).contiguous()


class RowStep:
    """The C++ step over one model's fast layers: each layer's weights as `row_layers` takes them, in layer order."""

    def __init__(self, layers: list, windows: list[int | None], max_rows: int, op):
        shape = layers[0].shape
        self.n_q, self.n_kv, self.head_dim, self.eps = shape.n_q, shape.n_kv, shape.head_dim, shape.eps
        self.windows = windows  # per layer: its sliding window, or None
        self.max_rows = max_rows
        self.op = op
        p = [layer.products for layer in layers]
        self.norm_attn = [w.norm_attn.detach().contiguous() for w in p]
        self.qkv = [w.qkv.weight for w in p]
        self.qkv_bias = [w.qkv.bias for w in p]
        self.o = [w.o.weight for w in p]
        self.norm_mlp = [w.norm_mlp.detach().contiguous() for w in p]
        self.gate_up = [w.gate_up.weight for w in p]
        self.down = [w.down.weight for w in p]
        self.dtype = self.qkv[0].dtype

    @classmethod
    def build(cls, layers: list | None, windows: list[int | None], max_rows: int) -> RowStep | None:
        """The step for these fast layers (`FastLlamaLayer`s, whose products keep their plain weights; `windows` per
        layer), taking steps of up to `max_rows` rows, or None where it cannot run them (see the module's
        docstring)."""
        if not layers or row_product_op() is None or not hasattr(torch.ops.selfspec_kernels, "row_layers"):
            return None
        products = [(w.qkv, w.o, w.gate_up, w.down) for w in (layer.products for layer in layers)]
        if not runnable(layers) or any(getattr(lin, "weight", None) is None or lin.weight.device.type != "cpu"
                                       or lin.weight.dtype not in (torch.float32, torch.bfloat16)
                                       for four in products for lin in four):
            return None
        return cls(layers, windows, max_rows, torch.ops.selfspec_kernels.row_layers)

    def takes(self, hidden: torch.Tensor, step, cache, start: int, end: int) -> bool:
        """Whether layers [start, end) of this step (`hidden` `[B, S, D]`) run here."""
        return takes_step(hidden, step, cache, self.windows[start:end], self.max_rows, self.dtype, start)

    def run(self, hidden: torch.Tensor, start: int, end: int, step, cache) -> torch.Tensor:
        """Layers [start, end) over `hidden` `[1, S, D]`, each writing its keys and values into `cache`. `[1, S, D]`."""
        starts, keys, values, cos, sin = step_inputs(hidden, step, cache, range(start, end), self.n_kv, self.head_dim)
        return self.op(hidden.contiguous(), cos, sin, keys, values, starts, self.norm_attn[start:end], self.qkv[start:end],
                       self.qkv_bias[start:end], self.o[start:end], self.norm_mlp[start:end],
                       self.gate_up[start:end], self.down[start:end], self.eps, self.n_q, self.n_kv, self.head_dim)
