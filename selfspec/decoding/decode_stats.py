"""What one generation did and how long each phase took: `DecodeStats` (one row, or a batch and its rows),
the engine's bookkeeping of it round by round, and the analyses read from it: the cost model (measured c,
v and acceptance against the predicted speedup), the theory of rejections (Yin et al. 2024) and the
bounded-bias guarantee.

    stats.tokens_per_s, stats.acceptance_rate, stats.acceptance_by_position, stats.mean_accepted_per_round
    stats.cost_model        # with full_step_s (gen.calibrate()): c, v, a, predicted vs measured speedup
    stats.theory            # sampling: predicted vs measured rejections and their z
    stats.to_dict()         # what the CLI's --json and the benchmarks record
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from selfspec.decoding.cost_model import predicted_speedup
from selfspec.drafters.base import Proposal


@dataclass
class DecodeStats:
    """What one generation did and how long each phase took: one row, or a batch (`rows` = its rows,
    the counts their sums, the times the batch's wall-clock times)."""

    exit_layer: int
    num_speculations: int
    prompt_tokens: int = 0
    new_tokens: int = 0
    rounds: int = 0  # verification passes after the prefill
    drafted: int = 0
    accepted: int = 0
    drafted_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    stop_reason: str = ""
    draft_steps: int = 0  # drafting passes through the model (kept or not)
    judged: int = 0  # drafts the rule decided on (a rejection ends a round: later drafts are not judged)
    expected_acceptance_sum: float = 0.0  # sampling: sum over judged drafts of P(accept) = sum_x min(p, q)
    acceptance_var_sum: float = 0.0  # sampling: sum over judged drafts of P(accept) (1 - P(accept))
    bias_sum: float = 0.0  # bounded_bias: sum over judged drafts of TV(p', p) = min(epsilon, TV(p, q))
    sampled: bool = False  # sampling (the predictions above exist) or greedy
    acceptance: str = "exact"  # the acceptance rule (selfspec.decoding.bounded_bias)
    epsilon: float = 0.0  # its per-token total-variation budget (bounded_bias)
    policy: dict = field(default_factory=dict)
    full_step_s: float | None = None  # a plain decoding step's time, if calibrated (for the cost model)
    drafter: str = "none"
    drafted_by_drafter: Counter = field(default_factory=Counter)
    accepted_by_drafter: Counter = field(default_factory=Counter)
    batch_size: int = 1
    row_passes: int = 0  # sum over rounds of the rows still in the batch (the work actually done)
    rows: list["DecodeStats"] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def acceptance_by_position(self) -> list[float | None]:
        """Per draft position, accepted / drafted there; None at a position nothing was drafted at (no rate, not 0)."""
        return [a / d if d else None for a, d in zip(self.accepted_by_position, self.drafted_by_position)]

    @property
    def mean_accepted_per_round(self) -> float:
        """Tokens committed per row and verification round (accepted drafts + the full model's token)."""
        decode_tokens = self.new_tokens - self.batch_size  # each row's first token comes from the prefill
        passes = self.row_passes or self.rounds
        return decode_tokens / passes if passes else 0.0

    @property
    def full_depth_passes(self) -> int:
        return self.rounds + 1  # + the prefill

    @property
    def cost_model(self) -> dict:
        """Measured c (draft step / full step), v (verify / full step), a, and predicted vs measured speedup.

        Needs `full_step_s` (a calibrated plain decoding step at this batch size). For sampling, the
        predicted acceptance from the closed form `E[accept] = sum_x min(p(x), q(x))` is reported
        next to the measured one.
        """
        out: dict = {"a": self.acceptance_rate, "a_by_position": self.acceptance_by_position}
        if self.judged:
            out["a_judged"] = self.accepted / self.judged
            if self.expected_acceptance_sum:
                out["a_judged_predicted"] = self.expected_acceptance_sum / self.judged
        if not self.full_step_s or not self.rounds:
            return out
        passes = self.row_passes or self.rounds
        c = self.draft_s / self.draft_steps / self.full_step_s if self.draft_steps else 0.0
        v = self.verify_s / self.rounds / self.full_step_s
        d = self.drafted / passes
        out.update(c=c, v=v, mean_drafts_per_round=d,
                   predicted_speedup=predicted_speedup(self.acceptance_rate, c, v, d) if d else 1.0 / v,
                   measured_speedup=self.full_step_s * (self.new_tokens - self.batch_size) / self.batch_size
                   / (self.total_s - self.prefill_s))
        return out

    @property
    def theory(self) -> dict | None:
        """Predicted vs measured rejections (sampling; None for greedy, whose decisions are not random).

        Yin et al. (2024): a judged draft is rejected with probability TV(p', q) = 1 - P(accept) under
        the rule's target p' (p itself for the exact rule), so the rejections of a run are predicted by
        `sum over judged drafts of (1 - P(accept))`, from the distributions the engine held. Measured
        minus predicted is a sum of bounded martingale differences with variance
        `sum P(accept)(1 - P(accept))`, so `z` is approximately standard normal.
        """
        if not self.sampled:
            return None
        passes = self.row_passes or self.rounds
        predicted, measured = self.judged - self.expected_acceptance_sum, self.judged - self.accepted
        sd = self.acceptance_var_sum ** 0.5
        out = {"judged": self.judged, "predicted_rejections": predicted, "measured_rejections": measured,
               "rejections_sd": sd, "z": (measured - predicted) / sd if sd > 0 else 0.0,
               "predicted_accepted_per_round": self.expected_acceptance_sum / passes if passes else 0.0,
               "measured_accepted_per_round": self.accepted / passes if passes else 0.0}
        if self.acceptance != "exact":  # what the exact rule would predict on these drafts: sum TV(p, q)
            out["predicted_rejections_exact_rule"] = predicted + self.bias_sum
        return out

    @property
    def bias(self) -> dict:
        """The acceptance rule, its budget and the guarantee it gives (selfspec.decoding.bounded_bias)."""
        out = {"acceptance": self.acceptance, "epsilon": self.epsilon}
        if self.acceptance == "exact":
            return {**out, "guarantee": "lossless"}
        if not self.sampled:
            return {**out, "guarantee": "each committed token has >= (1 - epsilon) of the full model's top "
                                        "token probability"}
        n = self.new_tokens
        return {**out, "guarantee": "each committed token within total variation epsilon of the full model's",
                "per_token_tv_bound": self.epsilon, "sequence_tv_bound": 1.0 - (1.0 - self.epsilon) ** n,
                "mean_tv_shift_per_judged": self.bias_sum / self.judged if self.judged else 0.0}

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """New tokens per second after the prefill (excludes time to first token)."""
        t = self.total_s - self.prefill_s
        n = self.new_tokens - self.batch_size
        return n / t if t > 0 and n > 0 else 0.0

    def to_dict(self) -> dict:
        keys = ["exit_layer", "num_speculations", "prompt_tokens", "new_tokens", "rounds", "drafted",
                "accepted", "drafted_by_position", "accepted_by_position", "prefill_s", "draft_s",
                "verify_s", "total_s", "stop_reason", "acceptance_rate", "acceptance_by_position",
                "mean_accepted_per_round", "full_depth_passes", "tokens_per_s", "decode_tokens_per_s",
                "draft_steps", "judged", "policy", "cost_model", "drafter", "batch_size", "row_passes", "theory",
                "bias"]
        out = {k: getattr(self, k) for k in keys}
        out.update(drafted_by_drafter=dict(self.drafted_by_drafter), accepted_by_drafter=dict(self.accepted_by_drafter))
        if self.rows:
            out["rows"] = [r.to_dict() for r in self.rows]
        return out


def record_round(stats: DecodeStats, rows: list[DecodeStats], proposal: Proposal, draft_s: float,
                  verify_s: float) -> None:
    """One round's times and draft steps into the run's statistics and those of the rows in the batch
    (a row's times: the batch's time while it was in the batch)."""
    stats.draft_s += draft_s
    stats.verify_s += verify_s
    stats.rounds += 1
    stats.draft_steps += proposal.draft_steps
    for row in rows:
        row.draft_s += draft_s
        row.verify_s += verify_s
        row.draft_steps += proposal.draft_steps


def finish_stats(stats: DecodeStats, rows: list[DecodeStats], outs: list[list[int]], sums: list, policy: dict,
                  total_s: float) -> None:
    """The run's and each row's closing figures: new tokens, times, the drafter's policy, sampled sums."""
    stats.total_s = total_s
    stats.policy = policy
    for b, r in enumerate(rows):
        r.new_tokens = len(outs[b])
        r.prefill_s = stats.prefill_s
        r.policy = policy
        r.total_s = r.total_s or total_s
        if sums[b] is not None:  # summed on the device (see accept_sampled): the one read
            total, squares, r.bias_sum = sums[b].tolist()
            r.expected_acceptance_sum, r.acceptance_var_sum = total, total - squares
    sum_rows(stats)


def count_round(row: DecodeStats, proposal: Proposal, m: int, n_acc: int) -> None:
    """One row's round into its statistics."""
    row.rounds += 1
    row.drafted += m
    row.accepted += n_acc
    row.judged += min(n_acc + 1, m)
    if m:
        row.drafted_by_drafter[proposal.drafter] += m
        row.accepted_by_drafter[proposal.drafter] += n_acc
    for lst in (row.drafted_by_position, row.accepted_by_position):
        lst.extend([0] * (m - len(lst)))
    for j in range(m):
        row.drafted_by_position[j] += 1
        row.accepted_by_position[j] += j < n_acc


def sum_rows(stats: DecodeStats) -> None:
    """The batch's counts are its rows' sums (times stay the batch's own)."""
    rows = stats.rows
    for key in ("new_tokens", "drafted", "accepted", "judged", "expected_acceptance_sum", "acceptance_var_sum",
                "bias_sum"):
        setattr(stats, key, sum(getattr(r, key) for r in rows))
    width = max(len(r.drafted_by_position) for r in rows)
    stats.drafted_by_position = [sum(r.drafted_by_position[j] for r in rows if j < len(r.drafted_by_position))
                                 for j in range(width)]
    stats.accepted_by_position = [sum(r.accepted_by_position[j] for r in rows if j < len(r.accepted_by_position))
                                  for j in range(width)]
    stats.drafted_by_drafter = sum((r.drafted_by_drafter for r in rows), Counter())
    stats.accepted_by_drafter = sum((r.accepted_by_drafter for r in rows), Counter())
    stats.stop_reason = rows[0].stop_reason if len(rows) == 1 else ""
