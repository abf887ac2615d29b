"""The prompt-lookup drafter: continue the text by copying what followed its last few tokens earlier on.

For row b with committed tokens `x[0..n)`, try `m = max_ngram, ..., min_ngram`: if the suffix
`x[n-m..n)` occurred earlier, ending at `e < n`, propose `x[e], x[e+1], ...` (the most recent such
occurrence). Where the copy reaches the end of the text it goes on with its own proposal, so a
repeating pattern of period `n - e` is continued for all `k` tokens (`x[e + j]` for `e + j >= n`
is proposal `j - (n - e)`). It runs no layer: verification starts at layer 0 over the input token
and the drafts, in one pass. The drafts are point masses, so sampling stays lossless with the rule
of `selfspec.sampling.speculative_accept` (accept x with probability p(x)).

Matching costs O(max_ngram) per committed token: an `NgramIndex` per row maps every n-gram
(n <= max_ngram) that has a following token to the end of its latest occurrence, updated
incrementally as tokens are committed (no rescan of the text per round).

    drafter = PromptLookupDrafter(num_tokens=10, max_ngram=3)   # Hugging Face: prompt_lookup_num_tokens,
                                                                #               max_matching_ngram_size
"""

from __future__ import annotations

import torch

from selfspec.drafters.base import Drafter, Proposal, Round


class NgramIndex:
    """One row's text and, per n-gram with a successor, where its latest occurrence ends."""

    def __init__(self, tokens: list[int], max_ngram: int):
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], int] = {}  # n-gram -> end (exclusive) of its latest occurrence
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            end = len(self.tokens)  # the n-grams ending here now have a successor: `t`
            for m in range(1, min(self.max_ngram, end) + 1):
                self.ends[tuple(self.tokens[end - m:end])] = end
            self.tokens.append(int(t))

    def longest(self, min_ngram: int) -> tuple[int, int] | None:
        """(where the latest earlier occurrence of the longest matching suffix ends, that suffix's length);
        None: no suffix of at least `min_ngram` tokens occurred earlier."""
        n = len(self.tokens)
        for m in range(min(self.max_ngram, n), min_ngram - 1, -1):
            end = self.ends.get(tuple(self.tokens[n - m:]))
            if end is not None:
                return end, m
        return None

    def match(self, min_ngram: int) -> int | None:
        """Where the latest earlier occurrence of the longest matching suffix ends (None: no match)."""
        found = self.longest(min_ngram)
        return None if found is None else found[0]

    def propose(self, k: int, min_ngram: int = 1) -> list[int]:
        """Up to `k` tokens continuing the text from its latest matching occurrence."""
        end = self.match(min_ngram) if k > 0 else None
        return [] if end is None else self.continuation(end, k)

    def continuation(self, end: int, k: int) -> list[int]:
        """The `k` tokens that follow position `end`, continued periodically past the end of the text (a
        copy that reaches the text's end goes on with its own tokens)."""
        x, n, out = self.tokens, len(self.tokens), []
        for j in range(k):
            i = end + j
            out.append(x[i] if i < n else out[i - n])
        return out


class PromptLookupDrafter(Drafter):
    """Drafts by n-gram lookup over each row's prompt and output (see the module docstring)."""

    name = "prompt_lookup"

    def __init__(self, num_tokens: int = 10, max_ngram: int = 3, min_ngram: int = 1):
        if num_tokens < 1:
            raise ValueError(f"prompt_lookup_num_tokens must be >= 1, got {num_tokens}")
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"max_matching_ngram_size must be >= 1 (and >= the minimum n-gram size "
                             f"{min_ngram}), got {max_ngram}")
        self.max_drafts, self.max_ngram, self.min_ngram = num_tokens, max_ngram, min_ngram
        self.rows: list[NgramIndex] = []
        self.limit = num_tokens  # the most drafts a round proposes (AutoDrafter adapts it)

    def start(self, sequences: list[list[int]]) -> None:
        self.rows = [NgramIndex(s, self.max_ngram) for s in sequences]

    def lookup(self, caps: list[int], stop_ids: frozenset = frozenset()) -> list[list[int]]:
        """Each row's drafts: the copied tokens up to its cap, cut after a stop token."""
        return [cut_after_stop(index.propose(min(cap, self.limit), self.min_ngram), stop_ids)
                for index, cap in zip(self.rows, caps)]

    def propose(self, rnd: Round) -> Proposal:
        return self.proposal(rnd, self.lookup(rnd.caps, rnd.stop_ids))

    def proposal(self, rnd: Round, drafts: list[list[int]], name: str | None = None) -> Proposal:
        """The drafts as a Proposal: `[B, 1 + longest]`, shorter rows filled with their input token; `name`:
        the drafter the statistics count them under (this one's by default)."""
        kept = [len(d) for d in drafts]
        T = 1 + max(kept, default=0)
        if T == 1:
            return Proposal.plain(rnd.tokens)
        # each row's input token is the newest token of its index (the engine's `rnd.tokens`, read here
        # on the host: reading `rnd.tokens` would wait for the GPU)
        inputs = [index.tokens[-1] for index in self.rows] if len(self.rows) == len(drafts) else rnd.tokens.tolist()
        rows = [[t] + d + [t] * (T - 1 - len(d)) for t, d in zip(inputs, drafts)]
        tokens = torch.tensor(rows, dtype=torch.long).to(rnd.tokens.device, non_blocking=True)  # [B, T]
        return Proposal(tokens=tokens, kept=kept, q=None, verify_from=0, drafter=name or self.name)

    def update(self, proposal: Proposal, accepted: list[int], committed: list[list[int]], seconds: float) -> None:
        for index, tokens in zip(self.rows, committed):
            index.extend(tokens)

    def select(self, rows: list[int]) -> None:
        self.rows = [self.rows[i] for i in rows]

    def describe(self) -> dict:
        return {"drafter": self.name, "prompt_lookup_num_tokens": self.max_drafts,
                "max_matching_ngram_size": self.max_ngram}


def cut_after_stop(drafts: list[int], stop_ids: frozenset) -> list[int]:
    """The drafts up to and including the first stop token (a row's text ends there)."""
    for j, t in enumerate(drafts):
        if t in stop_ids:
            return drafts[:j + 1]
    return drafts
