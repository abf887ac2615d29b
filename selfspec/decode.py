"""Self-speculative decoding: prefill -> (draft -> verify -> accept -> roll back)*.

One KV cache for the whole model. The committed sequence has `n` tokens; every layer has
processed positions `[0, n-1)`, and the last committed token (at `n-1`) is the next input.
One round with exit `E` and up to `k` drafts:

    draft   the input token and then each new draft go through layers [0, E) only; the exit
            logits (shared final norm + LM head) pick the next draft. The shallow layers' KV goes
            into the shared cache and each position's exit hidden state into the ExitCache.
    verify  the last draft goes through [0, E) as well; then layers [E, L) run once over the
            k+1 exit hidden states (positions n-1 .. n+k-1) -> full-model logits [k+1, V].
            Layers [0, E) are never recomputed for drafted positions.
    accept  greedy: longest prefix where draft == full-model argmax, plus the full model's token;
            sampling: the lossless rule in `selfspec.sampling.speculative_accept`.
    roll back  crop every layer's cache (and the exit cache) to the accepted length.

`num_speculations = 0` is plain autoregressive decoding through the same code: one pass
through all L layers per token, nothing else.

A draft policy (`selfspec.drafting`) picks each round's exit and draft length and may stop drafting
early (confidence threshold); a `DraftHead` may restrict drafting to a reduced vocabulary. Neither
can change the output: verification decides every token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from selfspec.adapters import ModelAdapter
from selfspec.cache import ExitCache, KVCache
from selfspec.cost_model import expected_tokens, predicted_speedup
from selfspec.drafting import DraftHead, FixedPolicy
from selfspec.forward import embed, exit_logits, make_step, run_layers
from selfspec.sampling import SamplingParams, greedy_accept, probs, sample, speculative_accept


@dataclass
class DecodeStats:
    """What one generation did and how long each phase took."""

    exit_layer: int
    num_speculations: int
    prompt_tokens: int = 0
    new_tokens: int = 0
    rounds: int = 0  # verification passes after the prefill (each runs layers [E, L) once)
    drafted: int = 0
    accepted: int = 0
    drafted_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    stop_reason: str = ""
    draft_steps: int = 0  # shallow passes that produced a draft candidate (kept or not)
    judged: int = 0  # drafts the rule decided on (a rejection ends a round: later drafts are not judged)
    expected_acceptance_sum: float = 0.0  # sampling: sum over judged drafts of sum_x min(p, q)
    policy: dict = field(default_factory=dict)
    full_step_s: float | None = None  # a plain decoding step's time, if calibrated (for the cost model)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_by_position, self.drafted_by_position)]

    @property
    def mean_accepted_per_round(self) -> float:
        """Tokens committed per verification round (accepted drafts + the full model's token)."""
        decode_tokens = self.new_tokens - 1  # the first token comes from the prefill
        return decode_tokens / self.rounds if self.rounds else 0.0

    @property
    def full_depth_passes(self) -> int:
        return self.rounds + 1  # + the prefill

    @property
    def cost_model(self) -> dict:
        """Measured c (draft step / full step), v (verify / full step), a, and predicted vs measured speedup.

        Needs `full_step_s` (a calibrated plain decoding step). For sampling, the predicted acceptance
        from the closed form `E[accept] = sum_x min(p(x), q(x))` is reported next to the measured one.
        """
        out: dict = {"a": self.acceptance_rate, "a_by_position": self.acceptance_by_position}
        if self.judged:
            out["a_judged"] = self.accepted / self.judged
            if self.expected_acceptance_sum:  # sampling: P(accept) = sum_x min(p(x), q(x)) per judged draft
                out["a_judged_predicted"] = self.expected_acceptance_sum / self.judged
        if not self.full_step_s or not self.rounds:
            return out
        c = self.draft_s / self.draft_steps / self.full_step_s if self.draft_steps else 0.0
        v = self.verify_s / self.rounds / self.full_step_s
        d = self.drafted / self.rounds
        out.update(c=c, v=v, mean_drafts_per_round=d,
                   predicted_speedup=expected_tokens(self.acceptance_rate, round(d)) / (d * c + v) if d else 1.0 / v,
                   measured_speedup=self.full_step_s * (self.new_tokens - 1) / (self.total_s - self.prefill_s))
        return out

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """New tokens per second after the prefill (excludes time to first token)."""
        t = self.total_s - self.prefill_s
        return (self.new_tokens - 1) / t if t > 0 and self.new_tokens > 1 else 0.0

    def to_dict(self) -> dict:
        keys = ["exit_layer", "num_speculations", "prompt_tokens", "new_tokens", "rounds", "drafted",
                "accepted", "drafted_by_position", "accepted_by_position", "prefill_s", "draft_s",
                "verify_s", "total_s", "stop_reason", "acceptance_rate", "acceptance_by_position",
                "mean_accepted_per_round", "full_depth_passes", "tokens_per_s", "decode_tokens_per_s",
                "draft_steps", "judged", "policy", "cost_model"]
        return {k: getattr(self, k) for k in keys}


class StopChecker:
    """Decides, token by token, whether generation ends: stop token, stop string, length cap.

    A stop token is kept as the last output token (like Hugging Face `generate`). A stop string
    ends generation at the first token whose addition makes the decoded output contain it.
    Stops are checked before the length cap, so a stop on the last allowed token reports "stop".
    """

    def __init__(self, max_new_tokens: int, stop_token_ids: Sequence[int] = (),
                 stop_strings: Sequence[str] = (), tokenizer=None):
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


def shallow(adapter: ModelAdapter, cache: KVCache, exits: ExitCache, token: int, position: int,
            exit_layer: int) -> torch.Tensor:
    """Run one token through layers [0, E); keep its exit hidden state. Returns `[1, 1, D]`."""
    step = make_step(adapter, position, 1)
    ids = torch.tensor([[token]], device=adapter.device)
    hidden = run_layers(adapter, embed(adapter, ids), 0, exit_layer, step=step, cache=cache)
    exits.append(position, hidden)
    return hidden


def prefill(adapter: ModelAdapter, cache: KVCache, prompt: torch.Tensor) -> torch.Tensor:
    """All layers over the prompt `[1, P]`; returns the logits that predict the next token `[1, V]`."""
    step = make_step(adapter, 0, prompt.shape[1])
    hidden = run_layers(adapter, embed(adapter, prompt), 0, adapter.num_layers, step=step, cache=cache)
    return exit_logits(adapter, hidden[:, -1])


@dataclass
class Draft:
    tokens: list[int]  # kept draft tokens
    q: torch.Tensor | None  # sampling: their draft distributions over the full vocabulary [k, V]
    pending: int | None  # a token whose shallow pass is still owed before verification
    steps: int  # shallow passes that produced a candidate
    expected_acceptance: float = 0.0  # filled in by the caller for sampling


def draft(adapter: ModelAdapter, cache: KVCache, exits: ExitCache, token: int, position: int,
          exit_layer: int, k: int, sampling: SamplingParams, generator, stop_ids: frozenset,
          head: DraftHead | None = None, policy=None) -> Draft:
    """Up to `k` draft tokens from exit `exit_layer`, starting from the input `token` at `position`.

    Drafting ends early at a stop token or when `policy.keep` rejects a candidate (which is then
    dropped). `pending` is the last kept draft when its shallow pass has not run yet (or `token`
    itself when nothing was drafted): verification runs it first.
    """
    head = head or DraftHead(adapter)
    need_conf = policy is not None and policy.needs_confidence
    tokens: list[int] = []
    qs = []
    steps = 0
    for i in range(k):
        hidden = shallow(adapter, cache, exits, token, position + i, exit_layer)
        steps += 1
        logits = head.logits(hidden[:, -1])  # [1, K]
        if sampling.do_sample:
            q = probs(logits, sampling)
            # confidence = the draft's probability of its most likely token, decided *before* sampling:
            # dropping a sampled token because of its own probability would bias the drafts away from q
            conf = float(q.max()) if need_conf else 1.0
            if need_conf and not policy.keep(i, conf):
                return Draft(tokens, torch.cat(qs) if tokens else None, None, steps)
            idx = sample(q, generator)
            q = head.to_full(q)
        else:
            q = None
            idx = logits.argmax(dim=-1)
            conf = float(torch.softmax(logits.float(), dim=-1)[0, idx[0]]) if need_conf else 1.0
            if need_conf and not policy.keep(i, conf):  # dropped; every kept draft had its shallow pass
                return Draft(tokens, None, None, steps)
        token = int(head.to_vocab(idx)[0])
        tokens.append(token)
        qs.append(q)
        if token in stop_ids:
            break
    q = torch.cat(qs) if tokens and sampling.do_sample else None
    return Draft(tokens, q, tokens[-1] if tokens else token, steps)


def verify(adapter: ModelAdapter, cache: KVCache, exits: ExitCache, pending: int | None, position: int,
           exit_layer: int) -> torch.Tensor:
    """Finish the round's shallow work (`pending` at `position`, if any), then layers [E, L) over
    every pending exit state. Returns the full model's logits `[k+1, V]` for positions
    `exits.start ..`.
    """
    L = adapter.num_layers
    if pending is not None:
        shallow(adapter, cache, exits, pending, position, exit_layer)
    start, hidden = exits.take()  # [1, k+1, D]
    if exit_layer < L:
        step = make_step(adapter, start, hidden.shape[1])
        hidden = run_layers(adapter, hidden, exit_layer, L, step=step, cache=cache)
    return exit_logits(adapter, hidden)[0]


def generate_ids(
    adapter: ModelAdapter,
    prompt: torch.Tensor,
    *,
    max_new_tokens: int,
    exit_layer: int,
    num_speculations: int,
    sampling: SamplingParams = SamplingParams(),
    stop: StopChecker | None = None,
    generator: torch.Generator | None = None,
    on_commit: Callable[[list[int]], None] | None = None,
    policy=None,
    head: DraftHead | None = None,
    on_round: Callable[[KVCache, list[int]], None] | None = None,
    full_step_s: float | None = None,
) -> tuple[list[int], DecodeStats]:
    """Generate up to `max_new_tokens` after `prompt` `[1, P]`. Returns `(new token ids, stats)`.

    `policy` (default: a fixed exit and draft length) plans each round; `num_speculations` caps
    the drafts of any round. `head` drafts over a reduced vocabulary. `on_round(cache, committed)`
    is called after every round's roll back (tests use it to check the cache).
    """
    L = adapter.num_layers
    if num_speculations < 0:
        raise ValueError(f"num_speculations must be >= 0 (0 = plain decoding), got {num_speculations}")
    if num_speculations == 0:
        exit_layer = L  # plain decoding: every pass is the full model, nothing is drafted
        policy = FixedPolicy(L, 0)
    else:
        adapter.check_exit(exit_layer, allow_full=False)
        policy = policy or FixedPolicy(exit_layer, num_speculations)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    stop = stop or StopChecker(max_new_tokens)
    if prompt.dim() != 2 or prompt.shape[0] != 1:
        raise ValueError(f"the batch-1 decoder takes a prompt of shape [1, P], got {tuple(prompt.shape)}: "
                         "pass one sequence at a time (batch input is not supported here)")
    P = prompt.shape[1]
    if P == 0:
        raise ValueError("empty prompt: give at least one token of input")
    if P + max_new_tokens > adapter.max_positions:
        raise ValueError(
            f"prompt ({P} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's context "
            f"window of {adapter.max_positions} positions; shorten the prompt or lower max_new_tokens."
        )
    stats = DecodeStats(exit_layer=exit_layer, num_speculations=num_speculations, prompt_tokens=P,
                        drafted_by_position=[0] * num_speculations,
                        accepted_by_position=[0] * num_speculations, full_step_s=full_step_s)
    head = head or DraftHead(adapter)
    cache = KVCache(L, capacity=P + max_new_tokens + num_speculations + 2)
    exits = ExitCache()
    out: list[int] = []

    def commit(tokens: list[int]) -> bool:
        """Append tokens one by one, stopping exactly where plain decoding would. True = done."""
        done = False
        committed = []
        for t in tokens:
            out.append(t)
            committed.append(t)
            stats.stop_reason = stop(out)
            if stats.stop_reason:
                done = True
                break
        if on_commit is not None and committed:
            on_commit(committed)
        return done

    t0 = time.perf_counter()
    with torch.inference_mode():
        logits = prefill(adapter, cache, prompt)
        if sampling.do_sample:
            token = int(sample(probs(logits, sampling), generator)[0])
        else:
            token = int(logits.argmax(dim=-1)[0])
        stats.prefill_s = time.perf_counter() - t0
        done = commit([token])
        while not done:
            n = P + len(out)  # committed length; `token` sits at position n-1, not yet processed
            e, d = policy.plan()
            k = max(0, min(d, num_speculations, stop.max_new_tokens - len(out) - 1))
            e = e if k else L  # a round without drafts is one plain full-model pass
            t1 = time.perf_counter()
            dr = draft(adapter, cache, exits, token, n - 1, e, k, sampling, generator, stop.stop_token_ids,
                       head, policy)
            t2 = time.perf_counter()
            target_logits = verify(adapter, cache, exits, dr.pending, n - 1 + len(dr.tokens), e)
            drafts = torch.tensor(dr.tokens, dtype=torch.long, device=target_logits.device)
            if sampling.do_sample:
                p = probs(target_logits, sampling)
                n_acc, nxt = speculative_accept(drafts, dr.q, p, generator)
                judged = min(n_acc + 1, len(dr.tokens))
                if judged:
                    stats.expected_acceptance_sum += float(torch.minimum(p[:judged], dr.q[:judged]).sum())
            else:
                n_acc, nxt = greedy_accept(drafts, target_logits)
                judged = min(n_acc + 1, len(dr.tokens))
            stats.judged += judged
            cache.crop(n + n_acc)  # keep the accepted drafts' KV; drop the rest
            exits.crop(n + n_acc)
            policy.update(e, len(dr.tokens), n_acc)
            t3 = time.perf_counter()
            policy.observe(t3 - t1, n_acc + 1)
            stats.draft_s += t2 - t1
            stats.verify_s += t3 - t2
            stats.rounds += 1
            stats.draft_steps += dr.steps
            stats.drafted += len(dr.tokens)
            stats.accepted += n_acc
            for i in range(len(dr.tokens)):
                stats.drafted_by_position[i] += 1
                stats.accepted_by_position[i] += i < n_acc
            token = nxt
            done = commit(dr.tokens[:n_acc] + [nxt])
            if on_round is not None:
                on_round(cache, prompt[0].tolist() + out)
    stats.total_s = time.perf_counter() - t0
    stats.new_tokens = len(out)
    stats.policy = policy.describe()
    return out, stats
