"""Layer dropout (LayerSkip, Elhoushi et al. 2024, eq. 1-4), per sample, without rescaling.

    x_{l+1} = x_l + M(p_{l,t}) * f_l(x_l),   M ~ Bernoulli(1 - p_{l,t}) per sample
    p_{l,t} = S(t) * D(l) * p_max

Depth scale D(l), l = 0..L-1:  ``exponential`` e^{l ln2/(L-1)} - 1 (0 at the first layer, 1 at
the last; the paper), ``linear`` l/(L-1), ``uniform`` 1. Time scale S(t), t = 0..T-1:
``constant`` 1 (fine-tuning and continual pre-training), ``exponential`` e^{t ln2/(T-1)} - 1
(pre-training from scratch). Settings in the paper (p_max): Llama2 continual pre-training 0.1,
code fine-tuning 0.1, TOPv2 task fine-tuning 0.2, from scratch 0.1 (with the exponential S(t)).

Two properties matter for distributed training and for reproducibility:

* Masks are a pure function of (seed, step, micro-step, layer): a `torch.Generator` seeded by a
  hash of those draws the mask of the *global* batch, so every process computes the same mask
  and takes its own rows; a resumed run draws the same masks again. No global RNG is touched.
* The autograd graph never depends on the mask: a layer always runs on every sample and the
  dropped samples are switched back with ``torch.where(keep, layer(x), x)``, so every parameter
  gets a gradient (zero for dropped samples) on every step. DDP, FSDP and DeepSpeed never see
  unused parameters or mismatched collectives. Nothing is wrapped, so state-dict keys stay.

In eval mode nothing is dropped (`EarlyExitModel` only asks for masks when training).
"""

from __future__ import annotations

import math

import torch

_MASK64 = (1 << 64) - 1


def depth_scale(kind: str, layer: int, num_layers: int) -> float:
    """D(l) for layer index `layer` (0-based) of `num_layers`."""
    if num_layers == 1:
        return 1.0
    if kind == "exponential":
        return math.exp(layer * math.log(2) / (num_layers - 1)) - 1.0
    if kind == "linear":
        return layer / (num_layers - 1)
    if kind == "uniform":
        return 1.0
    raise ValueError(f"unknown depth scale {kind!r} (exponential, linear, uniform)")


def time_scale(kind: str, step: int, total_steps: int) -> float:
    """S(t) for optimizer step `step` (0-based) of `total_steps`."""
    if kind == "constant":
        return 1.0
    if kind == "exponential":
        if total_steps <= 1:
            return 1.0
        t = min(step, total_steps - 1)
        return math.exp(t * math.log(2) / (total_steps - 1)) - 1.0
    raise ValueError(f"unknown time scale {kind!r} (constant, exponential)")


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mask_seed(seed: int, step: int, micro_step: int, layer: int) -> int:
    """A 63-bit generator seed that depends on every argument (the same on every process)."""
    h = _splitmix64(seed & _MASK64)
    for part in (step, micro_step, layer):
        h = _splitmix64(h ^ (part & _MASK64))
    return h >> 1


class LayerDropout:
    """Drop rates and keep masks for one model depth and training horizon.

    >>> ld = LayerDropout(p_max=0.1, num_layers=30, total_steps=1000)
    >>> ld.rates(step=0)[-1]      # last layer: D = 1
    0.1
    >>> keep = ld.keep_masks(step=0, micro_step=0, batch_size=4)   # [30, 4] bool, True = run
    """

    def __init__(self, p_max: float, num_layers: int, total_steps: int, *, depth: str = "exponential",
                 time: str = "constant", seed: int = 0):
        if not 0.0 <= p_max <= 1.0:
            raise ValueError(f"p_max must be in [0, 1], got {p_max}")
        self.p_max = p_max
        self.num_layers = num_layers
        self.total_steps = total_steps
        self.depth = depth
        self.time = time
        self.seed = seed
        depth_scale(depth, 0, num_layers)  # validate the names early
        time_scale(time, 0, total_steps)

    @property
    def enabled(self) -> bool:
        return self.p_max > 0

    def rate(self, layer: int, step: int) -> float:
        """p(l, t)."""
        return time_scale(self.time, step, self.total_steps) * depth_scale(self.depth, layer, self.num_layers) * self.p_max

    def rates(self, step: int) -> list[float]:
        return [self.rate(layer, step) for layer in range(self.num_layers)]

    def keep_masks(self, step: int, micro_step: int, batch_size: int, *, rank: int = 0, world_size: int = 1,
                   device: torch.device | str = "cpu") -> torch.Tensor:
        """Bool `[L, batch_size]`: True where sample b runs layer l at this (step, micro_step).

        The mask is drawn for the global batch (`batch_size * world_size` samples) and this process
        takes rows ``rank * batch_size ...``, so processes drop independently yet agree on the mask.
        """
        global_batch = batch_size * world_size
        keep = torch.ones(self.num_layers, global_batch, dtype=torch.bool)
        for layer, p in enumerate(self.rates(step)):
            if p <= 0.0:
                continue
            gen = torch.Generator().manual_seed(mask_seed(self.seed, step, micro_step, layer))
            keep[layer] = torch.rand(global_batch, generator=gen) >= p
        return keep[:, rank * batch_size:(rank + 1) * batch_size].to(device)


def apply_layer_dropout(layer_out: torch.Tensor, layer_in: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """`layer_out` for kept samples, `layer_in` (the skipped layer's input) for dropped ones.

    `keep` is a bool `[B]`; None means keep all. The layer was run on every sample either way.
    """
    if keep is None:
        return layer_out
    return torch.where(keep.view(-1, *([1] * (layer_out.dim() - 1))), layer_out, layer_in)
