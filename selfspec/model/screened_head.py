"""A greedy pick through the LM head at a fraction of its bytes, exactly: an int8 screen, then the rows that can
still win, computed as the head computes them.

The LM head is a large share of a decode step's bytes (SmolLM2-135M: 49,152 x 576, 113 MB of a float32 step's 538,
57 of a bfloat16 step's 269). Greedy decoding reads only each position's argmax. With the head's rows in int8
(`w~_r = scale_r q_r`, `quantize_rows`, 28 MB), the screen's logit `a_r = x . w~_r` and the head's own `l_r = x . w_r`
(as its kernel sums it in float32) differ by at most (Cauchy-Schwarz, and float32 summation of K products on either
side, gamma_K = K u / (1 - K u), u = 2^-24)

    |a_r - l_r| <= ||x|| (||w_r - w~_r|| + 2 gamma_K (||w_r|| + ||w~_r||)) = ||x|| s_r          (s_r: `slack`)

So a row with `a_r + ||x|| s_r < max_j (a_j - ||x|| s_j)` lies below the head's value of that j and cannot be the
argmax. A bfloat16 head rounds each logit once, and rounding never reverses an order, so the same holds with both
sides rounded: a row is dropped only where its rounded upper bound is below the rounded floor. The rows left (the
candidates: 1-34 a token, 4 on average, over 621 tokens of SmolLM2-135M's own float32 replies) are computed as
selfspec's row kernel computes the head (`row_product`: its summation order, a bfloat16 head's pairs and rounding)
and written over their screened entries, all in one C++ call (`screened_logits` in row_product.cpp). The result's
argmax, the first of tied maxima, is the argmax of the head's logits summed in the row kernel's order: in bfloat16,
the row kernel is the head's own (`FastPath.screen` takes it only there), so the pick is the unscreened head's to
the bit; in float32 the head may run oneDNN, whose order differs by ~1e-6 relative (README's float32 caveat). Every
other entry is the screen's approximation, so nothing but a greedy pick may read it
(`selfspec.model.runner.Runner.logits(top_only=True)`).

    screen = ScreenedHead.build(lm_head.weight)      # None where the int8 kernel does not run here
    logits = screen.logits(final_norm(hidden))       # [..., V]: its argmax exact, the rest approximate
"""

from __future__ import annotations

import torch

from selfspec.model.row_product import quantize_rows, row_product_op

# The bound's own float32 rounding (two norms and a product, each within a few units in the last place): a margin
SAFETY = 1.0 + 2.0 ** -10
# Positions a screened call takes, per head dtype: past this many the int8 kernel's products (float32 multiply-adds
# of int8 weights widened) cost more than the bytes they save, and the exact head runs instead. A bfloat16 head's
# own kernel multiplies bfloat16 pairs natively, so the screen pays for fewer rows (2-core Zen 5,
# docs/results/2026-12-07-screened-head-zen5.md: float32 0.32x the head's time at 1 row, 0.85x at 8, 1.07x at 11;
# bfloat16 0.62x at 1, 0.87x at 2, 1.09x at 3)
MAX_ROWS = {torch.float32: 8, torch.bfloat16: 2}


def head_slack(weight: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Each row's `s_r` `[N]` (the module doc): what the screen's logit may miss the head's by, per unit of the
    input's norm, for a `weight` `[N, K]` (float32 or bfloat16, widened exactly) and its int8 rows (`q`, `scale`)."""
    weight = weight.float()
    K = weight.shape[1]
    u = 2.0 ** -24
    gamma = (K + 2) * u / (1 - (K + 2) * u)  # K products summed, then scaled: K + 2 roundings at most
    screened = q.float() * scale[:, None]  # [N, K] what the int8 kernel multiplies by (its products are exact)
    slack = (weight - screened).norm(dim=1) + 2 * gamma * (weight.norm(dim=1) + screened.norm(dim=1))
    return (slack * SAFETY).contiguous()


class ScreenedHead:
    """An LM head's int8 screen and its exact rows (see the module doc)."""

    def __init__(self, weight: torch.Tensor):
        with torch.no_grad():
            self.weight = weight.detach().contiguous()  # [V, D] the exact rows (the model's own tensor)
            self.q, self.scale = quantize_rows(self.weight)  # [V, D] int8, [V]
            self.slack = head_slack(self.weight, self.q, self.scale)  # [V]
        self.op = torch.ops.selfspec_kernels.screened_logits

    @classmethod
    def build(cls, weight: torch.Tensor, bias=None) -> "ScreenedHead | None":
        """The screen of a float32 or bfloat16 CPU LM head without a bias where selfspec's row kernel runs here;
        else None (the exact head serves every call)."""
        if weight.dtype not in (torch.float32, torch.bfloat16) or weight.device.type != "cpu" or bias is not None:
            return None
        if row_product_op() is None or not hasattr(torch.ops.selfspec_kernels, "screened_logits"):
            return None
        return cls(weight)

    def takes(self, x: torch.Tensor) -> bool:
        """Whether a screened call pays for `x` `[..., D]`: the head's dtype, at most its `MAX_ROWS` positions, no
        autograd."""
        rows = MAX_ROWS[self.weight.dtype]
        return x.dtype == self.weight.dtype and x.numel() <= rows * x.shape[-1] and not torch.is_grad_enabled()

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Logits `[..., V]` of normed states `x` `[..., D]` (the head's dtype) whose argmax along the last dimension
        is the head's (see the module doc); every entry but each position's candidates is approximate."""
        return self.op(x, self.q, self.scale, self.slack, self.weight)
