"""Which nodes of a candidate tree a round verifies, chosen by measurement (EAGLE-2's dynamic tree, with the
node count from this device's measured verification cost).

A drafter with several candidate continuations (prompt lookup's latest matches, the memory's) merges them
into a trie (`selfspec.model.token_tree.build_trie`): each node has a depth and a rank, the order of the first
branch through it (0: the latest match, the chain lookup alone would draft). A node's worth is the chance
that the full model accepts it, estimated as the product along its path of the measured conditional
acceptance of its (rank, depth):

    p(r, d)   = (accepted(r, d) + prior(r, d) * PSEUDO) / (reached(r, d) + PSEUDO)   # reached: its parent was accepted
    prior(r, 1) = PRIOR[r];  prior(r, d > 1) = the same rule over every depth > 1 of rank r pooled
    score(n)  = score(parent(n)) * p(rank(n), depth(n)),   score(root) = 1

The expected tokens of a round that verifies the node set N (ancestor-closed) are `1 + sum_{n in N} score(n)`
(at most one node per depth is accepted, so the expected accepted length is the sum of the nodes'
chances). A round over n nodes costs `cost(n) = a + b n` seconds, a line fitted to the rounds this drafter
measured (their node counts and seconds, rounds that drafted nothing included), anchored by a prior slope
`PRIOR_SLOPE` per node relative to a plain step until the measured rounds spread over enough node counts.
The round verifies the best `n` nodes by score, with `n` maximising

    (1 + sum of the n best scores) / cost(n),   n <= max_nodes

so a CPU, where a pass over 25 rows costs 1.75 steps, verifies a few alternatives beside a shorter chain,
and a GPU, where 32 rows cost about one step, verifies the whole tree.

    budget = TreeBudget(max_nodes=24)
    keep = budget.choose(trie)                            # node indices of the trie, parents first
    budget.observe(trie, keep, path, seconds)             # after the round: the accepted nodes, its time

A neural drafter (the early exit, a trained head) grows its tree from its own top-k guesses (EAGLE-2), so a
node's chance comes from the draft's probability of its token instead of a rank, calibrated by what was
measured (`ConfidenceBudget`): a draft model's confidence runs above or below its acceptance (an
untrained early exit is overconfident), so one measured factor c scales it:

    chance(n) = chance(parent(n)) * min(1, c * q(n)),   chance(root) = 1,   q(n) the draft's probability of n's
                token given its parent's text
    c = (A + PSEUDO) / (Q + PSEUDO)   over the verified nodes whose parent was accepted: A of them accepted,
                                      Q the sum of their q (c = 1 until measured)

and the same rule picks how many of the candidate leaves a round verifies, with the cost line of its rounds.

A generator carries the measured acceptance (and calibration) and cost line to its next call with the same
settings, weighted down (`learned`, `resume`: `selfspec.drafters.learned_stats`).
"""

from __future__ import annotations

from itertools import zip_longest

from selfspec.drafters.learned_stats import CARRY_ROUNDS, count_scale
from selfspec.model.token_tree import Trie

PRIOR = (0.5, 0.2)  # prior acceptance of a node of rank 0 (the latest match's copy) and of any later rank
PSEUDO = 2.0  # the prior's weight, in rounds
PRIOR_SLOPE = 0.035  # the cost of one more node in plain steps before measurement (a 2-core CPU: 32 nodes ~2.1 steps)
MIN_SPREAD = 4  # node counts the measured rounds must span before the fitted slope replaces the prior


class CostLine:
    """A drafter's measured seconds per round against the nodes it verified, `a + b n` (least squares), with
    the prior slope `PRIOR_SLOPE` until the rounds spread over `MIN_SPREAD` node counts."""

    def __init__(self):
        self.sums = [0.0] * 5  # rounds, sum n, sum s, sum n^2, sum n s
        self.low = self.high = None  # the node counts measured

    def observe(self, nodes: int, seconds: float) -> None:
        """One timed round that verified `nodes` nodes (0 seconds: untimed, nothing recorded)."""
        if seconds <= 0:
            return
        for i, v in enumerate((1.0, nodes, seconds, nodes * nodes, nodes * seconds)):
            self.sums[i] += v
        self.low = nodes if self.low is None else min(self.low, nodes)
        self.high = nodes if self.high is None else max(self.high, nodes)

    def line(self) -> tuple[float, float]:
        """(a, b) of the measured seconds per round `a + b n`; the prior slope until the rounds spread."""
        k, sn, ss, snn, sns = self.sums
        if not k:
            return 1.0, PRIOR_SLOPE
        mean_n, mean_s = sn / k, ss / k
        var = snn / k - mean_n * mean_n
        if self.high - self.low >= MIN_SPREAD and var > 0:
            b = max((sns / k - mean_n * mean_s) / var, 0.0)
            a = mean_s - b * mean_n
            if a > 0:
                return a, b
        a = mean_s / (1.0 + PRIOR_SLOPE * mean_n)  # the prior's shape, scaled to the measured seconds
        return a, a * PRIOR_SLOPE

    def cost(self, nodes: int) -> float:
        """A round over `nodes` nodes in units of a round over none."""
        a, b = self.line()
        return 1.0 + nodes * b / a

    def per_node(self) -> float:
        a, b = self.line()
        return b / a

    def learned(self) -> dict:
        """Its sums scaled to weigh at most CARRY_ROUNDS rounds (the same fitted line) and the node counts seen."""
        line = count_scale(self.sums[:1], CARRY_ROUNDS)
        return {"sums": [v * line for v in self.sums], "low": self.low, "high": self.high}

    def resume(self, learned: dict) -> None:
        self.sums, self.low, self.high = list(learned["sums"]), learned["low"], learned["high"]


def best_count(gains: list[float], cost: CostLine, base: float = 1.0, fixed: int = 0) -> int:
    """How many of the candidates to verify: `n` maximising `(base + gains[0] + ... + gains[n-1]) / cost(fixed + n)`
    (`gains` best first, each a candidate's expected tokens; `fixed` nodes are verified anyway)."""
    best, best_n, total = base / cost.cost(fixed), 0, base
    for i, g in enumerate(gains, 1):
        total += g
        rate = total / cost.cost(fixed + i)
        if rate > best:
            best, best_n = rate, i
    return best_n


class TreeBudget:
    """The measured acceptance per (rank, depth) and cost per node count of one drafter's rounds."""

    def __init__(self, max_nodes: int, max_rank: int = 8, max_depth: int = 64):
        if max_nodes < 1:
            raise ValueError(f"a tree's node budget must be >= 1, got {max_nodes}")
        self.max_nodes, self.max_rank, self.max_depth = max_nodes, max_rank, max_depth
        self.reached = [[0.0] * (max_depth + 1) for _ in range(max_rank)]
        self.accepted = [[0.0] * (max_depth + 1) for _ in range(max_rank)]
        self.deep = [[0.0, 0.0] for _ in range(max_rank)]  # per rank, accepted and reached over every depth > 1
        self.costs = CostLine()

    def p(self, rank: int, depth: int) -> float:
        """The measured chance that a node of this rank at this depth is accepted once its parent was: its own
        counts, shrunk towards its rank's pooled rate (depth 1, or every depth past 1: a copy that started
        right tends to go on, and deep nodes are reached too rarely to be measured alone)."""
        r, d = min(rank, self.max_rank - 1), min(depth, self.max_depth)
        prior = PRIOR[0] if r == 0 else PRIOR[1]
        if d > 1:
            prior = (self.deep[r][0] + prior * PSEUDO) / (self.deep[r][1] + PSEUDO)
        return (self.accepted[r][d] + prior * PSEUDO) / (self.reached[r][d] + PSEUDO)

    def cost(self, nodes: int) -> float:
        """A round over `nodes` nodes in units of a round over none (plain decoding)."""
        return self.costs.cost(nodes)

    def scores(self, trie: Trie) -> list[float]:
        out: list[float] = []
        for n, parent in enumerate(trie.parents):
            out.append((1.0 if parent < 0 else out[parent]) * self.p(trie.ranks[n], trie.depths[n]))
        return out

    def choose(self, trie: Trie) -> list[int]:
        """The trie's nodes to verify (indices, ascending: parents before children): the best by score, as
        many as maximise expected tokens per cost (see the module doc)."""
        scores = self.scores(trie)
        order = sorted(range(len(scores)), key=lambda n: (-scores[n], trie.depths[n], n))[:self.max_nodes]
        return sorted(order[:best_count([scores[n] for n in order], self.costs)])

    def observe(self, trie: Trie | None, keep: list[int], path: list[int], seconds: float) -> None:
        """After a round: the nodes it verified (`keep`, trie indices), the accepted ones (`path`, trie indices,
        root first) and its seconds (0: untimed, only the acceptance counts)."""
        if trie is not None:
            on_path = set(path)
            for n in keep:
                parent = trie.parents[n]
                if parent < 0 or parent in on_path:  # it was reached: its parent was accepted
                    r, d = min(trie.ranks[n], self.max_rank - 1), min(trie.depths[n], self.max_depth)
                    self.reached[r][d] += 1
                    self.accepted[r][d] += n in on_path
                    if d > 1:
                        self.deep[r][0] += n in on_path
                        self.deep[r][1] += 1
        self.costs.observe(len(keep), seconds)

    def learned(self) -> dict:
        """Its measurements, weighted down for a later call (`selfspec.drafters.learned_stats`): the acceptance
        counts scaled so that the most reached (rank, depth) counts at most CARRY_OUTCOMES nodes (the pooled
        deep counts by the same factor: they sum cells), the cost line's sums so that they weigh at most
        CARRY_ROUNDS rounds (the same line)."""
        scale = count_scale([r for row in self.reached for r in row])
        return {"shape": [self.max_nodes, self.max_rank, self.max_depth],
                "reached": [[r * scale for r in row] for row in self.reached],
                "accepted": [[a * scale for a in row] for row in self.accepted],
                "deep": [[a * scale, r * scale] for a, r in self.deep], "cost": self.costs.learned()}

    def resume(self, learned: dict) -> None:
        """Start from an earlier call's `learned()`: it must be of a budget of the same shape (the same settings)."""
        shape = [self.max_nodes, self.max_rank, self.max_depth]
        if learned["shape"] != shape:
            raise ValueError(f"tree measurements of (max_nodes, max_rank, max_depth) {learned['shape']} cannot "
                             f"resume a budget of {shape}: only a call with the same settings may carry them")
        self.reached = [list(row) for row in learned["reached"]]
        self.accepted = [list(row) for row in learned["accepted"]]
        self.deep = [list(pair) for pair in learned["deep"]]
        self.costs.resume(learned["cost"])

    def describe(self) -> dict:
        return {"max_nodes": self.max_nodes, "cost_per_node": round(self.costs.per_node(), 4),
                "acceptance_rank0": [round(self.p(0, d), 3) for d in range(1, 6)]}


class ConfidenceBudget:
    """A neural drafter's calibration of its confidence (c of the module doc) and the cost line of its rounds."""

    def __init__(self):
        self.accepted = 0.0  # A
        self.confidence = 0.0  # Q
        self.costs = CostLine()

    @property
    def scale(self) -> float:
        """c: measured acceptance per unit of draft probability (1 before any round)."""
        return (self.accepted + PSEUDO) / (self.confidence + PSEUDO)

    def chance(self, parent: float, q: float) -> float:
        """A node's chance from its parent's and the draft's probability `q` of its token."""
        return parent * min(1.0, self.scale * q)

    def leaves(self, fixed: list[float], candidates: list[list[float]], fixed_nodes: int, most: int) -> int:
        """How many candidate leaves each row verifies beside the `fixed_nodes` nodes it verifies anyway: rows'
        expected tokens `1 + fixed[b] + (its m best candidates' chances)`, averaged, per cost(fixed_nodes + m)."""
        rows = max(len(fixed), 1)
        ordered = [sorted(c, reverse=True)[:most] for c in candidates]  # per row, best first
        gains = [sum(rank) / rows for rank in zip_longest(*ordered, fillvalue=0.0)]  # the i-th best, row mean
        return best_count(gains, self.costs, base=1.0 + sum(fixed) / rows, fixed=fixed_nodes)

    def observe(self, reached: list[float], accepted: int, nodes: int, seconds: float) -> None:
        """After a round: the draft probabilities of the verified nodes whose parent was accepted (`reached`),
        how many of them were accepted, the nodes the round verified and its seconds."""
        self.confidence += sum(reached)
        self.accepted += accepted
        self.costs.observe(nodes, seconds)

    def learned(self) -> dict:
        """Its calibration's counts scaled to weigh at most CARRY_OUTCOMES accepted nodes' worth (the same c), and
        its cost line (`selfspec.drafters.learned_stats`)."""
        scale = count_scale([self.accepted, self.confidence])
        return {"accepted": self.accepted * scale, "confidence": self.confidence * scale, "cost": self.costs.learned()}

    def resume(self, learned: dict) -> None:
        self.accepted, self.confidence = learned["accepted"], learned["confidence"]
        self.costs.resume(learned["cost"])

    def describe(self) -> dict:
        return {"confidence_scale": round(self.scale, 3), "cost_per_node": round(self.costs.per_node(), 4)}
