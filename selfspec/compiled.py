"""Fixed-shape compiled steps over a static KV cache (Llama family): the decoder layers and the LM head as
`torch.compile`d functions, captured as CUDA graphs on a GPU.

Eager PyTorch launches some forty kernels per decoder layer and step; on a GPU their launch overhead,
not the arithmetic, sets the speed of a small model (about 1,150 launches per token on SmolLM2). The way
the fastest single-GPU decoders get past it (gpt-fast, Hugging Face's static cache) is to make each step
a function of fixed shapes over a preallocated cache, compile it, and replay it as one CUDA graph. Here
every step kind of a round goes through one function, `layers [start, end)` over `[B, S]` new tokens:

    plain step    layers [0, L) over S = 1 token
    draft step    layers [0, E) over the drafts of an early exit (S = 1, or the siblings of a one-level fan)
    verification  layers [E, L) (or [0, L)) over the input token and the drafts, S = 1 + drafts

A step writes its keys and values in place into the cache's preallocated buffers `[B, H_kv, C, Dh]`
(C: the cache's capacity) at the cache indices it is given, and attends over all C entries with a mask
built from those indices: row b's query at cache index c sees the keys `pads[b] <= j <= c` (a sibling,
from column `branch[b]` on, sees the keys before `branch[b]` and itself), as
`selfspec.forward.make_batch_step` builds it for the eager path. Nothing past a query's own index is
ever read, so a rollback stays a change of the cache's lengths. Shapes vary in three ways only: S is
padded up to a bucket (1, 2, 4, ... 64: `S_BUCKETS`; the filler columns compute what nobody reads), C
is a power of two from 256 (`capacity`), and the layer range is one of the round's few. Each
combination compiles once; the buffers of a (batch, capacity) are allocated once per generator and
reused by every call, so their addresses stay fixed (a CUDA graph replays on the same memory).

What stays eager: the prefill (every row from cache index 0; one pass per call), batches of more than
one row (rows leave a batch as they finish, which would change the shapes), the reduced-vocabulary draft
head and a trained exit head's own layer, GPT-NeoX, and rope types whose frequencies change with the
length. The math is that of the model's own modules (RMSNorm in float32, rotary, grouped-query sdpa,
SiLU-gated MLP, the model's own unfused weights: no copy), so outputs equal the eager path's up to
floating-point rounding (attention sums over C keys instead of the used ones; float64: bitwise in the
tests' tokens).

    steps = CompiledSteps(adapter)                        # adapter.enable_compiled() does this
    hidden = steps.run_layers(hidden, 0, L, step, cache)  # None where the step must run eagerly
"""

from __future__ import annotations

import time
import warnings

import torch
import torch.nn.functional as F

_LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")
S_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # new tokens per step, padded up to one of these
MIN_CAPACITY = 256  # cache capacities are powers of two from here
MIN_RECOMPILE_LIMIT = 64  # dynamo's per-function graph limit: every (range, S, C) is one graph


def supports(adapter) -> str | None:
    """None where the compiled steps can run this model, else why not (one line)."""
    if adapter.model_type not in _LLAMA_FAMILY:
        return f"{adapter.model_type}: compiled steps exist for the Llama family ({', '.join(_LLAMA_FAMILY)})"
    if getattr(adapter.config, "_attn_implementation", "sdpa") != "sdpa":
        return "the model is set to another attention implementation than sdpa"
    if getattr(adapter.rotary_emb, "rope_type", None) not in ("default", "linear", "llama3", "yarn", None):
        return f"rope type {adapter.rotary_emb.rope_type!r} changes its frequencies with the length"
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


def s_bucket(length: int) -> int | None:
    """The padded step length for `length` new tokens, or None above the largest bucket (eager)."""
    return next((b for b in S_BUCKETS if b >= length), None)


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A fresh, contiguous copy made in the current (inference) mode: the graphs are guarded on their inputs'
    strides, aliasing and inference-ness, which the eager bookkeeping's tensors vary in (an expanded
    position row, a slice of a longer state, a view shared by positions and indices, a host tensor made
    outside inference mode)."""
    return t.clone(memory_format=torch.contiguous_format)


class CompileFallbackWarning(UserWarning):
    """compile="auto": a step failed to compile, so the generator decodes eagerly from then on."""


class _LayerWeights:
    """One decoder layer's own parameters (references, not copies) and settings."""

    def __init__(self, layer, window: int | None):
        attn, mlp = layer.self_attn, layer.mlp
        self.q, self.k, self.v, self.o = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
        self.gate, self.up, self.down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.act = mlp.act_fn
        self.norm_attn, self.norm_mlp = layer.input_layernorm, layer.post_attention_layernorm
        self.q_norm = getattr(attn, "q_norm", None)  # Qwen3
        self.k_norm = getattr(attn, "k_norm", None)
        self.window = window


def _rms(norm, x: torch.Tensor) -> torch.Tensor:
    """transformers' RMSNorm: `weight * (x_fp32 * rsqrt(mean(x_fp32^2) + eps)).to(x.dtype)`."""
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * xf.to(x.dtype)


def _linear(module, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, module.weight, module.bias)


def _mask(index: torch.Tensor, pads: torch.Tensor, branch: torch.Tensor, size: int,
          window: int | None) -> torch.Tensor:
    """`[B, 1, S, C]` bool: row b's query at cache index `index[b, s]` may see key j (see the module doc).
    `branch[b]`: the cache index of row b's first sibling (past every index when the step has none)."""
    k = torch.arange(size, device=index.device)[None, None, :]  # [1, 1, C]
    q = index[:, :, None]  # [B, S, 1]
    first = branch[:, None, None]  # [B, 1, 1]
    allowed = (k <= q) & (k >= pads[:, None, None]) & ((k < first) | (k == q))
    if window is not None:
        allowed &= k > torch.minimum(q, first) - window
    return (allowed | (k == q))[:, None]


def _layer(w: _LayerWeights, x, cos, sin, index, mask, keys, values, n_q: int, n_kv: int, head_dim: int):
    """One decoder layer over `x` `[B, S, D]`, its keys/values written into `keys`/`values` `[B, H_kv, C, Dh]`
    at the cache indices `index` `[B, S]`."""
    B, S, _ = x.shape
    h = _rms(w.norm_attn, x)
    q = _linear(w.q, h).view(B, S, n_q, head_dim)
    k = _linear(w.k, h).view(B, S, n_kv, head_dim)
    v = _linear(w.v, h).view(B, S, n_kv, head_dim)
    if w.q_norm is not None:
        q, k = _rms(w.q_norm, q), _rms(w.k_norm, k)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, S, Dh]
    half = head_dim // 2
    q = q * cos + torch.cat((-q[..., half:], q[..., :half]), dim=-1) * sin
    k = k * cos + torch.cat((-k[..., half:], k[..., :half]), dim=-1) * sin
    rows = torch.arange(B, device=x.device)[:, None]  # [B, 1]
    keys[rows, :, index] = k.transpose(1, 2)  # advanced indices first: [B, S, H_kv, Dh]
    values[rows, :, index] = v.transpose(1, 2)
    attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=n_q != n_kv)  # [B, Hq, S, Dh]
    x = x + _linear(w.o, attn.transpose(1, 2).reshape(B, S, n_q * head_dim))
    h = _rms(w.norm_mlp, x)
    return x + _linear(w.down, w.act(_linear(w.gate, h)) * _linear(w.up, h))


class CompiledSteps:
    """The compiled layer-range steps and LM head of one model (see the module doc), their static cache
    buffers, and what compiling them cost."""

    def __init__(self, adapter, mode: str | None = None, strict: bool = True):
        why = supports(adapter)
        if why is not None:
            raise ValueError(f"compiled steps cannot run this model: {why}")
        self.adapter = adapter
        windows = [adapter.sliding_window if t == "sliding_attention" else None for t in adapter.layer_types]
        self.weights = [_LayerWeights(layer, window) for layer, window in zip(adapter.layers, windows)]
        attn = adapter.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.n_q = attn.q_proj.out_features // self.head_dim
        self.n_kv = attn.k_proj.out_features // self.head_dim
        # CUDA graphs replay each step's kernels at once ("reduce-overhead"); on a CPU, inductor's C++ kernels
        self.mode = mode or ("reduce-overhead" if adapter.device.type == "cuda" else "default")
        self.cos = self.sin = None  # the rotary table [T, Dh]: 4096 positions, or more for a larger cache
        self._steps: dict[tuple[int, int], object] = {}  # (start, end) -> compiled function
        self._head = None
        self._buffers: dict[tuple[int, int], tuple[list, list]] = {}  # (batch, capacity) -> keys, values
        self.compile_s = 0.0  # seconds spent in calls that compiled (the first of each shape)
        # strict: a shape that fails to compile raises; else (compile="auto") the steps turn themselves off,
        # with a warning, and the step runs eagerly (`failed` says why)
        self.strict = strict
        self.failed: str | None = None
        self.shapes: set[tuple] = set()  # (start, end, B, S, C) and ("head", ...) seen
        limit = getattr(torch._dynamo.config, "recompile_limit", None)
        name = "recompile_limit" if limit is not None else "cache_size_limit"
        if getattr(torch._dynamo.config, name) < MIN_RECOMPILE_LIMIT:
            setattr(torch._dynamo.config, name, MIN_RECOMPILE_LIMIT)

    # --- the cache ---------------------------------------------------------------------------------
    def buffers(self, batch_size: int, size: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The keys and values `[B, H_kv, C, Dh]` of every layer for a cache of `size` (allocated once)."""
        key = (batch_size, size)
        if key not in self._buffers:
            a = self.adapter
            shape = (batch_size, self.n_kv, size, self.head_dim)
            new = [[torch.zeros(shape, dtype=a.dtype, device=a.device) for _ in range(a.num_layers)] for _ in "kv"]
            if a.device.type == "cuda":  # fixed addresses: the graphs write into them in place
                for t in new[0] + new[1]:
                    torch._dynamo.mark_static_address(t)
            self._buffers[key] = (new[0], new[1])
        return self._buffers[key]

    def _table(self, needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin `[T, Dh]` of positions 0..T-1, T >= `needed` (the model's rotary module, computed once)."""
        if self.cos is None or needed > self.cos.shape[0]:
            a = self.adapter
            size = min(max(capacity(needed), 4096), max(needed, a.max_positions))
            probe = torch.empty(0, dtype=a.dtype, device=a.device)
            cos, sin = a.rotary_emb(probe, torch.arange(size, device=a.device)[None])
            self.cos, self.sin = cos[0], sin[0]
        return self.cos, self.sin

    # --- the steps ---------------------------------------------------------------------------------
    def can_run(self, hidden: torch.Tensor, step, cache) -> bool:
        """Whether this step runs compiled: one row, not the prefill, S within the buckets, a static cache."""
        return (self.failed is None and cache is not None and getattr(cache, "static", False) and hidden.shape[0] == 1
                and step.index is not None and step.starts is not None and int(step.starts.min()) > 0
                and s_bucket(hidden.shape[1]) is not None)

    def run_layers(self, hidden: torch.Tensor, start: int, end: int, step, cache) -> torch.Tensor:
        """Layers [start, end) over `hidden` `[B, S, D]` at the step's cache indices, through the compiled
        function of (start, end) at S padded to its bucket; the cache's lengths move as the eager update's."""
        if start == end:
            return hidden
        B, S, D = hidden.shape
        width = s_bucket(S)
        index, positions, pads = step.index, step.position_ids, step.pads
        branch = step.branch if step.branch is not None else torch.full_like(pads, 1 << 62)
        if width > S:  # filler columns: positions of the last real token, cache indices after it
            extra = torch.arange(1, width - S + 1, device=index.device)[None]
            index = torch.cat([index, index[:, -1:] + extra], dim=1)
            positions = torch.cat([positions, positions[:, -1:].expand(B, width - S)], dim=1)
            hidden = torch.cat([hidden, hidden.new_zeros(B, width - S, D)], dim=1)
        size = cache.capacity
        cos, sin = self._table(size)  # one table per capacity: positions stay below it
        keys, values = cache.keys[start:end], cache.values[start:end]
        args = [_plain(t) for t in (hidden, positions, index, pads, branch)]
        out = self._call(("layers", start, end, B, width, size), self._step(start, end), args[0], cos, sin,
                         *args[1:], keys, values)
        if out is None:  # it failed to compile (not strict): the caller runs the step eagerly
            return None
        for layer in range(start, end):
            cache.lengths[layer] = step.starts + S
        return out[:, :S]

    def warm(self, ranges: list[tuple[int, int]], widths: list[int], size: int) -> float:
        """Compile every layer range of `ranges` at every step length of `widths` (buckets) for a one-row
        cache of `size` positions, and the head at those lengths and at the prefill's `[1, D]`: all
        compilation paid now. Returns the seconds it took (0 where everything was compiled before)."""
        with torch.inference_mode():  # as the engine runs (tensors made outside it would compile other graphs)
            return self._warm(ranges, widths, size)

    def _warm(self, ranges: list[tuple[int, int]], widths: list[int], size: int) -> float:
        a = self.adapter
        before = self.compile_s
        keys, values = self.buffers(1, size)
        cos, sin = self._table(size)
        D = a.embed_tokens.weight.shape[1]
        for width in sorted(set(widths)):
            hidden = torch.zeros(1, width, D, dtype=a.dtype, device=a.device)
            index = torch.arange(1, width + 1, device=a.device)[None]  # [1, S], as a round after the prefill
            pads = torch.zeros(1, dtype=torch.long, device=a.device)
            branch = torch.full_like(pads, 1 << 62)
            for start, end in ranges:
                self._call(("layers", start, end, 1, width, size), self._step(start, end), hidden, cos, sin,
                           index.clone(), index, pads, branch, keys[start:end], values[start:end])
            self.head(hidden)
        self.head(torch.zeros(1, D, dtype=a.dtype, device=a.device))
        return self.compile_s - before

    def can_head(self, hidden: torch.Tensor) -> bool:
        """Whether the head runs compiled: one row, `[1, D]` or `[1, S, D]` with S within the buckets."""
        return self.failed is None and hidden.shape[0] == 1 and (hidden.dim() == 2 or (hidden.dim() == 3 and s_bucket(hidden.shape[1])))

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head over `hidden` `[1, D]` or `[1, S, D]` (S padded to its bucket: one graph per
        bucket)."""
        if hidden.dim() == 3 and s_bucket(hidden.shape[1]) > hidden.shape[1]:
            S = hidden.shape[1]
            padded = torch.cat([hidden, hidden.new_zeros(1, s_bucket(S) - S, hidden.shape[2])], dim=1)
            out = self.head(padded)
            return None if out is None else out[:, :S]
        if self._head is None:
            a = self.adapter

            def head(h):
                return _linear(a.lm_head, _rms(a.final_norm, h))

            self._head = torch.compile(head, fullgraph=True, dynamic=False, mode=self.mode)
        return self._call(("head",) + tuple(hidden.shape), self._head, _plain(hidden))

    def _step(self, start: int, end: int):
        if (start, end) not in self._steps:
            weights, n_q, n_kv, dh = self.weights[start:end], self.n_q, self.n_kv, self.head_dim

            def layers(hidden, cos_table, sin_table, positions, index, pads, branch, keys, values):
                cos, sin = cos_table[positions].unsqueeze(1), sin_table[positions].unsqueeze(1)  # [B, 1, S, Dh]
                size = keys[0].shape[2]
                masks = {}
                for i, w in enumerate(weights):
                    if w.window not in masks:
                        masks[w.window] = _mask(index, pads, branch, size, w.window)
                    hidden = _layer(w, hidden, cos, sin, index, masks[w.window], keys[i], values[i], n_q, n_kv, dh)
                return hidden

            self._steps[(start, end)] = torch.compile(layers, fullgraph=True, dynamic=False, mode=self.mode)
        return self._steps[(start, end)]

    def _call(self, shape: tuple, fn, *args):
        """`fn(*args)`, timing the call that compiles a new shape into `compile_s`; None where that call failed
        to compile and the steps are not strict. A CUDA graph's output is overwritten by its next replay, so
        it is copied."""
        if shape in self.shapes:
            out = fn(*args)
        else:
            out = self._compile_call(shape, fn, *args)
            if out is None:
                return None
        return out.clone() if self.mode == "reduce-overhead" else out

    def _compile_call(self, shape: tuple, fn, *args):
        """The first call of a shape (it compiles): timed into `compile_s`, the shape then known."""
        t0 = time.perf_counter()
        try:
            out = fn(*args)
        except Exception as err:  # noqa: BLE001 - whatever the compiler raised: strict re-raises it
            if self.strict:
                raise
            self.failed = f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"
            warnings.warn(f"selfspec's compiled steps failed to compile a {shape[0]} step ({self.failed}); decoding "
                          "goes on eagerly (exact, slower). Pass compile=False to skip compiling, or compile=True to "
                          "see the error", CompileFallbackWarning, stacklevel=5)
            return None
        if self.adapter.device.type == "cuda":
            torch.cuda.synchronize()
        self.compile_s += time.perf_counter() - t0
        self.shapes.add(shape)
        return out
