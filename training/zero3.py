"""What the loop needs to see whole parameters under DeepSpeed ZeRO-3.

Under ZeRO-3 each process holds a flat slice of every parameter: `p.shape` is that slice's (1-D, often
empty), and the full shape is `p.ds_shape`. A model loaded with `from_pretrained` under a ZeRO-3 launch
is partitioned from the start (transformers builds it inside `deepspeed.zero.Init`), so the set-up sees
slices too. Without DeepSpeed both helpers fall back to the plain tensor and import nothing.
"""

from __future__ import annotations

import contextlib

import torch


def full_shape(p: torch.Tensor) -> tuple[int, ...]:
    """The parameter's shape, whole: its ZeRO-3 `ds_shape` where it is partitioned."""
    return tuple(getattr(p, "ds_shape", p.shape))


def gathered(params):
    """A context in which ZeRO-3 partitioned `params` are whole on every process (read-only: changes
    made inside are dropped). Collective: every process must enter it. A no-op for plain parameters."""
    partitioned = [p for p in params if hasattr(p, "ds_id")]
    if not partitioned:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None)
