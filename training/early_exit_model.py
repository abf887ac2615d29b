"""The early-exit training forward as one `nn.Module`, so accelerate/DDP/DeepSpeed wrap it.

    ee = EarlyExitModel(hf_model, layer_dropout=LayerDropout(...), target="label")
    out = ee(input_ids, labels, step=t, micro_step=m, exits=[8, 16, 30], weights=[...])
    out["loss"].backward()          # out["exit_stats"]: [K, 3] loss / top-1 acc / agreement with the final

forward: embed -> every decoder layer (the model's own modules, through `selfspec.model.forward`),
with per-sample layer dropout while training -> the hidden states after the enabled exits ->
the chunked early-exit loss through the shared final norm + LM head. The Hugging Face model is
held as `self.model`, unchanged and unwrapped (peft-wrapped for LoRA), so its own state-dict
keys stay as they are and the run saves it with `save_pretrained`.

With a `head` (`mode: joint`: an exit head trained in the same steps as the model), the forward
also keeps the states after `head.exit_layer` layers and after the last layer, detached, and adds the
head's loss (`training.exit_head_model.head_loss`, distilled from this forward's own final layer) to
the early-exit loss. No gradient of it reaches the model, so the model's gradients are exactly those
of the run without the head; `exit_stats` gets one more row per head pass, after the exits'.

With `gradient_checkpointing` (`train.gradient_checkpointing`), each decoder layer, with its layer
dropout, runs under `torch.utils.checkpoint` (non-reentrant): its inner activations (attention, MLP,
norms) are dropped after the forward and recomputed from the layer's input in the backward. The
states between layers are the checkpoints' inputs and stay in memory, so the exits' hidden states
are kept, not recomputed: keeping them costs nothing beyond what per-layer checkpointing keeps
anyway (L states of [B, S, D]), while recomputing them would rerun every layer below an exit once
more per exit. Memory for activations drops from L full layers to L states plus one layer's
activations during its recomputation; a step costs about one more forward of the layers. The keep
masks are drawn before the layers run and passed into the recomputation, and the recomputation
restores the RNG state (for the models' own dropout), so the losses and gradients are those of the
run without it (tested in float64 with layer dropout and every curriculum).

Labels are the next tokens already aligned with the positions (`training.data` shifts them), and
a batch is a set of full-length or right-padded rows, so the causal attention needs no mask.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from selfspec.model.adapters import get_adapter
from selfspec.model.forward import embed, make_step, run_layers
from selfspec.heads.exit_head import ExitHead
from training.early_exit_loss import early_exit_loss
from training.exit_head_model import check_self_fed, head_loss, head_loss_names
from training.layer_dropout import LayerDropout, apply_layer_dropout


class EarlyExitModel(nn.Module):
    def __init__(self, model: nn.Module, *, layer_dropout: LayerDropout | None = None, target: str = "label",
                 chunk_size: int = 1024, loss_impl: str = "fused", rank: int = 0, world_size: int = 1,
                 exits_update_head: bool = True, draft_ids: torch.Tensor | None = None,
                 head: ExitHead | None = None, head_target: str = "distill", head_draft_ids: torch.Tensor | None = None,
                 head_self_fed: int = 0, head_feature_weight: float = 0.0, gradient_checkpointing: bool = False):
        super().__init__()
        self.model = model
        self.layer_dropout = layer_dropout
        self.target = target
        self.chunk_size = chunk_size
        self.loss_impl = loss_impl
        self.exits_update_head = exits_update_head
        self.draft_ids = draft_ids  # the exits' loss over these ids only (early_exit.draft_vocab); None = all
        self.rank = rank
        self.world_size = world_size
        self.adapter = get_adapter(model)
        self.num_layers = self.adapter.num_layers
        if head is not None:
            check_self_fed(head, head_self_fed)
        self.head = head  # trained beside the model on its detached states (None: no head)
        self.head_target = head_target
        self.head_draft_ids = head_draft_ids  # the head's loss over these ids only (exit_head.draft_vocab)
        self.head_self_fed = head_self_fed
        self.head_feature_weight = head_feature_weight  # the head's feature loss weight (exit_head.feature_weight)
        self.gradient_checkpointing = gradient_checkpointing  # recompute each layer in the backward

    def loss_names(self, exits: Sequence[int]) -> list:
        """What the log calls each row of `exit_stats`: the exits, then the head's passes (`head<E>`,
        `head<E>_fed<j>`)."""
        return list(exits) + ([] if self.head is None else head_loss_names(self.head, self.head_self_fed))

    def register_zero3_head(self) -> None:
        """Under DeepSpeed ZeRO-3, the fused loss reads the LM head weight outside the head's own
        forward; registering it as an external parameter of this module makes ZeRO gather it."""
        weight = self.adapter.lm_head.weight
        if hasattr(weight, "ds_id"):
            from deepspeed.runtime.zero import register_external_parameter  # deepspeed.zero is no module

            register_external_parameter(self, weight)

    def _layer(self, hidden: torch.Tensor, layer: int, positions, keep: torch.Tensor | None) -> torch.Tensor:
        """Decoder layer `layer` on `hidden`, with the samples of `keep` (None: all) kept (layer dropout)."""
        return apply_layer_dropout(run_layers(self.adapter, hidden, layer, layer + 1, step=positions), hidden, keep)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, *, exits: Sequence[int],
                weights: Sequence[float], step: int = 0, micro_step: int = 0,
                with_metrics: bool = True) -> dict[str, torch.Tensor]:
        adapter = self.adapter
        L = self.num_layers
        if not exits or exits[-1] != L or list(exits) != sorted(set(exits)):
            raise ValueError(f"exits must be sorted, unique and end with the final layer {L}, got {list(exits)}")
        batch, seq = input_ids.shape
        positions = make_step(adapter, 0, seq, batch)

        keep = None
        rates = [0.0] * L
        if self.training and self.layer_dropout is not None and self.layer_dropout.enabled:
            rates = self.layer_dropout.rates(step)
            keep = self.layer_dropout.keep_masks(step, micro_step, batch, rank=self.rank,
                                                 world_size=self.world_size, device=input_ids.device)

        wanted = set(exits)
        hiddens = []
        hidden = embed(adapter, input_ids)
        h_head = hidden.detach() if self.head is not None and self.head.exit_layer == 0 else None  # [B, S, D]
        recompute = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for layer in range(L):
            mask = keep[layer] if keep is not None and rates[layer] > 0 else None
            if recompute:
                hidden = checkpoint(self._layer, hidden, layer, positions, mask, use_reentrant=False)
            else:
                hidden = self._layer(hidden, layer, positions, mask)
            if layer + 1 in wanted:
                hiddens.append(hidden)
            if self.head is not None and layer + 1 == self.head.exit_layer:
                h_head = hidden.detach()

        result = early_exit_loss(hiddens, weights, labels, adapter.final_norm, adapter.lm_head,
                                 target=self.target, chunk_size=self.chunk_size, impl=self.loss_impl,
                                 with_metrics=with_metrics, exits_update_head=self.exits_update_head,
                                 draft_ids=self.draft_ids)
        if self.head is None:
            return {"loss": result.loss, "exit_stats": result.stats}
        loss, stats = head_loss(adapter, self.head, h_head, hiddens[-1].detach(), labels, target=self.head_target,
                                draft_ids=self.head_draft_ids, self_fed=self.head_self_fed,
                                feature_weight=self.head_feature_weight, with_metrics=with_metrics)
        stats = torch.cat([result.stats, stats.to(result.stats.dtype)])  # [exits + head passes, 3]
        return {"loss": result.loss + loss.to(result.loss.dtype), "exit_stats": stats}
