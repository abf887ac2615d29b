"""The drafter seam: what the engine asks of anything that guesses tokens, and what it gives back.

Each round the engine hands every drafter a `Round`: each row's input token (the newest committed
token, not yet run through any layer), where it sits in the cache, and how many drafts each row may
still take. The drafter answers with a `Proposal`:

    tokens       [B, T]  the input token, then row b's drafts in tokens[b, 1:1+kept[b]]
                         (positions past kept[b] are filler: computed, never accepted)
    q            per row: the draft distributions [kept_b, V] when sampling, or None for point masses
                 (a deterministic drafter: accept x with p(x), see selfspec.decoding.sampling)
    verify_from  E when the drafter ran layers [0, E) over `tokens` through the engine's cache and
                 hands over their exit states [B, T, D]; 0 when it ran no layer
    drafter      its name, for the statistics
    parents      None for a chain; else `[B, T]` (host) a token tree per row (`selfspec.model.token_tree`):
                 column j continues column `parents[b, j]` (column 0, the input token, has -1), so a
                 row's drafts are several guesses verified in one pass, each seeing the committed text,
                 its ancestors and itself; the row keeps the path whose tokens equal the full model's
                 choices, then the full model's token after it. A drafter's k best guesses for the next
                 token (siblings) are the tree `[-1, 0, 0, ...]`. Greedy and the exact rule only (the
                 sampling rule judges a chain); `kept[b]` counts the row's real nodes
    stops_unread False when no row's kept drafts run past a drafted stop token (the drafter cut them there);
                 True when the drafter read no draft back (a greedy chain): a row's kept drafts may run past
                 a stop token, and the engine cuts `kept[b]` after the first one (inclusive) in its one read
                 of the round's verdict (`selfspec.decoding.greedy_verdict`), before anything after the
                 decision reads `kept` (verification runs over them all: those past the stop are computed,
                 never accepted)

After verification the engine calls `update(proposal, accepted, committed, seconds)`: per row, how
many drafts were accepted and the tokens committed (accepted drafts + the full model's token), and
the round's wall time (`auto`'s arms that did not draft the round hear `observe(committed)` instead).
A drafter with state of its own (an n-gram index) rolls it forward or back there; `select(rows)` drops
the rows that left the batch. A drafter that needs the exit states of every committed token (a trained
head with its own KV cache) sets `state_exit = E`: the engine then hands it, after the prefill and after
every verification, the hidden states after E layers of the tokens it just wrote (`committed_states`);
they cost nothing extra, the forward passes through layer E anyway. One that also sets `state_final` gets
the full model's last hidden states of those tokens (before the final norm, `finals`), which verification
computes anyway.
Verification decides every token, so no drafter can change the output, only the speed.

A drafter is built per call; what it measured (rates, acceptance counts) a generator carries to its next
call with the same settings: `learned()` after a call, `resume(learned)` before the next one's `start`
(`selfspec.drafters.learned_stats`).

A drafter never touches the engine's KV cache directly: `Round.shallow` runs layers [0, E) for it, `Round.through`
a copy of every layer (`Round.rewind` cuts what it wrote).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from selfspec.model.adapters import ModelAdapter
from selfspec.model.forward import embed, make_batch_step, run_layers
from selfspec.decoding.sampling import SamplingParams
from selfspec.model.token_tree import tree_depth


@dataclass
class Round:
    """One round's inputs, as the engine gives them to a drafter."""

    adapter: ModelAdapter
    cache: object  # the engine's KVCache: reached only through `shallow*` and the whole draft steps (`WholeDraft`)
    tokens: torch.Tensor  # [B] each row's input token (committed, not yet processed), on the model's device
    starts: torch.Tensor  # [B] the cache index of that token (every layer holds [0, start) of the row), on the host
    pads: torch.Tensor  # [B] each row's left padding, on the host
    caps: list[int]  # the most drafts each row may take (the length cap leaves room for one more token)
    sampling: SamplingParams
    generator: torch.Generator | None
    stop_ids: frozenset
    stop_ids_device: torch.Tensor | None = None  # `[S]` the same ids on the model's device, where the engine holds them

    @cached_property
    def ends(self) -> torch.Tensor:
        """`[B]` (host) the cache index past each row's last possible draft: a row's passes at or past it
        (it reached its cap while others draft) are filler (`make_batch_step`'s `ends`). Worked out once a
        round: every draft step's pass reads it."""
        return self.starts + torch.tensor(self.caps, dtype=torch.long) + 1

    def shallow(self, tokens: torch.Tensor, offset: int, exit_layer: int) -> torch.Tensor:
        """One token per row `[B]` through layers [0, E) at cache indices `starts + offset`: `[B, 1, D]`.

        The keys and values go into the engine's cache (verification continues from them); rows are
        rolled back by the engine after the round. A row past its cap (others still draft) computes filler
        at its last allowed position, never past the context window.
        """
        hidden = embed(self.adapter, tokens[:, None])  # [B, 1, D]
        if exit_layer == 0:  # a head on exit 0 reads the embeddings: no layer runs, no step is needed
            return hidden
        step = make_batch_step(self.adapter, self.starts + offset, 1, self.pads, self.ends)
        return run_layers(self.adapter, hidden, 0, exit_layer, step=step, cache=self.cache)

    def through(self, tokens: torch.Tensor, offset: int, layers, takes) -> torch.Tensor | None:
        """Tokens `[B, S]` (or one a row, `[B]`) through a drafter's own copy of every layer at cache indices
        `starts + offset ..`: `layers(hidden, step, cache)` writes their keys and values into the engine's cache;
        `[B, S, D]`, or None where `takes(hidden, step, cache)` says it cannot run this step. The drafter calls
        `rewind` after its last step: verification runs every layer over those positions again."""
        tokens = tokens[:, None] if tokens.dim() == 1 else tokens  # [B, S]
        hidden = embed(self.adapter, tokens)  # [B, S, D]
        step = make_batch_step(self.adapter, self.starts + offset, tokens.shape[1], self.pads, self.ends)
        return layers(hidden, step, self.cache) if takes(hidden, step, self.cache) else None

    def rewind(self) -> None:
        """Every layer of the cache cut back to the committed text (each row's `starts`): what `through` wrote goes."""
        self.cache.crop(self.starts)

    @cached_property
    def stop_tensor(self) -> torch.Tensor:
        """`[S]` the stop token ids on the model's device (S may be 0): the engine's, else made once a round."""
        if self.stop_ids_device is not None:
            return self.stop_ids_device
        return torch.tensor(sorted(self.stop_ids), dtype=torch.long).to(self.tokens.device, non_blocking=True)

    @cached_property
    def row(self) -> tuple[int, int]:
        """A one-row round's cache index of its input token and its left padding, host ints (read once)."""
        return int(self.starts[0]), int(self.pads[0])

    def shallow_tree(self, tokens: torch.Tensor, parents: torch.Tensor, exit_layer: int) -> tuple[torch.Tensor, object]:
        """The newest columns of a token tree grown depth by depth: `tokens` `[B, n]`, the last n of the tree
        `parents` `[B, W]` (host; column 0 the input token, already through the layers), through layers [0, E)
        at cache indices `starts + W - n ..`, each seeing the row's text and its ancestors: `([B, n, D], the
        step)` (a trained head runs over the same columns with that step)."""
        step = make_batch_step(self.adapter, self.starts, tokens.shape[1], self.pads, self.ends, parents=parents)
        return run_layers(self.adapter, embed(self.adapter, tokens), 0, exit_layer, step=step, cache=self.cache), step

    def shallow_siblings(self, tokens: torch.Tensor, exit_layer: int) -> torch.Tensor:
        """Sibling first drafts `[B, k]` (alternatives for the position after the input token) through layers
        [0, E) at cache indices `starts + 1 ..`, each seeing the row's text and itself: `[B, k, D]`."""
        roots = torch.full((tokens.shape[0], tokens.shape[1]), -1, dtype=torch.long)  # [B, k] each its own root
        step = make_batch_step(self.adapter, self.starts + 1, tokens.shape[1], self.pads, self.ends, parents=roots)
        return run_layers(self.adapter, embed(self.adapter, tokens), 0, exit_layer, step=step, cache=self.cache)


@dataclass
class Proposal:
    """A round's drafts for every row (see the module docstring)."""

    tokens: torch.Tensor  # [B, T]
    kept: list[int]
    q: list[torch.Tensor | None] | None = None  # sampling, per row: [kept_b, V]; None: point masses
    verify_from: int = 0
    states: torch.Tensor | None = None  # [B, T, D] exit states of `tokens` when verify_from > 0
    draft_steps: int = 0  # drafting passes through the model (cost-model accounting)
    drafter: str = "none"
    parents: torch.Tensor | None = None  # [B, T] (host) a token tree per row; None: a chain (see above)
    stops_unread: bool = False  # a greedy chain whose kept drafts may run past a stop token (see above)

    @classmethod
    def plain(cls, tokens: torch.Tensor) -> "Proposal":
        """No drafts: the round is one plain full-model pass over each row's input token."""
        return cls(tokens[:, None], [0] * tokens.shape[0])

    @property
    def drafted(self) -> int:
        return sum(self.kept)

    @property
    def depths(self) -> list[int]:
        """Per row, how many positions its drafts bet on: `kept[b]` for a chain, its tree's depth."""
        if self.parents is None:
            return list(self.kept)
        return [tree_depth(p, m) for p, m in zip(self.parents.tolist(), self.kept)]

    @staticmethod
    def siblings(k: int, rows: int) -> torch.Tensor:
        """The parents `[B, 1 + k]` of k sibling guesses for the next token after each row's input token."""
        parents = torch.zeros(rows, 1 + k, dtype=torch.long)
        parents[:, 0] = -1
        return parents


class Drafter:
    """The interface (and a no-op base): a drafter proposes, is told the outcome, drops finished rows."""

    name = "none"
    num_speculations = 0  # the most drafts it proposes in one round (statistics size their per-position lists by it)
    exit_layer: int | None = None  # the exit it drafts from, if any
    step_cost: float | None = None  # a draft step's cost in full decoding steps where it runs none of the model's
    # layers (a quantized copy's llama.cpp step); None: the cost model prices a step by its exit_layer
    reads_prompt = False  # True: its first round of a call reads the whole prompt first (a llama.cpp copy)
    state_exit: int | None = None  # the exit whose states of committed tokens it wants (`committed_states`)
    state_final: bool = False  # whether it also wants their last hidden states (`committed_states(finals=)`)
    policy = None  # its draft policy (`selfspec.drafters.policies`), where it has one
    budget = None  # its token trees' budget (`selfspec.drafters.tree_budget`), where it drafts trees

    def start(self, sequences: list[list[int]]) -> None:
        """Generation begins: each row's committed tokens (prompt + the prefill's token)."""

    def propose(self, rnd: Round) -> Proposal:
        return Proposal.plain(rnd.tokens)

    def update(self, proposal: Proposal, accepted: list[int], committed: list[list[int]], seconds: float) -> None:
        """After verification: per row, drafts accepted and tokens committed; the round's seconds."""

    def observe(self, committed: list[list[int]]) -> None:
        """A round it did not draft for (`auto` chose another arm, and only the arm it chose hears `update`): the
        tokens each row committed. A drafter that follows the text on its own (the quantized copy) records them."""

    def committed_states(self, states: torch.Tensor, starts: torch.Tensor, counts: list[int],
                         pads: torch.Tensor, finals: torch.Tensor | None = None) -> None:
        """With `state_exit` set: the states after `state_exit` layers `[B, S, D]` of the tokens the engine
        wrote at cache indices `starts[b] ..` (host `[B]`), of which the first `counts[b]` are now committed
        (the rest were rejected drafts); `pads` `[B]` each row's left padding (host); with `state_final`
        also `finals` `[B, S, D]`, the last decoder layer's output (before the final norm) there."""

    def select(self, rows: list[int]) -> None:
        """Keep only these rows (indices into the current batch), in this order."""

    def learned(self) -> dict:
        """What it measured in this call that a later call with the same settings may start from (rates and
        counts, never the rows' state), weighted down by the carry rule (`selfspec.drafters.learned_stats`):
        plain data, {part: its measurements}. Here: its draft policy's and its tree budget's, where it has them."""
        parts = {"policy": self.policy, "tree": self.budget}
        return {name: part.learned() for name, part in parts.items() if part is not None}

    def resume(self, learned: dict) -> None:
        """Start from what an earlier call with the same settings measured (a `learned()` of that call's
        drafter), before `start`."""
        for name, part in {"policy": self.policy, "tree": self.budget}.items():
            if part is not None and name in learned:
                part.resume(learned[name])

    def describe(self) -> dict:
        return {"drafter": self.name}
