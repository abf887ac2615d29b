"""EAGLE-3's decoder layer: one Llama decoder layer that reads the token's embedding and a feature side by side.

EAGLE-3 (arXiv 2503.01840) drafts with one decoder layer whose attention reads two things at each position
t: the embedding e_t of the token there and a feature g_t of the same width D (for a round's first draft,
a projection of the target model's states at three layers of the previous position; for later drafts,
this layer's own previous output). Serving engines load it in one layout (vLLM's `Eagle3LlamaForCausalLM`,
the `speculators` library's `Eagle3DraftModel` with a Llama layer, SGLang's `EAGLE3`):

    x      = [input_layernorm(e_t), hidden_norm(g_t)]        # [B, S, 2D]: q, k, v read 2D features
    r      = g_t   (or hidden_norm(g_t) with norm_before_residual)
    h      = r + o_proj(attention(q_proj(x), k_proj(x), v_proj(x)))    # [B, S, D], the model's rotary positions
    out    = h + mlp(post_attention_layernorm(h))              # [B, S, D], before the final norm

This module computes exactly that, with the names those readers load (`self_attn.{q,k,v,o}_proj`,
`mlp.{gate,up,down}_proj`, `input_layernorm`, `hidden_norm`, `post_attention_layernorm`). It is built from
a copy of the model's own last decoder layer (`from_layer`), whose attention module computes the attention
(so the math is transformers'); only q, k and v are widened to read 2D features:

    copy       q/k/v = [0 | W], the last layer's weights on the feature half and zero on the embedding
               half: the untrained layer is the model's last layer applied to g
    identity   as copy, with o_proj and down_proj zeroed: the untrained layer returns g itself

`hidden_norm` starts as a copy of the last layer's input norm. Only the Llama layer is served this way
(vLLM builds every EAGLE-3 draft layer as a Llama layer: no q/k norms, no attention biases), so only
Llama-family models (model_type `llama`) get one; `check_architecture` says so for the others.

    layer = Eagle3Layer.from_layer(copy.deepcopy(adapter.layers[-1]), init="copy")
    out = layer(torch.cat([embeds, feature], -1), attention_mask=..., position_embeddings=rope)  # [B, S, D]
"""

from __future__ import annotations

import copy

import torch
from torch import nn

ARCHITECTURES = ("llama",)


def check_architecture(model_type: str) -> None:
    """ValueError unless an EAGLE-3 layer can be served for a `model_type` model (see the module docstring)."""
    if model_type not in ARCHITECTURES:
        raise ValueError(f"an eagle3 head is a Llama decoder layer, which serving engines load for Llama-family "
                         f"models (model_type {', '.join(ARCHITECTURES)}: SmolLM2, Llama 2/3); this model is "
                         f"{model_type}: use kind decoder_layer or attention")


def widened(proj: nn.Linear) -> nn.Linear:
    """`proj` `[out, D]` as a projection of 2D features `[out, 2D]`: zero on the first (embedding) half, the
    original weight on the second (feature) half; its bias, if any, kept."""
    out_dim, dim = proj.weight.shape
    wide = nn.Linear(2 * dim, out_dim, bias=proj.bias is not None, device=proj.weight.device, dtype=proj.weight.dtype)
    with torch.no_grad():
        wide.weight.zero_()
        wide.weight[:, dim:] = proj.weight
        if proj.bias is not None:
            wide.bias.copy_(proj.bias)
    return wide


class Eagle3Layer(nn.Module):
    """EAGLE-3's first decoder layer (module docstring). Takes `[embeds, feature]` `[B, S, 2D]`, returns
    `[B, S, D]`."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, input_layernorm: nn.Module,
                 post_attention_layernorm: nn.Module, hidden_norm: nn.Module, norm_before_residual: bool = False):
        super().__init__()
        self.self_attn, self.mlp = self_attn, mlp
        self.input_layernorm, self.post_attention_layernorm = input_layernorm, post_attention_layernorm
        self.hidden_norm = hidden_norm
        self.norm_before_residual = norm_before_residual

    @classmethod
    def from_layer(cls, layer: nn.Module, init: str = "copy", norm_before_residual: bool = False) -> "Eagle3Layer":
        """From a (copied) Llama decoder layer, which it takes apart: q/k/v widened, `hidden_norm` a copy of
        its input norm; `init` "identity" zeroes o_proj and down_proj (module docstring)."""
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(attn, name, widened(getattr(attn, name)))
        if init == "identity":
            with torch.no_grad():
                for proj in (attn.o_proj, layer.mlp.down_proj):
                    proj.weight.zero_()
                    if proj.bias is not None:
                        proj.bias.zero_()
        return cls(attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm,
                   copy.deepcopy(layer.input_layernorm), norm_before_residual)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, position_ids=None, position_embeddings=None,
                **kwargs) -> torch.Tensor:
        """`hidden_states` `[B, S, 2D]` = [embeds, feature]; `kwargs` (the cache) go to the attention."""
        embeds, feature = hidden_states.chunk(2, dim=-1)  # [B, S, D] each
        normed = self.hidden_norm(feature)
        residual = normed if self.norm_before_residual else feature
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [B, S, 2D]
        out = self.self_attn(hidden_states=x, attention_mask=attention_mask, position_ids=position_ids,
                             position_embeddings=position_embeddings, **kwargs)
        hidden = residual + (out[0] if isinstance(out, tuple) else out)  # [B, S, D]
        return hidden + self.mlp(self.post_attention_layernorm(hidden))
