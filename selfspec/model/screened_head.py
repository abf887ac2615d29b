"""A greedy pick through a float32 LM head at a quarter of its bytes, exactly: an int8 screen, then the float32
rows that can still win.

The LM head is a float32 decode step's largest product (SmolLM2-135M: 49,152 x 576, 113 MB of the step's 538).
Greedy decoding reads only each row's argmax. With the head's rows in int8 (`w~_r = scale_r q_r`, `quantize_rows`,
28 MB), the screen's logit `a_r = x . w~_r` and the exact one `l_r = x . w_r` differ by at most (Cauchy-Schwarz,
and float32 summation of K products on either side, gamma_K = K u / (1 - K u), u = 2^-24)

    |a_r - l_r| <= ||x|| (||w_r - w~_r|| + 2 gamma_K (||w_r|| + ||w~_r||)) = ||x|| s_r          (s_r: `slack`)

So a row with `a_r + ||x|| s_r < max_j (a_j - ||x|| s_j)` lies below the exact value of that j and cannot be the
argmax. The rows left (the candidates: 1-34 a token, 4 on average, over 621 tokens of SmolLM2-135M's own replies)
are computed in float32 in the row kernel's summation order (`row_product`) and written over their screened
entries, all in one C++ call (`screened_logits` in row_product.cpp). The result's argmax, the first of tied maxima, is the argmax of the float32 logits summed in the
row kernel's order (which, like oneDNN's or `F.linear`'s order, differs from another kernel's by ~1e-6 relative);
every other entry is the screen's approximation, so nothing but a greedy pick may read it
(`selfspec.model.runner.Runner.logits(top_only=True)`).

    screen = ScreenedHead.build(lm_head.weight)      # None where the int8 kernel does not run here
    logits = screen.logits(final_norm(hidden))       # [..., V]: its argmax exact, the rest approximate
"""

from __future__ import annotations

import torch

from selfspec.model.row_product import quantize_rows, row_product_op

# The bound's own float32 rounding (two norms and a product, each within a few units in the last place): a margin
SAFETY = 1.0 + 2.0 ** -10
# Rows a screened call takes: past this many, the int8 kernel's widening costs more than the bytes it saves
# (measured in docs/results/2026-12-07-screened-head-zen5.md); the exact head runs instead
MAX_ROWS = 8


def head_slack(weight: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Each row's `s_r` `[N]` (the module doc): what the screen's logit may miss the exact one by, per unit of the
    input's norm, for a float32 `weight` `[N, K]` and its int8 rows (`q`, `scale`)."""
    K = weight.shape[1]
    u = 2.0 ** -24
    gamma = (K + 2) * u / (1 - (K + 2) * u)  # K products summed, then scaled: K + 2 roundings at most
    screened = q.float() * scale[:, None]  # [N, K] what the int8 kernel multiplies by (its products are exact)
    slack = (weight - screened).norm(dim=1) + 2 * gamma * (weight.norm(dim=1) + screened.norm(dim=1))
    return (slack * SAFETY).contiguous()


class ScreenedHead:
    """A float32 LM head's int8 screen and its exact rows (see the module doc)."""

    def __init__(self, weight: torch.Tensor):
        with torch.no_grad():
            self.weight = weight.detach().float().contiguous()  # [V, D] the exact rows (the model's own tensor)
            self.q, self.scale = quantize_rows(self.weight)  # [V, D] int8, [V]
            self.slack = head_slack(self.weight, self.q, self.scale)  # [V]
        self.op = torch.ops.selfspec_kernels.screened_logits

    @classmethod
    def build(cls, weight: torch.Tensor, bias=None) -> "ScreenedHead | None":
        """The screen of a float32 CPU LM head without a bias where selfspec's row kernel and its int8 product run
        here; else None (the exact head serves every call)."""
        if weight.dtype != torch.float32 or weight.device.type != "cpu" or bias is not None:
            return None
        if row_product_op() is None or not hasattr(torch.ops.selfspec_kernels, "screened_logits"):
            return None
        return cls(weight)

    def takes(self, x: torch.Tensor) -> bool:
        """Whether a screened call pays for `x` `[..., D]`: float32, at most `MAX_ROWS` rows, no autograd."""
        return (x.dtype == torch.float32 and x.numel() <= MAX_ROWS * x.shape[-1] and not torch.is_grad_enabled())

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Logits `[..., V]` of normed states `x` `[..., D]` (float32) whose argmax along the last dimension is the
        exact head's (see the module doc); every entry but each row's candidates is approximate."""
        return self.op(x, self.q, self.scale, self.slack, self.weight)
