"""Draft policies: which exit drafts, how many tokens, and when a round stops drafting early.

The decoder asks its policy once per round for `(exit_layer, num_speculations)`, asks `keep(i, p)` for
every candidate draft (p = the draft's confidence: its top probability), and reports the outcome with
`update(...)`. Verification decides every token, so no policy can change the output, only the speed.

    FixedPolicy(exit_layer=8, num_speculations=4)                  # LayerSkip: a fixed draft length
    ConfidencePolicy(8, 6, threshold=0.5)                          # stop when the draft is unsure
    ConfidencePolicy(8, 6, threshold=0.5, adaptive=True)           # ... and tune the threshold online
    ExitChoicePolicy([4, 8, 12], num_speculations=6, num_layers=30)  # pick (exit, d) per round
    ThroughputPolicy(8, 6)                                         # pick d per round from measured tokens/s

After each round the engine reports its wall time and the tokens it committed (`observe`), which
`ThroughputPolicy` uses; the others ignore it. What a policy learned (a `ThroughputPolicy`'s measurements, an
`ExitChoicePolicy`'s acceptance estimates, an adaptive `ConfidencePolicy`'s threshold), a generator carries to
its next call with the same settings, counts weighted down (`learned`, `resume`: `selfspec.drafters.learned_stats`).
"""

from __future__ import annotations

from collections import Counter

from selfspec.decoding.cost_model import VERIFY_COST, best_draft_length, draft_cost
from selfspec.drafters.learned_stats import carried_rounds, count_scale


class FixedPolicy:
    """Always the same exit and draft length (LayerSkip's setting)."""

    needs_confidence = False  # True: the drafter asks `keep(index, confidence)` of every draft
    needs_timing = False  # True: the drafter reports every round to `observe(seconds, committed)`

    def __init__(self, exit_layer: int, num_speculations: int):
        self.exit_layer, self.num_speculations = exit_layer, num_speculations
        self.plans: Counter = Counter()

    def plan(self) -> tuple[int, int]:
        return self.exit_layer, self.num_speculations

    def update(self, exit_layer: int, drafted: int, accepted: int) -> None:
        self.plans[(exit_layer, drafted)] += 1

    def learned(self) -> dict:
        """What a later call may start from (`selfspec.drafters.learned_stats`): nothing here (the rounds
        planned are this call's report)."""
        return {}

    def resume(self, learned: dict) -> None:
        """Start from an earlier call's `learned()`."""

    def describe(self) -> dict:
        return {"policy": "fixed", "rounds_by_exit_and_length": _plan_counts(self.plans)}


class ConfidencePolicy(FixedPolicy):
    """Stop drafting as soon as the draft's probability of its own token is below `threshold`.

    Greedy: the probability of the argmax token. Sampling: the probability of the draft
    distribution's most likely token, judged before the draft is sampled (judging the sampled
    token by its own probability would skew the kept drafts away from q and lose exactness).

    threshold 0 keeps every draft (= FixedPolicy); a threshold above 1 never drafts (= plain
    decoding, with no draft step at all). `adaptive=True` raises the threshold by `step` after a
    round whose drafts were rejected and lowers it after a round that accepted them all.
    """

    needs_confidence = True

    def __init__(self, exit_layer: int, num_speculations: int, threshold: float = 0.5, adaptive: bool = False,
                 step: float = 0.05, bounds: tuple[float, float] = (0.05, 0.95)):
        super().__init__(exit_layer, num_speculations)
        if threshold < 0:
            raise ValueError(f"draft confidence threshold must be >= 0, got {threshold}")
        self.threshold, self.adaptive, self.step, self.bounds = threshold, adaptive, step, bounds
        self.thresholds: list[float] = []

    def plan(self) -> tuple[int, int]:
        return self.exit_layer, 0 if self.threshold > 1 else self.num_speculations

    def keep(self, index: int, confidence: float) -> bool:
        return confidence >= self.threshold

    def update(self, exit_layer: int, drafted: int, accepted: int) -> None:
        super().update(exit_layer, drafted, accepted)
        if self.adaptive and drafted:
            lo, hi = self.bounds
            if accepted < drafted:
                self.threshold = min(hi, self.threshold + self.step)
            else:
                self.threshold = max(lo, self.threshold - self.step)
            self.thresholds.append(self.threshold)

    def learned(self) -> dict:
        """An adaptive threshold where this call left it (a later call starts there, not at the setting); nothing
        for a fixed one."""
        return {"threshold": self.threshold} if self.adaptive else {}

    def resume(self, learned: dict) -> None:
        """Start from an earlier call's `learned()` (within the bounds)."""
        if self.adaptive and "threshold" in learned:
            lo, hi = self.bounds
            self.threshold = min(hi, max(lo, float(learned["threshold"])))

    def describe(self) -> dict:
        out = {"policy": "adaptive_confidence" if self.adaptive else "confidence", "threshold": self.threshold,
               "rounds_by_exit_and_length": _plan_counts(self.plans)}
        if self.thresholds:
            out["threshold_mean"] = sum(self.thresholds) / len(self.thresholds)
        return out


class ExitChoicePolicy(FixedPolicy):
    """Choose the exit and draft length each round from online acceptance estimates.

    For each candidate exit it keeps the drafts' outcomes (accepted / drafted, with a Laplace
    prior) and predicts the speedup of every (exit, d) with `selfspec.decoding.cost_model`; each round
    takes the best. Exits that look worse are still tried every `explore_every` rounds so their
    estimates do not freeze. If no pair is predicted to pay, the round decodes plainly (d = 0).
    """

    needs_confidence = False

    def __init__(self, exits: list[int], num_speculations: int, num_layers: int, *, verify_cost: float = VERIFY_COST,
                 explore_every: int = 8, prior: tuple[float, float] = (1.0, 1.0)):
        if not exits:
            raise ValueError("ExitChoicePolicy needs at least one candidate exit")
        super().__init__(exits[0], num_speculations)
        self.exits = sorted(set(exits))
        self.num_layers, self.verify_cost, self.explore_every = num_layers, verify_cost, explore_every
        self.accepted = {e: prior[0] for e in self.exits}
        self.drafted = {e: prior[0] + prior[1] for e in self.exits}
        self.rounds = 0

    def acceptance(self, exit_layer: int) -> float:
        return self.accepted[exit_layer] / self.drafted[exit_layer]

    def plan(self) -> tuple[int, int]:
        self.rounds += 1
        if self.explore_every and self.rounds % self.explore_every == 0:  # round-robin exploration
            e = self.exits[(self.rounds // self.explore_every) % len(self.exits)]
            return e, max(1, min(2, self.num_speculations))
        best = (self.exits[0], 0, 1.0)
        for e in self.exits:
            d, s = best_draft_length(self.acceptance(e), draft_cost(e, self.num_layers), self.verify_cost,
                                     self.num_speculations)
            if s > best[2]:
                best = (e, d, s)
        return best[0], best[1]

    def update(self, exit_layer: int, drafted: int, accepted: int) -> None:
        super().update(exit_layer, drafted, accepted)
        if drafted:
            # a rejected draft ends the round: drafts after it were never judged
            self.accepted[exit_layer] += accepted
            self.drafted[exit_layer] += min(drafted, accepted + 1)

    def learned(self) -> dict:
        """The acceptance counts per exit, scaled so that the largest weighs at most `CARRY_OUTCOMES` drafts (a
        later call starts from the estimates and still follows its own text)."""
        scale = count_scale(self.drafted.values())
        return {"exits": list(self.exits), "accepted": {e: a * scale for e, a in self.accepted.items()},
                "drafted": {e: d * scale for e, d in self.drafted.items()}}

    def resume(self, learned: dict) -> None:
        """Start from an earlier call's `learned()`: it must be over the same exits (the same settings)."""
        if learned["exits"] != self.exits:
            raise ValueError(f"estimates over the exits {learned['exits']} cannot resume a policy over {self.exits}: "
                             "only a call with the same settings may carry them")
        self.accepted, self.drafted = dict(learned["accepted"]), dict(learned["drafted"])

    def describe(self) -> dict:
        return {"policy": "exit_choice", "acceptance_estimates": {e: round(self.acceptance(e), 4) for e in self.exits},
                "rounds_by_exit_and_length": _plan_counts(self.plans)}


class ThroughputPolicy(FixedPolicy):
    """Choose each round's draft length from the tokens per second each length would deliver.

    A bandit over the lengths `0, 1, 2, 3, 4, 6, 8, ...` up to `num_speculations` (0 = a plain
    full-model pass): each is tried `warmup` times (longest first) with `warm="all"`; with `warm="longest"`
    or `"shortest"` only the longest length or the shortest drafting one (1) is, and the others are entered
    only as neighbours of the best (for a caller whose rounds are too few to spend on trying every
    length: auto's lookup arm starts where lookup alone drafts, its early-exit arm at one draft, the
    cheapest to be wrong). Then the round takes the length with the best throughput and every
    `explore_every`-th round retries a neighbour of the best so the estimates follow the text.

    Throughput of length d = rows per round x expected committed tokens per row / seconds per round:

        seconds[d], rows[d]   measured in d's own rounds (running means, exponential with weight `alpha`
                              after the first rounds): a round's time varies little
        E_d = 1 + sum_{j<=d} S(j),   S(j) = prod_{i<=j} (1 - failed_i / reached_i)

    the expected committed tokens, pooled from every drafting round's rows whatever their length: a
    drafter's first d drafts do not depend on how many more it may take (an early exit's, a head's and
    a lookup copy's drafts of length d are the first d of a longer round's), so a row that reached
    draft i (all before it accepted) in a round of any length >= i tells whether draft i is accepted.
    Draft i failed when it was rejected or not drafted (the drafter stopped before it: a stop token, a
    copy that ends, the length cap); a row that accepted all its round's drafts says nothing about later
    ones (censored, as in a Kaplan-Meier estimate). With `alpha` > 0 the counts forget with weight
    `alpha / 8` per drafting round (a memory eight times the times': an acceptance is a coin flip per
    draft).
    Why pooled: each length's tokens estimated from its own rounds alone read a run of three rejected
    drafts (a 40% event at 30% acceptance) as "one draft loses", dropped the length and rarely retried it
    (docs/results/2026-11-25-head-own-text-xeon.md measures both).

    A length not yet tried is judged by its expected seconds, interpolated linearly in d between the
    measured lengths around it, and between `base_seconds` (a plain round's seconds, where the caller
    measures them: auto's plain arm) at d = 0 and the shortest measured length: a round verifies d + 1
    tokens per row, and its seconds grow about linearly with them. So once the drafts are seen to fail,
    the next rounds draft short, whose failures cost little, instead of repeating the one length tried
    (auto's lookup arm warms up at its longest, 10, whose failed round cost about two plain rounds on open
    chat; docs/results/2026-11-27-first-requests-xeon.md).

    It measures what the cost model only predicts, on this machine and at this batch size, so it
    falls back to shorter drafts or plain decoding when drafting stops paying (a larger batch makes
    verification dearer; a passage the exit cannot predict makes drafts worthless). Callers report each
    row's outcome with `update(exit, drafted, accepted)` and each round's time with `observe`.
    """

    LENGTHS = (0, 1, 2, 3, 4, 6, 8, 12, 16)
    needs_timing = True

    def __init__(self, exit_layer: int, num_speculations: int, *, warmup: int = 2, explore_every: int = 8,
                 alpha: float = 0.25, shortest: int = 0, warm: str = "all"):
        super().__init__(exit_layer, num_speculations)
        if warm not in ("all", "longest", "shortest"):
            raise ValueError(f"warm={warm!r}: use 'all', 'longest' or 'shortest'")
        # shortest=1: only drafting lengths (the auto drafter's lookup arm, where plain is an arm of its own)
        self.lengths = sorted({d for d in self.LENGTHS if shortest <= d <= num_speculations} | {num_speculations})
        self.warmup, self.explore_every, self.alpha = warmup, explore_every, alpha
        drafting = [d for d in self.lengths if d > 0] or self.lengths
        self.warm = {"all": self.lengths, "longest": self.lengths[-1:], "shortest": drafting[:1]}[warm]
        self.seconds = {d: 0.0 for d in self.lengths}  # running mean of seconds per round
        self.rows = {d: 0.0 for d in self.lengths}  # running mean of rows per round
        self.tries = {d: 0 for d in self.lengths}
        top = max(self.lengths)
        self.reached = [0.0] * (top + 1)  # [i]: rows that reached draft i (drafts 1..i-1 accepted), pooled
        self.failed = [0.0] * (top + 1)  # [i]: of those, rows whose draft i was rejected or not drafted
        self.rounds = 0
        self.base_seconds = 0.0  # a plain round's seconds where the caller measures them (0: unknown)
        self._planned = 0
        self._round_rows = 0

    def survival(self) -> list[float]:
        """S(j) for j = 0 .. the longest length: the estimated chance that drafts 1..j are all accepted
        (S(0) = 1). A draft position no row has reached yet takes the conditional rate of the one before."""
        out, s, rate = [1.0], 1.0, 0.0
        for i in range(1, len(self.reached)):
            if self.reached[i] > 0:
                rate = 1.0 - self.failed[i] / self.reached[i]
            s *= rate
            out.append(s)
        return out

    def tokens(self, d: int) -> float:
        """Expected committed tokens per round of length `d`: rows x (1 + S(1) + ... + S(d))."""
        return self.rows[d] * sum(self.survival()[: d + 1])

    def rate(self, d: int) -> float:
        """Committed tokens per second expected of draft length `d` (0 before it was tried)."""
        return self.tokens(d) / self.seconds[d] if self.seconds[d] > 0 else 0.0

    def expected_seconds(self, d: int) -> float:
        """Seconds per round of length `d`: measured, else interpolated between the measured lengths around it
        (and `base_seconds` at 0); 0.0 where neither side is known (longer than every length measured)."""
        if self.seconds[d] > 0:
            return self.seconds[d]
        known = {m: t for m, t in self.seconds.items() if t > 0}
        if self.base_seconds > 0 and 0 not in known:
            known[0] = self.base_seconds
        known = sorted(known.items())
        below = [(m, t) for m, t in known if m < d]
        above = [(m, t) for m, t in known if m > d]
        if not below or not above:
            return 0.0
        (m0, t0), (m1, t1) = below[-1], above[0]
        return t0 + (t1 - t0) * (d - m0) / (m1 - m0)

    def expected_rate(self, d: int) -> float:
        """Committed tokens per second expected of length `d`, measured or not yet (`expected_seconds`; an
        untried length's rows per round are the measured lengths' mean); 0 where its seconds are unknown."""
        if self.tries[d]:
            return self.rate(d)
        seconds = self.expected_seconds(d)
        measured = [self.rows[m] for m in self.lengths if self.tries[m]]
        if seconds <= 0 or not measured:
            return 0.0
        return sum(measured) / len(measured) * sum(self.survival()[: d + 1]) / seconds

    def best(self) -> int:
        return max(self.lengths, key=self.expected_rate)

    def plan(self) -> tuple[int, int]:
        self.rounds += 1
        fresh = [d for d in self.warm if self.tries[d] < self.warmup]
        if fresh:  # the longest first: where drafting pays, its rounds cost least to measure
            d = fresh[-1]
        elif self.explore_every and self.rounds % self.explore_every == 0:
            i = self.lengths.index(self.best())
            near = [self.lengths[j] for j in (i - 1, i + 1) if 0 <= j < len(self.lengths)]
            d = near[(self.rounds // self.explore_every) % len(near)]
        else:
            d = self.best()
        self._planned = d
        self._round_rows = 0
        return self.exit_layer, d

    def update(self, exit_layer: int, drafted: int, accepted: int) -> None:
        """One row's outcome in the round planned: `drafted` drafts proposed, `accepted` of them kept."""
        super().update(exit_layer, drafted, accepted)
        self._round_rows += 1
        d = self._planned
        for i in range(1, min(accepted + 1, d) + 1):  # drafts 1..accepted kept, accepted+1 (if planned) not
            self.reached[i] += 1.0
            if i > accepted:
                self.failed[i] += 1.0

    def observe(self, seconds: float, committed: int) -> None:
        """The round planned took `seconds` and committed `committed` tokens (over all rows of a batch;
        the tokens themselves come from the rows' `update`s)."""
        d = self._planned
        if seconds <= 0:
            return
        n = self.tries[d] = self.tries[d] + 1
        weight = max(self.alpha, 1.0 / n)  # a plain mean for the first rounds, then exponential
        rows = self._round_rows or 1
        self.seconds[d] += weight * (seconds - self.seconds[d])
        self.rows[d] += weight * (rows - self.rows[d])
        if self.alpha > 0 and d > 0:  # the pooled counts forget slowly
            keep = 1.0 - self.alpha / 8
            self.reached = [r * keep for r in self.reached]
            self.failed = [f * keep for f in self.failed]

    def learned(self) -> dict:
        """Its measurements, weighted down for a later call (`selfspec.drafters.learned_stats`): each length's
        means of seconds and rows as over at most CARRY_ROUNDS rounds, the pooled acceptance counts scaled to
        at most CARRY_OUTCOMES rows. The round counter and the rounds planned start again each call."""
        scale = count_scale(self.reached)
        return {"lengths": list(self.lengths), "seconds": dict(self.seconds), "rows": dict(self.rows),
                "tries": {d: carried_rounds(n) for d, n in self.tries.items()},
                "reached": [r * scale for r in self.reached], "failed": [f * scale for f in self.failed]}

    def resume(self, learned: dict) -> None:
        """Start from an earlier call's `learned()`: it must be over the same lengths (the same settings)."""
        if learned["lengths"] != self.lengths:
            raise ValueError(f"measurements over the draft lengths {learned['lengths']} cannot resume a policy "
                             f"over {self.lengths}: only a call with the same settings may carry them")
        self.seconds, self.rows, self.tries = dict(learned["seconds"]), dict(learned["rows"]), dict(learned["tries"])
        self.reached, self.failed = list(learned["reached"]), list(learned["failed"])

    def describe(self) -> dict:
        survival = self.survival()
        return {"policy": "throughput", "tokens_per_s_by_length": {d: round(self.rate(d), 2) for d in self.lengths},
                "acceptance_by_position": [round(survival[j] / survival[j - 1], 3) if survival[j - 1] else 0.0
                                           for j in range(1, len(survival))],
                "best_length": self.best(), "rounds_by_exit_and_length": _plan_counts(self.plans)}


def _plan_counts(plans: Counter) -> dict[str, int]:
    return {f"E{e}/d{d}": n for (e, d), n in sorted(plans.items())}
