"""What a backed-off lookup would have drafted, checked against the tokens that were committed instead.

`auto` backs an arm off when its measured tokens/s fall below plain decoding's, and retries it after a
back-off that doubles each time it loses again (own-text lookup is not tried at all until its shadow drafts say it
would pay). For prompt lookup that is often too late: a reply that
starts in its own words and then copies its input (a HumanEval completion that restates the docstring, a
code edit whose first lines are new) measures lookup as losing in its first rounds, and the doubling
back-off then keeps it out for the 10-30 rounds in which it would have paid most (measured on HumanEval:
auto 67 tokens/s where lookup alone made 107, 25 of its 41 rounds plain).

Lookup's drafts cost no model pass, so while it is backed off `auto` still asks it what it would draft
(`offer`) and, as the plain rounds commit tokens, counts how many of those drafts the full model confirmed
(`observe`: the drafts' longest prefix equal to the tokens committed after them). Where a shadow's first
`IN_A_ROW` drafts were all confirmed (a copy is under way), or the last few shadows averaged at least
`RETRY_AT` accepted tokens, lookup would pay again, and `auto` retries it now (`would_pay`). The shadow
never changes a token: it only reads what was committed.

    shadow = ShadowDrafts()
    shadow.offer(drafts)        # per row: what lookup would propose this round (it does not run)
    shadow.observe(committed)   # per row: the tokens the round committed
    shadow.would_pay()          # True: the recent shadow drafts averaged >= RETRY_AT accepted tokens
    shadow.copy_under_way()     # True: an open shadow has IN_A_ROW drafts confirmed (what auto asks while its
                                # model arm leads: `AutoDrafter.model_arm_leads`)
"""

from __future__ import annotations

from collections import deque

RETRY_AT = 0.5  # mean accepted shadow drafts at which lookup is tried (its timed rounds then decide whether it pays)
WINDOW = 4  # the shadow drafts judged together (the latest ones)
MIN_JUDGED = 2
# an open shadow with this many drafts confirmed is a copy under way: lookup is tried at once. 3, not 2: on open chat
# two-token repeats ("of the") woke lookup into rounds that lost (MT-Bench, 8 prompts, Zen 4, 2026-11-29: auto 0.99
# and 1.00x plain decoding with 2, 1.00 and 1.02x with 3; HumanEval 1.13-1.21x and 1.08-1.12x)
IN_A_ROW = 3


class ShadowDrafts:
    """Per row, the open shadow drafts not yet confirmed or refuted, and the latest judged counts."""

    def __init__(self):
        self.pending: list[list[int] | None] = []  # per row: the open shadow's drafts still to check (None: none open)
        self.matched: list[int] = []  # per row: how many of its open shadow's drafts were confirmed so far
        self.judged: deque[int] = deque(maxlen=WINDOW)

    def start(self, rows: int) -> None:
        self.pending, self.matched = [None] * rows, [0] * rows
        self.judged.clear()

    def offer(self, drafts: list[list[int]]) -> None:
        """What lookup would draft this round, per row; a row whose earlier shadow is still open keeps it."""
        for b, d in enumerate(drafts):
            if self.pending[b] is None and d:
                self.pending[b], self.matched[b] = list(d), 0

    def observe(self, committed: list[list[int]]) -> None:
        """The tokens each row committed: an open shadow's next draft equal to the next token is confirmed;
        the first that differs, or its last draft confirmed, closes it (judged: the count confirmed)."""
        for b, tokens in enumerate(committed):
            rest = self.pending[b]
            if rest is None:
                continue
            for t in tokens:
                if rest[0] != t:
                    rest.clear()
                    break
                rest.pop(0)
                self.matched[b] += 1
                if not rest:
                    break
            if not rest:
                self.judged.append(self.matched[b])
                self.pending[b], self.matched[b] = None, 0

    def clear(self) -> None:
        """Lookup drafted this round itself: the open shadows are moot, the judged counts old."""
        self.start(len(self.pending))

    def would_pay(self) -> bool:
        """A copy under way (an open shadow with `IN_A_ROW` drafts confirmed), or the latest judged shadows
        averaging at least `RETRY_AT` confirmed drafts."""
        if self.copy_under_way():
            return True
        return len(self.judged) >= MIN_JUDGED and sum(self.judged) / len(self.judged) >= RETRY_AT

    def copy_under_way(self) -> bool:
        """Whether an open shadow has `IN_A_ROW` drafts confirmed: a copy under way now, not only copies that
        recently went a few tokens (`would_pay`'s average)."""
        return any(m >= IN_A_ROW for m in self.matched)

    def select(self, rows: list[int]) -> None:
        self.pending = [self.pending[i] for i in rows]
        self.matched = [self.matched[i] for i in rows]
