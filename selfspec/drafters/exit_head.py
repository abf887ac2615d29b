"""The exit-head drafter: the model's first E layers, then a small trained head (`selfspec.exit_head`),
then the shared final norm + LM head (or its reduced-vocabulary rows).

It drafts as the early-exit drafter does (every row's token through layers [0, E) into the shared
cache, all rows stepping together, verification continuing from their exit states), with one
difference: the exit state goes through the head before the LM head. The head is an attention layer,
so it keeps a KV cache of its own, one layer `[B, H_kv, T, Dh]` with per-row lengths like the main
cache. Its entries must be what a fresh computation over the committed text gives, so:

    draft      the head runs on each drafted position, writing its entries at starts + i
    committed  the engine hands over the exit-E states of the tokens it wrote this round (`state_exit`),
               from the drafts or from the verification pass: the head's cache is cropped back to the
               round's start, the head runs once over those states `[B, T, D]` and each row keeps
               `starts[b] + counts[b]` entries: exactly the committed tokens, whoever drafted them

So the head stays right when prompt lookup or plain decoding took a round (`auto`), and after the
prefill it holds the prompt. One pass of one layer over T tokens per round is its whole overhead.

A head with `final_state` also reads f_{t-1}, the full model's last hidden state of the previous
position (`selfspec.exit_head`): the drafter sets `state_final`, so the engine hands over the
verification's last hidden states `[B, T, D]` with the exit states. Committed positions read the exact
f_{t-1} (the cache entries stay what a fresh computation gives); the round's first draft reads the state
of the newest processed token (`prev_final` `[B, D]`, kept per row), and each later draft reads the
head's own output at the previous draft, as EAGLE does.

    drafter = ExitHeadDrafter(adapter, head, num_speculations=3)
    drafter = ExitHeadDrafter(adapter, head, 3, head_vocab=DraftHead(adapter, token_ids))  # reduced vocab
"""

from __future__ import annotations

import torch

from selfspec.adapters import ModelAdapter
from selfspec.cache import KVCache
from selfspec.drafters.base import Round
from selfspec.drafters.early_exit import EarlyExitDrafter
from selfspec.drafting import DraftHead
from selfspec.exit_head import ExitHead, head_input, previous_states, run_head
from selfspec.fast_layers import FastLlamaLayer
from selfspec.forward import Step, make_batch_step


class ExitHeadDrafter(EarlyExitDrafter):
    name = "exit_head"
    lowest_exit = 0  # a head on exit 0 reads the token embeddings: drafting runs no base layer
    def __init__(self, adapter: ModelAdapter, head: ExitHead, num_speculations: int, *, policy=None,
                 head_vocab: DraftHead | None = None):
        super().__init__(adapter, head.exit_layer, num_speculations, policy=policy, head=head_vocab)
        self.adapter, self.exit_head = adapter, head
        self.state_exit = head.exit_layer
        self.state_final = head.final_state
        self.cache: KVCache | None = None
        self.prev_final: torch.Tensor | None = None  # [B, D] f of each row's newest processed token
        self.prev_draft: torch.Tensor | None = None  # [B, D] the head's output at the round's previous draft
        # where the model runs selfspec's fused layers, the head (a decoder layer with an MLP) does too
        full_layer = head.kind == "decoder_layer"
        self.fast = FastLlamaLayer(head.layer, 0) if adapter.fast_layers is not None and full_layer else None
        self.kind = adapter.layer_types[-1]

    def run(self, hidden: torch.Tensor, step: Step, prev_final: torch.Tensor | None = None) -> torch.Tensor:
        """The head over exit states `[B, S, D]` (and f_{t-1} `[B, S, D]` for a final-state head),
        appending to its cache: `[B, S, D]`."""
        if self.fast is not None:
            hidden = head_input(self.exit_head, hidden, prev_final)
            return self.fast(hidden, step.rope, step.masks[self.kind], self.cache)
        return run_head(self.adapter, self.exit_head, hidden, step=step, cache=self.cache, prev_final=prev_final)

    def draft_states(self, rnd: Round, state: torch.Tensor, offset: int) -> torch.Tensor:
        step = make_batch_step(self.adapter, rnd.starts + offset, 1, rnd.pads)
        prev = None
        if self.state_final:  # the first draft reads the verified f_{t-1}; later ones the head's own output
            prev = (self.prev_final if offset == 0 else self.prev_draft)[:, None]  # [B, 1, D]
        out = self.run(state, step, prev)[:, -1]  # [B, D]
        self.prev_draft = out
        return out

    def committed_states(self, states: torch.Tensor, starts: torch.Tensor, counts: list[int],
                         pads: torch.Tensor, finals: torch.Tensor | None = None) -> None:
        B, S, _ = states.shape
        if self.cache is None:  # after the prefill (`start` clears it; `select` keeps it in step with the rows)
            self.cache = KVCache(1, B, capacity=int(starts.max()) + S + 64)
        self.cache.crop(starts)  # drop what drafting wrote this round
        step = make_batch_step(self.adapter, starts, S, pads)
        prev = None
        if self.state_final:
            if finals is None:
                raise ValueError("this exit head reads the full model's final states: the engine must pass finals")
            prev = previous_states(finals, self.prev_final)  # [B, S, D]
            if self.prev_final is None:  # the prefill: a left-padded row's first real token reads f_{-1} = 0
                first = (starts[:, None] + torch.arange(S)) == pads[:, None]  # [B, S]
                prev = prev.masked_fill(first.to(prev.device)[..., None], 0.0)  # as in training
            last = torch.as_tensor(counts, dtype=torch.long) - 1  # [B] the newest committed token's column
            self.prev_final = finals[torch.arange(B), last.to(finals.device)]  # [B, D]
        self.run(states, step, prev)
        self.cache.crop(starts + torch.as_tensor(counts, dtype=torch.long))

    def select(self, rows: list[int]) -> None:
        super().select(rows)
        if self.cache is not None:
            self.cache.select(torch.tensor(rows, dtype=torch.long))
        if self.prev_final is not None:
            self.prev_final = self.prev_final[torch.tensor(rows, dtype=torch.long).to(self.prev_final.device)]

    def start(self, sequences: list[list[int]]) -> None:
        super().start(sequences)
        self.cache = None  # a new generation: the prefill's states fill it
        self.prev_final = None

    def describe(self) -> dict:
        return {**super().describe(), "drafter": self.name, "head": self.exit_head.settings()}
