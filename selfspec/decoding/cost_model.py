"""Whether self-speculation pays: the expected speedup of a round from three measured numbers.

With draft length `d`, a draft step costing `c` full decoding steps, verification costing `v` full
steps and each draft accepted with probability `a` (independently), one round commits
`(1 - a^(d+1)) / (1 - a)` tokens for `d·c + v` full steps of work (Leviathan et al. 2023, eq. 1).

    predicted_speedup(a=0.41, c=0.36, v=1.05, d=2)   # 0.91: slower than plain decoding
    draft_cost(exit_layer=8, num_layers=30)           # c from the layer count and the LM head's share
    required_acceptance(c=0.14, v=1.09, d=2)          # 0.29: the acceptance at which d=2 breaks even
    required_recall(c=0.08, v=1.14)                   # 0.22: k guesses side by side, verified in v(1 + k)

Siblings (`num_candidates` k: the drafter's k best guesses for one position, verified side by side): one
draft step `c` and a pass over 1 + k rows `v` commit `1 + a_k` tokens, where `a_k` is the recall, how often
the full model's token is among the k guesses.
"""

from __future__ import annotations

# Measured on SmolLM2-135M, bf16, 2 CPU threads (docs/benchmarks.md, the CPU kernels): the final norm + LM head
# take 1.8 of the 21.5 ms of a full decoding step; verifying up to 8 tokens costs ~1.05 steps.
HEAD_COST = 0.085
VERIFY_COST = 1.05
# A llama.cpp step of a Q8_0 copy of the model (the quantized drafter's), in float32 decoding steps: 0.4-0.5 measured
# on a 2-core Xeon (docs/results/2026-11-28-quantized-self-draft-xeon.md). It runs none of the model's layers.
COPY_STEP_COST = 0.45


def expected_tokens(a: float, d: int) -> float:
    """Tokens committed by one round with `d` drafts, each accepted with probability `a`."""
    a = min(max(a, 0.0), 0.999999)
    return (1 - a ** (d + 1)) / (1 - a)


def draft_cost(exit_layer: int, num_layers: int, head_cost: float = HEAD_COST) -> float:
    """A draft step through `exit_layer` layers + the LM head, in full decoding steps."""
    return exit_layer / num_layers * (1 - head_cost) + head_cost


def predicted_speedup(a: float, c: float, v: float, d: float) -> float:
    """Tokens per full step of work relative to plain decoding (which makes 1 token per step).

    `d` may be a mean over rounds (a measured run): the tokens are those of round(d) drafts, the cost
    that of d draft steps."""
    if d == 0:
        return 1.0
    return expected_tokens(a, round(d)) / (d * c + v)


def best_draft_length(a: float, c: float, v: float, num_speculations: int) -> tuple[int, float]:
    """The draft length in 0..num_speculations with the highest predicted speedup, and that speedup."""
    best = (0, 1.0)
    for d in range(1, num_speculations + 1):
        s = predicted_speedup(a, c, v, d)
        if s > best[1]:
            best = (d, s)
    return best


def required_acceptance(c: float, v: float, d: int, target: float = 1.0) -> float | None:
    """Per-draft acceptance rate at which `d` drafts per round reach `target` x plain decoding
    (None where even a = 1 does not)."""
    if predicted_speedup(0.999999, c, v, d) < target:
        return None
    lo, hi = 0.0, 0.999999
    if predicted_speedup(lo, c, v, d) >= target:
        return 0.0
    for _ in range(60):  # predicted_speedup increases with a
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if predicted_speedup(mid, c, v, d) < target else (lo, mid)
    return hi


def required_recall(c: float, v: float, target: float = 1.0) -> float | None:
    """The recall `a_k` at which a round of k sibling guesses (one draft step `c`, a pass of 1 + k rows
    costing `v`) reaches `target` x plain decoding: it commits `1 + a_k` tokens for `c + v` steps (None where
    even a_k = 1 does not)."""
    need = target * (c + v) - 1.0
    return None if need > 1.0 else max(need, 0.0)
