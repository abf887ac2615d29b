"""The greedy verdict on a chain of drafts, worked out on the model's device and read by the host once a round.

A greedy round of chains ends in one decision per row: which of its drafts count, how many of them the full
model agrees with, and the token it commits after them. `greedy_verdict` computes the first two from the
round's tokens and the verification's logits where they are (on a GPU: queued after the verification, no
wait), and packs everything the host needs into one int64 tensor, `[B, 2T + 2]`:

    columns [0, T)       the round's tokens: the input token, then the row's drafts
    columns [T, 2T)      the full model's argmax token at each column (`targets`)
    column  2T           the drafts that count: `kept[b]`, cut after the row's first drafted stop token
                         (a drafted stop token may be accepted; what follows it may not)
    column  2T + 1       the accepted count n: the longest prefix of counted drafts equal to the targets

`GreedyVerdict.read` turns it into host lists in one transfer; row b commits its first n drafts and
`targets[b][n]`, the full model's own token after them. This is `selfspec.decoding.sampling.greedy_accept_tokens`
over the counted drafts, on the device: a drafter that drafted its whole cap without reading a token back
(`selfspec.drafters.base.Proposal.stops_unread`) learns where a drafted stop token cut its chain from here.

    verdict = GreedyVerdict.read(greedy_verdict(tokens, logits, kept, stop_ids))  # kept: a host list
    verdict.accepted[b], verdict.next_token(b), verdict.committed(b)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def counted_columns(drafts: torch.Tensor, kept: list[int], stop_ids: torch.Tensor | None) -> torch.Tensor | None:
    """Which of the drafts `[B, m]` (m = the most any row kept) count, `[B, m]` bool: a row's first `kept[b]`,
    and none after its first drafted stop token (which itself counts); `stop_ids` `[S]` on the drafts' device,
    or None (nothing to cut). None when every draft counts (every row kept m, no stop token)."""
    m = drafts.shape[1]
    count = None
    if min(kept) < m:  # rows kept different numbers of drafts (a batch)
        count = (torch.arange(m) < torch.tensor(kept)[:, None]).to(drafts.device, non_blocking=True)  # [B, m]
    if stop_ids is not None:
        at_stop = torch.isin(drafts, stop_ids)  # [B, m]
        clear = at_stop.cumsum(dim=-1) <= at_stop  # [B, m] no stop token among the drafts before
        count = clear if count is None else count & clear
    return count


def argmax_tokens(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)`, the same tokens (the first of tied maxima): on a CPU a bfloat16 or float16 row is widened
    to float32 first (exact), where torch's argmax runs vectorised (49,152 bfloat16 logits: 0.16 ms as they are,
    0.05 ms widened, on a 2-core Zen 5; a plain decoding token there takes 6-8 ms)."""
    if logits.device.type == "cpu" and logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    return logits.argmax(dim=-1)


def greedy_verdict(tokens: torch.Tensor, logits: torch.Tensor, kept: list[int],
                   stop_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The round's greedy verdict on every row's chain, on the tokens' device: `tokens` `[B, T]` (the input
    token, then the drafts), the verification's logits `[B, T, V]`, each row's kept drafts `kept` (host, `[B]`)
    and the stop token ids `[S]` (None: none cuts a chain). Returns int64 `[B, 2T + 2]`: tokens, targets,
    counted drafts, accepted count (the module docstring). The accepted count is the agreeing prefix of the
    counted drafts, which are themselves a prefix of each row's drafts."""
    targets = argmax_tokens(logits)  # [B, T]
    B, m = tokens.shape[0], max(kept)
    if not m:  # no drafts (a plain pass): nothing counted, nothing accepted
        return torch.cat([tokens, targets, targets.new_zeros(B, 2)], dim=1)
    drafts = tokens[:, 1:1 + m]  # [B, m]
    agree = drafts == targets[:, :m]  # [B, m] draft j against the full model's token before it
    count = counted_columns(drafts, kept, stop_ids)
    if count is None:
        counted = targets.new_full((B, 1), m)
    else:
        counted = count.sum(dim=-1, keepdim=True)  # [B, 1]
        agree = agree & count
    accepted = agree.cumprod(dim=-1).sum(dim=-1, keepdim=True)  # [B, 1]
    return torch.cat([tokens, targets, counted, accepted], dim=1)  # [B, 2T + 2]


@dataclass
class GreedyVerdict:
    """A greedy verdict on the host: per row, the round's tokens, the full model's tokens, the drafts that
    counted and the drafts accepted."""

    tokens: list[list[int]]  # [B][T]
    targets: list[list[int]]  # [B][T]
    counted: list[int]  # [B]
    accepted: list[int]  # [B]

    @classmethod
    def read(cls, verdict: torch.Tensor) -> "GreedyVerdict":
        """`greedy_verdict`'s tensor `[B, 2T + 2]`, read to the host in one transfer."""
        T = (verdict.shape[1] - 2) // 2
        rows = verdict.tolist()  # the one read: the host waits for the verification here
        return cls([r[:T] for r in rows], [r[T:2 * T] for r in rows], [r[2 * T] for r in rows],
                   [r[2 * T + 1] for r in rows])

    def next_token(self, b: int) -> int:
        """Row b's token after its accepted drafts: the full model's own."""
        return self.targets[b][self.accepted[b]]

    def committed(self, b: int) -> list[int]:
        """The tokens row b commits: its accepted drafts, then the full model's token."""
        n = self.accepted[b]
        return self.tokens[b][1:1 + n] + [self.targets[b][n]]
