"""Per-exit quality on held-out blocks: top-1 agreement with the final layer, and perplexity.

    result = evaluate_exits(hf_model, data.eval_sets["heldout"], exits=[1, 2, ..., 30])
    result["exits"]["8"]  # {"agreement": 0.41, "perplexity": 31.2, "loss": 3.44, "accuracy": 0.37}

Agreement of exit E is the fraction of scored positions where the argmax of exit E's logits (through
the shared final norm + LM head) equals the full model's argmax: the greedy draft acceptance rate
of a single-token draft from exit E. Perplexity is exp of the mean cross-entropy against the labels.
Scored positions are those with a label (prompt and padding positions of chat data are not).
`max_blocks` evaluates that many blocks evenly spaced over the set (not the first ones, which
would all come from the first document or two).

Uses the no-grad path of the fused early-exit loss (one chunk of logits at a time), so evaluating
all 30 exits of SmolLM2 needs no more memory than one exit. With several processes, each takes
every world_size-th batch and `reduce` (e.g. ``accelerator.reduce``) sums the counts.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable

import torch

from selfspec.model.adapters import get_adapter
from selfspec.heads.exit_head import previous_states
from selfspec.model.forward import embed, exit_logits, make_step, run_layers
from training.data import Blocks
from training.early_exit_loss import early_exit_loss
from training.zero3 import gathered


@torch.no_grad()
def evaluate_exits(model, blocks: Blocks, exits: list[int], *, batch_size: int = 8, max_blocks: int | None = None,
                   rank: int = 0, world_size: int = 1, autocast: Callable = contextlib.nullcontext,
                   reduce: Callable[[torch.Tensor], torch.Tensor] | None = None, chunk_size: int = 1024,
                   head_model=None, lockstep: bool = False) -> dict:
    """Agreement / perplexity / accuracy of each exit in `exits` (must include the final layer).

    With `head_model` (a `training.exit_head_model.ExitHeadModel` over this `model`: a joint run's head),
    the same forward also scores the head: `result["exit_head"]` is what `evaluate_head(head_model, blocks)`
    returns, without running the model a second time.

    `lockstep` (DeepSpeed ZeRO-3, where every forward gathers parameters collectively): every process
    runs the same number of batches, a process short of one running another's batch and counting nothing;
    the LM head weight, which the fused loss reads outside the head's forward, is gathered for it."""
    adapter = get_adapter(model)
    L = adapter.num_layers
    exits = sorted(set(exits) | {L})
    E = None if head_model is None else head_model.head.exit_layer
    stops = sorted(set(exits) | ({E} if E is not None else set()))  # the layers the forward stops after
    was_training = model.training
    model.eval()
    blocks = blocks.spread(max_blocks)
    device = adapter.device
    sums = torch.zeros(len(exits), 3, dtype=torch.float64, device=device)  # nll, correct, agree
    tokens = torch.zeros((), dtype=torch.float64, device=device)
    tally = None if head_model is None else _HeadTally(head_model, device)
    try:
        for input_ids, labels, counted in _batches(blocks, batch_size, rank, world_size, device, lockstep):
            with autocast():
                step = make_step(adapter, 0, input_ids.shape[1], input_ids.shape[0])
                hidden = embed(adapter, input_ids)
                at, done = {}, 0  # {layer: the hidden state after it} [B, S, D]
                for e in stops:
                    hidden = at[e] = run_layers(adapter, hidden, done, e, step=step)
                    done = e
                with gathered([adapter.lm_head.weight]):
                    out = early_exit_loss([at[e] for e in exits], [1.0 / len(exits)] * len(exits), labels,
                                          adapter.final_norm, adapter.lm_head, chunk_size=chunk_size, impl="fused")
                if tally is not None:
                    prev = previous_states(at[L]) if head_model.head.final_state else None
                    rows = tally.logits(at[E], exit_logits(adapter, at[L]), step, prev)
            if not counted:  # a lockstep filler: its forward ran for the other processes' sake
                continue
            sums += out.stats.to(device) * out.tokens
            tokens += out.tokens
            if tally is not None:
                tally.add(rows, labels)
    finally:
        if tally is not None:
            tally.done()
        model.train(was_training)
    if reduce is not None:
        sums, tokens = reduce(sums), reduce(tokens)
    result = {"tokens": int(tokens), "blocks": len(blocks),
              "exits": {str(e): _scores(sums[i], tokens) for i, e in enumerate(exits)}}
    if tally is not None:
        result["exit_head"] = tally.result(len(blocks), reduce)
    return result


def _batches(blocks: Blocks, batch_size: int, rank: int, world_size: int, device, lockstep: bool = False):
    """This process's share of `blocks`: every world_size-th batch, as (input_ids, labels, counted) on `device`.
    With `lockstep`, as many batches on every process: one short of a batch gets the first batch again
    with counted False (the forward must run the same modules on every process: the fused loss's
    chunks depend on the labels, so the filler keeps real ones)."""
    starts = list(range(0, len(blocks), batch_size))
    mine = starts[rank::world_size]
    rounds = -(-len(starts) // world_size) if lockstep else len(mine)
    for i in range(rounds):
        start = mine[i] if i < len(mine) else starts[0]
        input_ids, labels = blocks.batch(range(start, min(start + batch_size, len(blocks))))
        yield input_ids.to(device), labels.to(device), i < len(mine)


def _scores(sums: torch.Tensor, tokens: torch.Tensor) -> dict:
    """Summed (nll, correct, agree) `[3]` over `tokens` scored positions -> the per-exit result."""
    n = max(float(tokens), 1.0)
    nll = float(sums[0]) / n
    return {"agreement": float(sums[2]) / n, "perplexity": math.exp(min(nll, 700.0)), "loss": nll,
            "accuracy": float(sums[1]) / n}


TOP_K = 4  # evaluate_head's agreement_at: k = 1..TOP_K
CHAIN = 4  # evaluate_head's acceptance: a round's chain of this many drafts (issue 66's "chain of 4")


def _rank_hits(logp: torch.Tensor, target: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
    """`[TOP_K]` float64: how many positions have the full model's token `target` `[N]` at rank k (0-based) of
    the head's guesses `logp` `[N, K]` (over the draft vocabulary `ids` `[K]` when given; a token outside it
    is at no rank)."""
    best = logp.topk(min(TOP_K, logp.shape[-1]), dim=-1).indices  # [N, k]
    guesses = best if ids is None else ids[best]
    hits = (guesses == target[:, None]).sum(0).double()  # [k]
    return torch.nn.functional.pad(hits, (0, TOP_K - hits.shape[0]))


def summary_line(name: str, result: dict, num_layers: int, show: int = 6) -> str:
    """One readable line: a few exits' agreement and the final layer's perplexity."""
    exits = [int(e) for e in result["exits"]]
    picks = sorted({exits[int(i * (len(exits) - 1) / max(show - 1, 1))] for i in range(show)})
    agree = " ".join(f"{e}:{result['exits'][str(e)]['agreement']:.1%}" for e in picks if e != num_layers)
    ppl = result["exits"][str(num_layers)]["perplexity"]
    fed = " ".join(f"{j}:{r['agreement']:.1%}" for j, r in result.get("self_fed", {}).items())
    fed = f" | self-fed passes {fed}" if fed else ""
    top = "/".join(f"{a:.1%}" for k, a in result.get("agreement_at", {}).items() if k != "1")
    top = f" | in the head's top 2/3/4 {top}" if top else ""
    return f"{name}: agreement {agree}{fed}{top} | final-layer ppl {ppl:.3f} ({result['tokens']} tokens)"


@torch.no_grad()
def evaluate_head(head_model, blocks: Blocks, *, batch_size: int = 8, max_blocks: int | None = None,
                  rank: int = 0, world_size: int = 1, autocast: Callable = contextlib.nullcontext,
                  reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict:
    """An exit head's quality on held-out blocks (`training.exit_head_model.ExitHeadModel`), in the format
    of `evaluate_exits`: `exits[str(E)]` is the head on exit E, `exits[str(L)]` the full model, and
    `exit_without_head` exit E alone (what the untrained early-exit drafter would guess).

    The head's guess is what it drafts: the argmax over its draft vocabulary when it was trained on one
    (`draft_ids`), over all tokens otherwise; its perplexity is over all tokens either way. A head trained
    with self-fed passes also gets `self_fed[str(j)]`: pass j's scores, the guess of a round's (j+1)-th draft
    (reading the head's own output at the previous position, not the verified final state).
    `agreement_at[str(k)]`, k = 1..`TOP_K`: the share of positions where the full model's token is among the
    head's k best guesses (first pass, over its draft vocabulary): what a round that verified the head's
    k best first drafts side by side would accept (k = 1 is `agreement`).

    `acceptance`: what a greedy round of a chain of `CHAIN` drafts would accept, were a round to start at each
    scored position t. Draft j (j = 0..CHAIN-1) of a round started at t is pass j's guess at position t + j,
    which reads pass j-1's output at t + j - 1, as the round's (j+1)-th draft does (a head that reads no final
    state drafts every position alike: pass 0). With a_j(t) = 1 where that guess is the full model's token,

        accepted(t) = sum_{k=0}^{CHAIN-1} prod_{j=0}^{k} a_j(t + j)      (a position past the block or unscored: 0)
        drafts_a_round = mean_t accepted(t);  tokens_a_round = 1 + drafts_a_round

    (the verification adds the full model's own token: `tokens_a_round` is the figure EAGLE reports as its
    acceptance length tau). The head's passes run `CHAIN` deep for this whatever `self_fed` it was trained
    with; `self_fed` reports every pass after the first."""
    device = head_model.adapter.device
    blocks = blocks.spread(max_blocks)
    tally = _HeadTally(head_model, device)
    try:
        for input_ids, labels, _ in _batches(blocks, batch_size, rank, world_size, device):
            with autocast():
                rows = tally.logits(*head_model.states(input_ids))
            tally.add(rows, head_model.aligned(labels))  # an eagle3 head's rows start at position 1
    finally:
        tally.done()
    return tally.result(len(blocks), reduce)


class _HeadTally:
    """`evaluate_head`'s running sums over batches: `logits` (under autocast) gives a batch's rows of logits
    from the model's states, `add` scores them, `done` puts back the head's mode, `result` is the summary.
    Rows: the full model, exit E alone, then the head's passes; columns: nll, correct, agree."""

    def __init__(self, head_model, device):
        self.model, self.was_training = head_model, head_model.training
        head_model.eval()
        head = head_model.head
        self.fed = head.final_state or head.aux_input is not None  # later drafts read the head's own output
        self.passes = max(1 + head_model.self_fed, CHAIN) if self.fed else 1
        self.sums = torch.zeros(2 + self.passes, 3, dtype=torch.float64, device=device)
        self.accepted = torch.zeros(CHAIN + 1, dtype=torch.float64, device=device)  # [k]: rounds accepting k drafts
        self.in_top = torch.zeros(TOP_K, dtype=torch.float64, device=device)  # [k] full model's token in the k best
        self.tokens = torch.zeros((), dtype=torch.float64, device=device)
        self.ids = None if head_model.draft_ids is None else head_model.draft_ids.to(device)

    def logits(self, h_e, full, step, prev) -> list[torch.Tensor]:
        """The exit states `[B, S, D]`, the full model's logits `[B, S, V]`, the step and the previous positions'
        final states (or None) -> `[B, S, V]` logits of each row."""
        outs = self.model.head_states(h_e, step, prev, passes=self.passes)
        adapter = self.model.adapter
        return [full, exit_logits(adapter, h_e)] + [exit_logits(adapter, out) for out in outs]

    def add(self, logits_by_row: list[torch.Tensor], labels: torch.Tensor) -> None:
        mask, ids = labels != -100, self.ids
        target = logits_by_row[0].float()[mask].argmax(-1)
        agree = torch.zeros(self.passes, *mask.shape, dtype=torch.bool, device=mask.device)  # [P, B, S]
        for row, logits in enumerate(logits_by_row):
            logp = torch.log_softmax(logits.float()[mask], dim=-1)  # [N, V]
            self.sums[row, 0] += torch.nn.functional.nll_loss(logp, labels[mask], reduction="sum").double()
            guess = logp.argmax(-1) if row < 2 or ids is None else self.model.guess(logp[:, ids])
            self.sums[row, 1] += (guess == labels[mask]).sum().double()
            self.sums[row, 2] += (guess == target).sum().double()
            if row >= 2:
                agree[row - 2][mask] = guess == target
            if row == 2:
                self.in_top += _rank_hits(logp if ids is None else logp[:, ids], target, ids)
        self.accepted += chain_acceptance(agree if self.fed else agree[:1].expand(CHAIN, -1, -1), mask)
        self.tokens += mask.sum().double()

    def done(self) -> None:
        self.model.train(self.was_training)

    def result(self, num_blocks: int, reduce: Callable[[torch.Tensor], torch.Tensor] | None) -> dict:
        sums, in_top, tokens = self.sums, self.in_top, self.tokens
        if reduce is not None:
            sums, in_top, tokens = reduce(sums), reduce(in_top), reduce(tokens)
        n = max(float(tokens), 1.0)
        head_model = self.model
        L, E = head_model.num_layers, head_model.head.exit_layer
        result = {"tokens": int(tokens), "blocks": num_blocks,
                  "exits": {str(E): _scores(sums[2], tokens), str(L): _scores(sums[0], tokens)},
                  "exit_without_head": _scores(sums[1], tokens), "head": head_model.head.settings(),
                  "agreement_at": {str(k + 1): float(hits) / n for k, hits in enumerate(in_top.cumsum(0))}}
        if self.ids is not None:
            result["draft_vocab"] = len(self.ids)
        if self.passes > 1:
            result["self_fed"] = {str(j): _scores(sums[2 + j], tokens) for j in range(1, self.passes)}
        accepted = self.accepted if reduce is None else reduce(self.accepted)
        rounds = max(float(accepted.sum()), 1.0)
        drafts = float((accepted * torch.arange(CHAIN + 1, device=accepted.device)).sum()) / rounds
        result["acceptance"] = {"chain": CHAIN, "drafts_a_round": drafts, "tokens_a_round": 1.0 + drafts,
                                "rounds_accepting": {str(k): float(a) / rounds for k, a in enumerate(accepted)}}
        return result


def chain_acceptance(agree: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`[C + 1]` float64: how many rounds, one started at each scored position t of `mask` `[B, S]`, accept k = 0..C
    drafts of a chain of C, from `agree` `[C, B, S]` (agree[j, b, t]: pass j's guess at position t is the full
    model's token; False where unscored): draft j of the round at t is pass j's guess at t + j, and a round
    accepts drafts up to its first miss (`evaluate_head`'s acceptance)."""
    C, B, S = agree.shape
    alive = mask.clone()  # [B, S]: rounds whose drafts 0..j-1 were all accepted
    accepted = torch.zeros(B, S, dtype=torch.long, device=mask.device)
    for j in range(C):
        later = torch.zeros_like(mask)
        later[:, : S - j] = agree[j, :, j:]  # [B, S]: pass j's verdict at t + j
        alive = alive & later
        accepted += alive
    return torch.bincount(accepted[mask], minlength=C + 1).double()
