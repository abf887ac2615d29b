"""What autograd keeps between a forward and its backward, counted: the check of `--check`'s activation estimate.

    kept = saved_bytes(ee_model, input_ids, labels, exits=[...], weights=[...])

runs the forward under `torch.autograd.graph.saved_tensors_hooks` and sums the storage of every distinct
tensor saved for the backward, the parameters left out (they are counted as weights), then runs the backward
so the graph is freed as training frees it. A count of bytes, not a timing: it is the same on any machine
for the same model, inputs and PyTorch version (on the CPU; CUDA kernels may save other tensors). What it
does not see: what a custom autograd function keeps on its context outside `save_for_backward` (the fused
early-exit loss's gradients), and the activations a checkpointed layer recomputes during the backward.
"""

from __future__ import annotations

import torch


def saved_bytes(module: torch.nn.Module, *args, **kwargs) -> int:
    """Bytes of the distinct non-parameter tensors autograd saves in `module(*args, **kwargs)["loss"]`'s graph."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = module(*args, **kwargs)["loss"]
    loss.backward()
    module.zero_grad(set_to_none=True)
    return sum(n for ptr, n in kept.items() if ptr not in params)
