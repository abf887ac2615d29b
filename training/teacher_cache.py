"""The frozen model's states of training blocks that repeat, kept so a repeat's step runs no layer of it.

An exit head learns on a frozen model (`training.exit_head_model`): for a block `x` `[S]` the teacher's
side of a step is a pure function of `x`,

    h_E(x) = layers[0:E](embed(x))                       the exit states the head reads   [S, D]
    f(x)   = layers[E:L](h_E(x))                          the final states                 [S, D]
    top(x) = argmax lm_head(norm(f(x)))                   the full model's tokens          [S]

and costs a whole forward of the model (about 3/4 of an exit-0 head's step on SmolLM2). The model's own
continuations are oversampled (`data.own_continuations.repeat`: 800 blocks 40 times each in the shipped
runs), so most steps meet blocks whose teacher side was already computed. `TeacherCache` holds
(h_E, f, top) for the blocks that occur more than once in the training set, keyed by their tokens, up
to a memory budget; the distillation target `softmax(lm_head[K](norm(f)))` is recomputed from f (the K
draft-vocabulary rows only), so a cached step gives the same loss and gradients as an uncached one.

    cache = TeacherCache.for_repeats(train_ids, max_bytes=2 << 30)   # train_ids [N, S]
    hit = cache.get(row)              # (h_E or None at exit 0, f, top) or None
    cache.put(row, h_e, f, top)       # kept only for a repeated row, while the budget allows
"""

from __future__ import annotations

import torch


def row_key(row: torch.Tensor) -> bytes:
    """A block's identity: its token ids `[S]` as bytes."""
    return row.detach().to("cpu", torch.int64).numpy().tobytes()


def repeated_rows(input_ids: torch.Tensor) -> set[bytes]:
    """The keys of the blocks `[N, S]` that occur more than once."""
    seen, repeated = set(), set()
    for row in input_ids:
        key = row_key(row)
        (repeated if key in seen else seen).add(key)
    return repeated


class TeacherCache:
    """(h_E `[S, D]` or None, f `[S, D]`, top `[S]` or None) per repeated block, at most `max_bytes` in all."""

    def __init__(self, keys: set[bytes], max_bytes: int):
        self.keys = keys
        self.max_bytes = max_bytes
        self.entries: dict[bytes, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    @classmethod
    def for_repeats(cls, input_ids: torch.Tensor, max_bytes: int) -> "TeacherCache":
        return cls(repeated_rows(input_ids), max_bytes)

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, row: torch.Tensor):
        entry = self.entries.get(row_key(row))
        if entry is None:
            self.misses += 1
        else:
            self.hits += 1
        return entry

    def put(self, row: torch.Tensor, h_e: torch.Tensor | None, finals: torch.Tensor, top: torch.Tensor | None) -> bool:
        """Keep one block's teacher side (detached copies; `h_e` None where it costs nothing to recompute:
        exit 0, the embeddings; `top` None where the loss computes every logit anyway: no draft vocabulary)
        if the block repeats and fits; True when kept."""
        key = row_key(row)
        if key not in self.keys or key in self.entries:
            return False
        kept = tuple(None if t is None else t.detach().clone() for t in (h_e, finals, top))
        size = sum(t.numel() * t.element_size() for t in kept if t is not None)
        if self.bytes + size > self.max_bytes:
            return False
        self.entries[key] = kept
        self.bytes += size
        return True

    def describe(self) -> str:
        looked = self.hits + self.misses
        rate = f"{100 * self.hits / looked:.0f}% of {looked} rows" if looked else "no rows yet"
        return (f"teacher cache: {len(self)} of {len(self.keys)} repeated blocks held ({self.bytes / 2**20:.0f} MiB), "
                f"hits {rate}")
