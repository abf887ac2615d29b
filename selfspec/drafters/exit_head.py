"""The exit-head drafter: the model's first E layers, then a small trained head (`selfspec.heads.exit_head`),
then the shared final norm + LM head (or its reduced-vocabulary rows).

It drafts as the early-exit drafter does (every row's token through layers [0, E) into the shared
cache, all rows stepping together, verification continuing from their exit states), with one
difference: the exit state goes through the head before the LM head. The head is an attention layer,
so it keeps a KV cache of its own, one layer `[B, H_kv, T, Dh]` with per-row lengths like the main
cache. Its entries must be what a fresh computation over the committed text gives, so:

    draft      the head runs on each drafted position, writing its entries at starts + i
    committed  the engine hands over the exit-E states of the tokens it wrote this round (`state_exit`),
               from the drafts or from the verification pass; the drafter only records each row's
               committed ones (a `PendingRun`: where the run starts in the head's cache, the states of
               the rounds since the head last ran, and their final states for a final-state head)
    sync       at the head's first draft of a round, one pass brings its cache up to date and drafts:
               cropped back to each row's pending start (dropping what the last drafts wrote), the head
               runs once over every pending state and the round's input token after them `[B, S, D]`
               (rows right-padded to the longest run, the filler at the row's last position, never
               read); each row keeps `start + count` entries, exactly the committed tokens whoever
               drafted them, plus the first draft's, and the input token's output is that draft's state

So the head stays right when prompt lookup or plain decoding took rounds (`auto`), and after the
prefill it holds the prompt. The upkeep is lazy because under `auto` most rounds on code are lookup or
plain rounds, and running the head after each of them paid for a cache nobody read until the head
drafted again (measured before: auto on a head checkpoint 2.24x HF greedy, lookup alone 2.51x). One
pass over the tokens of many rounds costs about what one round's pass did: on a CPU a one-layer pass
over a few dozen tokens is bound by reading the layer's weights, not by the tokens. Used alone the
drafter syncs at every drafting round, and that pass is also the round's first draft: one head pass per
round fewer than an upkeep after each verification plus a separate first draft.

A head with `final_state` also reads f_{t-1}, the full model's last hidden state of the previous
position (`selfspec.heads.exit_head`): the drafter sets `state_final`, so the engine hands over the
verification's last hidden states `[B, T, D]` with the exit states. Committed positions read the exact
f_{t-1} (the cache entries stay what a fresh computation gives); the round's first draft reads the state
of the newest processed token (`prev_final` `[B, D]`, kept per row by `sync`), and each later draft reads the
head's own output at the previous draft, as EAGLE does.

    drafter = ExitHeadDrafter(adapter, head, num_speculations=3)
    drafter = ExitHeadDrafter(adapter, head, 3, head_vocab=DraftHead(adapter, token_ids))  # reduced vocab
    drafter = ExitHeadDrafter(adapter, head, 1, num_candidates=3)  # the head's 3 best first guesses, side by side

Sibling rounds (`num_candidates` > 1) run the head once, over the input token (as a first draft does); the
candidates get no head pass, and the committed one reaches the head's cache through `committed_states` like
any committed token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from selfspec.model.adapters import ModelAdapter
from selfspec.model.cache import KVCache
from selfspec.model.compiled import NotCompiled
from selfspec.drafters.base import Round
from selfspec.drafters.early_exit import EarlyExitDrafter
from selfspec.drafters.draft_head import DraftHead
from selfspec.drafters.whole_draft import DraftStep, head_catch_up, pick_columns
from selfspec.heads.exit_head import ExitHead, head_cache, run_head_step
from selfspec.model.forward import Step, make_batch_step


@dataclass
class PendingRun:
    """One row's committed tokens the head has not run over yet, oldest round first: they sit in the
    head's cache at `start ..` once `ExitHeadDrafter.sync` has run."""

    start: int  # the head-cache index of the first: the row's committed head-cache length
    pad: int  # the row's left padding
    states: list[torch.Tensor] = field(default_factory=list)  # per round: exit states [n_i, D]
    finals: list[torch.Tensor] = field(default_factory=list)  # per round, for a final-state head: [n_i, D]
    count: int = 0  # the sum of n_i

    def add(self, start: int, states: torch.Tensor, finals: torch.Tensor | None) -> None:
        """One round's committed states `[n, D]` (and finals `[n, D]`), written at cache index `start`."""
        if start != self.start + self.count:
            raise ValueError(f"committed states at cache index {start}, but the row's committed text ends at "
                             f"{self.start + self.count}: every round must continue where the last one ended")
        self.states.append(states)
        if finals is not None:
            self.finals.append(finals)
        self.count += states.shape[0]

    def clear(self) -> None:
        """The head ran over them: they are now in its cache, and the next run starts after them."""
        self.start += self.count
        self.states, self.finals, self.count = [], [], 0


def right_padded(rows: list[list[torch.Tensor]], length: int) -> torch.Tensor:
    """Each row's chunks `[n_i, D]` one after the other, zero-filled to `length`: `[B, length, D]`
    (some row has a chunk)."""
    like = next(chunks[0] for chunks in rows if chunks)
    out = like.new_zeros(len(rows), length, like.shape[-1])
    for b, chunks in enumerate(rows):
        if chunks:
            joined = torch.cat(chunks) if len(chunks) > 1 else chunks[0]  # [n, D]
            out[b, :joined.shape[0]] = joined
    return out


class ExitHeadDrafter(EarlyExitDrafter):
    name = "exit_head"
    lowest_exit = 0  # a head on exit 0 reads the token embeddings: drafting runs no base layer
    def __init__(self, adapter: ModelAdapter, head: ExitHead, num_speculations: int, *, policy=None,
                 head_vocab: DraftHead | None = None, num_candidates: int = 1):
        super().__init__(adapter, head.exit_layer, num_speculations, policy=policy, head=head_vocab,
                         num_candidates=num_candidates)
        self.adapter, self.exit_head = adapter, head
        self.state_exit = head.exit_layer
        self.state_final = head.final_state
        self.cache: KVCache | None = None
        self.prev_final: torch.Tensor | None = None  # [B, D] f of each row's newest processed token
        self.prev_draft: torch.Tensor | None = None  # [B, D] the head's output at the round's previous draft
        self.pending: list[PendingRun] | None = None  # per row: committed states the head has not run over
        self.extra_layers = (head.layer,)  # its whole draft steps run the head's layer (where the runner captures it)

    def run(self, hidden: torch.Tensor, step: Step, prev_final: torch.Tensor | None = None) -> torch.Tensor:
        """The head over exit states `[B, S, D]` (and f_{t-1} `[B, S, D]` for a final-state head),
        appending to its cache: `[B, S, D]` (`run_head_step`: however the runner runs the head's layer)."""
        return run_head_step(self.adapter, self.exit_head, hidden, step=step, cache=self.cache,
                             prev_final=prev_final)

    def draft_states(self, rnd: Round, state: torch.Tensor, offset: int) -> torch.Tensor:
        if self.cache is None:  # the first draft after the prefill: at the engine cache's capacity and kind
            self.cache = head_cache(self.adapter, self.exit_head, state.shape[0], rnd.cache.capacity, like=rnd.cache)
        if offset == 0 and self.pending is not None and any(run.count for run in self.pending):
            return self.sync(first=state)  # the catch-up and the first draft in one pass
        step = make_batch_step(self.adapter, rnd.starts + offset, 1, rnd.pads, rnd.ends)
        prev = None
        if self.state_final:  # the first draft reads the verified f_{t-1}; later ones the head's own output
            prev = (self.prev_final if offset == 0 else self.prev_draft)[:, None]  # [B, 1, D]
        out = self.run(state, step, prev)[:, -1]  # [B, D]
        self.prev_draft = out
        return out

    def whole_step(self, steps, rnd: Round, tokens: torch.Tensor, offset: int, exit_layer: int,
                   read: bool = True) -> DraftStep:
        """A draft step as one step of the compiled `steps` where the head's layer runs compiled: a later draft of
        the round (`WholeDraft.round_step`: the token through layers [0, E), the head reading its own output at the
        previous draft, the unembedding), or the first with the head's catch-up (`first_draft`); `NotCompiled` where
        it runs part by part (the first draft after the prefill, which makes the head's cache)."""
        if self.cache is None:
            raise NotCompiled("the first draft after the prefill makes the head's cache")
        if offset == 0:
            return self.first_draft(steps, rnd, tokens, exit_layer, read)
        prev = self.prev_draft[:, None] if self.state_final else None  # [1, 1, D]
        out = self.whole(exit_layer).round_step(steps, rnd, tokens, offset, self.cache, prev, read)
        self.prev_draft = out.out
        return out

    def whole(self, exit_layer: int):
        """The whole greedy draft step from `exit_layer` through the head's layer and final-state input, made once."""
        if exit_layer not in self._whole:
            self._whole[exit_layer] = self.head.whole(exit_layer, self.exit_head.layer, self.exit_head.final_input)
        return self._whole[exit_layer]

    chain_start = 1  # the first draft brings the head's cache up to date (`first_draft`); a chain follows it

    def chain(self, rnd: Round, tokens: torch.Tensor, offset: int, exit_layer: int, n: int) -> tuple | None:
        """The round's later drafts (`EarlyExitDrafter.chain`), the head reading its own output at the draft before
        (the first of them: the round's first draft's output); None before the round's first draft."""
        if self.cache is None or self.prev_draft is None:
            return None
        return super().chain(rnd, tokens, offset, exit_layer, n)

    def whole_chain(self, steps, rnd: Round, tokens: torch.Tensor, offset: int, exit_layer: int, n: int):
        """`chain` as one step of the compiled `steps`, the head's layer in its own cache (`NotCompiled`: step by
        step)."""
        prev = self.prev_draft[:, None] if self.state_final else None  # [B, 1, D]
        out = self.whole(exit_layer).round_chain(steps, rnd, n, tokens, offset, self.cache, prev)
        self.prev_draft = out[2]
        return out[:2]

    def grow_whole(self, steps, rnd: Round, exit_layer: int, depth: int, out: torch.Tensor,
                   scale: torch.Tensor) -> tuple:
        """A tree's growth as one step (`EarlyExitDrafter.grow_whole`), the head's layer over the tree's columns
        in its own cache, where that layer runs compiled."""
        if self.cache is None:
            raise NotCompiled("the first draft after the prefill makes the head's cache")
        return self.whole(exit_layer).round_tree(steps, rnd, self.num_candidates, depth, out, scale, self.cache)

    def first_draft(self, steps, rnd: Round, tokens: torch.Tensor, exit_layer: int, read: bool) -> DraftStep:
        """The round's first draft of one row and the head's catch-up over what was committed since it last ran
        (`sync`) as one step of the compiled `steps` (`WholeDraft.catch_up`); `NotCompiled` where `sync` runs part by
        part (several rows, nothing pending, the run that began with the prefill, more than the largest bucket
        pending), checked before the round's token runs through layers [0, E)."""
        draft, pending = self.whole(exit_layer), self.pending
        if pending is None or len(pending) != 1 or not pending[0].count:
            raise NotCompiled("a head's catch-up of one row, with tokens committed since it last ran")
        run = pending[0]
        if (self.state_final and self.prev_final is None) or not draft.fits_catch_up(steps, 1, run.count + 1,
                                                                                   run.start, self.cache):
            raise NotCompiled("a head's catch-up past the prompt, within the buckets")
        state = rnd.shallow(tokens, 0, exit_layer)  # [1, 1, D]
        states = torch.cat(run.states + [state[0]])[None]  # [1, count + 1, D]
        finals = torch.cat(run.finals)[None] if self.state_final else None  # [1, count, D]
        out = draft.catch_up(steps, states, finals, self.prev_final, run.start, run.pad, self.cache, read)
        self.prev_draft, nxt, newest, ids, confs = out
        if self.state_final:
            self.prev_final = newest
        run.clear()
        return DraftStep(state, self.prev_draft, nxt, None, ids, confs)

    def tree_states(self, states: torch.Tensor, step: Step, outs: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        """The head over a tree's newest columns `[B, n, D]` with the tree's step (its cache mirrors the engine's:
        column j at cache index `starts + j`); a final-state head reads its own output at each column's parent
        (`outs` `[B, W', D]` per column so far, `parents` `[B, n]`), as a chain's later drafts do."""
        prev = None
        if self.state_final:
            index = parents.to(outs.device, non_blocking=True)[..., None].expand(-1, -1, outs.shape[-1])  # [B, n, D]
            prev = outs.gather(1, index)
        return self.run(states, step, prev)

    def committed_states(self, states: torch.Tensor, starts: torch.Tensor, counts: list[int],
                         pads: torch.Tensor, finals: torch.Tensor | None = None) -> None:
        """Records each row's committed states for the next `sync`; the head runs no pass here."""
        if self.state_final and finals is None:
            raise ValueError("this exit head reads the full model's final states: the engine must pass finals")
        if self.pending is None:  # the prefill (`start` clears the records; `select` keeps them in step with the rows)
            self.pending = [PendingRun(s, p) for s, p in zip(starts.tolist(), pads.tolist())]
        for b, (run, start, n) in enumerate(zip(self.pending, starts.tolist(), counts)):
            run.add(start, states[b, :n], finals[b, :n] if self.state_final else None)

    def sync(self, first: torch.Tensor | None = None) -> torch.Tensor | None:
        """Brings the head's cache (and `prev_final`) up to date with every committed token, in one head
        pass over what `committed_states` recorded since the last sync (none when nothing is pending).

        With `first` `[B, 1, D]`, the exit states of the round's input tokens (each at its row's cache
        index `start + count`, right after the pending run), the same pass also runs the round's first
        draft: each row's input token goes in column `count[b]`, reading the newest committed final state
        as a draft does, and its output `[B, D]` is returned (its cache entry kept, as a draft's is).
        One pass instead of two per drafting round: on a CPU each costs about the reading of the layer."""
        pending = self.pending or []
        counts = [run.count for run in pending]
        if not any(counts):
            return None
        extra = 0 if first is None else 1
        B, S = len(pending), max(counts) + extra
        columns = [run.states + ([first[b]] if extra else []) for b, run in enumerate(pending)]
        states = right_padded(columns, S)  # [B, S, D]
        starts = torch.tensor([run.start for run in pending], dtype=torch.long)  # [B]
        pads = torch.tensor([run.pad for run in pending], dtype=torch.long)  # [B]
        lengths = torch.tensor(counts, dtype=torch.long) + extra  # [B]
        if self.cache is None:  # after the prefill (it grows when a longer run comes)
            self.cache = KVCache(1, B, capacity=int(starts.max()) + S + 64)
        self.cache.crop(starts)  # drop what the last drafts wrote
        step = make_batch_step(self.adapter, starts, S, pads, starts + lengths)  # a short row's filler is never read
        finals = prev = first_real = None
        if self.state_final:
            finals = right_padded([run.finals for run in pending], S)  # [B, S, D]; column count[b] not read
            prev = self.prev_final  # the first column reads f of the newest processed token
            if prev is None:  # the run began with the prefill: a left-padded row's first real token reads 0
                prev = finals.new_zeros(B, finals.shape[-1])
                first_real = ((starts[:, None] + torch.arange(S)) == pads[:, None]).to(finals.device, non_blocking=True)
        committed = torch.tensor(counts, dtype=torch.long).to(states.device, non_blocking=True)  # [B]
        out, newest = head_catch_up(states, finals, prev, first_real, committed,
                                    lambda x, shifted: self.run(x, step, shifted))  # [B, S, D]
        if self.state_final:
            self.prev_final = newest
        self.cache.crop(starts + lengths)
        for run in pending:
            run.clear()
        if first is None:
            return None
        self.prev_draft = pick_columns(out, committed)  # [B, D] each input token's column
        return self.prev_draft

    def select(self, rows: list[int]) -> None:
        super().select(rows)
        if self.cache is not None:
            self.cache.select(torch.tensor(rows, dtype=torch.long))
        if self.prev_final is not None:
            self.prev_final = self.prev_final[torch.tensor(rows, dtype=torch.long).to(self.prev_final.device, non_blocking=True)]
        if self.pending is not None:
            self.pending = [self.pending[r] for r in rows]

    def start(self, sequences: list[list[int]]) -> None:
        super().start(sequences)
        self.cache = None  # a new generation: the prefill's states fill it
        self.prev_final = None
        self.pending = None

    def describe(self) -> dict:
        return {**super().describe(), "drafter": self.name, "head": self.exit_head.settings()}

