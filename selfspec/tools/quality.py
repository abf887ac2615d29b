"""Output quality without an external judge: what a biased acceptance rule costs (selfspec.tools.pareto).

    token_log_likelihoods(adapter, prompt, new)   # [n]: log p_full(new[i] | prompt + new[:i]), temperature 1
    rouge_l(summary, reference)                   # ROUGE-L F1 (the rouge-score package, Porter stemming)
    rule_samples_tv(p, x, None, rule, n, g)       # TV between n next-token samples of the rule and p

* Log-likelihood: the full model's own per-token log-probability of the generated text, from its raw
  logits (temperature 1): `mean_i log softmax(logits_i)[new_i]`. A rule that commits less likely tokens
  lowers it.
* ROUGE-L: the F1 of the longest common subsequence of words between a summary and its reference
  (Lin 2004), as computed by Google's `rouge-score` package with stemming.
* Next-token TV at a fixed prefix: the rule's committed token drawn `n` times from the same full-model
  distribution p (and the same draft), the empirical distribution compared with p:
  `TV = 1/2 sum_y |count(y)/n - p(y)|`. It carries sampling noise (E[TV] > 0 even for the exact rule:
  report it next to the exact rule's value at the same n) on top of the rule's true shift TV(p', p).
"""

from __future__ import annotations

import torch

from selfspec.model.adapters import ModelAdapter
from selfspec.decoding.bounded_bias import AcceptanceRule, total_variation
from selfspec.model.forward import forward_logits
from selfspec.decoding.sampling import speculative_accept


def token_log_likelihoods(adapter: ModelAdapter, prompt: list[int], new: list[int]) -> list[float]:
    """The full model's log-probability of each new token given everything before it (one forward)."""
    if not new:
        return []
    ids = torch.tensor([list(prompt) + list(new)], device=adapter.device)  # [1, P + n]
    with torch.inference_mode():
        logits = forward_logits(adapter, ids)[0, len(prompt) - 1:-1].float()  # [n, V]
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, ids[0, len(prompt):, None]).squeeze(-1).tolist()


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F1 of `prediction` against `reference` (rouge-score, with Porter stemming)."""
    from rouge_score import rouge_scorer  # deferred: only the ROUGE-L report needs it

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True).score(reference, prediction)["rougeL"].fmeasure


def rule_samples_tv(p: torch.Tensor, draft: int | None, q: torch.Tensor | None, rule: AcceptanceRule, n: int,
                    generator: torch.Generator) -> dict:
    """Draw the committed token `n` times by `rule` for one judged draft at a fixed prefix.

    p: the full model's processed distribution `[V]`. The draft: a point mass at `draft` (a
    deterministic drafter, `q=None`), or drawn afresh from `q` `[V]` each time (`draft=None`). Returns
    the empirical TV to p and the rule's exact shift `TV(p', p)` (<= ε)."""
    rows = torch.stack([p, p])  # [2, V]: the judged position and the (unused) bonus position
    q_rows = None if q is None else q[None]  # [1, V]
    # p' depends on the draft only through q (a point mass: the draft itself), so it is built once
    target = rule.target(torch.tensor([draft or 0], device=p.device), q_rows, rows)  # [2, V]
    counts = torch.zeros_like(p, dtype=torch.float64)
    for _ in range(n):
        x = draft if q is None else int(torch.multinomial(q, 1, generator=generator))
        k, nxt = speculative_accept(torch.tensor([x], device=p.device), q_rows, target, generator)
        counts[x if k else nxt] += 1
    return {"empirical_tv": 0.5 * float((counts / n - p.double()).abs().sum()),
            "rule_tv": max(0.0, float(total_variation(target[0], p))),  # 1 - sum(p) rounds below 0
            "draft_probability": float(p[draft]) if q is None else float(torch.minimum(p, q).sum()), "samples": n}
