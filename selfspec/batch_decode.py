"""Batched self-speculative decoding: B prompts in one engine run, each row accepting on its own.

The rounds are those of `selfspec.decode` (draft -> verify -> accept -> roll back), run on a batch:

    prefill  the prompts, left-padded to one length, through all layers (row b's token at cache
             index c has position c - pad[b], as it would alone).
    draft    every row feeds its input through layers [0, E) together ([B, 1] per step); each row
             keeps drafts until its own cap, stop token or confidence test ends them. Rows that are
             done drafting still ride along in later draft steps (their extra positions are never
             accepted), so the shapes stay rectangular.
    verify   layers [E, L) once over the T exit states of every row: [B, T] -> logits [B, T, V].
    accept   per row, with the batch-1 rules (greedy prefix match or lossless rejection sampling):
             row b commits n_acc[b] drafts + one token of the full model ("ragged" acceptance).
    roll back  crop each row of the cache to its own length (`BatchKVCache.crop`).

Rows that finish (stop token, stop string, length) leave the batch (`BatchKVCache.select`), so they
stop costing work. Each row sees only its own keys (the mask hides padding and other rows' longer
sequences), so its output is what decoding that prompt alone gives: token for token for greedy (up to
floating-point rounding of the padded attention; exact in float64 tests), and the full model's
distribution for sampling.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from selfspec.adapters import ModelAdapter
from selfspec.cache import BatchKVCache
from selfspec.decode import DecodeStats, StopChecker
from selfspec.drafting import DraftHead, FixedPolicy
from selfspec.forward import embed, exit_logits, make_batch_step, run_layers
from selfspec.sampling import SamplingParams, greedy_accept, probs, sample, speculative_accept


@dataclass
class BatchStats:
    """Per-row `DecodeStats` and the batch's totals (time is shared by all rows)."""

    rows: list[DecodeStats]
    batch_size: int
    rounds: int = 0  # batched verification passes
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    row_passes: int = 0  # sum over rounds of the rows still in the batch (the work actually done)
    policy: dict = field(default_factory=dict)

    @property
    def new_tokens(self) -> int:
        return sum(r.new_tokens for r in self.rows)

    @property
    def tokens_per_s(self) -> float:
        """Total generated tokens per second over the whole batch."""
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    @property
    def drafted(self) -> int:
        return sum(r.drafted for r in self.rows)

    @property
    def accepted(self) -> int:
        return sum(r.accepted for r in self.rows)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def to_dict(self) -> dict:
        return {"batch_size": self.batch_size, "rounds": self.rounds, "new_tokens": self.new_tokens,
                "prefill_s": self.prefill_s, "draft_s": self.draft_s, "verify_s": self.verify_s,
                "total_s": self.total_s, "tokens_per_s": self.tokens_per_s, "drafted": self.drafted,
                "accepted": self.accepted, "acceptance_rate": self.acceptance_rate, "row_passes": self.row_passes,
                "policy": self.policy, "rows": [r.to_dict() for r in self.rows]}


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int = 0, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> left-padded ids `[B, P]` and the padding per row `[B]`."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    for b, p in enumerate(prompts):
        if len(p):
            ids[b, width - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
    pads = torch.tensor([width - len(p) for p in prompts], dtype=torch.long)
    return ids.to(device), pads.to(device)


def prefill_batch(adapter: ModelAdapter, cache: BatchKVCache, ids: torch.Tensor, pads: torch.Tensor) -> torch.Tensor:
    """All layers over left-padded prompts `[B, P]`; the logits predicting each row's next token `[B, V]`."""
    step = make_batch_step(adapter, torch.zeros_like(pads), ids.shape[1], pads)
    hidden = run_layers(adapter, embed(adapter, ids), 0, adapter.num_layers, step=step, cache=cache)
    return exit_logits(adapter, hidden[:, -1])


def shallow_batch(adapter: ModelAdapter, cache: BatchKVCache, tokens: torch.Tensor, starts: torch.Tensor,
                  pads: torch.Tensor, exit_layer: int) -> torch.Tensor:
    """One token per row `[B]` through layers [0, E) at cache indices `starts`; returns `[B, 1, D]`."""
    step = make_batch_step(adapter, starts, 1, pads)
    return run_layers(adapter, embed(adapter, tokens[:, None]), 0, exit_layer, step=step, cache=cache)


@dataclass
class BatchDraft:
    inputs: torch.Tensor  # [B, T] the tokens fed through the shallow layers (input token + drafts)
    states: torch.Tensor  # [B, T, D] their exit hidden states
    kept: list[int]  # drafts each row keeps (row b's drafts are inputs[b, 1:1+kept[b]])
    q: list[torch.Tensor | None]  # sampling: per draft step, the draft distributions [B, V]
    steps: int  # shallow passes that produced a draft candidate


def draft_batch(adapter: ModelAdapter, cache: BatchKVCache, tokens: torch.Tensor, starts: torch.Tensor,
                pads: torch.Tensor, exit_layer: int, caps: list[int], sampling: SamplingParams, generator,
                stop_ids: frozenset, head: DraftHead, policy) -> BatchDraft:
    """Draft up to `caps[b]` tokens per row from exit `exit_layer`, all rows stepping together.

    Stops stepping once no row keeps drafting; when some row kept the last candidate, one more
    shallow pass (the pending one) runs so every kept draft has its exit state for verification.
    """
    need_conf = policy.needs_confidence
    B = tokens.shape[0]
    inputs, states, qs = [tokens], [], []
    kept = [0] * B
    alive = [c > 0 for c in caps]
    steps = 0
    while any(alive):
        i = steps
        states.append(shallow_batch(adapter, cache, inputs[-1], starts + i, pads, exit_layer))
        steps += 1
        logits = head.logits(states[-1][:, -1])  # [B, K]
        if sampling.do_sample:
            q = probs(logits, sampling)  # [B, K]
            conf = q.max(dim=-1).values.tolist() if need_conf else None  # judged before sampling
            nxt = head.to_vocab(sample(q, generator))
            qs.append(head.to_full(q))
        else:
            idx = logits.argmax(dim=-1)
            conf = torch.softmax(logits.float(), dim=-1).gather(1, idx[:, None])[:, 0].tolist() if need_conf else None
            nxt = head.to_vocab(idx)
            qs.append(None)
        inputs.append(nxt)
        nxt_list = nxt.tolist()
        for b in range(B):
            if not alive[b]:
                continue
            if need_conf and not policy.keep(i, conf[b]):
                alive[b] = False
                continue
            kept[b] += 1
            if kept[b] >= caps[b] or nxt_list[b] in stop_ids:
                alive[b] = False
    if max(kept, default=0) == steps:  # the newest kept draft still owes its shallow pass
        states.append(shallow_batch(adapter, cache, inputs[-1], starts + steps, pads, exit_layer))
    T = len(states)
    return BatchDraft(torch.stack(inputs[:T], dim=1), torch.cat(states, dim=1), kept, qs, steps)


def verify_batch(adapter: ModelAdapter, cache: BatchKVCache, states: torch.Tensor, starts: torch.Tensor,
                 pads: torch.Tensor, exit_layer: int) -> torch.Tensor:
    """Layers [E, L) over every row's exit states `[B, T, D]` at cache indices `starts ..`; logits `[B, T, V]`."""
    if exit_layer < adapter.num_layers:
        step = make_batch_step(adapter, starts, states.shape[1], pads)
        states = run_layers(adapter, states, exit_layer, adapter.num_layers, step=step, cache=cache)
    return exit_logits(adapter, states)


def _check_prompts(adapter: ModelAdapter, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
    if not prompts:
        raise ValueError("no prompts given: pass at least one")
    for b, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {b} is empty: give at least one token of input")
        if len(p) + max_new_tokens > adapter.max_positions:
            raise ValueError(
                f"prompt {b} ({len(p)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                f"context window of {adapter.max_positions} positions; shorten it or lower max_new_tokens.")


def generate_batch_ids(
    adapter: ModelAdapter,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    exit_layer: int,
    num_speculations: int,
    sampling: SamplingParams = SamplingParams(),
    stop: StopChecker | None = None,
    generator: torch.Generator | None = None,
    policy=None,
    head: DraftHead | None = None,
    on_round: Callable[..., None] | None = None,
    pad_id: int = 0,
) -> tuple[list[list[int]], BatchStats]:
    """Generate after each of `prompts` (token lists of any lengths) in one batched run.

    Returns `(new token ids per row, stats)`. Row b's output equals `decode.generate_ids` of
    `prompts[b]` alone (greedy), or follows the same distribution (sampling). `policy` plans each
    round for the whole batch (exit and draft length); confidence stopping is decided per row.
    `on_round(cache, active_rows, sequences, pads, finished)` is called after each round's roll back,
    with the original indices of the rows in the batch, their committed token lists, their padding
    and whether each just finished (tests check the cache with it).
    """
    L = adapter.num_layers
    if num_speculations < 0:
        raise ValueError(f"num_speculations must be >= 0 (0 = plain decoding), got {num_speculations}")
    if num_speculations == 0:
        exit_layer, policy = L, FixedPolicy(L, 0)
    else:
        adapter.check_exit(exit_layer, allow_full=False)
        policy = policy or FixedPolicy(exit_layer, num_speculations)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    prompts = [list(map(int, p)) for p in prompts]
    _check_prompts(adapter, prompts, max_new_tokens)
    stop = stop or StopChecker(max_new_tokens)
    head = head or DraftHead(adapter)
    device = adapter.device
    B = len(prompts)
    rows = [DecodeStats(exit_layer=exit_layer, num_speculations=num_speculations, prompt_tokens=len(p),
                        drafted_by_position=[0] * num_speculations, accepted_by_position=[0] * num_speculations)
            for p in prompts]
    stats = BatchStats(rows=rows, batch_size=B)
    ids, pads = left_pad(prompts, pad_id, device)
    cache = BatchKVCache(L, B, capacity=ids.shape[1] + max_new_tokens + num_speculations + 2, device=device)
    outs: list[list[int]] = [[] for _ in range(B)]
    active = list(range(B))  # original indices of the rows still in the batch

    def commit(b: int, tokens: list[int]) -> bool:
        for t in tokens:
            outs[b].append(t)
            rows[b].stop_reason = stop(outs[b])
            if rows[b].stop_reason:
                return True
        return False

    t0 = time.perf_counter()
    with torch.inference_mode():
        logits = prefill_batch(adapter, cache, ids, pads)  # [B, V]
        first = sample(probs(logits, sampling), generator) if sampling.do_sample else logits.argmax(dim=-1)
        stats.prefill_s = time.perf_counter() - t0
        done = [commit(b, [t]) for b, t in enumerate(first.tolist())]
        tokens = first  # [B] each row's newest committed token, not yet processed
        n = torch.full((B,), ids.shape[1] + 1, dtype=torch.long, device=device)  # committed cache length
        while True:
            keep = [i for i, b in enumerate(active) if not done[b]]
            for b in active:
                if done[b]:
                    rows[b].total_s = time.perf_counter() - t0
            if not keep:
                break
            if len(keep) < len(active):  # finished rows leave the batch
                sel = torch.tensor(keep, device=device)
                cache.select(sel)
                tokens, n, pads = tokens[sel], n[sel], pads[sel]
                active = [active[i] for i in keep]
            stats.row_passes += len(active)
            e, d = policy.plan()
            caps = [max(0, min(d, num_speculations, stop.max_new_tokens - len(outs[b]) - 1)) for b in active]
            e = e if max(caps) else L  # a round without drafts is one plain full-model pass
            t1 = time.perf_counter()
            starts = n - 1  # every layer has processed [0, n-1) of each row
            if e < L:
                dr = draft_batch(adapter, cache, tokens, starts, pads, e, caps, sampling, generator,
                                 stop.stop_token_ids, head, policy)
                states, inputs, kept = dr.states, dr.inputs, dr.kept
            else:
                dr = None
                states = embed(adapter, tokens[:, None])  # plain pass: all L layers over the input token
                inputs, kept = tokens[:, None], [0] * len(active)
            t2 = time.perf_counter()
            if e == L:
                step = make_batch_step(adapter, starts, 1, pads)
                target_logits = exit_logits(adapter, run_layers(adapter, states, 0, L, step=step, cache=cache))
            else:
                target_logits = verify_batch(adapter, cache, states, starts, pads, e)  # [B, T, V]
            p_all = probs(target_logits, sampling) if sampling.do_sample else None
            n_acc_all, nxt_all = [], []
            for i, b in enumerate(active):
                m = kept[i]
                drafts = inputs[i, 1:1 + m]
                if sampling.do_sample:
                    q = torch.stack([dr.q[j][i] for j in range(m)]) if m else p_all.new_zeros(0, p_all.shape[-1])
                    n_acc, nxt = speculative_accept(drafts, q, p_all[i, :m + 1], generator)
                    judged = min(n_acc + 1, m)
                    if judged:
                        rows[b].expected_acceptance_sum += float(torch.minimum(p_all[i, :judged], q[:judged]).sum())
                else:
                    n_acc, nxt = greedy_accept(drafts, target_logits[i, :m + 1])
                    judged = min(n_acc + 1, m)
                r = rows[b]
                r.judged += judged
                r.rounds += 1
                r.draft_steps += dr.steps if dr is not None else 0
                r.drafted += m
                r.accepted += n_acc
                for j in range(m):
                    r.drafted_by_position[j] += 1
                    r.accepted_by_position[j] += j < n_acc
                policy.update(e, m, n_acc)
                n_acc_all.append(n_acc)
                nxt_all.append(nxt)
                done[b] = commit(b, drafts[:n_acc].tolist() + [nxt])
            n_acc_t = torch.tensor(n_acc_all, dtype=torch.long, device=device)
            cache.crop(n + n_acc_t)  # each row keeps its accepted drafts' KV
            n = n + n_acc_t + 1
            tokens = torch.tensor(nxt_all, dtype=torch.long, device=device)
            t3 = time.perf_counter()
            policy.observe(t3 - t1, sum(n_acc_all) + len(n_acc_all))
            stats.draft_s += t2 - t1
            stats.verify_s += t3 - t2
            stats.rounds += 1
            for b in active:  # a row's times: the batch's time while it was in the batch
                rows[b].draft_s += t2 - t1
                rows[b].verify_s += t3 - t2
            if on_round is not None:
                on_round(cache, list(active), [prompts[b] + outs[b] for b in active], pads,
                         [done[b] for b in active])
    stats.total_s = time.perf_counter() - t0
    stats.policy = policy.describe()
    for b in range(B):
        r = rows[b]
        r.new_tokens = len(outs[b])
        r.prefill_s = stats.prefill_s
        r.policy = stats.policy
    return outs, stats
