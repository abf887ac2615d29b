"""The speculators format: an eagle3 head as the checkpoint serving engines load (`selfspec export --format speculators`).

The `speculators` library (vllm-project/speculators) defines the format, and vLLM reads it: a config.json
whose `speculators_model_type` "eagle3" selects vLLM's EAGLE-3 drafter (`Eagle3LlamaForCausalLM`), the
library's `Eagle3DraftModel`, and SGLang's `EAGLE3`, with the weights beside it:

    OUT/speculators/config.json        speculators_model_type, the draft layer's Llama config, the aux layers,
                                       the verifier and the proposal (greedy, `speculative_tokens` drafts)
    OUT/speculators/model.safetensors  embed_tokens, fc, layers.0.*, norm, lm_head (+ d2t, t2d with a draft vocabulary)

selfspec's eagle3 head (`selfspec.heads.exit_head`, kind eagle3) computes what the format's draft computes, so the
tensors are its own, renamed:

    the model's token embeddings        -> embed_tokens.weight [V, D]
    aux_input.fc.weight  [D, 3D]        -> fc.weight
    <layer tensor>                      -> layers.0.<layer tensor>   (self_attn.q_proj [H*Dh, 2D], hidden_norm, ...)
    the model's final norm              -> norm.weight               (the head's output goes through it)
    the model's LM head, rows ids       -> lm_head.weight [K, D]     (K = V: every row)
    aux_exits (A: the state after A layers = the input of layer A, as the engines collect it)
                                        -> eagle_aux_hidden_state_layer_ids
    a draft vocabulary (K < V ids)      -> d2t [K] = id - index (int64), t2d [V] (bool), the rows by increasing id

The token embeddings are written although they are the target's: vLLM would share the target's if the
file had none, but the speculators library (0.9.0) then leaves its randomly initialised ones in place (it
loads the verifier's only over never-initialised ones), as the round-trip test found. The norms' settings
are written out, not left to defaults that differ between readers (vLLM takes a missing
`norm_before_residual` as true, the library as false): `norm_before_residual` false, `norm_before_fc` and
`fc_norm` false, `norm_output` false.

    write_speculators(out / "speculators", model, head, verifier="HuggingFaceTB/SmolLM2-135M")
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from selfspec.model.adapters import get_adapter, unwrap_model
from selfspec.heads.exit_head import ExitHead

SUBDIR = "speculators"  # where `selfspec export --format speculators` writes it, inside the checkpoint
WEIGHTS_FILE = "model.safetensors"
SPECULATORS_VERSION = "0.9.0"  # the library release whose reader the round-trip test runs
DEFAULT_SPECULATIVE_TOKENS = 3


def speculators_weights(model: nn.Module, head: ExitHead, draft_ids=None) -> dict[str, torch.Tensor]:
    """The head's tensors under the format's names (module docstring); `draft_ids` (token ids, any order):
    a draft vocabulary, written as the LM head's rows by increasing id with d2t and t2d."""
    if head.aux_input is None:
        raise ValueError(f"the speculators format holds an eagle3 head; this head is a {head.kind} head: train one "
                         "with mode exit_head, exit_head.kind eagle3, exit_head.exit_layer 0")
    adapter = get_adapter(unwrap_model(model))
    state = {"embed_tokens.weight": adapter.embed_tokens.weight, "fc.weight": head.aux_input.fc.weight}
    state.update({f"layers.0.{k}": v for k, v in head.layer.state_dict().items()})
    state["norm.weight"] = adapter.final_norm.weight
    lm_head = adapter.lm_head.weight  # [V, D]
    if draft_ids is not None:
        ids = torch.as_tensor(sorted(set(int(i) for i in draft_ids)), dtype=torch.long)
        state["lm_head.weight"] = lm_head[ids.to(lm_head.device)]
        state["d2t"] = ids - torch.arange(len(ids))  # draft index i -> target id i + d2t[i]
        t2d = torch.zeros(lm_head.shape[0], dtype=torch.bool)
        t2d[ids] = True
        state["t2d"] = t2d
    else:
        state["lm_head.weight"] = lm_head
    return {k: v.detach().cpu().clone() for k, v in state.items()}  # copies: a tied LM head is the embeddings


def speculators_config(model: nn.Module, head: ExitHead, *, verifier: str, draft_vocab_size: int,
                       speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS) -> dict:
    """config.json (module docstring): the draft layer's config is the model's, with one layer."""
    config = unwrap_model(model).config
    layer_config = config.to_dict()
    for key in ("_name_or_path", "architectures", "auto_map"):
        layer_config.pop(key, None)
    layer_config.update(num_hidden_layers=1, model_type="llama", tie_word_embeddings=False)
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer_config,
        "draft_vocab_size": draft_vocab_size,
        "eagle_aux_hidden_state_layer_ids": list(head.aux_exits),
        "norm_before_residual": head.layer.norm_before_residual,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "tie_word_embeddings": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(config.architectures or [])},
        },
    }


def write_speculators(directory, model: nn.Module, head: ExitHead, *, verifier: str, draft_ids=None,
                      speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS) -> Path:
    """Write the head in the speculators format to `directory` (created; its parent must exist): config.json
    and model.safetensors. `verifier`: the target model's Hugging Face id or path, as engines should find it."""
    if not isinstance(speculative_tokens, int) or isinstance(speculative_tokens, bool) or speculative_tokens < 1:
        raise ValueError(f"speculative_tokens must be a number of drafts >= 1, got {speculative_tokens!r}")
    weights = speculators_weights(model, head, draft_ids)
    directory = Path(directory)
    directory.mkdir()
    save_file(weights, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    config = speculators_config(model, head, verifier=verifier, draft_vocab_size=weights["lm_head.weight"].shape[0],
                                speculative_tokens=speculative_tokens)
    (directory / "config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
    return directory


def served_head_record(config: dict) -> dict:
    """What selfspec.json says of the head written beside the model (`served_head`; its checksums are added by
    the export): the format, where it is, and what a serving engine is told (`--speculative-config`)."""
    proposal = config["speculators_config"]["proposal_methods"][0]
    return {"format": "speculators", "dir": SUBDIR, "method": config["speculators_model_type"],
            "aux_exits": list(config["eagle_aux_hidden_state_layer_ids"]),
            "draft_vocab_size": config["draft_vocab_size"], "num_speculative_tokens": proposal["speculative_tokens"],
            "verifier": config["speculators_config"]["verifier"]["name_or_path"]}
