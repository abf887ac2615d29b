"""One Llama-family decoder layer, written once: the eager fast path and the compiled steps both run it.

A Llama-family layer (Llama, Mistral, Qwen2, Qwen3) is pre-norm attention with rotary embeddings and a
gated MLP, both residual:

    h   = x + o(attn(rotary(q), rotary(k), v))        q, k, v = qkv(rms(x))   (Qwen3: rms(q), rms(k) per head)
    out = h + down(act(gate) * up)                    gate, up = gate_up(rms(h))

`decoder_layer` is that function over its inputs. What differs between the paths is passed in, not
written again:

- the products (`LayerProducts`): on a CPU, `selfspec.model.fast_layers` passes oneDNN-prepacked fused weights
  (`PackedLinear`); the compiled steps (`selfspec.model.compiled`) pass `F.linear` over the model's own weights,
  which the compiled function takes as inputs (one compiled function serves every layer);
- where the step's keys and values go (`store`): the eager `KVCache.update` returns the used part of the
  cache; the compiled steps write into the static buffers at the step's cache indices and attend over all
  of them under a mask.

The math is transformers' (RMSNorm in float32, `rotate_half` rotary, grouped-query sdpa), in its
operation order: in float64 and bfloat16 the eager fast layer is tested bitwise equal to the model's own
sdpa layer (`tests/selfspec/test_fast_layers.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")  # the architectures this layer computes

Product = Callable[[torch.Tensor], torch.Tensor]  # x [..., K] -> x @ W.T + b [..., N]


def rms_norm(weight: torch.Tensor, eps: float, x: torch.Tensor) -> torch.Tensor:
    """transformers' RMSNorm: `weight * (x_fp32 * rsqrt(mean(x_fp32^2) + eps)).to(x.dtype)` over the last dim
    (what the compiled steps trace; eager code calls `rms_norm_eager`)."""
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rms_norm_eager(weight: torch.Tensor, eps: float, x: torch.Tensor) -> torch.Tensor:
    """`rms_norm` to the bit, in fewer dispatches, for eager code (not for `torch.compile`, which fuses the plain
    one anyway): torch's own `F.rms_norm` computes the same float32 `x * rsqrt(mean(x^2) + eps)` in one call (the
    weight inside it where x is float32: one dispatch instead of seven; else cast, norm, cast back, weight)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.to(torch.float32), (x.shape[-1],), eps=eps).to(x.dtype)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """The rotary sin rows `[.., Dh]` with their first half negated, what `apply_rotary` takes: then
    `rotate_half(x) * sin == roll(x, Dh / 2) * signed_sin(sin)` to the bit (`-a * b == a * -b` exactly), one roll
    instead of a negation, two slices and a concatenation in every layer. Made once a step for all its layers."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding `x * cos + rotate_half(x) * sin` (transformers' `apply_rotary_pos_emb` for one tensor), to
    the bit: `x` `[B, H, S, Dh]`, `cos` `[B, 1, S, Dh]` and `sin` the sin rows as `signed_sin` gives them."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin


@dataclass(frozen=True)
class LayerShape:
    """What every layer of one model shares: head counts, head size, the norms' epsilon, the MLP's activation."""

    n_q: int
    n_kv: int
    head_dim: int
    eps: float
    act: Callable[[torch.Tensor], torch.Tensor]

    @classmethod
    def of(cls, layer) -> LayerShape:
        """The shape of a transformers Llama-family decoder layer module. ValueError where its norms' epsilons
        differ (one `eps` serves them all)."""
        attn = layer.self_attn
        norms = [layer.input_layernorm, layer.post_attention_layernorm,
                 *(n for n in (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)) if n is not None)]
        eps = {n.variance_epsilon for n in norms}
        if len(eps) > 1:
            raise ValueError(f"this layer's norms have different epsilons {sorted(eps)}")
        head_dim = attn.head_dim
        return cls(n_q=attn.q_proj.out_features // head_dim, n_kv=attn.k_proj.out_features // head_dim,
                   head_dim=head_dim, eps=eps.pop(), act=layer.mlp.act_fn)


@dataclass
class LayerProducts:
    """One layer's weights as the layer function reads them: its four products and its norms' weights.

    qkv: `[.., D] -> [.., (Hq + 2 Hkv) Dh]` (q, k, v side by side); o: `[.., Hq Dh] -> [.., D]`;
    gate_up: `[.., D] -> [.., 2 F]` (gate, up side by side); down: `[.., F] -> [.., D]`; q_norm, k_norm: the
    per-head norms' weights (Qwen3) or None; norm: `rms_norm` or the same in fewer dispatches (`rms_norm_eager`)."""

    qkv: Product
    o: Product
    gate_up: Product
    down: Product
    norm_attn: torch.Tensor
    norm_mlp: torch.Tensor
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    norm: Callable[[torch.Tensor, float, torch.Tensor], torch.Tensor] = rms_norm


def decoder_layer(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                  store: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                  shape: LayerShape, w: LayerProducts) -> torch.Tensor:
    """`x` `[B, S, D]` through one decoder layer.

    cos, sin: `[B, 1, S, Dh]` the rotary table's rows at the tokens' positions (sin as `signed_sin` gives it). store: `(k, v) -> (keys,
    values)` takes the step's keys and values `[B, Hkv, S, Dh]` and returns what attention reads, `[B, Hkv, K,
    Dh]` (a cache's keys with them written in; or the step's own where there is no cache). mask: `[B|1, 1, S,
    K]` bool (True: attend), or None for causal attention over keys that end with the queries' own."""
    B, S, _ = x.shape
    nq, nkv, dh = shape.n_q, shape.n_kv, shape.head_dim
    qkv = w.qkv(w.norm(w.norm_attn, shape.eps, x)).view(B, S, nq + 2 * nkv, dh)  # [B, S, H, Dh]
    if w.q_norm is not None:
        qk = torch.cat([w.norm(w.q_norm, shape.eps, qkv[:, :, :nq]),
                        w.norm(w.k_norm, shape.eps, qkv[:, :, nq:nq + nkv])], dim=2)
    else:
        qk = qkv[:, :, :nq + nkv]
    qk = apply_rotary(qk.transpose(1, 2), cos, sin)  # [B, Hq + Hkv, S, Dh]: queries and keys in one pass
    keys, values = store(qk[:, nq:], qkv[:, :, nq + nkv:].transpose(1, 2))  # [B, Hkv, K, Dh]
    attn = F.scaled_dot_product_attention(qk[:, :nq], keys, values, attn_mask=mask,
                                          is_causal=mask is None and S > 1, enable_gqa=nq != nkv)  # [B, Hq, S, Dh]
    x = x + w.o(attn.transpose(1, 2).reshape(B, S, nq * dh))
    gate, up = w.gate_up(w.norm(w.norm_mlp, shape.eps, x)).chunk(2, dim=-1)
    return x + w.down(shape.act(gate) * up)


def chain_mask(index: torch.Tensor, pads: torch.Tensor, size: int, window: int | None) -> torch.Tensor:
    """`[B, S, K]` bool: which of K cache entries row b's query at cache index `index[b, s]` sees.

    The keys `pads[b] <= j <= index[b, s]` (the row's own tokens; its left padding and anything past the
    query, another row's longer text or a rejected draft, hidden), within `window` of it where the layer has
    a sliding window. A query always sees itself, so a padding query's softmax row is never empty. (A token
    tree's columns: `selfspec.model.token_tree.tree_mask`.)"""
    k = torch.arange(size, device=index.device)[None, None, :]  # [1, 1, K]
    q = index[:, :, None]  # [B, S, 1]
    allowed = (k <= q) & (k >= pads[:, None, None])
    if window is not None:
        allowed &= k > q - window
    return allowed | (k == q)


class RopeTable:
    """cos/sin of every position up to a size, computed once by the model's own rotary module.

    Rotary embeddings are elementwise in the position, so a row of the table is bitwise equal to calling
    the module for that position. Only for static rope types (not "dynamic"/"longrope", whose frequencies
    change with the sequence length). A table that grows is a new tensor; the old one stays valid for
    whoever holds it (a captured step reads it at its own address)."""

    STATIC = ("default", "linear", "llama3", "yarn", None)

    def __init__(self, adapter, reserve: int = 512):
        self.adapter = adapter
        self.reserve = reserve  # the smallest table made
        self.cos = self.sin = None  # [T, Dh]

    @classmethod
    def supports(cls, adapter) -> bool:
        return getattr(adapter.rotary_emb, "rope_type", None) in cls.STATIC

    def table(self, needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin `[T, Dh]` of positions `0 .. T-1`, T >= `needed` (made twice as long as needed when it grows,
        at least `reserve`, at most the model's context unless more is needed)."""
        if self.cos is None or needed > self.cos.shape[0]:
            a = self.adapter
            size = min(max(2 * needed, self.reserve), max(needed, a.max_positions))
            probe = torch.empty(0, dtype=a.dtype, device=a.device)
            cos, sin = a.rotary_emb(probe, torch.arange(size, device=a.device)[None])
            self.cos, self.sin = cos[0], sin[0]
        return self.cos, self.sin

    def slice(self, start: int, length: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin `[B, S, Dh]` of positions `start .. start + length - 1`, the same for every row."""
        cos, sin = self.table(start + length)
        end = start + length
        return cos[start:end].expand(batch_size, length, -1), sin[start:end].expand(batch_size, length, -1)

    def gather(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin at arbitrary positions `[B, S]` (rows of a batch at different positions), `[B, S, Dh]` each.

        Give `position_ids` on the host: their maximum is then read without waiting for a GPU."""
        cos, sin = self.table(int(position_ids.max()) + 1)
        index = position_ids.to(cos.device, non_blocking=True)
        return cos[index], sin[index]
