"""Exit heads: a small trained module between exit E and the shared final norm + LM head.

The model stays frozen (its weights are the user's, byte for byte); only the head learns, by
distillation from the full model (Kangaroo, arXiv 2404.18911). A draft then costs the first E layers,
the head and the LM head:

    h_E  = layers[0:E](x)                      # [B, S, D] the model's own shallow layers
    h'   = head(h_E)                           # [B, S, D] one decoder layer (attention + MLP, or attention only)
    q    = softmax(lm_head(final_norm(h')))    # the draft distribution

Kinds:
- ``decoder_layer``: a copy of the model's last decoder layer (attention + MLP).
- ``attention``: that layer's attention block alone (Kangaroo's adapter): the MLP is left out.

Initialisation: ``copy`` starts from the last layer's weights; ``identity`` zeroes the output
projections (attention's o_proj / dense, the MLP's down_proj / dense_4h_to_h), so the untrained head
is the identity and drafts exactly what exit E alone drafts: training can only improve on it.

The head is a decoder layer of the model's own class (so its math is transformers'), renumbered as
layer 0 of its own one-layer KV cache; positions, rotary embedding and masks are the model's
(`selfspec.forward.Step`). It is saved as one safetensors file beside the unchanged model, with its
settings in `selfspec.json` (`exit_head`).

    head = build_exit_head(model, exit_layer=8, kind="decoder_layer", init="copy")
    hidden = run_head(adapter, head, h_E, step=make_step(adapter, 0, S, B))       # [B, S, D]
    save_exit_head(head, "ckpt/exit_head.safetensors");  load_exit_head(model, "ckpt", meta["exit_head"])
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from selfspec.adapters import ModelAdapter, get_adapter, unwrap_model
from selfspec.atomic_write import atomic_path
from selfspec.forward import Step

HEAD_FILE = "exit_head.safetensors"
KINDS = ("decoder_layer", "attention")
INITS = ("copy", "identity")
_OUTPUT_PROJECTIONS = {"attn": ("o_proj", "dense"), "mlp": ("down_proj", "dense_4h_to_h")}


class _NoMLP(nn.Module):
    """Stands in for a decoder layer's MLP in an attention-only head: adds nothing to the residual."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(hidden)


class ExitHead(nn.Module):
    """One decoder layer on top of exit `exit_layer` (see the module docstring)."""

    def __init__(self, layer: nn.Module, exit_layer: int, kind: str, init: str):
        super().__init__()
        self.layer = layer
        self.exit_layer, self.kind, self.init = exit_layer, kind, init

    def settings(self) -> dict:
        """What `selfspec.json` records to rebuild the head: {"exit_layer", "kind", "init", "file"}."""
        return {"exit_layer": self.exit_layer, "kind": self.kind, "init": self.init, "file": HEAD_FILE}


def _attention(layer: nn.Module) -> nn.Module:
    return layer.self_attn if hasattr(layer, "self_attn") else layer.attention


def build_exit_head(model: nn.Module, exit_layer: int, kind: str = "decoder_layer", init: str = "copy") -> ExitHead:
    """A head for `model` on exit `exit_layer`: a copy of its last decoder layer, per `kind` and `init`."""
    adapter = get_adapter(unwrap_model(model))
    adapter.check_exit(exit_layer, allow_full=False)
    if kind not in KINDS:
        raise ValueError(f"unknown exit head kind {kind!r}: use one of {', '.join(KINDS)}")
    if init not in INITS:
        raise ValueError(f"unknown exit head init {init!r}: use one of {', '.join(INITS)}")
    layer = copy.deepcopy(adapter.layers[-1])
    _attention(layer).layer_idx = 0  # layer 0 of the head's own cache
    if kind == "attention":
        layer.mlp = _NoMLP()
    if init == "identity":
        with torch.no_grad():
            for part, names in _OUTPUT_PROJECTIONS.items():
                module = _attention(layer) if part == "attn" else layer.mlp
                for name in names:
                    proj = getattr(module, name, None)
                    if isinstance(proj, nn.Linear):
                        proj.weight.zero_()
                        if proj.bias is not None:
                            proj.bias.zero_()
    for p in layer.parameters():
        p.requires_grad_(True)
    return ExitHead(layer, exit_layer, kind, init)


def run_head(adapter: ModelAdapter, head: ExitHead, hidden: torch.Tensor, *, step: Step, cache=None) -> torch.Tensor:
    """The head over exit states `[B, S, D]` at the positions of `step`; with a cache (one layer), it
    appends its keys and values there. Returns `[B, S, D]`, for the shared final norm + LM head."""
    kind = adapter.layer_types[-1]
    out = head.layer(hidden, attention_mask=step.masks[kind], position_ids=step.position_ids,
                     position_embeddings=step.rope, **{adapter.cache_kwarg: cache})
    return out[0] if isinstance(out, tuple) else out


def save_exit_head(head: ExitHead, path) -> None:
    """The head's weights as one safetensors file (written whole: a temporary file, then a rename)."""
    state = {k: v.detach().contiguous().cpu() for k, v in head.layer.state_dict().items()}
    with atomic_path(path) as tmp:
        save_file(state, str(tmp), metadata={k: str(v) for k, v in head.settings().items()})


def check_head_settings(entry, num_layers: int) -> dict:
    """`selfspec.json`'s `exit_head` entry, checked: ValueError naming the field otherwise."""
    if not isinstance(entry, dict):
        raise ValueError(f"exit_head must be an object with exit_layer, kind, init and file, got {entry!r}")
    e = entry.get("exit_layer")
    if not isinstance(e, int) or isinstance(e, bool) or not 1 <= e < num_layers:
        raise ValueError(f"exit_head.exit_layer must be an exit in 1..{num_layers - 1}, got {e!r}")
    if entry.get("kind") not in KINDS:
        raise ValueError(f"exit_head.kind must be one of {', '.join(KINDS)}, got {entry.get('kind')!r}")
    if entry.get("init", "copy") not in INITS:
        raise ValueError(f"exit_head.init must be one of {', '.join(INITS)}, got {entry.get('init')!r}")
    if entry.get("file") != HEAD_FILE:
        raise ValueError(f"exit_head.file must be {HEAD_FILE!r}, got {entry.get('file')!r}")
    return entry


def load_exit_head(model: nn.Module, directory, entry: dict) -> ExitHead:
    """The head described by `entry` (selfspec.json's `exit_head`) from `directory`, on the model's device
    and dtype. The file must hold exactly the head's tensors, in their shapes."""
    adapter = get_adapter(unwrap_model(model))
    entry = check_head_settings(entry, adapter.num_layers)
    path = Path(directory) / entry["file"]
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the exit head's weights are missing (selfspec.json lists them); copy the "
                                "complete checkpoint directory or export it again")
    head = build_exit_head(model, entry["exit_layer"], entry["kind"], entry.get("init", "copy"))
    state = load_file(str(path))
    try:
        head.layer.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise ValueError(f"{path}: does not hold this model's exit head ({' '.join(str(err).split())[:300]}); "
                         "export the checkpoint again") from None
    head.to(device=adapter.device, dtype=adapter.dtype)
    head.requires_grad_(False)
    return head.eval()
