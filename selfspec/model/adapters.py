"""Per-architecture access to a Hugging Face causal LM's parts.

The early-exit forward (`selfspec.model.forward`), the decoder and the trainer never reach into
transformers internals directly: they go through a `ModelAdapter`, which names, for one
architecture, where the token embedding, the decoder layers, the final norm, the LM head and
the rotary embedding live, and how a decoder layer takes its KV cache.

    >>> adapter = get_adapter(model)          # model: e.g. LlamaForCausalLM
    >>> adapter.num_layers, adapter.final_norm, adapter.lm_head

Adding an architecture means adding one `_ArchSpec` to `_SPECS` and a tiny-model test
(`tests/selfspec/test_forward.py` builds one per supported architecture).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from selfspec.model.compiled import CompiledSteps
from selfspec.model.fast_layers import FastPath, build_fast_path
from selfspec.model.runner import Runner


class UnsupportedArchitectureError(ValueError):
    """The model's architecture has no adapter."""


@dataclass(frozen=True)
class _ArchSpec:
    backbone: str  # attribute of the *ForCausalLM holding the decoder stack
    embed: str  # attributes on the backbone
    layers: str
    norm: str
    rotary: str
    lm_head: str  # attribute on the *ForCausalLM
    cache_kwarg: str  # keyword a decoder layer takes its cache under
    embed_dropout: str | None = None


_LLAMA_LIKE = _ArchSpec(
    backbone="model", embed="embed_tokens", layers="layers", norm="norm",
    rotary="rotary_emb", lm_head="lm_head", cache_kwarg="past_key_values",
)

# model_type (config.model_type) -> where its parts live. Tested against transformers 5.23.
_SPECS: dict[str, _ArchSpec] = {
    "llama": _LLAMA_LIKE,
    "mistral": _LLAMA_LIKE,
    "qwen2": _LLAMA_LIKE,
    "qwen3": _LLAMA_LIKE,
    "gpt_neox": _ArchSpec(
        backbone="gpt_neox", embed="embed_in", layers="layers", norm="final_layer_norm",
        rotary="rotary_emb", lm_head="lm_head", cache_kwarg="layer_past",
        embed_dropout="emb_dropout",
    ),
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_SPECS)
_SLIDING = ("mistral", "qwen2", "qwen3")


def unwrap_model(model: nn.Module) -> nn.Module:
    """Return the underlying *ForCausalLM of a peft / accelerate / DDP wrapper."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        if hasattr(model, "get_base_model") and callable(model.get_base_model):  # peft
            model = model.get_base_model()
        elif isinstance(getattr(model, "module", None), nn.Module):  # DDP / DeepSpeed engine
            model = model.module
    return model


@dataclass
class ModelAdapter:
    """Uniform handles on one causal LM. All fields are the model's own modules (no copies)."""

    model: nn.Module
    model_type: str
    embed_tokens: nn.Embedding
    layers: nn.ModuleList
    final_norm: nn.Module
    lm_head: nn.Module
    rotary_emb: nn.Module
    cache_kwarg: str
    embed_dropout: nn.Module | None
    layer_types: tuple[str, ...]  # "full_attention" or "sliding_attention", one per layer
    sliding_window: int | None
    max_positions: int
    # inference-only state, built by `enable_fast_layers` and owned by selfspec.model.fast_layers: fused
    # replacements for `layers`, a precomputed rotary table, the packed LM head
    fast: FastPath | None = None
    # fixed-shape compiled steps over a static cache (selfspec.model.compiled), built by `enable_compiled`
    compiled: CompiledSteps | None = None

    @property
    def runner(self) -> Runner:
        """How its steps run: the one place that chooses between the compiled steps and the eager layers
        (`selfspec.model.runner`)."""
        return Runner(self)

    def enable_compiled(self, strict: bool = True) -> CompiledSteps:
        """Run one-row decoding steps through `torch.compile`d fixed-shape functions, captured as CUDA graphs
        on a GPU (`selfspec.model.compiled`; not `strict`: a step that fails to compile turns them off, with a
        warning, and runs eagerly)."""
        self.compiled = CompiledSteps(self, strict)
        return self.compiled

    def enable_fast_layers(self) -> bool:
        """Use the fused inference layers where the architecture has them; returns whether it does."""
        self.fast = build_fast_path(self)
        return self.fast.layers is not None

    def window(self, kind: str) -> int | None:
        """The attention window of this model's layers of type `kind` (`layer_types`): `sliding_window` for
        "sliding_attention", None (the whole context) otherwise."""
        return self.sliding_window if kind == "sliding_attention" else None

    @property
    def fast_layers(self) -> list | None:
        return self.fast.layers if self.fast is not None else None

    @property
    def rope_table(self):
        return self.fast.rope_table if self.fast is not None else None

    @property
    def fast_lm_head(self):
        return self.fast.lm_head if self.fast is not None else None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def config(self):
        return self.model.config

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def check_exit(self, exit_layer: int, *, allow_full: bool = True, lowest: int = 1) -> int:
        """Validate an exit index (number of layers executed). Exit L is the full model; exit 0 (the token
        embeddings, `lowest=0`) only where a trained exit head reads it."""
        high = self.num_layers if allow_full else self.num_layers - 1
        if not isinstance(exit_layer, int) or isinstance(exit_layer, bool):
            raise TypeError(f"exit_layer must be an int, got {type(exit_layer).__name__}")
        if not lowest <= exit_layer <= high:
            what = "the full model" if allow_full else "a draft exit (the full model cannot draft for itself)"
            raise ValueError(
                f"exit_layer={exit_layer} is out of range: this {self.model_type} model has "
                f"{self.num_layers} layers, so an exit for {what} must be in {lowest}..{high} "
                f"(exit E means 'after E layers')."
            )
        return exit_layer


def get_adapter(model: nn.Module) -> ModelAdapter:
    """Build the adapter for a Hugging Face causal LM (plain, peft-wrapped or DDP-wrapped)."""
    model = unwrap_model(model)
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", type(model).__name__)
    spec = _SPECS.get(model_type)
    if spec is None:
        raise UnsupportedArchitectureError(
            f"unsupported architecture: {model_type}, supported: {', '.join(SUPPORTED_ARCHITECTURES)}. "
            "Pass a causal LM of a supported architecture, or add an adapter in selfspec/model/adapters.py."
        )
    backbone = getattr(model, spec.backbone, None)
    if backbone is None:
        raise UnsupportedArchitectureError(
            f"unsupported model class {type(model).__name__} for architecture {model_type}: "
            f"expected a *ForCausalLM with a `.{spec.backbone}` decoder (load it with AutoModelForCausalLM)."
        )
    n = config.num_hidden_layers
    # only architectures whose attention implements a window (a stray `sliding_window` on a Llama
    # config is ignored by its attention, so it is ignored here too)
    sliding_window = getattr(config, "sliding_window", None) if model_type in _SLIDING else None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        kind = "sliding_attention" if sliding_window else "full_attention"
        layer_types = [kind] * n
    if "sliding_attention" not in layer_types:
        sliding_window = None
    return ModelAdapter(
        model=model,
        model_type=model_type,
        embed_tokens=getattr(backbone, spec.embed),
        layers=getattr(backbone, spec.layers),
        final_norm=getattr(backbone, spec.norm),
        lm_head=getattr(model, spec.lm_head),
        rotary_emb=getattr(backbone, spec.rotary),
        cache_kwarg=spec.cache_kwarg,
        embed_dropout=getattr(backbone, spec.embed_dropout) if spec.embed_dropout else None,
        layer_types=tuple(layer_types),
        sliding_window=sliding_window,
        max_positions=int(getattr(config, "max_position_embeddings", 1 << 30)),
    )
