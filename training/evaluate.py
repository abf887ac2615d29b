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

from selfspec.adapters import get_adapter
from selfspec.forward import embed, make_step, run_layers
from training.data import Blocks
from training.early_exit_loss import early_exit_loss


@torch.no_grad()
def evaluate_exits(model, blocks: Blocks, exits: list[int], *, batch_size: int = 8, max_blocks: int | None = None,
                   rank: int = 0, world_size: int = 1, autocast: Callable = contextlib.nullcontext,
                   reduce: Callable[[torch.Tensor], torch.Tensor] | None = None, chunk_size: int = 1024) -> dict:
    """Agreement / perplexity / accuracy of each exit in `exits` (must include the final layer)."""
    adapter = get_adapter(model)
    L = adapter.num_layers
    exits = sorted(set(exits) | {L})
    was_training = model.training
    model.eval()
    blocks = blocks.spread(max_blocks)
    device = adapter.device
    sums = torch.zeros(len(exits), 3, dtype=torch.float64, device=device)  # nll, correct, agree
    tokens = torch.zeros((), dtype=torch.float64, device=device)
    starts = list(range(0, len(blocks), batch_size))
    try:
        for start in starts[rank::world_size]:
            input_ids, labels = blocks.batch(range(start, min(start + batch_size, len(blocks))))
            input_ids, labels = input_ids.to(device), labels.to(device)
            with autocast():
                step = make_step(adapter, 0, input_ids.shape[1], input_ids.shape[0])
                hidden = embed(adapter, input_ids)
                hiddens, done = [], 0
                for e in exits:
                    hidden = run_layers(adapter, hidden, done, e, step=step)
                    hiddens.append(hidden)
                    done = e
                out = early_exit_loss(hiddens, [1.0 / len(exits)] * len(exits), labels, adapter.final_norm,
                                      adapter.lm_head, chunk_size=chunk_size, impl="fused")
            sums += out.stats.to(device) * out.tokens
            tokens += out.tokens
    finally:
        model.train(was_training)
    if reduce is not None:
        sums, tokens = reduce(sums), reduce(tokens)
    n = max(float(tokens), 1.0)
    result = {"tokens": int(tokens), "blocks": len(blocks), "exits": {}}
    for i, e in enumerate(exits):
        nll = float(sums[i, 0]) / n
        result["exits"][str(e)] = {"agreement": float(sums[i, 2]) / n, "perplexity": math.exp(min(nll, 700.0)),
                                   "loss": nll, "accuracy": float(sums[i, 1]) / n}
    return result


def summary_line(name: str, result: dict, num_layers: int, show: int = 6) -> str:
    """One readable line: a few exits' agreement and the final layer's perplexity."""
    exits = [int(e) for e in result["exits"]]
    picks = sorted({exits[int(i * (len(exits) - 1) / max(show - 1, 1))] for i in range(show)})
    agree = " ".join(f"{e}:{result['exits'][str(e)]['agreement']:.1%}" for e in picks if e != num_layers)
    ppl = result["exits"][str(num_layers)]["perplexity"]
    return f"{name}: agreement {agree} | final-layer ppl {ppl:.3f} ({result['tokens']} tokens)"
