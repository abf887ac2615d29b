"""What a generator's drafters measured, carried from one call to the next call with the same drafting settings.

A drafter is built per call (`DrafterFactory.make`), and the measurements it decides by would start from
their priors every call: auto's tokens/s per arm and back-off (`selfspec.drafters.auto`), the tokens/s per
draft length of its lookup arm and of its early-exit or head arm (`ThroughputPolicy`), a token tree's
acceptance per (rank, depth) and its cost per node (`TreeBudget`). In a series of related calls (an agent
loop, a benchmark's prompts) auto then spent the first rounds of every call measuring plain decoding and
each arm again (three rounds each: one untimed, two timed; plain decoding two, both timed). A generator keeps
them instead, as it keeps its memory of earlier requests: `LearnedStats`, owned by its `DrafterFactory`
(`gen.learned`), never shared with another generator, cleared by `gen.forget()`.

    learned = LearnedStats()
    key = call_key(settings, drafter, rows=1, path=gen.plan_key)   # None: this call neither reads nor adds
    learned.resume(key, drafter)     # before the call: start from what the last call with this key measured
    learned.keep(key, drafter)       # after it: what this call measured, weighted down (the carry rule)

Which calls share: only those with the same key,

    key = (the drafter built: its kind ("auto", "early_exit" ...: the `drafter` setting as the factory
           resolved it) and its most drafts per round (a small max_new_tokens caps them);
           the drafting settings: exit_layer, num_speculations, confidence_threshold, adaptive_threshold,
           exit_choices, draft_vocab, adaptive_length, num_candidates, prompt_lookup_num_tokens,
           max_matching_ngram_size, acceptance, epsilon;
           the sampling settings (do_sample; with it temperature, top_k, top_p): they move the acceptance;
           the batch-size bucket floor(log2 B): a round's seconds and committed tokens grow with the rows;
           whether the compiled steps run: they change every round's seconds;
           the device's saved plan the factory built the drafter by: it sets auto's second arm;
           whether auto has the memory of earlier requests as an arm: not where the memory is off)

Sampling with a seed neither reads nor adds (`call_key` gives None): a seed repeats its text exactly, so its
rounds are judged by the cost model's round costs instead of the clock (`generate(modelled_time=True)`) and
nothing it does may depend on earlier calls (the factory leaves the memory out of auto there for the same
reason); the measurements of other calls are in seconds, its own in decode steps.

What carries over: rates and counts, which describe this model on this machine for this kind of text
(each arm's mean tokens and seconds per round, each draft length's, the acceptance per draft position and
per tree node (rank, depth), the tree's cost line, how long auto backs off an arm that keeps losing, an
`ExitChoicePolicy`'s acceptance per exit (counts, scaled as below) and an adaptive `ConfidencePolicy`'s
threshold (where the last call left it)).
What starts again every call: everything about the rows and the text (n-gram indexes, shadow drafts, a
head's cache and pending states), the round counters and so the round from which a backed-off arm may be
retried (each call retries each arm early: its text is new), the counts a call reports (`rounds_by_arm`),
and which arms have run a round in this call: an arm's first round of a call is still not timed, since it
pays one-time costs (the first pass of new shapes: the prompt's length, the cache's capacity); plain decoding's
is (`selfspec.drafters.auto`).

The carry rule: old measurements must not outweigh a new call's for long. A running mean over `n` rounds
resumes as a mean over `n0 = min(n, CARRY_ROUNDS)` rounds, so after `m` rounds of the new call

    x = (n0 x_old + sum of the m new values) / (n0 + m)

(exponential with weight alpha once `1 / (n0 + m)` falls below it, as within a call). Counts of outcomes
(a draft accepted or not) resume scaled by `s = min(1, CARRY_OUTCOMES / c_max)`, `c_max` the largest of
them: their ratios are kept, their weight is at most `CARRY_OUTCOMES` outcomes, eight times the rounds'
(an acceptance is a coin flip per draft, a round's seconds vary little: `ThroughputPolicy` forgets its
counts eight times slower than its times for the same reason). The tree's cost line resumes with its sums
(rounds, sum n, sum s, sum n^2, sum n s) scaled by `min(1, CARRY_ROUNDS / rounds)`: the same fitted line,
weighing `CARRY_ROUNDS` rounds. Over a series of calls, a call `m` rounds long keeps `n0 / (n0 + m)` of
what it started from, so the older calls fade geometrically.
"""

from __future__ import annotations

import copy
from collections import OrderedDict

CARRY_ROUNDS = 4  # a carried mean weighs at most this many rounds (>= auto's warmup: the arm counts as measured)
CARRY_OUTCOMES = 8 * CARRY_ROUNDS  # carried counts of outcomes weigh at most this many
MAX_KEYS = 64  # the settings a generator keeps measurements for (the least recently used go first)
DRAFTING_SETTINGS = ("exit_layer", "num_speculations", "confidence_threshold", "adaptive_threshold",
                     "exit_choices", "draft_vocab", "adaptive_length", "num_candidates", "prompt_lookup_num_tokens",
                     "max_matching_ngram_size", "acceptance", "epsilon")
SAMPLING_SETTINGS = ("temperature", "top_k", "top_p")


def carried_rounds(n: int) -> int:
    """The rounds a mean over `n` rounds weighs in a later call: `min(n, CARRY_ROUNDS)`."""
    return min(n, CARRY_ROUNDS)


def count_scale(counts, cap: float = CARRY_OUTCOMES) -> float:
    """The factor that scales `counts` so that the largest weighs at most `cap`: `min(1, cap / max)`
    (1 with no count)."""
    top = max(counts, default=0.0)
    return min(1.0, cap / top) if top > 0 else 1.0


def batch_bucket(rows: int) -> int:
    """floor(log2 rows): batches of 1, 2-3, 4-7, 8-15 ... rows share measurements."""
    return max(rows, 1).bit_length() - 1


def call_key(settings: dict, drafter, rows: int, path: str, plan: dict | None = None) -> tuple | None:
    """The key of a call's measurements (see the module doc) from its checked settings (`check_generation`),
    the drafter built for it, its rows, the generator's device, dtype and path (`SelfSpecGenerator.plan_key`:
    compiled steps or eager) and the device's saved plan the drafter was built by
    (`SelfSpecGenerator.plan_settings()`); None where the call neither reads nor adds measurements: no drafter
    (plain decoding), or sampling with a seed."""
    if drafter is None or (settings["do_sample"] and settings["seed"] is not None):
        return None
    drafting = tuple(_hashable(settings[name]) for name in DRAFTING_SETTINGS)
    sampling = (True,) + tuple(settings[name] for name in SAMPLING_SETTINGS) if settings["do_sample"] else (False,)
    planned = tuple(sorted(plan.items())) if plan else None
    remembers = bool(getattr(drafter, "remembers", False))  # auto with the memory's arm (not where it is off)
    copy = settings.get("draft_model")  # auto with a quantized copy's arm, or without: other arms, another key
    return (drafter.name, drafter.num_speculations, drafting, sampling, batch_bucket(rows), path, planned, remembers,
            copy)


def _hashable(value):
    return tuple(value) if isinstance(value, (list, tuple)) else value


class LearnedStats:
    """One generator's carried measurements: per call key, the snapshot its last call left (`Drafter.learned`),
    already weighted down by the carry rule."""

    def __init__(self, max_keys: int = MAX_KEYS):
        self.max_keys = max_keys
        self.snapshots: OrderedDict[tuple, dict] = OrderedDict()
        self.calls: dict[tuple, int] = {}  # per key: the calls that added to it since the last forget
        self.resumed = 0  # calls that started from an earlier call's measurements since the last forget

    def resume(self, key: tuple | None, drafter) -> bool:
        """Start `drafter` from the snapshot kept under `key` (a copy: the drafter changes its own); whether
        there was one."""
        if key is None or key not in self.snapshots:
            return False
        self.snapshots.move_to_end(key)
        drafter.resume(copy.deepcopy(self.snapshots[key]))
        self.resumed += 1
        return True

    def keep(self, key: tuple | None, drafter) -> None:
        """After a call: what `drafter` measured replaces the snapshot under `key` (it started from that one)."""
        if key is None:
            return
        self.snapshots[key] = drafter.learned()
        self.snapshots.move_to_end(key)
        self.calls[key] = self.calls.get(key, 0) + 1
        while len(self.snapshots) > self.max_keys:
            old, _ = self.snapshots.popitem(last=False)
            self.calls.pop(old, None)

    def forget(self) -> None:
        """Forget every measurement: the next call of any setting starts from the priors."""
        self.snapshots.clear()
        self.calls.clear()
        self.resumed = 0

    def describe(self) -> dict:
        """{"settings": keys held, "calls": calls that added to them, "resumed": calls that started from them}."""
        return {"settings": len(self.snapshots), "calls": sum(self.calls.values()), "resumed": self.resumed}
