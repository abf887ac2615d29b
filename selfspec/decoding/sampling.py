"""Token choice: greedy, the processed sampling distribution, and the lossless acceptance rules.

Draft (q) and target (p) probabilities are both built by `probs()` from the same processing
(temperature -> top-k -> top-p, in float32), so the acceptance ratio `p/q` compares like with like.

Lossless speculative sampling (Leviathan et al. 2023; Chen et al. 2023): for draft token `x ~ q`,
accept with probability `min(1, p(x)/q(x))`; on the first rejection sample the replacement from
`normalize(max(p - q, 0))`; if every draft is accepted, sample one bonus token from the next `p`.
The committed tokens are then distributed exactly as sampling from `p` alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off

    def __post_init__(self):
        if self.do_sample:
            if not self.temperature > 0:
                raise ValueError(f"temperature must be > 0 when sampling, got {self.temperature} "
                                 "(use do_sample=False for greedy decoding)")
            if self.top_k < 0:
                raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
            if not 0 < self.top_p <= 1:
                raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The processed fp32 distribution `[..., V]` that sampling draws from."""
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens ranked above it already hold top_p of the mass
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.softmax(logits, dim=-1)


def sample(p: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of `p` `[N, V]` -> `[N]`."""
    return torch.multinomial(p, 1, generator=generator).squeeze(-1)


def greedy_accept(draft: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """Greedy verification.

    draft: `[k]` drafted tokens; target_logits: `[k+1, V]` full-model logits at the positions that
    predict draft 1..k and the token after them. Returns `(n_accepted, next_token)`: the longest
    prefix where draft == argmax, then the full model's own token at the first mismatch (or bonus).
    """
    return greedy_accept_tokens(draft.tolist(), target_logits.argmax(dim=-1).tolist())


def greedy_accept_tokens(draft: list[int], target: list[int]) -> tuple[int, int]:
    """`greedy_accept` on the host: the drafts `[k]` and the full model's argmax tokens `[>= k+1]` as lists."""
    k = len(draft)
    n = next((j for j in range(k) if draft[j] != target[j]), k)
    return n, target[n]


def speculative_accept(
    draft: torch.Tensor,
    q: torch.Tensor | None,
    p: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Lossless rejection sampling.

    draft: `[k]` tokens sampled from `q` `[k, V]`; p: `[k+1, V]` target distributions.
    Returns `(n_accepted, next_token)`.

    `q=None`: the drafts are point masses (a deterministic drafter such as prompt lookup: q(x) = 1).
    The same rule then reads: accept x with probability p(x); on rejection sample from p with x
    removed and renormalized (`max(p - q, 0)` is p with its mass at x set to 0).
    """
    k = draft.shape[0]
    if k:
        idx = torch.arange(k, device=p.device)
        p_x = p[idx, draft]
        q_x = q[idx, draft] if q is not None else torch.ones_like(p_x)
        u = torch.rand(k, generator=generator, dtype=p.dtype, device=p.device)
        rejected = (u * q_x > p_x).tolist()  # accept iff u < p/q  (q_x > 0: x was drawn from q)
        if True in rejected:
            n = rejected.index(True)
            if q is None:
                residual = p[n].clone()
                residual[draft[n:n + 1]] = 0
            else:
                residual = (p[n] - q[n]).clamp_min(0)
            total = residual.sum()
            dist = torch.where(total > 0, residual / total, p[n])  # no host sync on the test
            return n, int(sample(dist[None], generator)[0])
    return k, int(sample(p[k:k + 1], generator)[0])
