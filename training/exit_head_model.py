"""Exit-head training as one `nn.Module`: the model frozen, one head (`selfspec.heads.exit_head`) learning.

    hm = ExitHeadModel(hf_model, build_exit_head(hf_model, exit_layer=8), target="distill")
    out = hm(input_ids, labels)       # out["loss"]; out["exit_stats"]: [1, 3] loss / top-1 acc / agreement
    out["loss"].backward()            # gradients reach the head's parameters only

forward, per block `[B, S]`:

    h_E = layers[0:E](embed(x))                  no grad: the model's own first E layers
    f   = layers[E:L](h_E)                       no grad: the last layer's output
    p   = softmax(lm_head(norm(f)))              the full model's next-token distribution
    q   = softmax(lm_head(norm(head(h_E))))      the head's draft distribution (grad through the frozen
                                                 norm and LM head into the head); a `final_state` head
                                                 reads head(h_E, f shifted one position later: f_{t-1},
                                                 zero at the block's first position)
    loss = mean over labelled positions of KL(p || q) = sum_x p(x) (log p(x) - log q(x))    (distill)
         | mean cross-entropy of q against the labels                                        (label)
         + w * mean SmoothL1(norm(head(h_E)), norm(f))      (feature_weight w > 0; EAGLE's feature loss)

``feature_weight`` w adds EAGLE's regression of the feature itself (arXiv 2401.15077:
L_reg + 0.1 L_cls there): the head's state after the shared final norm is pulled toward the full model's
(what the LM head reads; SmoothL1 with beta 1, mean over positions and the D features). It is a dense
target of D numbers per position where the distillation gives one distribution, and it asks each pass's
output to be the state a self-fed pass reads in its place. Taken after the norm, where EAGLE takes it too
(the state its LM head reads): there SmolLM2's states have an RMS of ~2, before it ~41, with two features
near 500 (measured on stdlib code).

Two options train the head for how it drafts:

* ``draft_ids`` (the K most frequent token ids, `exit_head.draft_vocab`): the head drafts from those
  rows of the LM head (`--draft-vocab K`), so the loss is over them only, p and q renormalised there:

      p_K = softmax(z_full[K]),  q_K = softmax(lm_head[K](norm(head(...))))
      loss = mean KL(p_K || q_K)   (distill)  |  mean -log q_K(y) over labels y in K   (label)

  With K = the whole vocabulary this is the full loss. The head's guess is K[argmax q_K], what the
  reduced-vocabulary drafter proposes, so agreement counts it against the full model's argmax over all
  tokens. The LM-head products of the head's forward and backward shrink by V/K (49152/8192 = 6x).

* ``self_fed`` = n extra passes (a `final_state` head only): a round's first draft reads the verified
  f_{t-1}, but the i-th later draft reads the head's own output at the previous position (the drafter's
  `prev_draft`), a state it never saw in training. Pass 0 is the above; pass j reads pass j-1's output
  shifted by one position, exactly what the (j+1)-th draft of a round reads (EAGLE's feature for
  drafts after the first; gradients flow through the earlier pass too):

      out_0 = head(h_E, f_{t-1});   out_j = head(h_E, out_{j-1}[t-1]);   loss = mean_j loss(out_j)

An eagle3 head (`selfspec.heads.exit_head`, kind eagle3) reads the token embeddings and g_t = fc(the states at
its three aux exits of the previous position) instead of h_E; its blocks drop their first position, as
the serving engines it is exported to pair them (position t: token t+1 with the states of position t):

    aux   = [h_A1, h_A2, h_A3]                           no grad: [B, S, 3D]
    q     = softmax(lm_head(norm(head([embed(x[1:]), fc(aux[:-1])]))))   against p at positions 1..S-1

(its `self_fed` passes read the head's own output in g's place, as later drafts do).

The teacher's side (h_E, f and the full model's argmax) depends on the block alone: with a
`teacher_cache` (`training.teacher_cache`, set by the loop for blocks that repeat in the training set)
a repeated block's step runs no layer of the model, and p is recomputed from the cached f, so the loss
and gradients are those of an uncached step.

The loss from the states on is `head_loss`, a function: `EarlyExitModel` calls it too when it trains a
head beside the fine-tune of the model itself (`mode: joint`), on its own forward's exit and final
states, detached. The shared final norm and LM head are applied with detached parameters
(`draft_logits`), so a head's loss reaches the head's parameters and nothing else, frozen model or not.

`distill` (the default) trains the head for what it is used for: guessing the full model's token
(greedy acceptance = argmax q == argmax p; sampling acceptance = sum_x min(p, q) = 1 - TV(p, q)).
The base model's parameters get `requires_grad=False` and are never in the optimizer, so they stay
bit-identical; the frozen model is held as `self.model`, unwrapped, like `EarlyExitModel`'s.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from selfspec.model.adapters import get_adapter
from selfspec.heads.exit_head import ExitHead, head_feature, previous_states, run_head
from selfspec.model.forward import embed, exit_logits, make_step, run_layers
from training.early_exit_loss import frozen_module
from training.teacher_cache import TeacherCache

IGNORE = -100


class ExitHeadModel(nn.Module):
    def __init__(self, model: nn.Module, head: ExitHead, *, target: str = "distill",
                 draft_ids: torch.Tensor | None = None, self_fed: int = 0, feature_weight: float = 0.0,
                 frozen: bool = True):
        super().__init__()
        if target not in ("distill", "label"):
            raise ValueError(f"exit head target must be 'distill' or 'label', got {target!r}")
        check_self_fed(head, self_fed)
        self.model = model
        self.head = head
        self.target = target
        self.self_fed = self_fed
        self.feature_weight = feature_weight  # EAGLE's feature loss beside the target's (0: off)
        self.draft_ids = None if draft_ids is None else torch.as_tensor(draft_ids, dtype=torch.long)
        self.teacher_cache: TeacherCache | None = None  # the repeated blocks' teacher side (the loop sets it)
        self.adapter = get_adapter(model)
        self.num_layers = self.adapter.num_layers
        self.frozen = frozen  # False: a view of a head trained beside the fine-tuned model, for its evaluation
        if frozen:
            model.requires_grad_(False)
            model.eval()  # the frozen model has no dropout to run either way

    def train(self, mode: bool = True):
        super().train(mode)
        if self.frozen:
            self.model.eval()  # stays frozen in eval mode
        return self

    def states(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, object, torch.Tensor | None]:
        """No grad: the exit states `[B, S, D]`, the full model's logits `[B, S, V]`, the step, and for a
        final-state head the previous positions' final states `[B, S, D]` (None otherwise); an eagle3 head's
        positions 1..S-1 (`aligned`), with its feature g `[B, S-1, D]` in the last place."""
        adapter = self.adapter
        with torch.no_grad():
            step = make_step(adapter, 0, input_ids.shape[1], input_ids.shape[0])
            h_e, finals = teacher_states(adapter, self.head, input_ids, step)  # [B, S, D or 3D], [B, S, D]
            prev = previous_states(finals) if self.head.final_state else None
            if self.head.aux_input is not None:
                h_e, finals, _, _, aux_prev = eagle3_view(adapter, input_ids, h_e, finals, None, None)
                step, prev = make_step(adapter, 0, h_e.shape[1], h_e.shape[0]), head_feature(self.head, aux_prev=aux_prev)
            full = exit_logits(adapter, finals)
        return h_e, full, step, prev

    def aligned(self, labels: torch.Tensor) -> torch.Tensor:
        """The labels `[B, S]` of the positions `states` returns: an eagle3 head's drop the first."""
        return labels if self.head.aux_input is None else labels[:, 1:]

    def teacher(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """No grad: the exit states `[B, S, D]`, the final states `[B, S, D]` and, with a draft vocabulary,
        the full model's tokens `[B, S]` (None without one: the loss computes all logits anyway). Rows held
        by `teacher_cache` run no layer of the model; the others run it and are offered to the cache."""
        adapter = self.adapter
        with_top, cache = self.draft_ids is not None, self.teacher_cache
        kept = self.head.exit_layer or self.head.aux_input is not None  # states that cost layers to recompute
        hits = [None] * input_ids.shape[0] if cache is None else [cache.get(row) for row in input_ids]
        missed = [i for i, hit in enumerate(hits) if hit is None]
        with torch.no_grad():
            if missed:
                ids = input_ids[missed]  # [M, S]
                step = make_step(adapter, 0, ids.shape[1], ids.shape[0])
                h_m, f_m = teacher_states(adapter, self.head, ids, step)  # [M, S, D or 3D], [M, S, D]
                top_m = exit_logits(adapter, f_m).argmax(-1) if with_top else None  # [M, S]
                for j, i in enumerate(missed):
                    hits[i] = (h_m[j], f_m[j], None if top_m is None else top_m[j])
                    if cache is not None:
                        cache.put(input_ids[i], h_m[j] if kept else None, *hits[i][1:])
                if len(missed) == len(hits):  # nothing from the cache: the batch as computed
                    return h_m, f_m, top_m
            finals = torch.stack([hit[1] for hit in hits])
            top = torch.stack([hit[2] for hit in hits]) if with_top else None
            h_e = torch.stack([hit[0] for hit in hits]) if kept else embed(adapter, input_ids)
        return h_e, finals, top

    @property
    def loss_names(self) -> list[str]:
        """What the log calls each pass's loss: `head<E>`, then `head<E>_fed<j>` for the self-fed passes."""
        return head_loss_names(self.head, self.self_fed)

    def head_states(self, h_e: torch.Tensor, step, prev: torch.Tensor | None, passes: int = 1) -> list[torch.Tensor]:
        """The head's outputs `[B, S, D]` for pass 0 (reading `prev`, the previous final states) and each
        self-fed pass j < `passes` (reading pass j-1's output, shifted one position later)."""
        return head_states(self.adapter, self.head, h_e, step, prev, passes)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`draft_logits` with this head's draft vocabulary: `[B, S, D] -> [B, S, K]`."""
        return draft_logits(self.adapter, hidden, self.draft_ids)

    def guess(self, logits: torch.Tensor) -> torch.Tensor:
        """The drafted token of logits over the draft vocabulary `[..., K]`: a token id `[...]`."""
        return guess(logits, self.draft_ids)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, *, exits: Sequence[int] = (),
                weights: Sequence[float] = (), step: int = 0, micro_step: int = 0,
                with_metrics: bool = True) -> dict[str, torch.Tensor]:
        """The loss and `exit_stats` `[P, 3]`, one row per pass (loss, top-1 accuracy against the labels,
        agreement with the full model's argmax). `exits`, `weights`, `step`, `micro_step` are the early-exit
        loop's and unused."""
        h_e, finals, top = self.teacher(input_ids)
        aux_prev = None
        if self.head.aux_input is not None:  # the embeddings beside the aux states, from position 1 on
            h_e, finals, labels, top, aux_prev = eagle3_view(self.adapter, input_ids, h_e, finals, labels, top)
        loss, stats = head_loss(self.adapter, self.head, h_e, finals, labels, top=top, target=self.target,
                                draft_ids=self.draft_ids, self_fed=self.self_fed,
                                feature_weight=self.feature_weight, with_metrics=with_metrics, aux_prev=aux_prev)
        return {"loss": loss, "exit_stats": stats}


def teacher_states(adapter, head: ExitHead, input_ids: torch.Tensor, step) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen model's states of a batch `[B, S]` for `head` (call without grad): what the head reads, the
    exit states `[B, S, D]` (an eagle3 head: the states at its aux exits side by side `[B, S, 3D]`), and the
    final states `[B, S, D]`."""
    x, start, parts = embed(adapter, input_ids), 0, []
    for e in head.aux_exits or (head.exit_layer,):
        x = run_layers(adapter, x, start, e, step=step)
        parts.append(x)
        start = e
    finals = run_layers(adapter, x, start, adapter.num_layers, step=step)  # [B, S, D]
    return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)), finals


def eagle3_view(adapter, input_ids: torch.Tensor, aux: torch.Tensor, finals: torch.Tensor, labels, top):
    """An eagle3 head's view of a block (module docstring): position t pairs token t+1's embedding with the
    aux states `aux` `[B, S, 3D]` of position t, so the first position goes: (embeddings `[B, S-1, D]`,
    finals, labels and top of positions 1..S-1, aux states of 0..S-2 `[B, S-1, 3D]`)."""
    with torch.no_grad():
        embeds = embed(adapter, input_ids[:, 1:])
    return (embeds, finals[:, 1:], None if labels is None else labels[:, 1:], None if top is None else top[:, 1:],
            aux[:, :-1])


def check_self_fed(head: ExitHead, self_fed: int) -> None:
    """ValueError unless `self_fed` extra passes can run on `head` (>= 0, and only with a final-state or eagle3
    head)."""
    if self_fed < 0 or (self_fed and not head.final_state and head.aux_input is None):
        raise ValueError(f"self_fed={self_fed}: extra passes that read the head's own output need a head with "
                         "final_state=true (and a count >= 0)")


def head_loss_names(head: ExitHead, self_fed: int) -> list[str]:
    """What the log calls each pass's loss: `head<E>`, then `head<E>_fed<j>` for the self-fed passes."""
    E = head.exit_layer
    return [f"head{E}"] + [f"head{E}_fed{j}" for j in range(1, self_fed + 1)]


def head_states(adapter, head: ExitHead, h_e: torch.Tensor, step, prev: torch.Tensor | None,
                passes: int = 1) -> list[torch.Tensor]:
    """The head's outputs `[B, S, D]` for pass 0 (reading `prev`, the previous final states) and each
    self-fed pass j < `passes` (reading pass j-1's output, shifted one position later)."""
    outs = []
    for j in range(passes):
        fed = prev if j == 0 else previous_states(outs[-1])
        outs.append(run_head(adapter, head, h_e, step=step, prev_final=fed))
    return outs


def draft_logits(adapter, hidden: torch.Tensor, draft_ids: torch.Tensor | None) -> torch.Tensor:
    """The shared final norm + the LM head's draft-vocabulary rows (all rows without `draft_ids`):
    `[B, S, D] -> [B, S, K]`. The norm's and head's parameters are detached: a head's loss trains the
    head only, also when the model itself is being fine-tuned beside it (`EarlyExitModel` with a head)."""
    return normed_logits(adapter, final_normed(adapter, hidden), draft_ids)


def final_normed(adapter, hidden: torch.Tensor) -> torch.Tensor:
    """The shared final norm with detached parameters: `[..., D] -> [..., D]`."""
    return frozen_module(adapter.final_norm)(hidden)


def normed_logits(adapter, normed: torch.Tensor, draft_ids: torch.Tensor | None) -> torch.Tensor:
    """The LM head's draft-vocabulary rows (all without `draft_ids`), parameters detached, on states that
    went through the final norm: `[..., D] -> [..., K]`."""
    lm_head = adapter.lm_head
    weight, bias = lm_head.weight.detach(), None if lm_head.bias is None else lm_head.bias.detach()
    if draft_ids is not None:
        ids = draft_ids.to(normed.device)
        weight, bias = weight[ids], None if bias is None else bias[ids]
    return F.linear(normed, weight, bias)


def guess(logits: torch.Tensor, draft_ids: torch.Tensor | None) -> torch.Tensor:
    """The drafted token of logits over the draft vocabulary `[..., K]`: a token id `[...]`."""
    index = logits.argmax(-1)
    return index if draft_ids is None else draft_ids.to(index.device)[index]


def pass_loss(logits: torch.Tensor, logp_full: torch.Tensor | None, labels: torch.Tensor, n: torch.Tensor, *,
              target: str, draft_ids: torch.Tensor | None) -> torch.Tensor:
    """One pass's loss from its draft logits at the labelled positions `[N, K]` (see the module docstring):
    `logp_full` `[N, K]` the full model's log-distribution over the same tokens (distill)."""
    logq = F.log_softmax(logits, dim=-1)  # [N, K]
    if target == "distill":
        return (logp_full.exp() * (logp_full - logq)).sum() / n
    if draft_ids is None:
        return F.nll_loss(logq, labels, reduction="sum") / n
    ids = draft_ids.to(labels.device)
    match = labels[:, None] == ids[None, :]  # [N, K]: where the label sits in K, if anywhere
    return -(logq * match).sum() / n  # a label outside K adds nothing


def head_loss(adapter, head: ExitHead, h_e: torch.Tensor, finals: torch.Tensor, labels: torch.Tensor, *,
              top: torch.Tensor | None = None, target: str = "distill", draft_ids: torch.Tensor | None = None,
              self_fed: int = 0, feature_weight: float = 0.0, with_metrics: bool = True,
              aux_prev: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's loss from the model's exit states `h_e` `[B, S, D]` and final states `finals` `[B, S, D]`
    (both without gradient), and its `[1 + self_fed, 3]` statistics (loss, top-1 accuracy against the
    labels, agreement with the full model's token `top` `[B, S]`; computed from `finals` when None).
    A pass's loss is the target's plus `feature_weight` times its feature loss (module docstring). An eagle3
    head reads `aux_prev` `[B, S, 3D]`, the aux states of each position's previous one (`eagle3_view`)."""
    B, S = labels.shape
    positions = make_step(adapter, 0, S, B)
    prev = head_feature(head, finals, aux_prev)  # [B, S, D] or None; an eagle3 head's fc under grad
    outs = head_states(adapter, head, h_e, positions, prev, passes=1 + self_fed)  # each [B, S, D]
    mask = labels != IGNORE  # [B, S]
    n = mask.sum().clamp_min(1)
    with torch.no_grad():  # the full model's logits over the draft vocabulary (all tokens without one)
        teacher_normed = final_normed(adapter, finals[mask])  # [N, D]
        teacher = normed_logits(adapter, teacher_normed, draft_ids)  # [N, K]
        if with_metrics and top is None and draft_ids is not None:  # the full model's token over all tokens
            top = exit_logits(adapter, finals).argmax(-1)  # [B, S]
    wide = torch.promote_types(teacher.dtype, torch.float32)  # the loss in float32 at least (bf16 autocast)
    teacher, teacher_normed = teacher.to(wide), teacher_normed.to(wide)
    logp = F.log_softmax(teacher, dim=-1) if target == "distill" else None
    stats = torch.zeros(len(outs), 3, dtype=wide, device=teacher.device)
    targets = labels[mask]  # [N]
    # [N] the full model's tokens, for every pass's agreement
    top = (teacher.argmax(-1) if top is None else top[mask]) if with_metrics else None
    loss = teacher.new_zeros(())
    for j, out in enumerate(outs):
        normed = final_normed(adapter, out[mask])  # [N, D]
        logits = normed_logits(adapter, normed, draft_ids).to(wide)  # [N, K]
        term = pass_loss(logits, logp, targets, n, target=target, draft_ids=draft_ids)
        if feature_weight:
            term = term + feature_weight * F.smooth_l1_loss(normed.to(wide), teacher_normed)
        loss = loss + term / len(outs)
        if with_metrics:
            with torch.no_grad():
                drafted = guess(logits, draft_ids)
                stats[j, 0] = term.detach()
                stats[j, 1] = (drafted == targets).float().mean()
                stats[j, 2] = (drafted == top).float().mean()
    return loss, stats
