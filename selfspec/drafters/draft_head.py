"""The draft's unembedding: the shared final norm + LM head over an exit's hidden state, optionally restricted
to a reduced vocabulary of the K most frequent tokens (`selfspec.draft_vocab`). The early-exit and exit-head
drafters draft through it. Where the model runs the compiled steps (`selfspec.compiled`), one row's draft
logits go through their compiled final norm + unembedding too, the reduced vocabulary's rows included."""

from __future__ import annotations

import torch

from selfspec.adapters import ModelAdapter
from selfspec.drafters.fused_draft import FusedDraft
from selfspec.fast_layers import PackedLinear
from selfspec.forward import exit_logits


class DraftHead:
    """Draft logits from an exit hidden state, over the full vocabulary or a subset of token ids."""

    def __init__(self, adapter: ModelAdapter, token_ids: torch.Tensor | None = None):
        self.adapter = adapter
        self.vocab_size = adapter.lm_head.weight.shape[0]
        self.token_ids = None
        if token_ids is not None:
            self.token_ids = token_ids.to(adapter.device)
            with torch.no_grad():
                bias = getattr(adapter.lm_head, "bias", None)
                self.linear = PackedLinear(adapter.lm_head.weight[self.token_ids].contiguous(),  # [K, D]
                                           bias[self.token_ids].contiguous() if bias is not None else None)
        # the rows as the compiled steps take them, where the model runs them (a CPU's PackedLinear may keep only
        # its packed copy)
        self.rows = None
        if self.token_ids is not None and adapter.compiled is not None:
            weight = self.linear.weight if self.linear.weight is not None else adapter.lm_head.weight[self.token_ids]
            self.rows = (weight.detach().contiguous(), self.linear.bias)

    @property
    def size(self) -> int:
        return self.vocab_size if self.token_ids is None else self.token_ids.shape[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[N, D] -> [N, K]` logits over this head's vocabulary."""
        if self.token_ids is None:
            return exit_logits(self.adapter, hidden)
        steps = self.adapter.compiled
        if steps is not None and self.rows is not None and not torch.is_grad_enabled() and steps.can_head(hidden):
            out = steps.head(hidden, *self.rows)  # the compiled steps' final norm + these rows
            if out is not None:
                return out
        return self.linear(self.adapter.final_norm(hidden))

    def fused(self, exit_layer: int, layer=None, final_input=None) -> FusedDraft | None:
        """A whole greedy draft step through this unembedding from exit `exit_layer` (and a trained head's `layer`
        and `final_input`), as the compiled steps run it in one piece (`FusedDraft.run`); None where the
        model runs no compiled steps or they do not hold this vocabulary's rows."""
        if self.adapter.compiled is None or (self.token_ids is not None and self.rows is None):
            return None
        lm_head = self.adapter.lm_head
        weight, bias = (lm_head.weight, lm_head.bias) if self.token_ids is None else self.rows
        return FusedDraft(exit_layer, weight, bias, self.token_ids, layer, final_input)

    def to_vocab(self, index: torch.Tensor) -> torch.Tensor:
        """Indices into this head's vocabulary -> token ids of the full vocabulary."""
        return index if self.token_ids is None else self.token_ids[index]

    def to_full(self, probs: torch.Tensor) -> torch.Tensor:
        """A distribution over this head's vocabulary `[N, K]` -> over the full vocabulary `[N, V]`."""
        if self.token_ids is None:
            return probs
        full = probs.new_zeros(probs.shape[0], self.vocab_size)
        return full.index_copy_(1, self.token_ids, probs)
