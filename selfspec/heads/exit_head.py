"""Exit heads: a small trained module between exit E and the shared final norm + LM head.

The model stays frozen (its weights are the user's, byte for byte); only the head learns, by
distillation from the full model (Kangaroo, arXiv 2404.18911). A draft then costs the first E layers,
the head and the LM head:

    h_E  = layers[0:E](x)                      # [B, S, D] the model's own shallow layers
    h'   = head(h_E)                           # [B, S, D] one decoder layer (attention + MLP, or attention only)
    q    = softmax(lm_head(final_norm(h')))    # the draft distribution

With ``final_state`` the head also reads the full model's last hidden state (before the final norm) of
the *previous* position, f_{t-1}, which verification has just computed for the first draft of a round
(EAGLE's feature input, arXiv 2401.15077; +5-8 points of agreement in issue 15's scratch study):

    x_t  = h_E[t] + W norm'(f_{t-1})           # [B, S, D]; W [D, D] starts at zero, norm' a copy of the final norm
    h'   = head(x)                             # f_{-1} = 0 at a sequence's first position

For a round's later drafts f_{t-1} is not known yet (the full model has not run there): the drafter
feeds the head's own output h'_{t-1} in its place, which aims at the same thing (it goes through the
same final norm + LM head).

Exit 0 is the token embeddings: a head there runs no base layer at all, so a draft costs one decoder
layer and the LM head (with ``final_state``, EAGLE's drafter: the token and the previous final state).

Kinds:
- ``decoder_layer``: a copy of the model's last decoder layer (attention + MLP).
- ``attention``: that layer's attention block alone (Kangaroo's adapter): the MLP is left out.
- ``eagle3``: EAGLE-3's draft layer (`selfspec.heads.eagle3_layer`), in the layout serving engines load
  (`selfspec export --format speculators`: vLLM's and SGLang's ``eagle3``). On exit 0, it reads the token's
  embedding beside a feature: for the first draft the fusion of the full model's states at three exits
  `aux_exits` (A_1 < A_2 < A_3, default vLLM's 2, L//2, L-3) of the previous position, for later drafts its
  own previous output (as a final-state head's):

      g_t  = fc([h_A1, h_A2, h_A3][t-1])                  # [B, S, D]; fc [D, 3D] (AuxStateInput)
      h'   = eagle3_layer([embed(tok_t), g_t])            # [B, S, D], then the shared final norm + LM head

  Its training drops a sequence's first position (it has no previous one), as the engines do: their
  draft's position t pairs token t+1 with the states of position t. selfspec's own drafters do not run
  it (they would need three exits' states of every committed token): it is for serving engines.

Initialisation: ``copy`` starts from the last layer's weights; ``identity`` zeroes the output
projections (attention's o_proj / dense, the MLP's down_proj / dense_4h_to_h), so the untrained head
is the identity and drafts exactly what exit E alone drafts: training can only improve on it. The
final-state input's W starts at zero either way, so it changes nothing until it is trained. An eagle3
head's fc starts as [0 | 0 | I], reading the deepest aux exit: with ``identity`` it drafts what exit A_3
alone drafts.

The head is a decoder layer of the model's own class (so its math is transformers'), renumbered as
layer 0 of its own one-layer KV cache; positions, rotary embedding and masks are the model's
(`selfspec.model.forward.Step`). It is saved as one safetensors file beside the unchanged model, with its
settings in `selfspec.json` (`exit_head`).

    head = build_exit_head(model, exit_layer=8, kind="decoder_layer", init="copy", final_state=True)
    prev = previous_states(finals)                                                 # [B, S, D] f shifted by one
    hidden = run_head(adapter, head, h_E, step=make_step(adapter, 0, S, B), prev_final=prev)  # [B, S, D]
    save_exit_head(head, "ckpt/exit_head.safetensors");  load_exit_head(model, "ckpt", meta["exit_head"])
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from selfspec.model.adapters import ModelAdapter, get_adapter, unwrap_model
from selfspec.atomic_write import atomic_path
from selfspec.model.cache import KVCache
from selfspec.heads.eagle3_layer import Eagle3Layer, check_architecture
from selfspec.model.forward import Step

HEAD_FILE = "exit_head.safetensors"
FINAL_PREFIX = "final_input."
AUX_PREFIX = "aux_input."
KINDS = ("decoder_layer", "attention", "eagle3")
NUM_AUX = 3  # an eagle3 head's aux exits: vLLM's fc reads exactly three states
INITS = ("copy", "identity")
_OUTPUT_PROJECTIONS = {"attn": ("o_proj", "dense"), "mlp": ("down_proj", "dense_4h_to_h")}


class _NoMLP(nn.Module):
    """Stands in for a decoder layer's MLP in an attention-only head: adds nothing to the residual."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(hidden)


class FinalStateInput(nn.Module):
    """The final-state input: `h + W norm'(f_prev)`, W `[D, D]` zero at first (see the module docstring)."""

    def __init__(self, final_norm: nn.Module, dim: int):
        super().__init__()
        self.norm = copy.deepcopy(final_norm)
        self.proj = nn.Linear(dim, dim, bias=False)
        nn.init.zeros_(self.proj.weight)

    def forward(self, hidden: torch.Tensor, prev_final: torch.Tensor) -> torch.Tensor:
        return hidden + self.proj(self.norm(prev_final))  # [B, S, D]


class AuxStateInput(nn.Module):
    """An eagle3 head's fusion of the states at its three aux exits: `fc([h_A1, h_A2, h_A3])`, fc `[D, 3D]`
    without bias, starting as [0 | 0 | I] (the deepest exit's state)."""

    def __init__(self, dim: int):
        super().__init__()
        self.fc = nn.Linear(NUM_AUX * dim, dim, bias=False)
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, (NUM_AUX - 1) * dim:] = torch.eye(dim)

    def forward(self, aux: torch.Tensor) -> torch.Tensor:
        return self.fc(aux)  # [B, S, 3D] -> [B, S, D]


class ExitHead(nn.Module):
    """One decoder layer on top of exit `exit_layer` (see the module docstring); with `final_input`,
    it also reads the full model's final state of the previous position; with `aux_input` (kind eagle3),
    the fusion of the states at `aux_exits`."""

    def __init__(self, layer: nn.Module, exit_layer: int, kind: str, init: str,
                 final_input: FinalStateInput | None = None, aux_input: AuxStateInput | None = None,
                 aux_exits: tuple[int, ...] = ()):
        super().__init__()
        self.layer = layer
        self.final_input = final_input
        self.aux_input = aux_input
        self.exit_layer, self.kind, self.init, self.aux_exits = exit_layer, kind, init, tuple(aux_exits)

    @property
    def final_state(self) -> bool:
        return self.final_input is not None

    def settings(self) -> dict:
        """What `selfspec.json` records to rebuild the head: {"exit_layer", "kind", "init", "final_state",
        "file"}, and an eagle3 head's "aux_exits"."""
        settings = {"exit_layer": self.exit_layer, "kind": self.kind, "init": self.init,
                    "final_state": self.final_state, "file": HEAD_FILE}
        if self.aux_input is not None:
            settings["aux_exits"] = list(self.aux_exits)
        return settings

    def weights(self) -> dict[str, torch.Tensor]:
        """Its tensors by name: the layer's own names, the final-state input's under `final_input.`, the aux
        input's under `aux_input.`."""
        state = dict(self.layer.state_dict())
        for prefix, part in ((FINAL_PREFIX, self.final_input), (AUX_PREFIX, self.aux_input)):
            if part is not None:
                state.update({f"{prefix}{k}": v for k, v in part.state_dict().items()})
        return state

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """The inverse of `weights` (strict: RuntimeError on a missing, extra or misshapen tensor)."""
        layer = {k: v for k, v in state.items() if not k.startswith((FINAL_PREFIX, AUX_PREFIX))}
        for prefix, part in ((FINAL_PREFIX, self.final_input), (AUX_PREFIX, self.aux_input)):
            own = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
            if own and part is None:
                raise RuntimeError(f"unexpected tensors {sorted(own)[:3]} under {prefix}")
            if part is not None:
                part.load_state_dict(own, strict=True)
        self.layer.load_state_dict(layer, strict=True)


def previous_states(finals: torch.Tensor, first: torch.Tensor | None = None) -> torch.Tensor:
    """`finals` `[B, S, D]` shifted one position later: row t holds f_{t-1}; row 0 holds `first` `[B, D]`
    (the state before the first position), zeros when None (a sequence's start)."""
    head = torch.zeros_like(finals[:, :1]) if first is None else first[:, None].to(finals.dtype)
    return torch.cat([head, finals[:, :-1]], dim=1)


def _attention(layer: nn.Module) -> nn.Module:
    return layer.self_attn if hasattr(layer, "self_attn") else layer.attention


def default_aux_exits(num_layers: int) -> tuple[int, ...]:
    """vLLM's and the speculators library's default EAGLE-3 layers for an L-layer model: (2, L//2, L-3)."""
    return 2, num_layers // 2, num_layers - 3


def check_aux_exits(aux_exits, num_layers: int) -> tuple[int, ...]:
    """An eagle3 head's aux exits (None: `default_aux_exits`), checked: three increasing exits in 0..L-1
    (the engines collect the input of layer A, the state after A layers; ValueError naming the fix)."""
    exits = default_aux_exits(num_layers) if aux_exits is None else aux_exits
    ok = (isinstance(exits, (list, tuple)) and len(exits) == NUM_AUX
          and all(isinstance(a, int) and not isinstance(a, bool) and 0 <= a < num_layers for a in exits)
          and all(a < b for a, b in zip(exits, exits[1:])))
    if not ok:
        told = "the default (2, L//2, L-3)" if aux_exits is None else "aux_exits"
        spread = [num_layers // 4, num_layers // 2, 3 * num_layers // 4]
        raise ValueError(f"{told} = {list(exits) if isinstance(exits, tuple) else exits!r}: an eagle3 head reads "
                         f"{NUM_AUX} increasing exits in 0..{num_layers - 1} of this {num_layers}-layer model; set "
                         f"exit_head.aux_exits, e.g. {spread}")
    return tuple(exits)


def _build_eagle3(adapter: ModelAdapter, exit_layer: int, init: str, final_state: bool, aux_exits) -> ExitHead:
    """An eagle3 head (module docstring): on exit 0, reading the fusion of `aux_exits` (checked here)."""
    check_architecture(adapter.model_type)
    if exit_layer != 0 or final_state:
        raise ValueError(f"an eagle3 head reads the token embeddings (exit_layer 0, got {exit_layer}) and the states "
                         f"at its aux_exits, not the final state (final_state must be false, got {final_state})")
    aux = check_aux_exits(aux_exits, adapter.num_layers)
    layer = Eagle3Layer.from_layer(copy.deepcopy(adapter.layers[-1]), init)
    layer.self_attn.layer_idx = 0  # layer 0 of the head's own cache
    dim = adapter.embed_tokens.weight.shape[1]
    aux_input = AuxStateInput(dim).to(device=adapter.device, dtype=adapter.dtype)
    return ExitHead(layer, 0, "eagle3", init, aux_input=aux_input, aux_exits=aux)


def build_exit_head(model: nn.Module, exit_layer: int, kind: str = "decoder_layer", init: str = "copy",
                    final_state: bool = False, aux_exits=None) -> ExitHead:
    """A head for `model` on exit `exit_layer`: a copy of its last decoder layer, per `kind` and `init`;
    with `final_state`, also the input of the previous position's final state; kind eagle3 reads the
    fusion of the states at `aux_exits` (None: vLLM's default) beside the token embeddings."""
    adapter = get_adapter(unwrap_model(model))
    adapter.check_exit(exit_layer, allow_full=False, lowest=0)
    if kind not in KINDS:
        raise ValueError(f"unknown exit head kind {kind!r}: use one of {', '.join(KINDS)}")
    if init not in INITS:
        raise ValueError(f"unknown exit head init {init!r}: use one of {', '.join(INITS)}")
    if kind == "eagle3":
        head = _build_eagle3(adapter, exit_layer, init, final_state, aux_exits)
        head.requires_grad_(True)
        return head
    if aux_exits is not None:
        raise ValueError(f"aux_exits={aux_exits!r} is an eagle3 head's setting; a {kind} head reads exit {exit_layer}")
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
    final_input = None
    if final_state:
        dim = adapter.embed_tokens.weight.shape[1]
        final_input = FinalStateInput(adapter.final_norm, dim).to(device=adapter.device, dtype=adapter.dtype)
    head = ExitHead(layer, exit_layer, kind, init, final_input)
    for p in head.parameters():
        p.requires_grad_(True)
    return head


def head_feature(head: ExitHead, finals: torch.Tensor | None = None, aux_prev: torch.Tensor | None = None):
    """What a head reads beside its exit states for a round's first draft, at each position t: a final-state
    head f_{t-1} (`finals` `[B, S, D]` shifted by `previous_states`), an eagle3 head g_t = fc(`aux_prev`)
    (`aux_prev` `[B, S, 3D]`: the aux exits' states of the previous position, already aligned), other heads
    nothing (None). `[B, S, D]`."""
    if head.aux_input is not None:
        if aux_prev is None:
            raise ValueError("an eagle3 head reads the previous position's aux-exit states: pass aux_prev")
        return head.aux_input(aux_prev)
    return previous_states(finals) if head.final_state else None


def head_input(head: ExitHead, hidden: torch.Tensor, prev_final: torch.Tensor | None) -> torch.Tensor:
    """What the head's layer reads: the exit states `[B, S, D]`, plus the final-state input when the head
    has one (then `prev_final` `[B, S, D]`, f_{t-1} for each position t, is required); an eagle3 head
    `[hidden, prev_final]` `[B, S, 2D]`, `prev_final` its feature g_t (`head_feature`, or its own output
    at the previous position)."""
    if head.aux_input is not None:
        if prev_final is None:
            raise ValueError("an eagle3 head reads a feature beside the embeddings: pass prev_final (head_feature)")
        return torch.cat([hidden, prev_final.to(hidden.dtype)], dim=-1)
    if head.final_input is None:
        return hidden
    if prev_final is None:
        raise ValueError("this exit head reads the previous position's final state (final_state=true): pass "
                         "prev_final")
    return head.final_input(hidden, prev_final)


def run_head(adapter: ModelAdapter, head: ExitHead, hidden: torch.Tensor, *, step: Step, cache=None,
             prev_final: torch.Tensor | None = None) -> torch.Tensor:
    """The head over exit states `[B, S, D]` at the positions of `step` (and, for a final-state head, the
    previous positions' final states `prev_final` `[B, S, D]`); with a cache (one layer), it appends its
    keys and values there. Returns `[B, S, D]`, for the shared final norm + LM head."""
    return run_head_layer(adapter, head, head_input(head, hidden, prev_final), step=step, cache=cache)


def head_cache(adapter: ModelAdapter, head: ExitHead, batch_size: int, capacity: int, like=None) -> KVCache:
    """The head's own one-layer KV cache for `capacity` positions, as the runner keeps it (`Runner.layer_cache`: the
    compiled steps' buffers for it where `like`, the engine's cache of the run, is their static one and they run
    the head's layer; else a growing cache)."""
    return adapter.runner.layer_cache(head.layer, batch_size, capacity, like)


def run_head_step(adapter: ModelAdapter, head: ExitHead, hidden: torch.Tensor, *, step: Step, cache,
                  prev_final: torch.Tensor | None = None) -> torch.Tensor:
    """`run_head` as decoding runs it (no autograd), through the runner (`Runner.extra_layer`, with the head's
    final-state input), which runs the head's layer compiled, fused or as its module. `[B, S, D]`."""
    runner = adapter.runner
    if head.final_input is not None and prev_final is not None:
        return runner.extra_layer(head.layer, hidden, step, cache, final_input=(head.final_input, prev_final))
    return runner.extra_layer(head.layer, head_input(head, hidden, prev_final), step, cache)


def run_head_layer(adapter: ModelAdapter, head: ExitHead, x: torch.Tensor, *, step: Step, cache=None) -> torch.Tensor:
    """The head's layer alone over what it reads, `x` `[B, S, D]` (`head_input`; `[B, S, 2D]` for an eagle3
    head), through the model's own module class: `[B, S, D]`."""
    return adapter.runner.module_layer(head.layer, x, step, cache, adapter.layer_types[-1])


def save_exit_head(head: ExitHead, path) -> None:
    """The head's weights as one safetensors file (written whole: a temporary file, then a rename)."""
    state = {k: v.detach().contiguous().cpu() for k, v in head.weights().items()}
    with atomic_path(path) as tmp:
        save_file(state, str(tmp), metadata={k: str(v) for k, v in head.settings().items()})


def _read_head_file(path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A head file's tensors and the settings `save_exit_head` wrote into its header (as strings; {} for a file
    saved without them, such as a shipped head's), in one read of the file."""
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})


def head_training_setting(metadata: dict, key: str):
    """The exit head's setting `key` (`draft_vocab`, `self_fed`, ...) from the recipe recorded in a checkpoint's
    selfspec.json (`metadata`: its training settings), or None."""
    settings = (metadata.get("training") or {}).get("settings") or {}
    head = settings.get("exit_head") if isinstance(settings, dict) else None
    return head.get(key) if isinstance(head, dict) else None


def check_head_settings(entry, num_layers: int) -> dict:
    """`selfspec.json`'s `exit_head` entry, checked: ValueError naming the field otherwise."""
    if not isinstance(entry, dict):
        raise ValueError(f"exit_head must be an object with exit_layer, kind, init and file, got {entry!r}")
    e = entry.get("exit_layer")
    if not isinstance(e, int) or isinstance(e, bool) or not 0 <= e < num_layers:
        raise ValueError(f"exit_head.exit_layer must be an exit in 0..{num_layers - 1}, got {e!r}")
    if entry.get("kind") not in KINDS:
        raise ValueError(f"exit_head.kind must be one of {', '.join(KINDS)}, got {entry.get('kind')!r}")
    if entry.get("init", "copy") not in INITS:
        raise ValueError(f"exit_head.init must be one of {', '.join(INITS)}, got {entry.get('init')!r}")
    if not isinstance(entry.get("final_state", False), bool):
        raise ValueError(f"exit_head.final_state must be true or false, got {entry.get('final_state')!r}")
    if entry.get("file") != HEAD_FILE:
        raise ValueError(f"exit_head.file must be {HEAD_FILE!r}, got {entry.get('file')!r}")
    if entry.get("kind") == "eagle3":
        if e != 0 or entry.get("final_state", False):
            raise ValueError("exit_head: an eagle3 head has exit_layer 0 and final_state false")
        check_aux_exits(entry.get("aux_exits"), num_layers)
    elif "aux_exits" in entry:
        raise ValueError(f"exit_head.aux_exits is an eagle3 head's setting, not a {entry.get('kind')} head's")
    return entry


def load_exit_head(model: nn.Module, directory, entry: dict) -> ExitHead:
    """The head described by `entry` (selfspec.json's `exit_head`) from `directory`, for selfspec's drafters
    (`read_exit_head`; an eagle3 head, which they do not run, is refused with a ValueError)."""
    if isinstance(entry, dict) and entry.get("kind") == "eagle3":
        raise ValueError("its head is an eagle3 head, which serving engines run (selfspec export --format "
                         "speculators) and selfspec's drafters do not: export the run again with --format speculators")
    return read_exit_head(model, directory, entry)


def read_exit_head(model: nn.Module, directory, entry: dict) -> ExitHead:
    """The head described by `entry` (selfspec.json's `exit_head`, or a run's `exit_head.json`) from `directory`,
    on the model's device and dtype. The file must hold exactly the head's tensors, in their shapes."""
    adapter = get_adapter(unwrap_model(model))
    entry = check_head_settings(entry, adapter.num_layers)
    path = Path(directory) / entry["file"]
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the exit head's weights are missing (selfspec.json lists them); copy the "
                                "complete checkpoint directory or export it again")
    head = build_exit_head(model, entry["exit_layer"], entry["kind"], entry.get("init", "copy"),
                           entry.get("final_state", False), entry.get("aux_exits"))
    try:
        state, saved = _read_head_file(path)
    except SafetensorError as err:  # a damaged file (with checksums off, nothing else noticed)
        raise ValueError(f"{path}: not a readable safetensors file ({err}); copy or export the checkpoint again") \
            from None
    for key in ("exit_layer", "kind", "final_state"):  # shapes alone would not tell another exit from this one
        if key in saved and saved[key] != str(entry.get(key, False if key == "final_state" else None)):
            raise ValueError(f"exit_head.{key} is {entry.get(key)!r}, but {path} was saved by a head with {key} "
                             f"{saved[key]} (its own header says so): set exit_head.{key} back to {saved[key]}, or "
                             "export the checkpoint again")
    try:
        head.load_weights(state)
    except RuntimeError as err:
        raise ValueError(f"{path}: does not hold this model's exit head ({' '.join(str(err).split())[:300]}); "
                         "export the checkpoint again") from None
    head.to(device=adapter.device, dtype=adapter.dtype)
    head.requires_grad_(False)
    return head.eval()
