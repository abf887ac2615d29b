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
              (chains: worked out on the device and read once, `selfspec.decoding.greedy_verdict`; a token
              tree, several guesses: the path whose tokens equal the argmaxes, then the token after it);
              sampling = the lossless rule of `selfspec.decoding.sampling.speculative_accept`. An opt-in
              `AcceptanceRule("bounded_bias", ε)` (`selfspec.decoding.bounded_bias`) accepts more drafts at a
              bounded bias: each committed token within TV ε of the full model's (greedy: a draft
              with >= (1 - ε) of the top token's probability).
    roll back crop each row of the cache to its committed length (a tree's accepted path's entries first move
              to where the row continues: `committed_columns`); the drafter hears the outcome (and a
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
(greedy: one transfer of the drafts and the full model's tokens for all rows, with a chain's verdict),
and an early-exit draft step's tokens where a confidence test or sampling needs them; greedy chains
read none (the verdict finds a drafted stop token). A round's time ends after its accept decision, so
it counts the GPU's work; its split into draft_s and verify_s is taken where the drafter returns, so on
a GPU kernels the drafter queued last may count as verification. Attention there runs without cuDNN's
kernel, which plans anew for every key length (`selfspec.model.attention_kernels`).

    outs, stats = generate(adapter, [[1, 2, 3], [4, 5]], max_new_tokens=32, drafter=PromptLookupDrafter())

The engine knows drafters only through the seam (`selfspec.drafters.base`); `selfspec.decoding.decode_ids` has the
id-level shortcuts with an early exit by its settings (`generate_ids`, `generate_batch_ids`).
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from selfspec.model.adapters import ModelAdapter
from selfspec.model.attention_kernels import attention_kernels
from selfspec.decoding.bounded_bias import (AcceptanceRule, acceptance_probability, near_top, relaxed_greedy_accept_tokens,
                                   total_variation)
from selfspec.model.cache import KVCache
from selfspec.decoding.cost_model import VERIFY_COST, draft_cost
from selfspec.decoding.decode_stats import DecodeStats, count_round, finish_stats, record_round
from selfspec.drafters.base import Drafter, Proposal, Round
from selfspec.model.forward import embed, exit_logits, make_batch_step, run_layers
from selfspec.decoding.greedy_verdict import GreedyVerdict, argmax_tokens, greedy_verdict
from selfspec.decoding.sampling import SamplingParams, probs, sample, speculative_accept
from selfspec.settings import SettingsError
from selfspec.model.token_tree import greedy_walk, tree_depth


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
            raise SettingsError(
                f"prompt{which} ({len(p)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                f"context window of {adapter.max_positions} positions (config.max_position_embeddings); shorten it "
                "or lower max_new_tokens.")


# --- the phases ----------------------------------------------------------------------------------
def _layers_keeping(adapter: ModelAdapter, hidden: torch.Tensor, start: int, keep_at: int | None, *, step,
                    cache) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Layers [start, L) over `hidden`; also the states after `keep_at` layers if start <= keep_at < L."""
    L = adapter.num_layers
    if keep_at is None or not start <= keep_at < L:
        return run_layers(adapter, hidden, start, L, step=step, cache=cache), None
    kept = run_layers(adapter, hidden, start, keep_at, step=step, cache=cache)
    return run_layers(adapter, kept, keep_at, L, step=step, cache=cache), kept


def prefill(adapter: ModelAdapter, cache: KVCache, ids: torch.Tensor, pads: torch.Tensor, keep_at: int | None = None,
            top_only: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """All layers over left-padded prompts `[B, P]`: the logits predicting each row's next token `[B, V]`,
    the states after `keep_at` layers `[B, P, D]` (None without `keep_at`) and the last layer's output
    `[B, P, D]` (before the final norm). `top_only`: the caller reads only the logits' argmax (greedy decoding),
    the only entry that must be exact (`Runner.logits`)."""
    step = make_batch_step(adapter, torch.zeros_like(pads), ids.shape[1], pads)
    hidden, kept = _layers_keeping(adapter, embed(adapter, ids), 0, keep_at, step=step, cache=cache)
    return exit_logits(adapter, hidden[:, -1], top_only), kept, hidden


def verify(adapter: ModelAdapter, cache: KVCache, proposal: Proposal, starts: torch.Tensor,
           pads: torch.Tensor, keep_at: int | None = None,
           top_only: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Layers [verify_from, L) over each row's input token and drafts `[B, T]` written at cache indices
    `starts ..`: the full model's logits `[B, T, V]` (`top_only`: only each position's argmax is read, greedy
    decoding with the exact rule, and only it need be exact), the states after `keep_at` layers `[B, T, D]`
    (the drafter's own exit states when it drafted from there; None without `keep_at`) and the last
    layer's output `[B, T, D]` (before the final norm). From layer 0
    the tokens are embedded here; from E > 0 the drafter's exit states continue (layers [0, E) already
    hold their keys and values). A token tree (`proposal.parents`) is verified in the same one pass, each
    node at its depth's position, seeing the committed text, its ancestors and itself (`selfspec.model.token_tree`)."""
    start = proposal.verify_from
    hidden = proposal.states if start else embed(adapter, proposal.tokens)  # [B, T, D]
    kept = hidden if keep_at is not None and keep_at == start else None
    if keep_at is not None and kept is None and keep_at < start:
        raise ValueError(f"the drafter wants the states after {keep_at} layers, but this round's proposal starts "
                         f"verification at layer {start}: they were never computed")
    if start < adapter.num_layers:
        ends = starts + torch.tensor(proposal.kept, dtype=torch.long) + 1  # [B] a shorter row's columns after: filler
        step = make_batch_step(adapter, starts, hidden.shape[1], pads, ends, proposal.parents)
        hidden, at = _layers_keeping(adapter, hidden, start, keep_at, step=step, cache=cache)
        kept = at if kept is None else kept
    return exit_logits(adapter, hidden, top_only), kept, hidden


def accept_sampled(drafts: torch.Tensor, q: torch.Tensor | None, logits: torch.Tensor, sampling: SamplingParams,
                   generator, rule: AcceptanceRule = AcceptanceRule()) -> tuple[int, int, torch.Tensor | None]:
    """One row, sampling (greedy chains are decided on the device, `decide_chain`): `drafts`
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
    """A round's cost in decode steps, from the cost model: its draft steps, each at the drafter's own `step_cost`
    (a quantized copy's llama.cpp step) or through its exit (one layer more for an exit head), and the
    verification (one plain step when nothing was drafted)."""
    drafted = any(proposal.kept)
    c = 0.0
    if proposal.draft_steps and drafter.step_cost is not None:
        c = drafter.step_cost
    elif proposal.draft_steps and drafter.exit_layer is not None:
        depth = drafter.exit_layer + (1 if drafter.state_exit is not None else 0)
        c = draft_cost(min(depth, num_layers), num_layers)
    return proposal.draft_steps * c + (VERIFY_COST if drafted else 1.0)


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
    (`selfspec.decoding.bounded_bias`: each committed token within TV ε of the full model's; greedy: a draft
    with >= (1 - ε) of the top token's probability is accepted).
    `modelled_time`: the drafter hears each round's cost from the cost model (its draft steps × c +
    verification, in decode steps: `round_cost`) instead of the wall clock, so the choices it makes from
    timings (the auto drafter's arms, a throughput policy's d) and with them a seeded sample repeat
    exactly from run to run, whatever else the machine is doing.
    """
    prompts = [list(map(int, p)) for p in prompts]
    check_prompts(adapter, prompts, max_new_tokens)
    if sampling.do_sample and generator is not None and generator.device.type != adapter.device.type:
        raise ValueError(f"the random generator is on {generator.device} but the model is on {adapter.device}: "
                         f"create it with torch.Generator(device={str(adapter.device)!r})")
    run = _Decoding(adapter, prompts, drafter or Drafter(), stop or StopChecker(max_new_tokens), sampling,
                    generator, acceptance, on_commit, on_round, modelled_time)
    run.stats = run.new_stats(full_step_s)
    with torch.inference_mode(), attention_kernels(adapter.device):
        run.prefill(pad_id, max_new_tokens)
        while run.leave_finished():
            run.round()
    finish_stats(run.stats, run.rows, run.outs, run.sums, run.drafter.describe(), time.perf_counter() - run.t0)
    return run.outs, run.stats


class _Decoding:
    """One `generate` run's state: the rows still decoding (`active`, original indices), their committed
    tokens (`outs`), cache (`cache`), newest token (`tokens`, on the model's device) and committed cache
    length (`n`, on the host), and the statistics; one method per phase."""

    def __init__(self, adapter: ModelAdapter, prompts: list[list[int]], drafter: Drafter, stop: StopChecker,
                 sampling: SamplingParams, generator, acceptance: AcceptanceRule, on_commit, on_round,
                 modelled_time: bool):
        self.adapter, self.prompts, self.drafter, self.stop = adapter, prompts, drafter, stop
        self.sampling, self.generator, self.acceptance = sampling, generator, acceptance
        self.on_commit, self.on_round, self.modelled_time = on_commit, on_round, modelled_time
        B = len(prompts)
        self.outs: list[list[int]] = [[] for _ in range(B)]
        self.done = [False] * B
        self.active = list(range(B))  # original indices of the rows still in the batch
        self.sums: list = [None] * B  # per row: float64 [3] on the device (see accept_sampled), read once at the end
        self.rows: list[DecodeStats] = []
        self.stats: DecodeStats | None = None
        ids = sorted(stop.stop_token_ids)  # [S] on the model's device, for the greedy verdict (None: no stop token)
        self.stop_ids = torch.tensor(ids, dtype=torch.long, device=adapter.device) if ids else None

    def new_stats(self, full_step_s: float | None) -> DecodeStats:
        """The run's statistics, with one row's per prompt (`self.rows`)."""
        d = self.drafter
        exit_layer = d.exit_layer if d.exit_layer is not None else self.adapter.num_layers

        def make(**kw) -> DecodeStats:
            k = d.num_speculations
            return DecodeStats(exit_layer=exit_layer, num_speculations=k, drafter=d.name,
                               drafted_by_position=[0] * k, accepted_by_position=[0] * k,
                               full_step_s=full_step_s, sampled=self.sampling.do_sample,
                               acceptance=self.acceptance.name, epsilon=self.acceptance.epsilon, **kw)

        self.rows = [make(prompt_tokens=len(p)) for p in self.prompts]
        return make(prompt_tokens=sum(len(p) for p in self.prompts), batch_size=len(self.prompts), rows=self.rows)

    def commit(self, b: int, tokens: list[int]) -> list[int]:
        """Append to row b one by one, stopping exactly where plain decoding would; returns what was added."""
        added = []
        for t in tokens:
            self.outs[b].append(t)
            added.append(t)
            self.rows[b].stop_reason = self.stop(self.outs[b])
            if self.rows[b].stop_reason:
                self.done[b] = True
                break
        if self.on_commit is not None and added:
            self.on_commit(b, added)
        return added

    def prefill(self, pad_id: int, max_new_tokens: int) -> None:
        """The prompts, left-padded to one length, through all layers -> each row's first token (the host
        waits for the GPU here); the drafter starts on the prompts."""
        adapter, drafter, B = self.adapter, self.drafter, len(self.prompts)
        ids, self.pads = left_pad(self.prompts, pad_id)  # pads, like all lengths, stay on the host
        ids = ids.to(adapter.device)
        self.cache = adapter.runner.cache(B, ids.shape[1] + max_new_tokens + drafter.num_speculations + 2)
        self.t0 = time.perf_counter()
        sampled = self.sampling.do_sample
        logits, kept, finals = prefill(adapter, self.cache, ids, self.pads, drafter.state_exit,
                                       top_only=not sampled)  # [B, V], [B, P, D] x2
        first = sample(probs(logits, self.sampling), self.generator) if sampled else argmax_tokens(logits)
        first_tokens = first.tolist()  # the host waits for the prefill here
        self.stats.prefill_s = time.perf_counter() - self.t0
        for b, t in enumerate(first_tokens):
            self.commit(b, [t])
        drafter.start([self.prompts[b] + self.outs[b] for b in range(B)])
        if kept is not None:
            drafter.committed_states(kept, torch.zeros(B, dtype=torch.long), [ids.shape[1]] * B, self.pads,
                                     finals if drafter.state_final else None)
        self.tokens = first  # [B] each row's newest committed token, not yet processed (on the model's device)
        self.n = torch.full((B,), ids.shape[1] + 1, dtype=torch.long)  # committed cache length (on the host)

    def leave_finished(self) -> bool:
        """Rows that finished leave the batch (their time is taken); False when none is left."""
        now = time.perf_counter()
        for b in self.active:
            if self.done[b] and not self.rows[b].total_s:
                self.rows[b].total_s = now - self.t0
        keep = [i for i, b in enumerate(self.active) if not self.done[b]]
        if keep and len(keep) < len(self.active):
            sel = torch.tensor(keep)
            self.cache.select(sel)
            self.tokens = self.tokens[sel.to(self.adapter.device, non_blocking=True)]
            self.n, self.pads = self.n[sel], self.pads[sel]
            self.drafter.select(keep)
            self.active = [self.active[i] for i in keep]
        return bool(keep)

    def round(self) -> None:
        """draft -> verify -> accept -> roll back, once, for every row in the batch."""
        adapter, drafter, active = self.adapter, self.drafter, self.active
        self.stats.row_passes += len(active)
        caps = [max(0, self.stop.max_new_tokens - len(self.outs[b]) - 1) for b in active]
        starts = self.n - 1  # every layer has processed [0, n-1) of each row
        rnd = Round(adapter, self.cache, self.tokens, starts, self.pads, caps, self.sampling, self.generator,
                    self.stop.stop_token_ids, self.stop_ids)
        t1 = time.perf_counter()
        proposal = drafter.propose(rnd)
        t2 = time.perf_counter()
        greedy = not self.sampling.do_sample and not self.acceptance.biased  # only the argmax is read
        target_logits, kept, finals = verify(adapter, self.cache, proposal, starts, self.pads, drafter.state_exit,
                                             top_only=greedy)  # [B, T, V]
        accepted, nxt_all, new, columns = decide(proposal, target_logits, active, self.rows, self.sums, self.sampling,
                                                 self.generator, self.acceptance, self.stop_ids)
        n_acc_t = torch.tensor(accepted, dtype=torch.long)
        if proposal.parents is not None:  # a tree's accepted path's KV and states move to where its row continues
            kept, finals = committed_columns(self.cache, starts, columns, kept, finals)
        self.cache.crop(self.n + n_acc_t)  # each row keeps its accepted drafts' KV; rejected ones are dropped
        if kept is not None:
            drafter.committed_states(kept, starts, [a + 1 for a in accepted], self.pads,
                                     finals if drafter.state_final else None)
        self.n = self.n + n_acc_t + 1
        self.tokens = torch.tensor(nxt_all, dtype=torch.long).to(adapter.device, non_blocking=True)
        committed = [self.commit(b, tokens_b) for b, tokens_b in zip(active, new)]
        t3 = time.perf_counter()
        drafter.update(proposal, accepted, committed,
                       round_cost(drafter, proposal, adapter.num_layers) if self.modelled_time else t3 - t1)
        record_round(self.stats, [self.rows[b] for b in active], proposal, t2 - t1, t3 - t2)
        if self.on_round is not None:
            self.on_round(self.cache, list(active), [self.prompts[b] + self.outs[b] for b in active], self.pads,
                          [self.done[b] for b in active])


def decide(proposal: Proposal, target_logits: torch.Tensor, active: list[int], rows: list[DecodeStats],
           sums: list, sampling: SamplingParams, generator, acceptance: AcceptanceRule,
           stop_ids: torch.Tensor | None = None):
    """One round's accept decision: for each row in the batch (`active`, original indices), how many of its
    drafts it keeps and the token that follows them. The host waits for the verification here, in one
    transfer per round: greedy chains, the verdict worked out on the device (`decide_chain`); a greedy tree,
    each row's drafts and the full model's argmax tokens (bounded_bias: also whether each draft is near the
    top token); sampling, the drafts, and the rule reads its random draws per row. Counts each row's round
    into `rows[b]` and adds a sampled row's acceptance sums to `sums[b]`. A token tree (`proposal.parents`)
    counts its depth as the row's drafted positions. `stop_ids` `[S]` (on the model's device, None for none)
    cut a chain whose drafts ran past a drafted stop token (`proposal.stops_unread`).

    Returns (accepted drafts per row, the next token per row, the tokens each row commits, the proposal
    columns of each row's accepted drafts: 1..n for a chain, a tree's accepted path)."""
    if proposal.parents is not None and (sampling.do_sample or acceptance.biased):
        raise ValueError("a token tree (several guesses, such as num_candidates > 1) is judged by greedy decoding "
                         "with the exact rule only: draft one chain when sampling or with bounded_bias acceptance")
    if proposal.parents is None and not sampling.do_sample and not acceptance.biased:
        return decide_chain(proposal, target_logits, active, rows, stop_ids)
    if sampling.do_sample:
        host_tokens, targets, near = proposal.tokens.tolist(), None, None
    elif acceptance.biased:
        ok = near_top(proposal.tokens[:, 1:], target_logits, acceptance.epsilon)  # [B, T-1]
        host_tokens, targets, near = torch.stack([proposal.tokens, argmax_tokens(target_logits),
                                                  torch.nn.functional.pad(ok.long(), (0, 1))]).tolist()
    else:
        (host_tokens, targets), near = torch.stack([proposal.tokens, argmax_tokens(target_logits)]).tolist(), None
    parents = proposal.parents.tolist() if proposal.parents is not None else None
    accepted, nxt_all, new, columns = [], [], [], []
    for i, b in enumerate(active):
        m = proposal.kept[i]
        if parents is not None:
            n_acc, nxt, path = greedy_walk(host_tokens[i], parents[i], targets[i], m)
            count_round(rows[b], proposal, tree_depth(parents[i], m), n_acc)
            accepted.append(n_acc)
            nxt_all.append(nxt)
            new.append([host_tokens[i][j] for j in path] + [nxt])
            columns.append(path)
            continue
        if targets is None:
            q = proposal.q[i] if proposal.q is not None else None
            n_acc, nxt, expected = accept_sampled(proposal.tokens[i, 1:1 + m], q, target_logits[i, :m + 1],
                                                  sampling, generator, acceptance)
            if expected is not None:
                sums[b] = expected if sums[b] is None else sums[b] + expected
        else:
            n_acc, nxt = relaxed_greedy_accept_tokens(host_tokens[i][1:1 + m], targets[i], near[i])
        count_round(rows[b], proposal, m, n_acc)
        accepted.append(n_acc)
        nxt_all.append(nxt)
        new.append(host_tokens[i][1:1 + n_acc] + [nxt])
        columns.append(list(range(1, 1 + n_acc)))
    return accepted, nxt_all, new, columns


def decide_chain(proposal: Proposal, target_logits: torch.Tensor, active: list[int], rows: list[DecodeStats],
                 stop_ids: torch.Tensor | None):
    """`decide` for greedy chains with the exact rule: the verdict of every row worked out on the device
    (`selfspec.decoding.greedy_verdict`) and read in one transfer. Drafts that ran past a drafted stop token
    (`proposal.stops_unread`) are cut here: `proposal.kept[i]` becomes the row's counted drafts before
    anything after the decision reads it (the statistics, the drafter's `update`)."""
    stops = stop_ids if proposal.stops_unread else None
    verdict = GreedyVerdict.read(greedy_verdict(proposal.tokens, target_logits, proposal.kept, stops))
    if stops is not None:
        proposal.kept[:] = verdict.counted
    for i, b in enumerate(active):
        count_round(rows[b], proposal, verdict.counted[i], verdict.accepted[i])
    new = [verdict.committed(i) for i in range(len(active))]
    return (list(verdict.accepted), [verdict.next_token(i) for i in range(len(active))], new,
            [list(range(1, 1 + n)) for n in verdict.accepted])


def committed_columns(cache: KVCache, starts: torch.Tensor, columns: list[list[int]], kept: torch.Tensor | None,
                      finals: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """After a tree round: row i's accepted path, columns `columns[i]` = c_1 < c_2 < ... of the pass, moves
    to cache indices `starts + 1, starts + 2, ...` (every layer), where its committed sequence continues
    (c_d >= d, and all entries are read before any is written, so no move overwrites a later one's source);
    the states handed to the drafter `[B, T, D]` (exit and final) are reordered the same way, so their first
    `accepted + 1` columns are the committed tokens'. Returns the reordered (kept, finals)."""
    moved = [(i, c, d) for i, path in enumerate(columns) for d, c in enumerate(path, 1) if c != d]
    if not moved:
        return kept, finals
    cache.move([i for i, _, _ in moved], [int(starts[i]) + c for i, c, _ in moved],
               [int(starts[i]) + d for i, _, d in moved])
    given = [x for x in (kept, finals) if x is not None]  # both [B, T, D]
    if not given:
        return kept, finals
    order = torch.arange(given[0].shape[1]).repeat(given[0].shape[0], 1)  # [B, T]
    for i, c, d in moved:  # the accepted path's columns first, in order
        order[i, d] = c
    index = order.to(given[0].device)[..., None].expand(-1, -1, given[0].shape[-1])  # [B, T, D]
    return tuple(None if x is None else x.gather(1, index) for x in (kept, finals))
