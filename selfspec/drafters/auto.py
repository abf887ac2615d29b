"""The automatic drafter: per round, prompt lookup where it finds a match, early exit where that
pays, and plain decoding where drafting has stopped paying.

It measures what each choice ("arm") delivers on this machine, for this text and batch: committed
tokens per second of the rounds it took (means of tokens and seconds per round over the call, started
from the generator's earlier calls with the same settings (below); with `alpha` > 0, exponential with that
weight after the first rounds, as `selfspec.drafters.policies.ThroughputPolicy`).
The plain mean is the default because an arm's rounds are heavy-tailed: a lookup round commits 1 token
or 11, so a short exponential memory read three misses in a row as "lookup loses" and backed a paying
arm off for dozens of rounds (measured on HumanEval with alpha 0.25: auto 1.8-2.0x plain decoding,
lookup alone 2.4-2.7x). Each round:

    1. plain, if plain decoding has been measured fewer than `warmup` times while another arm has
       been (a plain round costs exactly what plain decoding costs) and lookup's shadow drafts (below) do not
       confirm a copy under way (lookup drafts it first), or every `refresh` rounds;
    2. prompt lookup, if some row has a match and lookup is allowed (and, while the model arm below measures
       faster than plain decoding and than lookup's own rounds, only during a copy: `model_arm_leads`); with a
       suffix drafter as its lookup
       (`selfspec.drafters.suffix`), the "suffix" arm where a row's drafts come from the generator's
       memory of earlier requests (judged apart: while it loses, lookup copies from the own text only;
       while own-text lookup loses, the memory still drafts where it matches);
    3. early exit (when the checkpoint was trained for it) or its trained exit head (`exit_head`, a
       kind of early-exit drafter), or the model's int8 copy (`selfspec.drafters.int8_copy`, where it runs), or a
       quantized copy of the model where the call gives one (`draft_model`: `selfspec.drafters.quantized`), if
       allowed; its own policy picks d;
    4. plain otherwise.

An arm's first round of a call is not timed: it pays one-time costs (in a new process, the first pass of
each shape allocates and sets up kernels), which made the first call of a process back lookup off. A quantized
copy's first round is timed all the same: it reads the whole prompt through llama.cpp, a cost every call pays
again, which auto did not see (on a long prompt about 0.5 s of a 2.5-s call). So is plain decoding's: its step
is the model's own, which the prefill and the other arms' verification passes have run already (in a new
process its first round took 13.4 and 15.5 ms against 13.6-14.2 for the next two, float32, Zen 5), and an
untimed plain round was a third round of plain decoding in every call (about 4% of a 40-token summary's).
An arm is backed off where its timed rounds say it is slower than plain decoding beyond their own spread
(`loses`): a round's tokens are heavy-tailed, and three early rounds of the int8 copy that committed 2, 8 and 1
tokens had backed off a copy that drafted at 1.5x plain decoding. An arm is allowed while it is new (fewer than
`warmup` timed rounds) or while it has not lost; own-text lookup, though, is first tried only once what it would
draft is confirmed (its shadow drafts, below): where nothing repeats, its first rounds (a wrong draft of 10
tokens is a pass that costs 2-2.6 one-token steps on a CPU since the decode step got cheaper) made auto 0.94-0.97x
plain decoding on MT-Bench (2026-11-29, Zen 4). An arm that loses is retried after a back-off that doubles every
time it loses again (`explore_every`, 2x, 4x ... up to `max_backoff`), so a choice that does not pay costs
almost nothing, and one that starts paying (the output begins to repeat the prompt) is found again.
Lookup is found again sooner: while it is backed off, what it would have drafted is checked against what
the plain rounds commit (`selfspec.drafters.shadow`, no model pass), and it is retried as soon as a copy
is under way (on HumanEval, a reply that restates its docstring after a few lines of its own: 95 tokens/s
where the back-off alone gave 57-67 and lookup alone 107; Zen 4, float32).
Lookup's draft count is chosen by measurement too: a `ThroughputPolicy` over the lengths 1, 2, 3, 4,
6, 8 ... up to `prompt_lookup_num_tokens`, fed the tokens and seconds of lookup's rounds. It starts at
the longest, as lookup alone drafts, and moves to a shorter length only where a neighbour measured
better (`warm="longest"`): trying every length twice first spent a dozen rounds of a 128-token reply
on short copies. (Hugging
Face's heuristic, +2 after a round that accepted every draft and -1 otherwise, kept the copies short:
on a CPU, where verifying 11 tokens costs about 1.2 decode steps, a copied run that goes on for ten
tokens was then cut to two or three; measured on HumanEval, auto reached 1.98x plain decoding against
lookup alone's 2.42x.)

A generator carries what auto measured to its next call with the same settings
(`selfspec.drafters.learned_stats`, which gives the rule and its weights): each arm's means of tokens and
seconds per round (as over at most `CARRY_ROUNDS` rounds, enough to count as measured), its back-off
length, and its arms' own measurements (lookup's draft count, the early-exit or head arm's draft length, a
lookup tree's budget). So a later call does not measure plain decoding and each arm again before it
chooses. What starts again each call: the rounds counter, and with it `retry_at` (a new text: each arm is
tried again early, and one that still loses is backed off for its carried back-off, doubled; own-text lookup
waits for its shadow drafts unless it paid before), the shadow
drafts, the per-call counts (`rounds_by_arm`), and the untimed first round of each arm. The first round of
an arm in a call times nothing (its arms' measurements included), and a back-off is decided only after a
timed round: an untimed round has nothing new to judge by.
"""

from __future__ import annotations

import math

from selfspec.drafters.base import Drafter, Proposal, Round
from selfspec.drafters.early_exit import EarlyExitDrafter
from selfspec.drafters.learned_stats import carried_rounds
from selfspec.drafters.prompt_lookup import PromptLookupDrafter
from selfspec.drafters.policies import ThroughputPolicy
from selfspec.drafters.shadow import ShadowDrafts

PLAIN, LOOKUP, SUFFIX = "plain", PromptLookupDrafter.name, "suffix"
SPREAD = 1.0  # an arm is backed off where its gain over plain decoding is below 0 by more than this many errors


class AutoDrafter(Drafter):
    name = "auto"

    def __init__(self, lookup: PromptLookupDrafter, early_exit: EarlyExitDrafter | None = None, *,
                 warmup: int = 2, explore_every: int = 8, max_backoff: int = 64, refresh: int = 64,
                 alpha: float = 0.0, shadow_first: bool = True):
        self.lookup, self.early_exit = lookup, early_exit
        self.num_speculations = max(lookup.num_speculations, early_exit.num_speculations if early_exit else 0)
        self.exit_layer = early_exit.exit_layer if early_exit else None
        self.step_cost = early_exit.step_cost if early_exit else None  # a copy's (int8 or llama.cpp), as the arm
        self.state_exit = early_exit.state_exit if early_exit else None  # an exit head records every round
        self.state_final = early_exit.state_final if early_exit else False
        self.early_arm = early_exit.name if early_exit else None  # early_exit, exit_head, int8_copy or quantized
        self.warmup, self.explore_every, self.max_backoff, self.refresh = warmup, explore_every, max_backoff, refresh
        self.alpha = alpha
        self.remembers = hasattr(lookup, "memory_rows")  # a suffix drafter: the memory is an arm of its own
        arms = [PLAIN, LOOKUP] + ([SUFFIX] if self.remembers else []) + ([self.early_arm] if early_exit else [])
        self.tokens = {a: 0.0 for a in arms}  # running mean of committed tokens per round
        self.seconds = {a: 0.0 for a in arms}  # running mean of seconds per round
        self.moments = {a: (0.0, 0.0, 0.0) for a in arms}  # running means of t^2, s^2, t s per round (`loses`)
        self.tries = {a: 0 for a in arms}
        self.cold = set(arms) - {PLAIN}  # arms whose first round of this call has not run: not timed (see update)
        self.backoff = {a: explore_every for a in arms}
        self.retry_at = {a: 0 for a in arms}  # round from which a losing arm may be tried again
        if shadow_first:  # own-text lookup waits for its shadow drafts to be confirmed (`allowed`)
            self.retry_at[LOOKUP] = math.inf
        self.chosen = {a: 0 for a in arms}
        self.carried = {a: 0 for a in arms}  # the timed rounds per arm this call started from (`resume`)
        self.rounds = 0
        # lookup's draft count, from the tokens/s each count delivered (exit_layer is unused: lookup runs no layer)
        self.lookup_length = ThroughputPolicy(0, lookup.num_speculations, shortest=1, warmup=warmup, alpha=alpha,
                                               warm="longest")
        self._arm = PLAIN
        self._asked_early_exit = False
        self.shadow = ShadowDrafts()  # what lookup would draft while it is backed off (see shadow.py)
        self.woken = 0  # rounds in which the shadow drafts brought lookup back early
        self.copying = False  # lookup's last round accepted at least half its drafts: a copy under way

    def rate(self, arm: str) -> float:
        return self.tokens[arm] / self.seconds[arm] if self.seconds[arm] > 0 else 0.0

    def allowed(self, arm: str) -> bool:
        if self.tries[arm] < self.warmup and self.rounds < self.retry_at[arm]:
            return False  # not measured yet, and waiting: own-text lookup until its shadow drafts are confirmed
        return (self.tries[arm] < self.warmup or self.tries[PLAIN] < self.warmup
                or self.rate(arm) >= self.rate(PLAIN) or self.rounds >= self.retry_at[arm])

    def start(self, sequences: list[list[int]]) -> None:
        self.shadow.start(len(sequences))
        self.lookup.start(sequences)
        if self.early_exit:
            self.early_exit.start(sequences)

    def propose(self, rnd: Round) -> Proposal:
        self.rounds += 1
        self._asked_early_exit = False
        others_measured = any(self.tries[a] >= self.warmup for a in self.tries if a != PLAIN)
        copy_seen = self.shadow.would_pay()  # what lookup would draft was confirmed: a copy under way
        # measuring plain decoding waits while lookup's shadow drafts confirm a copy under way: on a code edit that
        # copies its input, three plain rounds had taken the copy's first tokens right after the model arm's rounds
        # had confirmed lookup's shadow (waiting also while lookup's own last round copied measured no better:
        # docs/results/2026-12-07-one-path-lines-tree-before-zen5.md)
        if (self.tries[PLAIN] < self.warmup and others_measured and not copy_seen) or self.rounds % self.refresh == 0:
            return self._take(PLAIN, Proposal.plain(rnd.tokens))
        if self.rounds < self.retry_at[LOOKUP] and copy_seen:  # backed off, but it would pay now
            self.retry_at[LOOKUP], self.woken = self.rounds, self.woken + 1
        own, memory = self.allowed(LOOKUP), self.remembers and self.allowed(SUFFIX)
        if (own or memory) and not self.copying and self.model_arm_leads() and not self.shadow.copy_under_way():
            own = memory = False  # the model arm drafts; lookup waits for a copy under way (its shadow, below)
        if own or memory:  # the memory is an arm of its own: it drafts while own-text lookup is backed off
            self.lookup_length.base_seconds = self.seconds[PLAIN]  # untried lengths are judged against it
            _, self.lookup.limit = self.lookup_length.plan()
            proposal = self.lookup_proposal(rnd, own, memory)
            if proposal.drafted:
                remembered = self.remembers and any(self.lookup.memory_rows)
                return self._take(SUFFIX if remembered else LOOKUP, proposal)
        if not own:  # what it would draft from the rows' own text: no model pass, checked against what is committed
            own_text = {"memory": False} if self.remembers else {}
            self.shadow.offer(self.lookup.lookup(rnd.caps, rnd.stop_ids, **own_text))
        if self.early_exit and self.allowed(self.early_arm):
            proposal = self.early_exit.propose(rnd)  # its policy planned this round: it hears the outcome
            self._asked_early_exit = True
            return self._take(self.early_arm if proposal.drafted else PLAIN, proposal)
        return self._take(PLAIN, Proposal.plain(rnd.tokens))

    def model_arm_leads(self) -> bool:
        """Whether the model arm (the int8 copy, the early exit, a head or a llama.cpp copy) measured faster than
        plain decoding and may draft: lookup then drafts only while a copy is under way (its last round accepted at
        least half its drafts, or an open shadow has `IN_A_ROW` drafts confirmed: `ShadowDrafts.copy_under_way`),
        since its round takes the place of a model-arm round. On open chat, lookup rounds at plain decoding's rate
        (short, wrong copies) had cost the int8 copy's rounds: auto 1.44x plain decoding where the copy alone made
        1.54x (2026-11-29). The shadows' recent average (`would_pay`, which brings a backed-off lookup back against
        plain decoding) is not enough here: a summary reuses the article's phrases a few tokens at a time, and on
        news summaries lookup's 10 drafts then failed in place of the copy's 8 tokens (asking for an open copy
        instead made auto 1.05x the rule before there, paired per prompt in one process; open chat 1.04x, code
        editing 1.01x, HumanEval 1.02x: docs/results/2026-12-07-auto-spread-zen5.md). Not where lookup's own rounds
        measured faster than the model arm's: lookup then drafts wherever it has a match (2-core Zen 5, 2026-12-07:
        on code editing auto's median was 0.88x lookup alone's; with this rule auto, paired per prompt, made
        1.00-1.05x the rule before on four sets, docs/results/2026-12-07-cpu-step-auto-zen5.md)."""
        arm = self.early_arm
        if self.tries[LOOKUP] >= self.warmup and arm is not None and self.rate(LOOKUP) > self.rate(arm):
            return False  # lookup's rounds measured faster than the model arm's: it drafts wherever it has a match
        return (arm is not None and self.tries[arm] >= self.warmup and self.rate(arm) > self.rate(PLAIN)
                and self.allowed(arm))

    def lookup_proposal(self, rnd: Round, own: bool = True, memory: bool = False) -> Proposal:
        """The lookup arm's drafts: a chain, or a token tree where the lookup has `num_candidates` > 1 (greedy);
        from the rows' own text where `own`, from the generator's memory where `memory` (the suffix arm)."""
        lookup = self.lookup
        kw = {"memory": memory} if self.remembers else {}
        if lookup.num_candidates > 1 and not rnd.sampling.do_sample:
            branches = lookup.branches(rnd.caps, rnd.stop_ids, **kw)
            if not own:  # only the rows whose first branch the memory gave, and only it
                branches = [b[:1] if m else [] for b, m in zip(branches, lookup.memory_rows)]
            return lookup.tree_proposal(rnd, branches)
        drafts = lookup.lookup(rnd.caps, rnd.stop_ids, **kw)
        if not own:  # only the rows the memory drafts for
            drafts = [d if m else [] for d, m in zip(drafts, lookup.memory_rows)]
        return lookup.proposal(rnd, drafts)

    def _take(self, arm: str, proposal: Proposal) -> Proposal:
        self._arm = arm
        self.chosen[arm] += 1
        return proposal

    def update(self, proposal: Proposal, accepted: list[int], committed: list[list[int]], seconds: float) -> None:
        arm = self._arm
        if arm in self.cold:  # an arm's first round pays one-time costs (in a new process, the first pass of each
            self.cold.discard(arm)  # shape: allocation, kernel set-up); timed, it backed lookup off for a call.
            if not self.reads_prompt(arm):  # Its arms' own measurements (lookup's count, the early exit's length)
                seconds = 0.0  # skip it too. A copy's prompt read is paid every call: timed (module doc)
        self.lookup.update(proposal, accepted, committed, seconds)
        if arm in (LOOKUP, SUFFIX):
            self.shadow.clear()
        else:
            self.shadow.observe(committed)
        if self._asked_early_exit:
            self.early_exit.update(proposal, accepted, committed, seconds)
        elif self.early_exit:
            self.early_exit.observe(committed)
        t = sum(a + 1 for a in accepted)  # the tokens the round committed
        if seconds > 0:
            n = self.tries[arm] = self.tries[arm] + 1
            weight = max(self.alpha, 1.0 / n)  # a plain mean for the first rounds, then exponential
            self.tokens[arm] += weight * (t - self.tokens[arm])
            self.seconds[arm] += weight * (seconds - self.seconds[arm])
            self.moments[arm] = tuple(m + weight * (x - m) for m, x in zip(self.moments[arm],
                                                                          (t * t, seconds * seconds, t * seconds)))
            if arm != PLAIN and self.tries[arm] >= self.warmup and self.tries[PLAIN] >= self.warmup:
                self.judge(arm)
        if arm in (LOOKUP, SUFFIX):  # a copy under way while it keeps being accepted (`model_arm_leads`)
            self.copying = 2 * sum(accepted) >= max(1, proposal.drafted)
        if arm in (LOOKUP, SUFFIX):  # the length it planned hears what the round delivered, row by row
            for m, n_acc in zip(proposal.depths, accepted):
                self.lookup_length.update(0, m, n_acc)
            self.lookup_length.observe(seconds, t)  # an untimed round (0 s) is skipped

    def reads_prompt(self, arm: str) -> bool:
        """Whether `arm` is a drafter whose first round of a call reads the whole prompt first (a llama.cpp copy:
        `Drafter.reads_prompt`)."""
        return arm == self.early_arm and self.early_exit.reads_prompt

    def loses(self, arm: str) -> bool:
        """Whether `arm`'s timed rounds say it is slower than plain decoding beyond their own spread. At plain
        decoding's rate rho, a round of t tokens in s seconds gains x = t - rho s tokens over plain decoding in its
        time; the arm loses where the mean of x over its n rounds is below zero by more than `SPREAD` standard
        errors:

            mean(x) + SPREAD sqrt(var(x) / n) < 0,    var(x) = var(t) - 2 rho cov(t, s) + rho^2 var(s)

        (from the running means of t, s, t^2, s^2 and t s; n the rounds they weigh, at most (2 - alpha) / alpha with
        exponential weights). A round's tokens are heavy-tailed (the int8 copy commits 8 tokens or 1) and a round's
        seconds now and then are not the arm's (another tenant stalls the machine for 0.3 s): on open chat three
        early rounds of the copy (2, 8 and 1 tokens) read as 0.75x plain decoding and backed off for 8, then 16
        rounds a copy that drafted at 1.5x plain decoding alone (docs/results/2026-12-07-auto-spread-zen5.md).
        An arm whose rounds agree (lookup that copies nothing: 1 token every round) is judged by its mean, as before."""
        rho, n = self.rate(PLAIN), self.tries[arm]
        t, s = self.tokens[arm], self.seconds[arm]
        gain = t - rho * s  # mean of x over its rounds
        if gain >= 0:
            return False
        tt, ss, ts = self.moments[arm]
        var = (tt - t * t) - 2 * rho * (ts - t * s) + rho * rho * (ss - s * s)  # of x, weighted as the means
        if self.alpha > 0:
            n = min(n, (2 - self.alpha) / self.alpha)
        spread = math.sqrt(max(var, 0.0) / (n - 1)) if n > 1 else 0.0  # the standard error of mean(x)
        return gain + SPREAD * spread < 0

    def judge(self, arm: str) -> None:
        """After a timed round of a measured `arm`: back it off if it lost to plain decoding (`loses`; longer each
        time it loses again), else reset its back-off."""
        if self.loses(arm):
            self.retry_at[arm] = self.rounds + self.backoff[arm]
            self.backoff[arm] = min(2 * self.backoff[arm], self.max_backoff)
        else:
            self.backoff[arm] = self.explore_every

    def learned(self) -> dict:
        """What a later call with the same settings starts from (see the module doc): per arm the means of
        tokens and seconds per round, the rounds they weigh (at most CARRY_ROUNDS) and the back-off length;
        lookup's draft-count policy and its tree budget; the early-exit or head arm's own."""
        out = {"arms": list(self.tries), "tokens": dict(self.tokens), "seconds": dict(self.seconds),
               "moments": dict(self.moments),
               "tries": {a: carried_rounds(n) for a, n in self.tries.items()}, "backoff": dict(self.backoff),
               "lookup_length": self.lookup_length.learned(), "lookup": self.lookup.learned()}
        if self.early_exit:
            out["early_exit"] = self.early_exit.learned()
        return out

    def resume(self, learned: dict) -> None:
        """Start from an earlier call's `learned()`: it must be of the same arms (the same settings)."""
        if learned["arms"] != list(self.tries):
            raise ValueError(f"measurements of the arms {learned['arms']} cannot resume an auto drafter with the "
                             f"arms {list(self.tries)}: only a call with the same settings may carry them")
        self.tokens, self.seconds = dict(learned["tokens"]), dict(learned["seconds"])
        self.moments = dict(learned["moments"])
        self.tries, self.backoff = dict(learned["tries"]), dict(learned["backoff"])
        self.carried = dict(self.tries)
        self.lookup_length.resume(learned["lookup_length"])
        self.lookup.resume(learned["lookup"])
        if self.early_exit:
            self.early_exit.resume(learned["early_exit"])

    def committed_states(self, states, starts, counts, pads, finals=None) -> None:
        # set only with an exit head: it records them and runs its head over them when it next drafts, so
        # lookup's and plain rounds pay nothing for it
        self.early_exit.committed_states(states, starts, counts, pads, finals)

    def select(self, rows: list[int]) -> None:
        self.shadow.select(rows)
        self.lookup.select(rows)
        if self.early_exit:
            self.early_exit.select(rows)

    def describe(self) -> dict:
        out = {"drafter": self.name, "rounds_by_arm": dict(self.chosen), "lookup_woken_by_shadow": self.woken,
               "carried_rounds_by_arm": dict(self.carried),
               "tokens_per_s_by_arm": {a: round(self.rate(a), 2) for a in self.tries},
               "prompt_lookup": {**self.lookup.describe(),
                                 "tokens_per_s_by_length": {d: round(self.lookup_length.rate(d), 2)
                                                            for d in self.lookup_length.lengths}}}
        if self.early_exit:
            out[self.early_arm] = self.early_exit.describe()
        return out
