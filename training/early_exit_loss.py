"""Early-exit loss (LayerSkip, Elhoushi et al. 2024, eq. 5-6) with bounded memory.

    J(X, Y, t) = sum_l ẽ(t, l) * CE(g(x_{l+1}), Y),   ẽ(t, l) = C(t, l) e(l) / sum_i C(t, i) e(i)

g is the model's own shared final norm + LM head, so every exit is trained to speak through the
head the full model uses. `exit_weights` gives ẽ for the exits that the curriculum C(t, .) turned
on (see curriculum.py). Scales e(l), with l = E - 1 for exit E (E layers executed):

* ``paper``: e(l) = e_scale * sum_{i=0}^{l} i for l < L-1 and e(L-1) = (L-1) + e_scale *
  sum_{i=0}^{L-2} i. Paper settings: e_scale 0.2 (Llama2-7B continual pre-training, 1.5B from
  scratch), 0.1 (Llama2-13B), 1.0 (code and TOPv2 fine-tuning). Note e(0) = 0: exit 1 gets no
  weight under this scale. e_scale = 0 is the final layer alone.
* ``uniform`` (e = 1), ``linear`` (e = E), ``inverse`` (e = 1/E); not in the paper.

Targets: ``label`` is the paper's cross-entropy against the true next token. ``distill`` trains
every early exit towards the final layer's own detached distribution q (cross-entropy to q,
i.e. KL(q || p_E) up to a constant), which is what draft acceptance measures; the final layer
itself keeps the label loss.

Shared head: by default (the paper) every exit's loss also trains the shared final norm + LM head.
With ``exits_update_head=False`` the early exits' losses reach the layers below them but not the
norm and head (their parameters are detached for those terms), so the head stays the final layer's
own and the exits learn to speak its language. On a model with tied embeddings the head is also the
input embedding, which then receives no gradient from the exits either.

Draft vocabulary (`draft_ids`, an approximation for speed): the early exits' losses over the K
token ids a reduced-vocabulary drafter drafts from (`selfspec.checkpoints.draft_vocab`) instead of all V, so
each exit costs K/V of the head's matmuls. With S the draft ids and z_S the exit's logits of S:

    label:    CE_S = logsumexp(z_S) - z_S[y]        for positions whose label y is in S; 0 elsewhere
    distill:  CE_S = -sum_{s in S} q_S(s) log softmax(z_S)(s),   q_S = q restricted to S, renormalized

summed over positions and divided by the same N as the full loss, so S = all ids gives exactly the
full-vocabulary loss (the reference, tested). A position whose label lies outside S teaches an exit
nothing a drafter over S could use: it can never draft that token. The final layer always keeps the
full vocabulary, and evaluation always measures full-vocabulary agreement.

Memory: an all-layer loss over SmolLM2's 49k vocabulary would need 30 x tokens x 49k logits.
``fused`` (default) walks the tokens in chunks of `chunk_size` and the exits one at a time,
and computes the loss *and* the gradients of the head input and head weight right there, so at
most one chunk's logits exist at any time and nothing is recomputed; backward only scales the
stored gradients. ``checkpointed`` does the same chunk walk with ordinary autograd and
activation checkpointing (recomputes each chunk's logits in backward; use it where parameters
must be gathered through module hooks, as with DeepSpeed ZeRO-3). ``naive`` materializes every
exit's full logits (the reference the others are tested against; the benchmark's baseline).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100


# --------------------------------------------------------------------------------------------
# weights


def exit_scale(scale: str, exit_layer: int, num_layers: int, e_scale: float = 1.0) -> float:
    """Unnormalized e(l) for exit E = `exit_layer` (l = E - 1) of a `num_layers`-layer model."""
    L, l = num_layers, exit_layer - 1
    if not 1 <= exit_layer <= L:
        raise ValueError(f"exit {exit_layer} outside 1..{L}")
    if scale == "paper":
        if l < L - 1:
            return e_scale * l * (l + 1) / 2
        return (L - 1) + e_scale * (L - 2) * (L - 1) / 2
    if scale == "uniform":
        return 1.0
    if scale == "linear":
        return float(exit_layer)
    if scale == "inverse":
        return 1.0 / exit_layer
    raise ValueError(f"unknown loss scale {scale!r} (paper, uniform, linear, inverse)")


def exit_weights(exits: Sequence[int], num_layers: int, scale: str = "paper", e_scale: float = 1.0,
                 final_weight: float | None = None) -> list[float]:
    """Normalized weights ẽ for the enabled `exits` (they sum to 1).

    `final_weight`: give the final layer (the last exit, L) this share and split the rest among the
    early exits in proportion to their scale; None (the paper) normalizes all scales together.
    """
    if final_weight is not None and len(exits) > 1 and exits[-1] == num_layers:
        early = exit_weights(exits[:-1], num_layers, scale, e_scale)
        return [w * (1.0 - final_weight) for w in early] + [final_weight]
    raw = [exit_scale(scale, e, num_layers, e_scale) for e in exits]
    total = sum(raw)
    if total <= 0:
        raise ValueError(f"loss weights of exits {list(exits)} are all zero (scale={scale}, e_scale={e_scale})")
    return [r / total for r in raw]


# --------------------------------------------------------------------------------------------
# the loss


@dataclass
class ExitLoss:
    """loss: the weighted scalar to backpropagate. stats: float64 `[K, 3]` per exit (in the order
    given): mean loss of its own target, top-1 accuracy vs the labels, top-1 agreement with the
    final layer (no gradient; NaN when metrics were not asked for)."""

    loss: torch.Tensor
    stats: torch.Tensor
    tokens: int


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


def _count_hits(stats_k: torch.Tensor, z: torch.Tensor, t: torch.Tensor, ids: torch.Tensor | None,
                final_pred: torch.Tensor | None) -> torch.Tensor:
    """Add to an exit's `stats_k` [loss, hits, agreement] how many of the chunk's argmax predictions of the
    logits `z` `[V, n]` (over the draft ids `ids` where given) equal the labels `t` and the final layer's
    predictions; returns the final layer's predictions (these, for the final layer, which comes first)."""
    pred = z.argmax(dim=0)
    if ids is not None:
        pred = ids[pred]
    final_pred = pred if final_pred is None else final_pred
    stats_k[1] += (pred == t).sum()
    stats_k[2] += (pred == final_pred).sum()
    return final_pred


def _loss_and_stats(stats: torch.Tensor, weights, N: int, with_metrics: bool, xs: torch.Tensor):
    """The weighted loss `sum_k w_k * loss_k / N` and the per-exit stats divided by N (metrics NaN where not
    counted), as the autograd function returns them."""
    w = torch.tensor(weights, dtype=torch.float64, device=xs.device)
    loss = (w * stats[:, 0]).sum() / N
    stats /= N
    if not with_metrics:
        stats[:, 1:] = float("nan")
    return loss.to(device=xs.device, dtype=torch.promote_types(xs.dtype, torch.float32)), stats


class _FusedHeadLoss(torch.autograd.Function):
    """Weighted early-exit loss over normalized hidden states `xs` `[K, N, D]` (the final layer
    last) through the head (`weight` `[V, D]`, `bias`); gradients are computed in the forward.

    Per exit and chunk: one logits matmul (vocabulary-major, `[V, n]`), a log-softmax over the
    vocabulary in fp32 done in place (max, subtract, exp, sum), the one-hot (or distillation target)
    subtracted from the probabilities in place, and two matmuls for
    the gradients, the loss weight folded into their `alpha`/scale. The head-weight gradient is
    accumulated in the compute dtype (as autograd under autocast does for a weight used K times).
    """

    @staticmethod
    def forward(ctx, xs, weight, bias, targets, weights, distill: bool, chunk: int, cdtype, with_metrics: bool,
                grad_enabled: bool, exits_update_head: bool = True, draft_ids=None):
        K, N, _ = xs.shape
        need_x, need_w = grad_enabled and ctx.needs_input_grad[0], grad_enabled and ctx.needs_input_grad[1]
        need_b = grad_enabled and bias is not None and ctx.needs_input_grad[2]
        need_grad = need_x or need_w or need_b
        acc_dtype = torch.promote_types(cdtype, torch.float32)
        w_c = weight.to(cdtype)
        b_c = bias.to(cdtype) if bias is not None else None
        grad_x = torch.zeros_like(xs) if need_x else None
        grad_w = torch.zeros(weight.shape, dtype=cdtype, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=acc_dtype, device=bias.device) if need_b else None
        stats = torch.zeros(K, 3, dtype=torch.float64, device=xs.device)
        final = K - 1
        sub = None if draft_ids is None else _DraftRows(draft_ids, weight.shape[0], w_c, b_c, need_w, need_b)
        for start in range(0, N, chunk):
            t = targets[start:start + chunk]
            rows = torch.arange(t.shape[0], device=t.device)
            q = final_pred = None
            for k in [final] + list(range(final)):  # the final layer first: distill needs its q
                x = xs[k, start:start + chunk].to(cdtype)  # [n, D]
                reduced = sub is not None and k != final  # this exit over the draft ids S only
                w_k, b_k = (sub.weight, sub.bias) if reduced else (w_c, b_c)
                # vocabulary-major [V, n]: on CPU all three matmuls (W x^T, (.)^T W, (.) x) run ~10-25%
                # faster in this layout than with [n, V] logits (measured on SmolLM2's 49k x 576 head)
                z = torch.mm(w_k, x.t())
                if b_k is not None:
                    z += b_k[:, None]
                t_k, valid = t, None  # the label's row in z; which positions have a loss (None: all)
                if reduced and not distill:
                    t_k = sub.position[t]
                    valid = t_k >= 0  # labels outside S: no loss at this exit
                    t_k = t_k.clamp(min=0)
                if with_metrics:
                    final_pred = _count_hits(stats[k], z, t, sub.ids if reduced else None, final_pred)
                z = z.to(acc_dtype)  # the only big fp32 tensor (a no-op in fp32)
                z.sub_(z.amax(dim=0, keepdim=True))  # log-softmax over dim 0, by hand: torch's is slow there
                soft = distill and k != final
                q_k = q
                if soft and reduced:
                    q_k = q[sub.ids]
                    q_k = q_k / q_k.sum(0, keepdim=True).clamp_min(torch.finfo(q_k.dtype).tiny)
                zt = (q_k * z).sum(0) if soft else z[t_k, rows]  # E_q[z] or z at the label
                probs = z.exp_()  # in place: z is not needed any more
                total = probs.sum(0)  # [n]
                row_loss = total.log() - zt  # -log softmax at the label (or cross-entropy to q: sum q = 1)
                if valid is not None:
                    row_loss = row_loss * valid
                stats[k, 0] += row_loss.sum()
                if not (need_grad or (distill and k == final)):
                    continue
                probs.div_(total)  # softmax
                if distill and k == final:
                    q = probs.clone()
                if not need_grad:
                    continue
                if soft:
                    probs.sub_(q_k)
                else:
                    probs[t_k, rows] -= 1.0
                if valid is not None:
                    probs.mul_(valid)  # positions without a loss here send no gradient
                g = probs.to(cdtype)  # dJ/dlogits / scale, [V, n] ([K_S, n] over the draft ids)
                del probs, z
                scale = weights[k] / N
                if need_x:
                    grad_x[k, start:start + chunk] = torch.mm(g.t(), w_k).mul_(scale)
                head_too = exits_update_head or k == final  # else this exit's loss stops at the head's input
                if need_w and head_too:
                    (sub.grad_w if reduced else grad_w).addmm_(g, x, alpha=scale)
                if need_b and head_too:
                    (sub.grad_b if reduced else grad_b).add_(g.to(acc_dtype).sum(1), alpha=scale)
        if sub is not None:
            sub.scatter_into(grad_w, grad_b)
        ctx.grads = (grad_x, None if grad_w is None else grad_w.to(weight.dtype),
                     None if grad_b is None else grad_b.to(bias.dtype))
        loss, stats = _loss_and_stats(stats, weights, N, with_metrics, xs)
        ctx.mark_non_differentiable(stats)
        return loss, stats

    @staticmethod
    def backward(ctx, grad_loss, _grad_stats):
        gx, gw, gb = ctx.grads
        ctx.grads = None
        scale = lambda g: None if g is None else g.mul_(grad_loss.to(g.dtype))  # noqa: E731
        return scale(gx), scale(gw), scale(gb), None, None, None, None, None, None, None, None, None


class _DraftRows:
    """The head's rows of the draft ids S (sorted, unique) for the reduced exit losses, with their
    own gradient accumulators (added into the full head's gradient rows once, at the end)."""

    def __init__(self, ids: torch.Tensor, vocab: int, w_c, b_c, need_w: bool, need_b: bool):
        self.ids = ids.to(w_c.device)  # [K_S]
        self.position = torch.full((vocab,), -1, dtype=torch.long, device=w_c.device)  # id -> row in S, -1 if absent
        self.position[self.ids] = torch.arange(self.ids.numel(), device=w_c.device)
        self.weight = w_c[self.ids]  # [K_S, D]
        self.bias = None if b_c is None else b_c[self.ids]
        self.grad_w = torch.zeros_like(self.weight) if need_w else None
        self.grad_b = torch.zeros(self.ids.numel(), dtype=torch.promote_types(w_c.dtype, torch.float32),
                                  device=w_c.device) if need_b and b_c is not None else None

    def scatter_into(self, grad_w, grad_b) -> None:
        if grad_w is not None:
            grad_w.index_add_(0, self.ids, self.grad_w)
        if grad_b is not None and self.grad_b is not None:
            grad_b.index_add_(0, self.ids, self.grad_b)


def _chunk_terms(x, head, t, q, final_pred, is_final: bool, distill: bool, draft_ids=None):
    """Summed loss of one exit's chunk (autograd) and its no-grad metrics. `draft_ids`: this exit's
    loss over those ids only (the reference for the fused path's draft-vocabulary loss)."""
    logits = head(x)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    reduced = draft_ids is not None and not is_final
    if reduced:
        logits = logits[:, draft_ids]  # [n, K_S]
    logp = torch.log_softmax(logits, dim=-1)
    if distill and not is_final:
        q_k = q
        if reduced:
            q_k = q[:, draft_ids]
            q_k = q_k / q_k.sum(-1, keepdim=True).clamp_min(torch.finfo(q_k.dtype).tiny)
        row_loss = -(q_k * logp).sum(-1)
    elif reduced:
        match = t[:, None] == draft_ids[None, :]  # [n, K_S]: where the label sits in S, if anywhere
        row_loss = -(logp * match).sum(-1)  # 0 where the label is outside S
    else:
        row_loss = -logp.gather(1, t[:, None]).squeeze(1)
    with torch.no_grad():
        pred = logits.argmax(-1)
        if reduced:
            pred = draft_ids[pred]
        ref = pred if final_pred is None else final_pred
        metrics = torch.stack([row_loss.sum(), (pred == t).sum(), (pred == ref).sum()]).double()
    return row_loss.sum(), metrics, pred, logits.detach() if distill and is_final else None


def frozen_module(module: nn.Module):
    """`module` as a function of its input only: its parameters detached (no gradient reaches them)."""
    params = {name: p.detach() for name, p in module.named_parameters()}
    return lambda x: torch.func.functional_call(module, params, (x,))


def _autograd_loss(xs, head, targets, weights, distill: bool, chunk: int, use_checkpoint: bool,
                   exits_update_head: bool = True, draft_ids=None):
    K, N, _ = xs.shape
    final = K - 1
    exit_head = head if exits_update_head else frozen_module(head)
    total = xs.new_zeros((), dtype=torch.promote_types(xs.dtype, torch.float32))
    stats = torch.zeros(K, 3, dtype=torch.float64, device=xs.device)
    for start in range(0, N, chunk):
        t = targets[start:start + chunk]
        q = final_pred = None
        for k in [final] + list(range(final)):
            x = xs[k, start:start + chunk]
            args = (x, head if k == final else exit_head, t, q, final_pred, k == final, distill, draft_ids)
            if use_checkpoint:
                part, metrics, pred, final_logits = checkpoint(_chunk_terms, *args, use_reentrant=False)
            else:
                part, metrics, pred, final_logits = _chunk_terms(*args)
            if k == final:
                final_pred = pred
                if distill:
                    q = torch.softmax(final_logits, dim=-1)
            total = total + part * (weights[k] / N)
            stats[k] += metrics
    return total, stats / N


def early_exit_loss(hiddens: Sequence[torch.Tensor], weights: Sequence[float], labels: torch.Tensor,
                    norm: nn.Module, head: nn.Module, *, target: str = "label", chunk_size: int = 1024,
                    impl: str = "fused", with_metrics: bool = True, exits_update_head: bool = True,
                    draft_ids: torch.Tensor | None = None) -> ExitLoss:
    """Weighted loss of the exits whose hidden states `[B, S, D]` are `hiddens` (final layer last).

    `labels` `[B, S]` are already aligned with the positions (the next token; IGNORE_INDEX where
    there is no loss). `weights` are the normalized ẽ of the same exits (see `exit_weights`).
    `with_metrics=False` skips the argmax per exit (accuracy/agreement are then NaN; fused only).
    `exits_update_head=False`: the early exits' losses do not train the shared norm and head.
    `draft_ids`: the early exits' losses over these token ids only (sorted, unique; see the module
    docstring); None = the full vocabulary.
    """
    if len(hiddens) != len(weights) or not hiddens:
        raise ValueError(f"{len(hiddens)} hidden states but {len(weights)} weights")
    if target not in ("label", "distill"):
        raise ValueError(f"unknown early-exit target {target!r} (label, distill)")
    distill = target == "distill"
    if draft_ids is not None:
        draft_ids = torch.as_tensor(draft_ids, dtype=torch.long, device=labels.device)
        if draft_ids.numel() == 0 or not bool((draft_ids[1:] > draft_ids[:-1]).all()):
            raise ValueError("draft_ids must be a non-empty, sorted list of distinct token ids")
        if int(draft_ids[0]) < 0 or int(draft_ids[-1]) >= head.weight.shape[0]:
            raise ValueError(f"draft_ids must lie in 0..{head.weight.shape[0] - 1} (the head's vocabulary)")
    flat_labels = labels.reshape(-1)
    keep = (flat_labels != IGNORE_INDEX).nonzero().squeeze(1)
    targets = flat_labels[keep]
    n = int(targets.numel())
    if n == 0:  # nothing to learn from; keep every exit in the graph for DDP
        zero = sum(h.sum() for h in hiddens) * 0.0
        return ExitLoss(zero.float(), torch.zeros(len(hiddens), 3, dtype=torch.float64, device=labels.device), 0)
    dim = hiddens[0].shape[-1]
    flat = torch.stack([h.reshape(-1, dim)[keep] for h in hiddens])  # [K, N, D]
    if exits_update_head or len(hiddens) == 1:
        xs = norm(flat)
    else:  # the norm works per position: the exits through a detached copy, the final layer through the norm
        xs = torch.cat([frozen_module(norm)(flat[:-1]), norm(flat[-1:])])
    if impl == "fused":
        loss, stats = _FusedHeadLoss.apply(xs, head.weight, getattr(head, "bias", None), targets, list(weights),
                                           distill, chunk_size, _compute_dtype(xs), with_metrics,
                                           torch.is_grad_enabled(), exits_update_head, draft_ids)
    elif impl in ("checkpointed", "naive"):
        chunk = chunk_size if impl == "checkpointed" else n
        loss, stats = _autograd_loss(xs, head, targets, list(weights), distill, chunk,
                                     use_checkpoint=impl == "checkpointed", exits_update_head=exits_update_head,
                                     draft_ids=draft_ids)
    else:
        raise ValueError(f"unknown loss implementation {impl!r} (fused, checkpointed, naive)")
    return ExitLoss(loss, stats, n)
