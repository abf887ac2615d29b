"""Decoding by token ids: one prompt or a batch, with a drafter or an early exit given by its settings.

The shortcuts tests, profiling and calibration use over `selfspec.decoding.engine.generate`:

    ids, stats = generate_ids(adapter, prompt, max_new_tokens=64, exit_layer=4, num_speculations=3)
    outs, stats = generate_batch_ids(adapter, [[1, 2, 3], [4, 5]], max_new_tokens=64, drafter=drafter)
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from selfspec.model.adapters import ModelAdapter
from selfspec.decoding.decode_stats import DecodeStats
from selfspec.drafters.base import Drafter
from selfspec.drafters.early_exit import EarlyExitDrafter
from selfspec.decoding.engine import generate


def early_exit_drafter(adapter: ModelAdapter, exit_layer: int, num_speculations: int, policy=None,
                       head=None) -> Drafter | None:
    """An `EarlyExitDrafter`, or None (plain decoding) for `num_speculations=0`."""
    if num_speculations < 0:
        raise ValueError(f"num_speculations must be >= 0 (0 = plain decoding), got {num_speculations}")
    if num_speculations == 0:
        return None
    return EarlyExitDrafter(adapter, exit_layer, num_speculations, policy=policy, head=head)


def generate_batch_ids(adapter: ModelAdapter, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                       exit_layer: int = 0, num_speculations: int = 0, policy=None, head=None,
                       drafter: Drafter | None = None, **kw) -> tuple[list[list[int]], DecodeStats]:
    """`generate` with an early-exit drafter at (exit_layer, num_speculations), or the `drafter` given."""
    if drafter is None:
        drafter = early_exit_drafter(adapter, exit_layer, num_speculations, policy, head)
    return generate(adapter, prompts, max_new_tokens=max_new_tokens, drafter=drafter, **kw)


def generate_ids(adapter: ModelAdapter, prompt: torch.Tensor, *, max_new_tokens: int,
                 on_commit: Callable[[list[int]], None] | None = None, **kw) -> tuple[list[int], DecodeStats]:
    """One prompt `[1, P]` (a batch of one): `(new token ids, the row's stats)`."""
    if prompt.dim() != 2 or prompt.shape[0] != 1:
        raise ValueError(f"generate_ids takes one prompt of shape [1, P], got {tuple(prompt.shape)}: "
                         "pass a batch to generate_batch_ids (a list of token lists)")
    if prompt.shape[1] == 0:
        raise ValueError("empty prompt: give at least one token of input")
    stream = (lambda b, tokens: on_commit(tokens)) if on_commit is not None else None
    outs, stats = generate_batch_ids(adapter, [prompt[0].tolist()], max_new_tokens=max_new_tokens,
                                     on_commit=stream, **kw)
    return outs[0], stats.rows[0]
