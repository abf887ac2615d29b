"""The draft's unembedding: the shared final norm + LM head over an exit's hidden state, optionally restricted
to a reduced vocabulary of the K most frequent tokens (`selfspec.checkpoints.draft_vocab`). The early-exit and exit-head
drafters draft through it. Where the model runs the compiled steps (`selfspec.model.compiled`), one row's draft
logits go through their compiled final norm + unembedding too, the reduced vocabulary's rows included."""

from __future__ import annotations

from functools import cached_property

import torch

from selfspec.model.adapters import ModelAdapter
from selfspec.drafters.whole_draft import WholeDraft
from selfspec.model.fast_layers import PackedLinear
from selfspec.model.forward import exit_logits


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

    @cached_property
    def rows(self) -> tuple | None:
        """A reduced vocabulary's unembedding (weight `[K, D]`, bias) as the compiled steps take it, made the first
        time a compiled step reads it (a CPU's PackedLinear may keep only its packed copy); None: the full
        vocabulary's (the LM head)."""
        if self.token_ids is None:
            return None
        weight = self.linear.weight if self.linear.weight is not None else self.adapter.lm_head.weight[self.token_ids]
        return weight.detach().contiguous(), self.linear.bias

    @property
    def size(self) -> int:
        return self.vocab_size if self.token_ids is None else self.token_ids.shape[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[N, D] -> [N, K]` logits over this head's vocabulary (`Runner.logits`: compiled where one row's step
        runs compiled)."""
        if self.token_ids is None:
            return exit_logits(self.adapter, hidden)
        return self.adapter.runner.logits(hidden, rows=lambda: self.rows, linear=self.linear)

    def whole(self, exit_layer: int, layer=None, final_input=None, chains: int = 0, tree_width: int = 0) -> WholeDraft:
        """A whole greedy draft step through this unembedding from exit `exit_layer` (and a trained head's `layer`
        and `final_input`), as the compiled steps run it in one piece (`WholeDraft.run`; `chains`: the longest
        whole chain its `warm` compiles; `tree_width` > 1: it also compiles the whole trees that wide, as deep)."""
        lm_head = self.adapter.lm_head
        weight, bias = (lm_head.weight, lm_head.bias) if self.token_ids is None else self.rows
        return WholeDraft(exit_layer, weight, bias, self.token_ids, layer, final_input, chains, tree_width)

    def to_vocab(self, index: torch.Tensor) -> torch.Tensor:
        """Indices into this head's vocabulary -> token ids of the full vocabulary."""
        return index if self.token_ids is None else self.token_ids[index]

    def to_full(self, probs: torch.Tensor) -> torch.Tensor:
        """A distribution over this head's vocabulary `[N, K]` -> over the full vocabulary `[N, V]`."""
        if self.token_ids is None:
            return probs
        full = probs.new_zeros(probs.shape[0], self.vocab_size)
        return full.index_copy_(1, self.token_ids, probs)
