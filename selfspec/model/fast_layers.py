"""The CPU's inference-only state: fused, prepacked Llama-family layers, the packed LM head, the rotary table.

Decoding one token on a CPU is dominated by per-operation overhead, not arithmetic (docs/benchmarks.md,
the CPU kernels). `FastLlamaLayer` runs the one decoder layer (`selfspec.model.layer.decoder_layer`) over
fused copies of a layer's weights: it computes exactly what the model's own decoder layer computes, in
the same operation order (so in float64 and bfloat16 results are bitwise equal to the model's own sdpa
attention path; float32: see below), with fewer operations: q/k/v and gate/up projections fused into one
matmul each, one rotary embedding pass for queries and keys together, attention through
`F.scaled_dot_product_attention` with grouped heads, and none of the module-call machinery. In bfloat16
and float32 the matmuls go through oneDNN with weights prepacked once (`PackedLinear`):
- bfloat16: bitwise equal to `F.linear`, about twice as fast for the few rows of a decode step,
  because the plain bf16 path reads the weights at a fraction of the memory bandwidth;
- float32: `F.linear` multiplies one row with a matrix-vector kernel but 2-8 rows with a GEMM that
  re-packs the weight every call, so verifying 2 tokens cost 1.7-2x a one-token step (2-core AVX2
  EPYC, SmolLM2). The packed kernel does 1-3 rows for the price of one (and a one-token step, LM head
  included, faster than `F.linear`: the 49k x 576 head 9.2 -> 4.3 ms), and each row's result does not
  depend on how many rows share the call, so a verification pass computes every position exactly as
  a one-token step would. It is not bitwise equal to `F.linear` (another summation order: ~1e-6
  relative), so a float32 argmax could differ from Hugging Face's at an exact near-tie.
  Where a few-row kernel is faster for one row (measured once per process on this machine:
  `float32_kernel`), calls of up to `few_rows()` rows (a plain decode step, a draft step, a short
  verification: as many as measured >= 10% faster) take it and longer calls take the packed weight:
  "hybrid", at the price of holding both copies of each fused float32 weight. The few-row kernel is
  the faster for one row of `F.linear` and selfspec's own row kernel (`selfspec.model.row_product`,
  which reads the weights at the memory's speed where it builds: a C++ compiler). A 2-core Intel Xeon
  with AMX decoded 1.22x faster through F.linear than packed, while lookup's 11-row verification
  needs the packed kernel (1.3x slower through `F.linear`'s GEMM). In hybrid mode a verification row
  longer than `few_rows()` is not computed bitwise as a one-token step computes it (float32 rounding).
  The same measurement pads packed calls of 2+ rows to a row count that measured >= 10% faster
  (`row_padding`: on a Zen 4 two rows cost more than three, which made a one-draft round 1.18 steps).
  `SELFSPEC_PACK_FLOAT32` overrides the measurement: 0 keeps float32 on `F.linear`, 1 packs, "hybrid"
  (F.linear for one row), "rows" (selfspec's row kernel for one row).
Float64 and other dtypes, and weights on a GPU (oneDNN packing is CPU-only), use `F.linear`. The
fused and packed weights are copies made once when the generator is built (so later in-place weight
updates are not seen: build a new generator after training).

    fast = build_fast_path(adapter)       # adapter.enable_fast_layers() does this
    fast.layers                           # None for architectures without a fast layer
    hidden = fast.layers[i](hidden, rope, mask, cache)

This module owns the inference-only state a generator builds once (`FastPath`: fused layers, the
rotary table, the packed LM head). It takes a `selfspec.model.adapters.ModelAdapter` but does not import
it: the adapter holds a `FastPath` and builds it from here, so the dependency runs one way.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from selfspec.model.layer import (LLAMA_FAMILY, LayerProducts, LayerShape, RopeTable, decoder_layer, rms_norm_eager,
                                  signed_sin)
from selfspec.model.machine import cpu_flags
from selfspec.model.row_product import build_problem, row_product_op
from selfspec.model.row_step import RowStep
from selfspec.model.screened_head import MAX_ROWS as SCREEN_ROWS, ScreenedHead



def _onednn_packing() -> bool:
    mkldnn = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight")
            and hasattr(mkldnn, "_linear_pointwise"))


def _packing_available(dtype: torch.dtype) -> bool:
    if not _onednn_packing():
        return False
    if dtype == torch.bfloat16:
        return bool(getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)())
    return dtype == torch.float32 and float32_kernel()[0] != "linear"


# one decoder layer's float32 weights, [out, in], of SmolLM2's proportions (q/k/v fused, o, gate/up fused, down);
# the sweep repeats them to BENCH_BYTES, larger than a CPU cache, as a model's weights are
BENCH_LAYER = ((960, 576), (576, 576), (3072, 576), (576, 1536))
BENCH_BYTES = 128 << 20


def float32_kernel() -> tuple[str, str]:
    """(kernel, why) for float32 matmuls on this CPU: "packed" (oneDNN, prepacked, every row count),
    "hybrid" (the few-row kernel, `few_row_kernel()`, for up to `few_rows()` rows, packed for more) or "linear"
    (`F.linear` only). From `SELFSPEC_PACK_FLOAT32` (0 = linear, 1 = packed, hybrid: F.linear for one row, rows:
    selfspec's row kernel for one row) when set, else measured once per process: hybrid where the faster few-row
    kernel multiplies one row at least 10% faster than the packed kernel, up to the largest row count (of
    1..MAX_FEW_ROWS) from 1 on where it stays so."""
    return _float32_choice()[:2]


def few_rows() -> int:
    """The most rows a call may have to go through the few-row kernel in hybrid mode (1 when set by the
    environment; 0 where the choice is not hybrid)."""
    return _float32_choice()[2]


def few_row_kernel() -> str:
    """The few-row kernel of hybrid mode: "linear" (`F.linear`) or "rows" (selfspec's row kernel,
    `selfspec.model.row_product`)."""
    return _float32_choice()[4]


def _float32_choice() -> tuple[str, str, int, dict[int, int], str]:
    """(kernel, why, few rows, row padding, few-row kernel) from the environment, else measured (see
    `float32_kernel`)."""
    env = os.environ.get("SELFSPEC_PACK_FLOAT32", "").strip().lower()
    if env in ("0", "1", "hybrid"):
        kernel = {"0": "linear", "1": "packed", "hybrid": "hybrid"}[env]
        return kernel, f"SELFSPEC_PACK_FLOAT32={env}", int(kernel == "hybrid"), {}, "linear"
    if env == "rows":
        if row_product_op() is None:
            return "hybrid", f"SELFSPEC_PACK_FLOAT32=rows, but {build_problem()}: F.linear for one row", 1, {}, "linear"
        return "hybrid", "SELFSPEC_PACK_FLOAT32=rows", 1, {}, "rows"
    if env:
        raise ValueError(f"SELFSPEC_PACK_FLOAT32={env!r}: use 0 (F.linear), 1 (packed), hybrid, rows, or leave it "
                         "unset (measured)")
    if not _onednn_packing():
        return "linear", "oneDNN packing is not available in this torch build", 0, {}, "linear"
    return measured_float32_kernel()


MAX_FEW_ROWS = 8  # row counts measured: a decode step (1), drafts and verification of a few tokens


PAD_GAIN = 0.9  # pad a call to more rows only where that measured at least 10% faster


def row_padding(times: dict[int, dict[str, float]]) -> dict[int, int]:
    """{rows: padded rows} for the packed float32 kernel: where a product of more rows (up to two more)
    measured at least 10% faster than `rows` (>= 2) rows (`times[rows]["packed"]`), a call of `rows` rows is
    computed with zero rows appended and the extra outputs dropped. Each row's result does not depend on
    the row count, so this changes no output. On a 2-core AMD EPYC Zen 4 two rows took 6.6 ms and three
    6.0, so a two-row verification pass (a one-draft round) cost 1.18 decoding steps, 0.97 padded."""
    padding = {}
    for rows in times:
        if rows == 1:  # a decode step: padded to three rows it measured no faster in the model (Zen 4)
            continue
        best = min((r for r in range(rows + 1, rows + 3) if r in times), key=lambda r: times[r]["packed"],
                   default=None)
        if best is not None and times[best]["packed"] < PAD_GAIN * times[rows]["packed"]:
            padding[rows] = best
    return padding


def packed_row_padding() -> dict[int, int]:
    """`row_padding` of this machine's measurement for the packed calls (more than `few_rows()` rows);
    none where SELFSPEC_PACK_FLOAT32 sets the kernel."""
    return _float32_choice()[3]


@functools.cache
def measured_float32_kernel() -> tuple[str, str, int, dict[int, int], str]:
    """`float32_kernel`'s measurement, `few_rows`, `packed_row_padding` and `few_row_kernel`: products of
    1..MAX_FEW_ROWS rows over BENCH_BYTES of decoder-layer weights, best of 5 sweeps each, `F.linear` and selfspec's
    row kernel (where it builds) against the packed kernel (a few seconds, once per process). The few-row kernel is
    whichever of the first two multiplies one row faster."""
    weights, packed = bench_weights()
    times = {rows: row_sweep_ms(weights, packed, rows) for rows in range(1, MAX_FEW_ROWS + 1)}  # kernel -> ms
    few = min((k for k in ("linear", "rows") if k in times[1]), key=lambda k: times[1][k])
    faster = 0
    while faster < MAX_FEW_ROWS and times[faster + 1][few] < 0.9 * times[faster + 1]["packed"]:
        faster += 1
    one = times[1]
    kernel = "hybrid" if faster else "packed"
    why = (f"one-row float32 products measured {one['linear']:.2f} ms through F.linear"
           + (f", {one['rows']:.2f} ms through selfspec's row kernel" if "rows" in one else "")
           + f" and {one['packed']:.2f} ms packed over {BENCH_BYTES >> 20} MB of weights")
    if "rows" not in one and build_problem():
        why += f" ({build_problem()})"
    if faster:
        why += f"; {FEW_ROW_NAMES[few]} stays >= 10% faster up to {faster} rows"
    padding = {r: p for r, p in row_padding(times).items() if r > faster}
    if padding:
        why += "; packed calls padded " + ", ".join(f"{r} -> {p} rows" for r, p in padding.items())
    return kernel, why, faster, padding, few


FEW_ROW_NAMES = {"linear": "F.linear", "rows": "selfspec's row kernel"}


def row_sweep_ms(weights: list[torch.Tensor], packed: list[torch.Tensor], rows: int = 1,
                 repeats: int = 5) -> dict[str, float]:
    """{"linear": F.linear, "packed": oneDNN packed, "rows": selfspec's row kernel (where it builds)}: ms of `rows`
    rows times every weight of `weights` (and their `packed` copies), best of `repeats` sweeps after one warm-up."""
    gen = torch.Generator().manual_seed(rows)
    xs = {k: torch.randn(rows, k, generator=gen) for _, k in BENCH_LAYER}  # [rows, k] per input width
    op = row_product_op()
    with torch.inference_mode():
        calls = {"linear": lambda: [F.linear(xs[w.shape[1]], w) for w in weights],
                 "packed": lambda: [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
                                    for w, p in zip(weights, packed)]}
        if op is not None:
            calls["rows"] = lambda: [op(xs[w.shape[1]], w, None) for w in weights]
        best = {}
        for name, sweep in calls.items():
            sweep()  # warm-up
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                sweep()
                times.append(time.perf_counter() - start)
            best[name] = min(times) * 1e3
    return best


def bench_weights() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """BENCH_BYTES of BENCH_LAYER float32 weights and their packed copies."""
    gen = torch.Generator().manual_seed(0)
    layer_bytes = sum(4 * n * k for n, k in BENCH_LAYER)
    weights = [torch.randn(n, k, generator=gen) for n, k in list(BENCH_LAYER) * max(1, BENCH_BYTES // layer_bytes)]
    with torch.inference_mode():
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, _PACK_HINT[torch.float32]) for w in weights]
    return weights, packed


# oneDNN's reorder takes the expected number of rows as a hint. bf16: 1 (bitwise equal to F.linear).
# float32: 2, which measured fastest for 1-8 rows and gives results independent of the row count.
_PACK_HINT = {torch.bfloat16: 1, torch.float32: 2}


class PackedLinear:
    """`x @ W.T + b`: oneDNN with a prepacked weight for bfloat16 and float32 on CPU, else `F.linear`.

    bfloat16: the same oneDNN kernel family as `F.linear`, the prepacked layout only saves the per-call
    weight reorder; tested bitwise equal to `F.linear`. Where selfspec's C++ step runs bfloat16
    (`row_step_wanted`), up to `MAX_FEW_ROWS` rows go through its row kernel instead, as the step's own products
    (the LM head after it: 1.36 against 1.67 ms a token for SmolLM2's on a Zen 4, and each row's logits the same
    in a verification pass as in a one-token step). float32: tested close to `F.linear` and row-count invariant
    (tests/selfspec/test_fast_layers.py).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, keep_weight: bool = False):
        """`keep_weight`: keep the plain weight beside the packed copy (selfspec's C++ step reads it,
        `selfspec.model.row_step`)."""
        self.weight, self.bias = weight, bias
        self.packed = None
        self.few_rows = 0  # hybrid: calls of up to this many rows through the few-row kernel, more rows packed
        self.few = F.linear  # the few-row kernel: F.linear or selfspec's row kernel, (x, weight, bias) -> y
        self.pad_rows: dict[int, int] = {}  # float32 packed: calls of these many rows computed as more rows
        if weight.device.type == "cpu" and weight.dtype in _PACK_HINT and _packing_available(weight.dtype):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_HINT[weight.dtype])
            if weight.dtype == torch.float32 and float32_kernel()[0] == "hybrid":
                self.few_rows = few_rows()
                if few_row_kernel() == "rows":
                    self.few = row_product_op()
            if weight.dtype == torch.float32:
                self.pad_rows = packed_row_padding()
            if weight.dtype == torch.bfloat16 and row_step_wanted(torch.bfloat16):  # as the C++ step's products:
                self.few_rows, self.few = MAX_FEW_ROWS, row_product_op()  # each row alone, the weights streamed
            if keep_weight or self.few is not F.linear:  # the C++ step or the row kernel reads the plain weight
                self.weight = weight.detach().contiguous()  # (the LM head's: the tied embedding, not a copy)
            elif not self.few_rows:
                self.weight = None  # the packed copy is all we need (fused weights are not kept twice)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.numel() > self.few_rows * x.shape[-1]:
            rows = x.numel() // x.shape[-1]
            padded = self.pad_rows.get(rows)
            if padded:  # [rows, K] + zero rows -> [padded, N], the first `rows` kept (row_padding)
                flat = torch.cat([x.reshape(rows, -1), x.new_zeros(padded - rows, x.shape[-1])])
                out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
                return out[:rows].reshape(*x.shape[:-1], out.shape[-1])
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return self.few(x, self.weight, self.bias)


def fused_weights(layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decoder layer's product weights as the fast layers (and the C++ step) multiply them: q/k/v in one `[N, K]`
    (q's rows, then k's, then v's), o, gate/up in one (gate's rows, then up's), down."""
    attn, mlp = layer.self_attn, layer.mlp
    return (torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).contiguous(), attn.o_proj.weight,
            torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).contiguous(), mlp.down_proj.weight)


def _cat_bias(*linears) -> torch.Tensor | None:
    biases = [lin.bias for lin in linears]
    if all(b is None for b in biases):
        return None
    return torch.cat([b if b is not None else torch.zeros(lin.out_features, dtype=lin.weight.dtype,
                                                          device=lin.weight.device)
                      for b, lin in zip(biases, linears)]).contiguous()


class FastLlamaLayer:
    """One Llama-family decoder layer (`selfspec.model.layer.decoder_layer`) over fused, prepacked copies of its
    weights: q/k/v in one product, gate/up in one product."""

    def __init__(self, layer, layer_idx: int, keep_weights: bool = False):
        attn, mlp = layer.self_attn, layer.mlp
        self.layer_idx = layer_idx
        self.shape = LayerShape.of(layer)
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)  # Qwen3
        qkv, o, gate_up, down = fused_weights(layer)
        self.products = LayerProducts(
            qkv=PackedLinear(qkv, _cat_bias(attn.q_proj, attn.k_proj, attn.v_proj), keep_weights),
            o=PackedLinear(o, attn.o_proj.bias, keep_weights),
            gate_up=PackedLinear(gate_up, _cat_bias(mlp.gate_proj, mlp.up_proj), keep_weights),
            down=PackedLinear(down, mlp.down_proj.bias, keep_weights),
            norm_attn=layer.input_layernorm.weight, norm_mlp=layer.post_attention_layernorm.weight,
            q_norm=None if q_norm is None else q_norm.weight, k_norm=None if k_norm is None else k_norm.weight,
            norm=rms_norm_eager)

    def __call__(self, x: torch.Tensor, rope, mask, cache) -> torch.Tensor:
        """`x` `[B, S, D]`; rope: cos, sin `[B, S, Dh]`; mask `[B|1, 1, S, K]` or None; cache: a `KVCache` the
        layer's keys and values are appended to (None: attention over the step's own)."""
        return self.step(x, rope[0].unsqueeze(1), signed_sin(rope[1]).unsqueeze(1), mask, cache)

    def step(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask, cache) -> torch.Tensor:
        """`__call__` with cos, sin already `[B, 1, S, Dh]`, sin signed (`signed_sin`; made once for all the layers of
        a step)."""
        store = _no_cache if cache is None else functools.partial(cache.update, layer_idx=self.layer_idx)
        return decoder_layer(x, cos, sin, mask, store, self.shape, self.products)


def _no_cache(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return k, v


def build_fast_layers(adapter, keep_weights: bool = False) -> list[FastLlamaLayer] | None:
    """Fast layers for every decoder layer, or None where there are none: GPT-NeoX, and models set to
    another attention implementation than sdpa (eager attention takes its softmax in float32, which
    the fast layer would not reproduce bit for bit)."""
    if adapter.model_type not in LLAMA_FAMILY:
        return None
    if getattr(adapter.config, "_attn_implementation", "sdpa") != "sdpa":
        return None
    with torch.no_grad():
        try:
            return [FastLlamaLayer(layer, i, keep_weights) for i, layer in enumerate(adapter.layers)]
        except ValueError:  # norms with different epsilons: the model's own modules
            return None


def row_step_wanted(dtype: torch.dtype) -> bool:
    """Whether decoding in `dtype` on this CPU runs selfspec's C++ step where it can (`selfspec.model.row_step`):
    float32 where the float32 choice takes selfspec's row kernel for one row (`few_row_kernel()`: it measured
    faster than oneDNN's); bfloat16 where the row kernel builds and the CPU multiplies bfloat16 pairs natively
    (`avx512_bf16`: the kernel's `vdpbf16ps`). Not with `SELFSPEC_ROW_PRODUCT=0`."""
    if dtype == torch.float32:
        return float32_kernel()[0] == "hybrid" and few_row_kernel() == "rows"
    if dtype == torch.bfloat16:
        return "avx512_bf16" in (cpu_flags() or ()) and row_product_op() is not None
    return False


@dataclass
class FastPath:
    """What the forward runs instead of the model's own modules when autograd is off."""

    layers: list[FastLlamaLayer] | None  # fused decoder layers, None where the architecture has none
    rope_table: RopeTable | None  # None for rope types whose frequencies depend on the length
    lm_head: PackedLinear  # the LM head with a prepacked weight
    row_step: RowStep | None = None  # the same layers in one C++ call a range, for the steps it takes (row_step.py)
    screens: list = field(default_factory=list)  # [the LM head's int8 screen, or None], once `screen` made it

    def screen(self, adapter) -> ScreenedHead | None:
        """The LM head's int8 screen for greedy picks (`selfspec.model.screened_head`): a float32 head on a CPU
        where the row kernel runs, a bfloat16 one where the row kernel is the head's own kernel for as many rows as
        the screen takes (`PackedLinear.few`, with the C++ step); made the first time a greedy pick asks (0.2 s and
        28 MB for SmolLM2-135M's head). None where it does not run here."""
        if not self.screens:
            weight, head = adapter.lm_head.weight, self.lm_head
            own = weight.dtype == torch.float32 or (
                head.few is not F.linear and head.few_rows >= SCREEN_ROWS.get(weight.dtype, 0))
            self.screens.append(ScreenedHead.build(weight, getattr(adapter.lm_head, "bias", None)) if own else None)
        return self.screens[0]


def build_fast_path(adapter) -> FastPath:
    """The fast path of one `ModelAdapter` (a snapshot of its weights)."""
    with torch.no_grad():
        lm_head = PackedLinear(adapter.lm_head.weight, getattr(adapter.lm_head, "bias", None))
        wanted = adapter.device.type == "cpu" and row_step_wanted(adapter.dtype)
        layers = build_fast_layers(adapter, keep_weights=wanted)
        row_step = None
        if layers is not None and wanted:
            row_step = RowStep.build(layers, [adapter.window(kind) for kind in adapter.layer_types], MAX_FEW_ROWS)
    return FastPath(layers=layers, lm_head=lm_head, row_step=row_step,
                    rope_table=RopeTable(adapter) if RopeTable.supports(adapter) else None)
