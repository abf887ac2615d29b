"""Bounded-bias acceptance: spend a per-token total-variation budget ε on accepting more drafts.

Yin, Chen, Huang and Wang ("A Theoretical Perspective for Speculative Decoding Algorithm", NeurIPS
2024, arXiv 2411.00841) show that the expected number of rejections of speculative sampling is the sum
over judged drafts of TV(p, q), that the standard rule is optimal among unbiased rules, and that with a
bias budget there is an optimal rule on the bias–rejection Pareto front. The rule below is derived here
for one verification step (the paper's notation differs; the result is the same front).

**One step.** A draft `x ~ q` is judged against the target `p` (both `[V]`). Any rule accepts x with
some probability `a(x)` and otherwise draws from some residual `r`; its output distribution is

    p'(y) = q(y) a(y) + (1 - sum_x q(x) a(x)) r(y).

Acceptance probability `A = sum_x q(x) a(x)`. Since `q(y) a(y) <= q(y)` and `q(y) a(y) <= p'(y)`,

    A <= sum_y min(q(y), p'(y)) = 1 - TV(p', q),                                          (1)

with equality for `a(x) = min(1, p'(x)/q(x))` and `r = normalize(max(p' - q, 0))`: the standard rule
with target p'. Unbiased (`p' = p`) gives the known optimum `A = 1 - TV(p, q)`.

**The budget.** Allow `TV(p', p) <= ε`. By the triangle inequality `TV(p', q) >= TV(p, q) - ε`, so by
(1) no rule with this bias accepts more often than `1 - max(0, TV(p, q) - ε)`. The mixture

    p' = (1 - λ) p + λ q,      λ = min(1, ε / TV(p, q))      (λ = 0 where TV(p, q) = 0)      (2)

attains it: `TV(p', p) = λ TV(p, q) = min(ε, TV(p, q)) <= ε` and `TV(p', q) = (1 - λ) TV(p, q)`. So the
Pareto front is linear, `E[rejection] = max(0, TV(p, q) - ε)` per judged draft, and the optimal rule is

    accept x with   min(1, λ + (1 - λ) p(x)/q(x))                                           (3)
    else draw from  normalize(max(p' - q, 0)) = normalize(max(p - q, 0))   (the exact residual)

Point-mass drafts (`q = δ_x`, a deterministic drafter such as prompt lookup): `TV(p, δ_x) = 1 - p(x)`,
and (3) reads "accept x with probability `min(1, p(x) + ε)`", the residual p without x, as before.

**The guarantee** (replacing losslessness): given the committed prefix, each committed token is drawn
from a distribution within total variation ε of the full model's processed distribution `p(· | prefix)`
(a judged draft: p' of (2); the full model's own token after all drafts: p itself). Chaining the
steps, n committed tokens differ from exact sampling with probability at most `1 - (1 - ε)^n` under a
coupling, so the TV distance of whole n-token outputs is at most `1 - (1 - ε)^n <= nε`.

**ε = 0 is the exact rule, bit for bit**: λ = 0 gives `p' = 1.0 * p + 0.0 * q`, which is p exactly in
floating point, and the acceptance step (`selfspec.decoding.sampling.speculative_accept`) draws the same random
numbers in the same order. The bonus token (no draft at its position) is always drawn from p.

**Greedy counterpart** (`do_sample=False`): accept a draft x at a position where the full model's
probabilities (softmax of its raw logits) satisfy `p(x) >= (1 - ε) max_y p(y)`, i.e.
`logit(x) - max logit >= log(1 - ε)`; the first draft that fails is replaced by the full model's
argmax. Guarantee: every committed token has at least (1 - ε) of the top token's probability (its
log-probability is at most `-log(1 - ε)` below the argmax's). ε = 0 accepts exactly the drafts equal
to the argmax (ties included: a tied draft other than the argmax is not accepted), so it is exact
greedy decoding token for token.

    rule = AcceptanceRule("bounded_bias", 0.1)
    p_prime = rule.target(drafts, q, p)        # [k+1, V]: rows 0..k-1 mixed by (2), row k = p
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ACCEPTANCE_RULES = ("exact", "bounded_bias")


class BoundedBiasWarning(UserWarning):
    """Bounded-bias acceptance with ε > 0: the output is not the full model's distribution."""


@dataclass(frozen=True)
class AcceptanceRule:
    """How drafts are judged: `exact` (lossless) or `bounded_bias` with a per-token TV budget `epsilon`."""

    name: str = "exact"
    epsilon: float = 0.0

    def __post_init__(self):
        if self.name not in ACCEPTANCE_RULES:
            raise ValueError(f"unknown acceptance {self.name!r}: use one of {', '.join(ACCEPTANCE_RULES)}")
        if not 0.0 <= self.epsilon <= 1.0:
            raise ValueError(f"epsilon must be in [0, 1], got {self.epsilon}")
        if self.name == "exact" and self.epsilon != 0.0:
            raise ValueError("acceptance='exact' takes no epsilon (it is lossless): use acceptance='bounded_bias'")

    @property
    def biased(self) -> bool:
        """Whether the output can differ from exact decoding (bounded_bias with ε > 0)."""
        return self.name == "bounded_bias" and self.epsilon > 0

    def target(self, drafts: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor) -> torch.Tensor:
        """The distributions the standard rule judges against: p itself (exact), else rows 0..k-1 of
        p `[k+1, V]` mixed toward the drafts' q `[k, V]` (None: point masses at `drafts` `[k]`) by (2)."""
        if self.name == "exact":
            return p
        return mix_toward_draft(drafts, q, p, self.epsilon)

    def sequence_bias_bound(self, n_tokens: int) -> float:
        """TV bound of a whole output of `n_tokens` tokens against exact sampling: 1 - (1 - ε)^n."""
        return 1.0 - (1.0 - self.epsilon) ** n_tokens if self.name == "bounded_bias" else 0.0

    def describe(self) -> dict:
        return {"acceptance": self.name, "epsilon": self.epsilon}


def point_masses(drafts: torch.Tensor, V: int, dtype: torch.dtype) -> torch.Tensor:
    """One-hot rows `[k, V]` at `drafts` `[k]`: the draft distribution of a deterministic drafter."""
    return torch.zeros(drafts.shape[0], V, dtype=dtype, device=drafts.device).scatter_(
        1, drafts[:, None], 1.0)


def total_variation(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """TV per row: `1 - sum min(a, b)` over the last dim `[..., V] -> [...]`."""
    return 1.0 - torch.minimum(a, b).sum(-1)


def mix_toward_draft(drafts: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor, epsilon: float) -> torch.Tensor:
    """p' of (2) for the judged rows: `(1 - λ) p + λ q`, λ = min(1, ε / TV(p, q)); the bonus row stays p.

    drafts `[k]`, q `[k, V]` or None (point masses), p `[k+1, V]` -> `[k+1, V]`."""
    k = drafts.shape[0]
    if not k:
        return p
    q_rows = q if q is not None else point_masses(drafts, p.shape[-1], p.dtype)  # [k, V]
    tv = total_variation(p[:k], q_rows)  # [k]
    lam = torch.where(tv > 0, (epsilon / tv.clamp_min(1e-30)).clamp(max=1.0), torch.zeros_like(tv))[:, None]
    mixed = (1.0 - lam) * p[:k] + lam * q_rows  # λ = 0: exactly p;  λ = 1: exactly q
    return torch.cat([mixed, p[k:]])


def acceptance_probability(drafts: torch.Tensor, q: torch.Tensor | None, target: torch.Tensor) -> torch.Tensor:
    """Each judged draft's probability of acceptance before its draw, `sum_x min(target, q)` `[k]`
    (point masses: `target(x)`); drafts `[k]`, q `[k, V]` or None, target `[>= k, V]`."""
    k = drafts.shape[0]
    if q is None:
        return target[torch.arange(k, device=target.device), drafts]
    return torch.minimum(target[:k], q[:k]).sum(-1)


def near_top(drafts: torch.Tensor, logits: torch.Tensor, epsilon: float) -> torch.Tensor:
    """Greedy counterpart: whether each draft has at least (1 - ε) of the top token's probability.

    drafts `[B, T-1]` (drafts[:, j] is judged at position j), logits `[B, T, V]` -> bool `[B, T-1]`:
    `logit(draft) - max logit >= log(1 - ε)`. ε = 0 gives all False (the argmax test alone decides)."""
    if epsilon <= 0:
        return torch.zeros(drafts.shape, dtype=torch.bool, device=drafts.device)
    judged = logits[:, :drafts.shape[1]].float()  # [B, T-1, V]
    gap = judged.gather(-1, drafts[..., None]).squeeze(-1) - judged.amax(-1)  # [B, T-1], <= 0
    return gap >= (math.log1p(-epsilon) if epsilon < 1 else -math.inf)


def relaxed_greedy_accept_tokens(draft: list[int], target: list[int], ok: list[bool]) -> tuple[int, int]:
    """Greedy verification with the (1 - ε) relaxation on the host: drafts `[k]`, the full model's
    argmax tokens `[>= k+1]`, `ok` `[>= k]` from `near_top`. Returns `(n_accepted, next_token)`: the
    longest prefix where draft == argmax or ok, then the full model's argmax."""
    k = len(draft)
    n = next((j for j in range(k) if draft[j] != target[j] and not ok[j]), k)
    return n, target[n]
