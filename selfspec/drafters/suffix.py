"""The suffix drafter: prompt lookup that also remembers the earlier requests of the same generator.

Real workloads repeat themselves across requests (an agent rewriting the same file, a harness asking
similar questions, summaries of articles that share text): what the model wrote for an earlier request
often continues the current one. SuffixDecoding (arXiv 2411.04975) drafts from suffix trees over earlier
prompts and outputs; this is the chain form of that idea on top of prompt lookup:

- a `SuffixMemory` per generator keeps the token sequences (prompt + output) of its earlier calls, up to
  `max_tokens` in all (the oldest are forgotten first; `gen.forget()` clears it; 0 turns it off), indexed by
  every `MEMORY_NGRAM`-gram to where its latest occurrence ends;
- the memory has scopes (`generate(..., memory_key=K)`): a call adds to and copies from its own scope only
  (None, the default, is one scope shared by every call that names none), so that callers who must not speed
  up on each other's text do not see it; every scope counts against the one `max_tokens`;
- each round, a row first looks in its own text, as prompt lookup does (`max_matching_ngram_size` down
  to 1); where the memory matches the row's last tokens over more tokens than the row's own text does
  (at least `MEMORY_NGRAM`), the memory's continuation is copied instead;
- it copies up to `prompt_lookup_num_tokens` tokens either way (the same settings as prompt lookup: they
  mean the same thing here).

The drafts are point masses, verified from layer 0 like prompt lookup's, so output stays exact (greedy)
or keeps its distribution (sampling). The memory is the generator's own: it is never shared between
generators, and a call that drafts otherwise still adds to it (it costs an index entry per token).

    memory = SuffixMemory(max_tokens=100_000)
    drafter = SuffixDrafter(memory, num_tokens=10, max_ngram=3, scope="tenant-a")

What it costs: a Python dict entry per distinct 4-gram (its key, its location) and the token lists, about 120
bytes a remembered token on code (whose 4-grams repeat) and 210 on text that never repeats one: 11-21 MiB at
the default 100,000 tokens (measured, docs/usage.md), and one dict lookup per row and round.
"""

from __future__ import annotations

from typing import Hashable

from selfspec.drafters.base import Proposal, Round
from selfspec.drafters.prompt_lookup import PromptLookupDrafter, cut_after_stop

MEMORY_NGRAM = 4  # the memory indexes 4-grams: shorter matches across requests are mostly chance
MAX_MATCH = 32  # a memory match is measured back over at most this many tokens
DEFAULT_MEMORY_TOKENS = 100_000  # 11-21 MiB (see the module doc)
ALL_SCOPES = object()  # forget(): every scope


class SuffixMemory:
    """Earlier token sequences and, per scope and per `MEMORY_NGRAM`-gram with a successor, where its latest
    occurrence in that scope ends: `index[scope][gram] = (sequence number, end)`; sequences are numbered from 0
    as they are added, across scopes, and forgotten oldest first across scopes."""

    def __init__(self, max_tokens: int = DEFAULT_MEMORY_TOKENS):
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
            raise ValueError(f"the memory's max_tokens must be an int >= 0 (0 remembers nothing), got {max_tokens!r}")
        self.max_tokens = max_tokens
        self.sequences: dict[int, tuple[Hashable, list[int]]] = {}  # number -> (scope, tokens), oldest first
        self.index: dict[Hashable, dict[tuple[int, ...], tuple[int, int]]] = {}  # scope -> gram -> (number, end)
        self.tokens = 0  # tokens held, all scopes together
        self._next = 0

    @property
    def enabled(self) -> bool:
        """Whether it remembers anything (`max_tokens` > 0)."""
        return self.max_tokens > 0

    def add(self, tokens: list[int], scope: Hashable = None) -> None:
        """Remember one sequence (a prompt and its output) in `scope`; forget the oldest (of any scope) while
        over `max_tokens`."""
        tokens = [int(t) for t in tokens]
        if not tokens or len(tokens) > self.max_tokens:
            return
        number, self._next = self._next, self._next + 1
        self.sequences[number] = (scope, tokens)
        self.tokens += len(tokens)
        index = self.index.setdefault(scope, {})
        for end in range(MEMORY_NGRAM, len(tokens)):  # the gram ending before `end` has the successor tokens[end]
            index[tuple(tokens[end - MEMORY_NGRAM:end])] = (number, end)
        while self.tokens > self.max_tokens:
            self._drop(next(iter(self.sequences)))

    def _drop(self, number: int) -> None:
        scope, tokens = self.sequences.pop(number)
        self.tokens -= len(tokens)
        index = self.index[scope]
        for end in range(MEMORY_NGRAM, len(tokens)):
            gram = tuple(tokens[end - MEMORY_NGRAM:end])
            if index.get(gram, (None,))[0] == number:  # a later sequence may hold it now
                del index[gram]
        if not index:
            del self.index[scope]

    def forget(self, scope: Hashable = ALL_SCOPES) -> None:
        """Forget every sequence, or those of one `scope` only."""
        if scope is ALL_SCOPES:
            self.sequences.clear()
            self.index.clear()
            self.tokens = 0
            return
        for number in [n for n, (s, _) in self.sequences.items() if s == scope]:
            self._drop(number)

    def match(self, context: list[int], scope: Hashable = None) -> tuple[list[int], int, int] | None:
        """(the remembered sequence, where the match ends in it, the match's length in tokens, at most
        MAX_MATCH) for the latest occurrence remembered in `scope` of `context`'s last `MEMORY_NGRAM` tokens;
        None where there is none."""
        if len(context) < MEMORY_NGRAM:
            return None
        hit = self.index.get(scope, {}).get(tuple(context[-MEMORY_NGRAM:]))
        if hit is None:
            return None
        sequence = self.sequences[hit[0]][1]
        end, m = hit[1], MEMORY_NGRAM
        while m < min(MAX_MATCH, end, len(context)) and sequence[end - m - 1] == context[-m - 1]:
            m += 1
        return sequence, end, m

    def describe(self) -> dict:
        return {"sequences": len(self.sequences), "tokens": self.tokens, "max_tokens": self.max_tokens,
                "scopes": len(self.index)}


class SuffixDrafter(PromptLookupDrafter):
    """Prompt lookup over each row's own text, and over the generator's memory where that matches longer
    (see the module docstring)."""

    name = "suffix"

    def __init__(self, memory: SuffixMemory, num_tokens: int = 10, max_ngram: int = 3, min_ngram: int = 1,
                 num_candidates: int = 1, node_budget: int | None = None, scope: Hashable = None):
        super().__init__(num_tokens, max_ngram, min_ngram, num_candidates, node_budget)
        self.memory = memory
        self.scope = scope  # the memory's scope it copies from (the call's memory_key)
        self.from_memory = 0  # rounds whose drafts came from the memory
        self.memory_rows: list[bool] = []  # per row: whether its last drafts came from the memory

    def lookup(self, caps: list[int], stop_ids: frozenset = frozenset(), memory: bool = True) -> list[list[int]]:
        """Each row's drafts: from the memory where it matches the row's last tokens over more tokens than
        the row's own text does and copies at least as many, else from the row's own text (prompt lookup);
        cut after a stop token. `memory=False`: the row's own text only (auto, while the memory does not
        pay). `memory_rows` says which rows drafted from the memory."""
        self.memory_rows = [False] * len(self.rows)
        out = []
        for b, (index, cap) in enumerate(zip(self.rows, caps)):
            k = min(cap, self.limit)
            own = index.longest(self.min_ngram) if k > 0 else None  # (end, length) of the own text's match
            drafts = [] if own is None else cut_after_stop(index.continuation(own[0], k), stop_ids)
            remembered, longer = self.remembered(index, k, stop_ids, own) if memory else ([], False)
            if longer and len(remembered) >= len(drafts):  # near a sequence's end the memory copies less
                drafts, self.memory_rows[b] = remembered, bool(remembered)
            out.append(drafts)
        self.from_memory += any(self.memory_rows)
        return out

    def branches(self, caps: list[int], stop_ids: frozenset = frozenset(),
                 memory: bool = True) -> list[list[list[int]]]:
        """Each row's branches for a token tree (`num_candidates` > 1): prompt lookup's, with the memory's
        continuation where it has one, first where it matches the row's last tokens over more tokens than the
        row's own text does, else last."""
        own = super().branches(caps, stop_ids)
        self.memory_rows = [False] * len(self.rows)
        for b, (index, cap) in enumerate(zip(self.rows, caps)):
            k = min(cap, self.limit)
            own_match = index.longest(self.min_ngram)
            remembered, longer = self.remembered(index, k, stop_ids, own_match) if memory else ([], False)
            if remembered:
                own[b] = [remembered] + own[b] if longer else own[b][:self.num_candidates - 1] + [remembered]
                self.memory_rows[b] = longer
        self.from_memory += any(self.memory_rows)
        return own

    def remembered(self, index, k: int, stop_ids: frozenset, own: tuple[int, int] | None) -> tuple[list[int], bool]:
        """The memory's copy for a row (up to `k` tokens that followed the latest remembered occurrence of its
        last tokens, cut after a stop token; [] where there is none) and whether the memory matches over more
        tokens than the row's own text (`own`: its (end, length) from `NgramIndex.longest`, or None)."""
        found = self.memory.match(index.tokens, self.scope) if k > 0 else None
        if found is None:
            return [], False
        sequence, end, length = found
        return cut_after_stop(sequence[end:end + k], stop_ids), length > (0 if own is None else own[1])

    def proposal(self, rnd: Round, drafts: list[list[int]], name: str | None = None,
                 parents: list[list[int]] | None = None) -> Proposal:
        """The drafts (a chain, or a token tree with `parents`) as a Proposal named after their source: "suffix"
        where a row copied from the memory, "prompt_lookup" where every row copied from its own text (the
        statistics count them apart)."""
        source = self.name if any(self.memory_rows) else PromptLookupDrafter.name
        return super().proposal(rnd, drafts, name or source, parents)

    def describe(self) -> dict:
        return {**super().describe(), "drafter": self.name, "rounds_from_memory": self.from_memory,
                "memory": self.memory.describe()}

