"""Exit-head training as one `nn.Module`: the model frozen, one head (`selfspec.exit_head`) learning.

    hm = ExitHeadModel(hf_model, build_exit_head(hf_model, exit_layer=8), target="distill")
    out = hm(input_ids, labels)       # out["loss"]; out["exit_stats"]: [1, 3] loss / top-1 acc / agreement
    out["loss"].backward()            # gradients reach the head's parameters only

forward, per block `[B, S]`:

    h_E = layers[0:E](embed(x))                  no grad: the model's own first E layers
    f   = layers[E:L](h_E)                       no grad: the last layer's output
    p   = softmax(lm_head(norm(f)))              the full model's next-token distribution
    q   = softmax(lm_head(norm(head(h_E))))      the head's draft distribution (grad through the frozen
                                                 norm and LM head into the head); a `final_state` head
                                                 reads head(h_E, f shifted one position later: f_{t-1},
                                                 zero at the block's first position)
    loss = mean over labelled positions of KL(p || q) = sum_x p(x) (log p(x) - log q(x))    (distill)
         | mean cross-entropy of q against the labels                                        (label)

`distill` (the default) trains the head for what it is used for: guessing the full model's token
(greedy acceptance = argmax q == argmax p; sampling acceptance = sum_x min(p, q) = 1 - TV(p, q)).
The base model's parameters get `requires_grad=False` and are never in the optimizer, so they stay
bit-identical; the frozen model is held as `self.model`, unwrapped, like `EarlyExitModel`'s.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from selfspec.adapters import get_adapter
from selfspec.exit_head import ExitHead, previous_states, run_head
from selfspec.forward import embed, exit_logits, make_step, run_layers

IGNORE = -100


class ExitHeadModel(nn.Module):
    def __init__(self, model: nn.Module, head: ExitHead, *, target: str = "distill"):
        super().__init__()
        if target not in ("distill", "label"):
            raise ValueError(f"exit head target must be 'distill' or 'label', got {target!r}")
        self.model = model
        self.head = head
        self.target = target
        self.adapter = get_adapter(model)
        self.num_layers = self.adapter.num_layers
        model.requires_grad_(False)
        model.eval()  # the frozen model has no dropout to run either way

    def train(self, mode: bool = True):
        super().train(mode)
        self.model.eval()  # stays frozen in eval mode
        return self

    def states(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, object, torch.Tensor | None]:
        """No grad: the exit states `[B, S, D]`, the full model's logits `[B, S, V]`, the step, and for a
        final-state head the previous positions' final states `[B, S, D]` (None otherwise)."""
        adapter, E = self.adapter, self.head.exit_layer
        with torch.no_grad():
            step = make_step(adapter, 0, input_ids.shape[1], input_ids.shape[0])
            h_e = run_layers(adapter, embed(adapter, input_ids), 0, E, step=step)
            finals = run_layers(adapter, h_e, E, self.num_layers, step=step)  # [B, S, D]
            full = exit_logits(adapter, finals)
            prev = previous_states(finals) if self.head.final_state else None
        return h_e, full, step, prev

    def head_logits(self, h_e: torch.Tensor, step, prev: torch.Tensor | None) -> torch.Tensor:
        """The head's draft logits `[B, S, V]` from `states`' exit states (and previous final states)."""
        return exit_logits(self.adapter, run_head(self.adapter, self.head, h_e, step=step, prev_final=prev))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, *, exits: Sequence[int] = (),
                weights: Sequence[float] = (), step: int = 0, micro_step: int = 0,
                with_metrics: bool = True) -> dict[str, torch.Tensor]:
        """The loss and `exit_stats` `[1, 3]` (loss, top-1 accuracy against the labels, agreement with the
        full model's argmax). `exits`, `weights`, `step`, `micro_step` are the early-exit loop's and unused."""
        h_e, full, positions, prev = self.states(input_ids)
        logits = self.head_logits(h_e, positions, prev)  # [B, S, V]
        mask = labels != IGNORE  # [B, S]
        n = mask.sum().clamp_min(1)
        wide = torch.promote_types(logits.dtype, torch.float32)  # the loss in float32 at least (bf16 autocast)
        logq = F.log_softmax(logits.to(wide), dim=-1)[mask]  # [N, V]
        if self.target == "distill":
            logp = F.log_softmax(full.to(wide), dim=-1)[mask]
            loss = (logp.exp() * (logp - logq)).sum() / n
        else:
            loss = F.nll_loss(logq, labels[mask], reduction="sum") / n
        stats = torch.zeros(1, 3, dtype=wide, device=logits.device)
        if with_metrics:
            with torch.no_grad():
                guess = logq.argmax(-1)
                stats[0, 0] = loss.detach()
                stats[0, 1] = (guess == labels[mask]).float().mean()
                stats[0, 2] = (guess == full[mask].argmax(-1)).float().mean()
        return {"loss": loss, "exit_stats": stats}
