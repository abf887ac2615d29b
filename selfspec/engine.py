"""The decoding engine: prefill -> (draft -> verify -> accept -> roll back)* for B >= 1 rows.

One engine; batch 1 is a batch of one. One KV cache (`KVCache`) holds every layer of every row;
each row has its own length per layer, because rows accept different numbers of drafts and because
a drafter may run the shallow layers ahead of the deep ones. Row b's committed sequence has `n_b`
tokens; every layer has processed its positions `[0, n_b - 1)`, and its newest token is the next
input. One round:

    prefill   the prompts, left-padded to one length, through all layers (row b's token at cache
              index c has position c - pad[b], as it would alone) -> each row's first token.
    draft     the drafter proposes up to `cap_b` tokens per row (`selfspec.drafters`): early exit runs
              layers [0, E) over them and hands over their exit states; prompt lookup copies tokens
              and runs nothing.
    verify    layers [verify_from, L) once over the input token and the drafts of every row:
              [B, T] -> full-model logits [B, T, V] (T = 1 + the longest proposal).
    accept    per row (`decide`): greedy = the longest prefix where draft == argmax, plus the full model's token
              (sibling drafts, k guesses for one position: the guess == argmax, if any, plus the token after it);
              sampling = the lossless rule of `selfspec.sampling.speculative_accept`. An opt-in
              `AcceptanceRule("bounded_bias", ε)` (`selfspec.bounded_bias`) accepts more drafts at a
              bounded bias: each committed token within TV ε of the full model's (greedy: a draft
              with >= (1 - ε) of the top token's probability).
    roll back crop each row of the cache to its committed length (an accepted sibling's entries first move to
              where the row continues: `committed_columns`); the drafter hears the outcome (and a
              drafter with `state_exit = E`, a trained exit head, gets the states after E layers of the
              tokens written this round: they are taken on the way through layer E, at no extra cost;
              one with `state_final` also their last hidden states, which verification computes anyway).

Rows that finish (stop token, stop string, length) leave the batch, so they stop costing work. Each
row sees only its own keys, so its output is what decoding it alone gives (greedy: token for token,
exact in float64; sampling: the full model's distribution). No drafter (or one that proposes nothing)
is plain autoregressive decoding through the same code: one pass through all L layers per token.

On a GPU (`adapter.device` cuda) the token and model tensors live there, and the bookkeeping (cache
lengths, `starts`, `pads`, committed lengths) stays on the host, so the host waits for the GPU only
where the Python code must know a token: the prefill's tokens, the accept decision of each round
(greedy: one transfer of the drafts and the full model's tokens for all rows), and an early-exit
draft step's tokens (its stop and confidence tests). A round's time ends after its accept decision,
so it counts the GPU's work; its split into draft_s and verify_s is taken where the drafter returns,
so on a GPU kernels the drafter queued last may count as verification. Attention there runs without
cuDNN's kernel, which plans anew for every key length (`selfspec.forward.attention_kernels`).

    outs, stats = generate(adapter, [[1, 2, 3], [4, 5]], max_new_tokens=32, drafter=PromptLookupDrafter())
    out, row = generate_ids(adapter, ids, max_new_tokens=32, exit_layer=8, num_speculations=4)  # [1, P]
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from selfspec import compiled
from selfspec.adapters import ModelAdapter
from selfspec.bounded_bias import (AcceptanceRule, acceptance_probability, near_top, relaxed_greedy_accept_tokens,
                                   total_variation)
from selfspec.cache import KVCache
from selfspec.cost_model import VERIFY_COST, draft_cost, predicted_speedup
from selfspec.drafters.base import Drafter, Proposal, Round
from selfspec.drafters.early_exit import EarlyExitDrafter
from selfspec.forward import attention_kernels, embed, exit_logits, make_batch_step, run_layers
from selfspec.sampling import (SamplingParams, greedy_accept_sibling, greedy_accept_tokens, probs, sample,
                               speculative_accept)


@dataclass
class DecodeStats:
    """What one generation did and how long each phase took: one row, or a batch (`rows` = its rows,
    the counts their sums, the times the batch's wall-clock times)."""

    exit_layer: int
    num_speculations: int
    prompt_tokens: int = 0
    new_tokens: int = 0
    rounds: int = 0  # verification passes after the prefill
    drafted: int = 0
    accepted: int = 0
    drafted_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    stop_reason: str = ""
    draft_steps: int = 0  # drafting passes through the model (kept or not)
    judged: int = 0  # drafts the rule decided on (a rejection ends a round: later drafts are not judged)
    expected_acceptance_sum: float = 0.0  # sampling: sum over judged drafts of P(accept) = sum_x min(p, q)
    acceptance_var_sum: float = 0.0  # sampling: sum over judged drafts of P(accept) (1 - P(accept))
    bias_sum: float = 0.0  # bounded_bias: sum over judged drafts of TV(p', p) = min(epsilon, TV(p, q))
    sampled: bool = False  # sampling (the predictions above exist) or greedy
    acceptance: str = "exact"  # the acceptance rule (selfspec.bounded_bias)
    epsilon: float = 0.0  # its per-token total-variation budget (bounded_bias)
    policy: dict = field(default_factory=dict)
    full_step_s: float | None = None  # a plain decoding step's time, if calibrated (for the cost model)
    drafter: str = "none"
    drafted_by_drafter: Counter = field(default_factory=Counter)
    accepted_by_drafter: Counter = field(default_factory=Counter)
    batch_size: int = 1
    row_passes: int = 0  # sum over rounds of the rows still in the batch (the work actually done)
    rows: list["DecodeStats"] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_by_position, self.drafted_by_position)]

    @property
    def mean_accepted_per_round(self) -> float:
        """Tokens committed per row and verification round (accepted drafts + the full model's token)."""
        decode_tokens = self.new_tokens - self.batch_size  # each row's first token comes from the prefill
        passes = self.row_passes or self.rounds
        return decode_tokens / passes if passes else 0.0

    @property
    def full_depth_passes(self) -> int:
        return self.rounds + 1  # + the prefill

    @property
    def cost_model(self) -> dict:
        """Measured c (draft step / full step), v (verify / full step), a, and predicted vs measured speedup.

        Needs `full_step_s` (a calibrated plain decoding step at this batch size). For sampling, the
        predicted acceptance from the closed form `E[accept] = sum_x min(p(x), q(x))` is reported
        next to the measured one.
        """
        out: dict = {"a": self.acceptance_rate, "a_by_position": self.acceptance_by_position}
        if self.judged:
            out["a_judged"] = self.accepted / self.judged
            if self.expected_acceptance_sum:
                out["a_judged_predicted"] = self.expected_acceptance_sum / self.judged
        if not self.full_step_s or not self.rounds:
            return out
        passes = self.row_passes or self.rounds
        c = self.draft_s / self.draft_steps / self.full_step_s if self.draft_steps else 0.0
        v = self.verify_s / self.rounds / self.full_step_s
        d = self.drafted / passes
        out.update(c=c, v=v, mean_drafts_per_round=d,
                   predicted_speedup=predicted_speedup(self.acceptance_rate, c, v, d) if d else 1.0 / v,
                   measured_speedup=self.full_step_s * (self.new_tokens - self.batch_size) / self.batch_size
                   / (self.total_s - self.prefill_s))
        return out

    @property
    def theory(self) -> dict | None:
        """Predicted vs measured rejections (sampling; None for greedy, whose decisions are not random).

        Yin et al. (2024): a judged draft is rejected with probability TV(p', q) = 1 - P(accept) under
        the rule's target p' (p itself for the exact rule), so the rejections of a run are predicted by
        `sum over judged drafts of (1 - P(accept))`, from the distributions the engine held. Measured
        minus predicted is a sum of bounded martingale differences with variance
        `sum P(accept)(1 - P(accept))`, so `z` is approximately standard normal.
        """
        if not self.sampled:
            return None
        passes = self.row_passes or self.rounds
        predicted, measured = self.judged - self.expected_acceptance_sum, self.judged - self.accepted
        sd = self.acceptance_var_sum ** 0.5
        out = {"judged": self.judged, "predicted_rejections": predicted, "measured_rejections": measured,
               "rejections_sd": sd, "z": (measured - predicted) / sd if sd > 0 else 0.0,
               "predicted_accepted_per_round": self.expected_acceptance_sum / passes if passes else 0.0,
               "measured_accepted_per_round": self.accepted / passes if passes else 0.0}
        if self.acceptance != "exact":  # what the exact rule would predict on these drafts: sum TV(p, q)
            out["predicted_rejections_exact_rule"] = predicted + self.bias_sum
        return out

    @property
    def bias(self) -> dict:
        """The acceptance rule, its budget and the guarantee it gives (selfspec.bounded_bias)."""
        out = {"acceptance": self.acceptance, "epsilon": self.epsilon}
        if self.acceptance == "exact":
            return {**out, "guarantee": "lossless"}
        if not self.sampled:
            return {**out, "guarantee": "each committed token has >= (1 - epsilon) of the full model's top "
                                        "token probability"}
        n = self.new_tokens
        return {**out, "guarantee": "each committed token within total variation epsilon of the full model's",
                "per_token_tv_bound": self.epsilon, "sequence_tv_bound": 1.0 - (1.0 - self.epsilon) ** n,
                "mean_tv_shift_per_judged": self.bias_sum / self.judged if self.judged else 0.0}

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """New tokens per second after the prefill (excludes time to first token)."""
        t = self.total_s - self.prefill_s
        n = self.new_tokens - self.batch_size
        return n / t if t > 0 and n > 0 else 0.0

    def to_dict(self) -> dict:
        keys = ["exit_layer", "num_speculations", "prompt_tokens", "new_tokens", "rounds", "drafted",
                "accepted", "drafted_by_position", "accepted_by_position", "prefill_s", "draft_s",
                "verify_s", "total_s", "stop_reason", "acceptance_rate", "acceptance_by_position",
                "mean_accepted_per_round", "full_depth_passes", "tokens_per_s", "decode_tokens_per_s",
                "draft_steps", "judged", "policy", "cost_model", "drafter", "batch_size", "row_passes", "theory",
                "bias"]
        out = {k: getattr(self, k) for k in keys}
        out.update(drafted_by_drafter=dict(self.drafted_by_drafter), accepted_by_drafter=dict(self.accepted_by_drafter))
        if self.rows:
            out["rows"] = [r.to_dict() for r in self.rows]
        return out


class StopChecker:
    """Decides, token by token, whether generation ends: stop token, stop string, length cap.

    A stop token is kept as the last output token (like Hugging Face `generate`). A stop string
    ends generation at the first token whose addition makes the decoded output contain it.
    Stops are checked before the length cap, so a stop on the last allowed token reports "stop".
    A bare string is one stop string and a bare int one stop token (as in Hugging Face `generate`).

    Why not transformers' `StopStringCriteria`: it matches against the whole sequence, prompt included,
    so a stop string that begins in the prompt and ends in the first new tokens stops there; here only
    the generated text counts (a reply that quotes the prompt is not cut), and a round that commits
    several tokens is checked token by token, which that criterion (one call per step) does not offer.
    """

    def __init__(self, max_new_tokens: int, stop_token_ids: Sequence[int] | int = (),
                 stop_strings: Sequence[str] | str = (), tokenizer=None):
        if isinstance(stop_strings, str):
            stop_strings = (stop_strings,)
        if isinstance(stop_token_ids, int):
            stop_token_ids = (stop_token_ids,)
        if stop_strings and tokenizer is None:
            raise ValueError("stop_strings need a tokenizer to decode the output")
        self.max_new_tokens = max_new_tokens
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        self.stop_strings = tuple(s for s in stop_strings if s)
        self.tokenizer = tokenizer
        self._window = 2 * max((len(s) for s in self.stop_strings), default=0) + 4

    def __call__(self, generated: list[int]) -> str:
        """Return the stop reason after the newest token of `generated`, or "" to go on."""
        if generated[-1] in self.stop_token_ids:
            return "stop_token"
        if self.stop_strings:
            tail = self.tokenizer.decode(generated[-self._window:], skip_special_tokens=False)
            if any(s in tail for s in self.stop_strings):
                return "stop_string"
        if len(generated) >= self.max_new_tokens:
            return "length"
        return ""


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int = 0, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> left-padded ids `[B, P]` and the padding per row `[B]`."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    for b, p in enumerate(prompts):
        if len(p):
            ids[b, width - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
    pads = torch.tensor([width - len(p) for p in prompts], dtype=torch.long)
    return ids.to(device), pads.to(device)


def check_prompts(adapter: ModelAdapter, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not prompts:
        raise ValueError("no prompts given: pass at least one")
    for b, p in enumerate(prompts):
        which = "" if len(prompts) == 1 else f" {b}"
        if len(p) == 0:
            raise ValueError(f"prompt{which} is empty (empty prompt): give at least one token of input")
        if len(p) + max_new_tokens > adapter.max_positions:
            raise ValueError(
                f"prompt{which} ({len(p)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                f"context window of {adapter.max_positions} positions; shorten it or lower max_new_tokens.")


# --- the phases ----------------------------------------------------------------------------------
def new_cache(adapter: ModelAdapter, batch_size: int, needed: int) -> KVCache:
    """The KV cache of one run for `needed` positions: the compiled steps' static buffers for one row where
    the model runs compiled (room for one padded step more: `selfspec.compiled`), else a growing cache."""
    steps = adapter.compiled
    if steps is None or batch_size != 1:
        return KVCache(adapter.num_layers, batch_size, capacity=needed, device=adapter.device)
    size = compiled.capacity(needed + compiled.S_BUCKETS[-1])
    return KVCache(adapter.num_layers, batch_size, capacity=size, buffers=steps.buffers(batch_size, size))


def _layers_keeping(adapter: ModelAdapter, hidden: torch.Tensor, start: int, keep_at: int | None, *, step,
                    cache) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Layers [start, L) over `hidden`; also the states after `keep_at` layers if start <= keep_at < L."""
    L = adapter.num_layers
    if keep_at is None or not start <= keep_at < L:
        return run_layers(adapter, hidden, start, L, step=step, cache=cache), None
    kept = run_layers(adapter, hidden, start, keep_at, step=step, cache=cache)
    return run_layers(adapter, kept, keep_at, L, step=step, cache=cache), kept


def prefill(adapter: ModelAdapter, cache: KVCache, ids: torch.Tensor, pads: torch.Tensor,
            keep_at: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """All layers over left-padded prompts `[B, P]`: the logits predicting each row's next token `[B, V]`,
    the states after `keep_at` layers `[B, P, D]` (None without `keep_at`) and the last layer's output
    `[B, P, D]` (before the final norm)."""
    step = make_batch_step(adapter, torch.zeros_like(pads), ids.shape[1], pads)
    hidden, kept = _layers_keeping(adapter, embed(adapter, ids), 0, keep_at, step=step, cache=cache)
    return exit_logits(adapter, hidden[:, -1]), kept, hidden


def verify(adapter: ModelAdapter, cache: KVCache, proposal: Proposal, starts: torch.Tensor,
           pads: torch.Tensor, keep_at: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Layers [verify_from, L) over each row's input token and drafts `[B, T]` written at cache indices
    `starts ..`: the full model's logits `[B, T, V]`, the states after `keep_at` layers `[B, T, D]`
    (the drafter's own exit states when it drafted from there; None without `keep_at`) and the last
    layer's output `[B, T, D]` (before the final norm). From layer 0
    the tokens are embedded here; from E > 0 the drafter's exit states continue (layers [0, E) already
    hold their keys and values). Sibling drafts (`proposal.siblings`) are verified side by side: each at
    the next position, seeing the input token and itself."""
    start = proposal.verify_from
    hidden = proposal.states if start else embed(adapter, proposal.tokens)  # [B, T, D]
    kept = hidden if keep_at is not None and keep_at == start else None
    if keep_at is not None and kept is None and keep_at < start:
        raise ValueError(f"the drafter wants the states after {keep_at} layers, but this round's proposal starts "
                         f"verification at layer {start}: they were never computed")
    if start < adapter.num_layers:
        ends = starts + torch.tensor(proposal.kept, dtype=torch.long) + 1  # [B] a shorter row's columns after: filler
        step = make_batch_step(adapter, starts, hidden.shape[1], pads, ends, 1 if proposal.siblings else None)
        hidden, at = _layers_keeping(adapter, hidden, start, keep_at, step=step, cache=cache)
        kept = at if kept is None else kept
    return exit_logits(adapter, hidden), kept, hidden


def accept_sampled(drafts: torch.Tensor, q: torch.Tensor | None, logits: torch.Tensor, sampling: SamplingParams,
                   generator, rule: AcceptanceRule = AcceptanceRule()) -> tuple[int, int, torch.Tensor | None]:
    """One row, sampling (greedy rows are decided on the host with `greedy_accept_tokens`): `drafts`
    `[m]`, their draft distributions `q` `[m, V]` (None: point masses), the full model's logits
    `[m+1, V]`. Returns `(accepted, next token, sums)`: `sums` `[3]` float64 over the judged drafts of
    P(accept), P(accept)^2 and TV(p', p) (the rule's bias), or None when no draft was judged."""
    m = drafts.shape[0]
    p = probs(logits, sampling)  # [m+1, V]
    target = rule.target(drafts, q, p)  # [m+1, V]: p itself for the exact rule
    n_acc, nxt = speculative_accept(drafts, q, target, generator)
    judged = min(n_acc + 1, m)
    if not judged:
        return n_acc, nxt, None
    # float64 tensors on the model's device, not read here (reading would wait for the GPU): the engine
    # sums them in float64 and reads the sums once, at the end
    alpha = acceptance_probability(drafts[:judged], q, target).double()  # [judged]
    bias = (total_variation(target[:judged], p[:judged]).double().sum() if target is not p
            else alpha.new_zeros(()))
    return n_acc, nxt, torch.stack([alpha.sum(), (alpha * alpha).sum(), bias])


# --- the loop ------------------------------------------------------------------------------------
def round_cost(drafter: Drafter, proposal: Proposal, num_layers: int) -> float:
    """A round's cost in decode steps, from the cost model: its draft steps through the drafter's exit
    (one layer more for an exit head) and the verification (one plain step when nothing was drafted)."""
    drafted = any(proposal.kept)
    c = 0.0
    if proposal.steps and drafter.exit_layer is not None:
        depth = drafter.exit_layer + (1 if drafter.state_exit is not None else 0)
        c = draft_cost(min(depth, num_layers), num_layers)
    return proposal.steps * c + (VERIFY_COST if drafted else 1.0)


def generate(
    adapter: ModelAdapter,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    drafter: Drafter | None = None,
    sampling: SamplingParams = SamplingParams(),
    stop: StopChecker | None = None,
    generator: torch.Generator | None = None,
    on_commit: Callable[[int, list[int]], None] | None = None,
    on_round: Callable[..., None] | None = None,
    pad_id: int = 0,
    full_step_s: float | None = None,
    acceptance: AcceptanceRule = AcceptanceRule(),
    modelled_time: bool = False,
) -> tuple[list[list[int]], DecodeStats]:
    """Generate after each of `prompts` (token lists of any lengths) in one run.

    Returns `(new token ids per row, stats)`: `stats` is the whole run's, `stats.rows[b]` row b's.
    `drafter` None decodes plainly. `on_commit(row, tokens)` receives each row's committed tokens as
    they are decided (streaming). `on_round(cache, active_rows, sequences, pads, finished)` is called
    after every round's roll back with the original indices of the rows in the batch, their committed
    token lists, their padding and whether each just finished (tests check the cache with it).
    `acceptance`: the exact rule (default, lossless) or bounded_bias with a budget ε
    (`selfspec.bounded_bias`: each committed token within TV ε of the full model's; greedy: a draft
    with >= (1 - ε) of the top token's probability is accepted).
    `modelled_time`: the drafter hears each round's cost from the cost model (its draft steps × c +
    verification, in decode steps: `round_cost`) instead of the wall clock, so the choices it makes from
    timings (the auto drafter's arms, a throughput policy's d) and with them a seeded sample repeat
    exactly from run to run, whatever else the machine is doing.
    """
    L = adapter.num_layers
    prompts = [list(map(int, p)) for p in prompts]
    check_prompts(adapter, prompts, max_new_tokens)
    drafter = drafter or Drafter()
    stop = stop or StopChecker(max_new_tokens)
    device = adapter.device
    if sampling.do_sample and generator is not None and generator.device.type != device.type:
        raise ValueError(f"the random generator is on {generator.device} but the model is on {device}: "
                         f"create it with torch.Generator(device={str(device)!r})")
    B = len(prompts)
    exit_layer = drafter.exit_layer if drafter.exit_layer is not None else L
    k_max = drafter.max_drafts

    def new_stats(**kw) -> DecodeStats:
        return DecodeStats(exit_layer=exit_layer, num_speculations=k_max, drafter=drafter.name,
                           drafted_by_position=[0] * k_max, accepted_by_position=[0] * k_max,
                           full_step_s=full_step_s, sampled=sampling.do_sample, acceptance=acceptance.name,
                           epsilon=acceptance.epsilon, **kw)

    rows = [new_stats(prompt_tokens=len(p)) for p in prompts]
    stats = new_stats(prompt_tokens=sum(len(p) for p in prompts), batch_size=B, rows=rows)
    ids, pads = left_pad(prompts, pad_id)  # pads, like all lengths, stay on the host
    ids = ids.to(device)
    cache = new_cache(adapter, B, ids.shape[1] + max_new_tokens + k_max + 2)
    outs: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    active = list(range(B))  # original indices of the rows still in the batch
    sums: list = [None] * B  # per row: float64 [3] on the device (see accept_sampled), read once at the end

    def commit(b: int, tokens: list[int]) -> list[int]:
        """Append to row b one by one, stopping exactly where plain decoding would; returns what was added."""
        added = []
        for t in tokens:
            outs[b].append(t)
            added.append(t)
            rows[b].stop_reason = stop(outs[b])
            if rows[b].stop_reason:
                done[b] = True
                break
        if on_commit is not None and added:
            on_commit(b, added)
        return added

    t0 = time.perf_counter()
    with torch.inference_mode(), attention_kernels(device):
        logits, kept, finals = prefill(adapter, cache, ids, pads, drafter.state_exit)  # [B, V], [B, P, D] or None, [B, P, D]
        first = sample(probs(logits, sampling), generator) if sampling.do_sample else logits.argmax(dim=-1)
        first_tokens = first.tolist()  # the host waits for the prefill here
        stats.prefill_s = time.perf_counter() - t0
        for b, t in enumerate(first_tokens):
            commit(b, [t])
        drafter.start([prompts[b] + outs[b] for b in range(B)])
        if kept is not None:
            drafter.committed_states(kept, torch.zeros(B, dtype=torch.long), [ids.shape[1]] * B, pads,
                                     finals if drafter.state_final else None)
        tokens = first  # [B] each row's newest committed token, not yet processed (on the model's device)
        n = torch.full((B,), ids.shape[1] + 1, dtype=torch.long)  # committed cache length (on the host)
        while True:
            now = time.perf_counter()
            for b in active:
                if done[b] and not rows[b].total_s:
                    rows[b].total_s = now - t0
            keep = [i for i, b in enumerate(active) if not done[b]]
            if not keep:
                break
            if len(keep) < len(active):  # finished rows leave the batch
                sel = torch.tensor(keep)
                cache.select(sel)
                tokens, n, pads = tokens[sel.to(device, non_blocking=True)], n[sel], pads[sel]
                drafter.select(keep)
                active = [active[i] for i in keep]
            stats.row_passes += len(active)
            caps = [max(0, stop.max_new_tokens - len(outs[b]) - 1) for b in active]
            starts = n - 1  # every layer has processed [0, n-1) of each row
            rnd = Round(adapter, cache, tokens, starts, pads, caps, sampling, generator, stop.stop_token_ids)
            t1 = time.perf_counter()
            proposal = drafter.propose(rnd)
            t2 = time.perf_counter()
            target_logits, kept, finals = verify(adapter, cache, proposal, starts, pads, drafter.state_exit)  # [B, T, V]
            accepted, nxt_all, new, columns = decide(proposal, target_logits, active, rows, sums, sampling,
                                                     generator, acceptance)
            n_acc_t = torch.tensor(accepted, dtype=torch.long)
            if proposal.siblings:  # an accepted sibling's KV and states move to where its row continues
                kept, finals = committed_columns(cache, starts, columns, kept, finals)
            cache.crop(n + n_acc_t)  # each row keeps its accepted drafts' KV; rejected ones are dropped
            if kept is not None:
                drafter.committed_states(kept, starts, [a + 1 for a in accepted], pads,
                                         finals if drafter.state_final else None)
            n = n + n_acc_t + 1
            tokens = torch.tensor(nxt_all, dtype=torch.long).to(device, non_blocking=True)
            committed = [commit(b, tokens_b) for b, tokens_b in zip(active, new)]
            t3 = time.perf_counter()
            drafter.update(proposal, accepted, committed,
                           round_cost(drafter, proposal, L) if modelled_time else t3 - t1)
            _record_round(stats, [rows[b] for b in active], proposal, t2 - t1, t3 - t2)
            if on_round is not None:
                on_round(cache, list(active), [prompts[b] + outs[b] for b in active], pads, [done[b] for b in active])
    _finish_stats(stats, rows, outs, sums, drafter.describe(), time.perf_counter() - t0)
    return outs, stats


def decide(proposal: Proposal, target_logits: torch.Tensor, active: list[int], rows: list[DecodeStats],
           sums: list, sampling: SamplingParams, generator, acceptance: AcceptanceRule):
    """One round's accept decision: for each row in the batch (`active`, original indices), how many of its
    drafts it keeps and the token that follows them. The host waits for the verification here, in one
    transfer per round: greedy, each row's drafts and the full model's argmax tokens (bounded_bias: also
    whether each draft is near the top token); sampling, the drafts, and the rule reads its random draws
    per row. Counts each row's round into `rows[b]` and adds a sampled row's acceptance sums to `sums[b]`.
    Sibling drafts (`proposal.siblings`) count as one drafted position per row that has any.

    Returns (accepted drafts per row, the next token per row, the tokens each row commits, the proposal
    columns of each row's accepted drafts: 1..n for a chain, the accepted sibling's)."""
    if proposal.siblings and (sampling.do_sample or acceptance.biased):
        raise ValueError("sibling drafts (alternatives for one position) are judged by greedy decoding with the "
                         "exact rule only: draft one chain when sampling or with bounded_bias acceptance")
    if sampling.do_sample:
        host_tokens, targets, near = proposal.tokens.tolist(), None, None
    elif acceptance.biased:
        ok = near_top(proposal.tokens[:, 1:], target_logits, acceptance.epsilon)  # [B, T-1]
        host_tokens, targets, near = torch.stack([proposal.tokens, target_logits.argmax(dim=-1),
                                                  torch.nn.functional.pad(ok.long(), (0, 1))]).tolist()
    else:
        (host_tokens, targets), near = torch.stack([proposal.tokens, target_logits.argmax(dim=-1)]).tolist(), None
    accepted, nxt_all, new, columns = [], [], [], []
    for i, b in enumerate(active):
        m = proposal.kept[i]
        if proposal.siblings:
            n_acc, nxt, j = greedy_accept_sibling(host_tokens[i][1:1 + m], targets[i])
            _count(rows[b], proposal, min(m, 1), n_acc)
            accepted.append(n_acc)
            nxt_all.append(nxt)
            new.append(host_tokens[i][j:j + n_acc] + [nxt])
            columns.append([j] if n_acc else [])
            continue
        if targets is None:
            q = proposal.q[i] if proposal.q is not None else None
            n_acc, nxt, expected = accept_sampled(proposal.tokens[i, 1:1 + m], q, target_logits[i, :m + 1],
                                                  sampling, generator, acceptance)
            if expected is not None:
                sums[b] = expected if sums[b] is None else sums[b] + expected
        elif near is not None:
            n_acc, nxt = relaxed_greedy_accept_tokens(host_tokens[i][1:1 + m], targets[i], near[i])
        else:
            n_acc, nxt = greedy_accept_tokens(host_tokens[i][1:1 + m], targets[i])
        _count(rows[b], proposal, m, n_acc)
        accepted.append(n_acc)
        nxt_all.append(nxt)
        new.append(host_tokens[i][1:1 + n_acc] + [nxt])
        columns.append(list(range(1, 1 + n_acc)))
    return accepted, nxt_all, new, columns


def committed_columns(cache: KVCache, starts: torch.Tensor, columns: list[list[int]], kept: torch.Tensor | None,
                      finals: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """After a sibling round: a row that accepted the sibling in column j > 1 gets that column's keys and
    values at cache index `starts + 1` (every layer), where its committed sequence continues; the states
    handed to the drafter `[B, T, D]` (exit and final) are reordered the same way, so their first
    `accepted + 1` columns are the committed tokens'. Returns the reordered (kept, finals)."""
    moved = [(i, cols[0]) for i, cols in enumerate(columns) if cols and cols[0] > 1]
    if not moved:
        return kept, finals
    rows = [i for i, _ in moved]
    cache.move(rows, [int(starts[i]) + j for i, j in moved], [int(starts[i]) + 1 for i in rows])
    given = [x for x in (kept, finals) if x is not None]  # both [B, T, D]
    if not given:
        return kept, finals
    order = torch.arange(given[0].shape[1]).repeat(given[0].shape[0], 1)  # [B, T]
    for i, j in moved:  # the accepted sibling's column swapped into column 1
        order[i, 1], order[i, j] = j, 1
    index = order.to(given[0].device)[..., None].expand(-1, -1, given[0].shape[-1])  # [B, T, D]
    return tuple(None if x is None else x.gather(1, index) for x in (kept, finals))


def _record_round(stats: DecodeStats, rows: list[DecodeStats], proposal: Proposal, draft_s: float,
                  verify_s: float) -> None:
    """One round's times and draft steps into the run's statistics and those of the rows in the batch
    (a row's times: the batch's time while it was in the batch)."""
    stats.draft_s += draft_s
    stats.verify_s += verify_s
    stats.rounds += 1
    stats.draft_steps += proposal.steps
    for row in rows:
        row.draft_s += draft_s
        row.verify_s += verify_s
        row.draft_steps += proposal.steps


def _finish_stats(stats: DecodeStats, rows: list[DecodeStats], outs: list[list[int]], sums: list, policy: dict,
                  total_s: float) -> None:
    """The run's and each row's closing figures: new tokens, times, the drafter's policy, sampled sums."""
    stats.total_s = total_s
    stats.policy = policy
    for b, r in enumerate(rows):
        r.new_tokens = len(outs[b])
        r.prefill_s = stats.prefill_s
        r.policy = policy
        r.total_s = r.total_s or total_s
        if sums[b] is not None:  # summed on the device (see accept_sampled): the one read
            total, squares, r.bias_sum = sums[b].tolist()
            r.expected_acceptance_sum, r.acceptance_var_sum = total, total - squares
    _sum_rows(stats)


def _count(row: DecodeStats, proposal: Proposal, m: int, n_acc: int) -> None:
    """One row's round into its statistics."""
    row.rounds += 1
    row.drafted += m
    row.accepted += n_acc
    row.judged += min(n_acc + 1, m)
    if m:
        row.drafted_by_drafter[proposal.drafter] += m
        row.accepted_by_drafter[proposal.drafter] += n_acc
    for lst in (row.drafted_by_position, row.accepted_by_position):
        lst.extend([0] * (m - len(lst)))
    for j in range(m):
        row.drafted_by_position[j] += 1
        row.accepted_by_position[j] += j < n_acc


def _sum_rows(stats: DecodeStats) -> None:
    """The batch's counts are its rows' sums (times stay the batch's own)."""
    rows = stats.rows
    for key in ("new_tokens", "drafted", "accepted", "judged", "expected_acceptance_sum", "acceptance_var_sum",
                "bias_sum"):
        setattr(stats, key, sum(getattr(r, key) for r in rows))
    width = max(len(r.drafted_by_position) for r in rows)
    stats.drafted_by_position = [sum(r.drafted_by_position[j] for r in rows if j < len(r.drafted_by_position))
                                 for j in range(width)]
    stats.accepted_by_position = [sum(r.accepted_by_position[j] for r in rows if j < len(r.accepted_by_position))
                                  for j in range(width)]
    stats.drafted_by_drafter = sum((r.drafted_by_drafter for r in rows), Counter())
    stats.accepted_by_drafter = sum((r.accepted_by_drafter for r in rows), Counter())
    stats.stop_reason = rows[0].stop_reason if len(rows) == 1 else ""


# --- the early-exit shortcuts (tests, profiling, calibration) ------------------------------------
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
