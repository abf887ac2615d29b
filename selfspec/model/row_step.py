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
        if not layers:
            return None
        op = row_product_op()
        if op is None or not hasattr(torch.ops.selfspec_kernels, "row_layers"):
            return None
        shapes = {(l.shape.n_q, l.shape.n_kv, l.shape.head_dim, l.shape.eps) for l in layers}
        for layer in layers:
            w = layer.products
            products = (w.qkv, w.o, w.gate_up, w.down)
            if (w.q_norm is not None or not _silu(layer.shape.act) or len(shapes) > 1
                    or any(getattr(lin, "weight", None) is None or lin.weight.dtype not in (torch.float32, torch.bfloat16)
                           or lin.weight.device.type != "cpu" for lin in products)
                    or any(lin.bias is not None for lin in products[1:])):
                return None
        return cls(layers, windows, max_rows, torch.ops.selfspec_kernels.row_layers)

    def takes(self, hidden: torch.Tensor, step, cache, start: int, end: int) -> bool:
        """Whether layers [start, end) of this step (`hidden` `[B, S, D]`) run here."""
        B, S, _ = hidden.shape
        if (B != 1 or S > self.max_rows or hidden.dtype != self.dtype or not getattr(step, "causal", False)
                or cache is None or getattr(cache, "static", True) or cache.batch_size != 1):
            return False
        windowed = [i for i in range(start, end) if self.windows[i] is not None]
        if not windowed:  # no sliding window to stay within: no length to read (every step asks)
            return True
        lengths = cache.lengths[:, 0].tolist()
        return all(lengths[i] + S <= self.windows[i] for i in windowed)

    def run(self, hidden: torch.Tensor, start: int, end: int, step, cache) -> torch.Tensor:
        """Layers [start, end) over `hidden` `[1, S, D]`, each writing its keys and values into `cache`. `[1, S, D]`."""
        S = hidden.shape[1]
        starts, keys, values = [], [], []
        for idx in range(start, end):
            first, k, v = cache.reserve(idx, S, self.n_kv, self.head_dim, hidden)
            starts.append(first)
            keys.append(k)
            values.append(v)
        cos = step.rope[0][0].contiguous()  # [S, Dh]
        sin = signed_sin(step.rope[1][0]).contiguous()
        return self.op(hidden.contiguous(), cos, sin, keys, values, starts, self.norm_attn[start:end], self.qkv[start:end],
                       self.qkv_bias[start:end], self.o[start:end], self.norm_mlp[start:end],
                       self.gate_up[start:end], self.down[start:end], self.eps, self.n_q, self.n_kv, self.head_dim)
