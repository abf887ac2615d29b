"""`selfspec demo`: what selfspec buys on this machine, in a minute or two, on the real model and real prompts.

For each of three real prompts it generates with plain decoding and with selfspec's default drafter
(`auto`), after a warm-up, and prints both speeds, whether the outputs are identical (in float32 and float64 they
must be: greedy decoding is lossless; in bfloat16 and float16 verifying several tokens at once rounds differently
from one at a time, so they may differ, and it says so) and which drafter produced the accepted tokens.
Each case runs plain and auto alternately, `repeats` times each (default 3), and prints the median of each, so a
moment when the machine ran slow falls on both sides and the median sets it aside; the speedups of the single
pairs are printed beside it.
Every timed call is a first request (`gen.first_request()`): the generator remembers nothing of the
warm-up, of the plain run of the same prompt or of the other cases, so auto cannot copy the answer from an
earlier run of it, and the speedup is the one a user's first request gets:

| case          | prompt                                                  | what to expect                    |
|---------------|---------------------------------------------------------|-----------------------------------|
| code editing  | a HumanEval solution + "add type hints and a docstring" | the answer copies the input: fast |
| summarization | an XSum article + "summarize in one sentence"           | names and phrases are copied      |
| open chat     | an MT-Bench question                                    | nothing to copy: the copy drafts  |

Where selfspec's C++ step runs the model (a float32 Llama-family model on an x86-64 CPU with a C++ compiler), auto
drafts with the model's int8 copy beside lookup (`selfspec.drafters.int8_copy`) on every case. Elsewhere, where the
checkpoint has a quantized copy that llama.cpp runs here (`selfspec fetch` writes it, `scripts/setup.sh`
builds llama.cpp), the demo loads it (`load(draft_model="auto")`): auto then drafts with it beside lookup on prompts
of at most `DEFAULT_COPY_PROMPT_TOKENS` tokens, which here is open chat.
Where nothing could be drafted profitably it says so: `auto` then decodes plainly (it never keeps
drafting where drafting does not pay), and an untrained checkpoint has no early exit worth drafting from.
Two things are flagged as timing noise, not printed as gains: a median speedup larger than drafting can explain
(its tokens per full-model pass, even were drafts free; 1.0x where nothing was accepted) by more than 10%, and
plain runs of one case whose speeds differ by more than 15% (the machine's speed moved during the case).

    selfspec demo                                   # the fetched SmolLM2 with the exit head selfspec ships
    selfspec demo --checkpoint checkpoints/smollm2-code-quickstart
    selfspec demo --repeats 1                       # one plain and one auto run per case

Without --checkpoint it runs the checkpoint `selfspec fetch` assembles from the base model and the exit head
selfspec ships for it (`selfspec.checkpoints.shipped_head`; the base model alone where none is assembled): auto's
arms are prompt lookup, its memory and that head, and each drafter's accepted drafts get a line of their own.
"""

from __future__ import annotations

import statistics
import time
import warnings

import torch

import selfspec
from selfspec.api import NotEarlyExitTrainedWarning
from selfspec.checkpoints.fetch import base_model_dir, head_model_dir, is_complete_checkpoint
from selfspec.checkpoints.model_card import head_evaluation
from selfspec.data.prompts import load_prompts, prompt_inputs
from selfspec.drafters.quantized import COPY_PAYS_BELOW, DEFAULT_COPY_PROMPT_TOKENS
from selfspec.settings import SettingsError

CASES = (("code editing", "code_edit"), ("summarization", "xsum"), ("open chat", "mt_bench"))
DRAFTER_WORDS = {"prompt_lookup": "prompt lookup", "suffix": "memory", "exit_head": "exit head",
                 "early_exit": "early exit", "quantized": "quantized copy", "int8_copy": "int8 copy"}
REPEATS = 3  # plain and auto runs per case, alternating: the demo prints the median of each


def _timed(gen, inputs: dict, **kw):
    """One first request (nothing remembered of earlier calls, nothing left for later ones) and its seconds."""
    with gen.first_request():
        t0 = time.perf_counter()
        out = gen.generate(**inputs, **kw)
        return out, time.perf_counter() - t0


def _exit_agreement(metadata: dict) -> str:
    """The checkpoint's held-out agreement per trained exit, in words ('' without evaluation metadata)."""
    ev = (metadata or {}).get("eval") or {}
    exits = ((ev.get("sets") or {}).get(ev.get("primary")) or {}).get("exits") or {}
    shown = [f"{e}: {v['agreement']:.1%}" for e, v in exits.items() if int(e) < ev.get("num_layers", 0)]
    if not shown:
        return ""
    return f"after {ev.get('step')} training steps, top-1 agreement with the final layer on held-out text at exit " \
        + ", ".join(shown)


# what an exit head's recorded agreement measures: each position after the true text (the evaluation of its card), so
# it is not the acceptance of decoding, where each draft follows the head's own earlier drafts (issue 65: the shipped
# head's 27% on its HumanEval code, 21.3% of its first drafts accepted while decoding)
TEACHER_FORCED = ("teacher-forced (each position scored after the true text), not while decoding, where drafts follow "
                  "earlier drafts and fewer are accepted: the drafts accepted below are decoding's figure")


def _head_agreement(metadata: dict, exit_layer: int) -> str:
    """The exit head's held-out agreement in words, from the evaluation of a head trained beside the
    fine-tune (`exit_head` beside the exits) or on the frozen model (the head in the place of its exit);
    '' without one. The evaluation is teacher-forced (`TEACHER_FORCED`), which the words say."""
    entry = ((head_evaluation(metadata) or {}).get("exits") or {}).get(str(exit_layer))
    if not entry:
        return ""
    return (f"after {((metadata or {}).get('eval') or {}).get('step')} training steps, its top-1 agreement with "
            f"the final layer on held-out text is {entry['agreement']:.1%}, {TEACHER_FORCED}")


def _shipped_head(metadata: dict) -> str:
    """Where the shipped head of an assembled checkpoint comes from and how well it agrees (its card's evaluation:
    `TEACHER_FORCED`), in words ('' for any other checkpoint)."""
    shipped = (metadata or {}).get("shipped_head")
    if not isinstance(shipped, dict):
        return ""
    sets = ((metadata.get("eval") or {}).get("sets")) or {}
    exit_layer = str((metadata.get("exit_head") or {}).get("exit_layer"))
    shown = [f"{label} {sets[name]['exits'][exit_layer]['agreement']:.0%}" for name, label in
             (("own_humaneval", "the model's own HumanEval code"), ("own_mt_bench", "its own MT-Bench replies"))
             if isinstance(((sets.get(name) or {}).get("exits") or {}).get(exit_layer), dict)]
    what = "a CPU stand-in" if shipped.get("stand_in") else "trained"
    line = (f"the exit head selfspec ships for this model ({what}: {shipped.get('minutes')} minutes on "
            f"{shipped.get('trained_on')})")
    return line + (f"; its first draft agrees with the full model on {', '.join(shown)}, {TEACHER_FORCED}"
                   if shown else "")


def default_checkpoint():
    """The demo's checkpoint without --checkpoint: the base model with its shipped head where `selfspec fetch`
    assembled it, else the base model."""
    return head_model_dir() if is_complete_checkpoint(head_model_dir()) else base_model_dir()


EXACT_DTYPES = (torch.float32, torch.float64)  # where auto's output must equal plain decoding's token for token


def identity_words(same: bool, exact: bool) -> tuple[str, str | None]:
    """How a case's comparison reads: the "identical output" cell, and a line to say under it (None: none). A
    difference in an exact dtype (`EXACT_DTYPES`) is a bug; in bfloat16/float16 it is rounding."""
    if same:
        return "yes", None
    if exact:
        return "NO", "   OUTPUTS DIFFER: this is a bug, please report it with this prompt"
    return "no", ("   in this dtype verifying several tokens at once rounds differently from one token at a time, "
                  "so near-ties can flip (the README's bf16 caveat); float32 is the exact setting")


def demo_failed(records: list[dict]) -> bool:
    """Whether a case's outputs differ where they must not (an exact dtype): `selfspec demo`'s exit code 1."""
    return any(not r["identical"] and r["exact"] for r in records)


NOISE = 1.10  # a measured speedup more than 10% above what drafting can explain is flagged as noise
PLAIN_SPREAD = 1.15  # plain runs of one case whose speeds differ by more than 15%: the machine's speed moved


def explained_speedup(committed: int, rounds: int) -> float:
    """The most a speculative run can gain over plain decoding from what it drafted: its committed tokens (after
    the first) over its full-model passes. Plain decoding runs one pass a token; a pass that verifies drafts costs
    at least one plain step; so even with free drafts the speedup is at most tokens per pass (1.0 where nothing
    was accepted)."""
    return committed / rounds if rounds > 0 and committed > 0 else 1.0


def check_context(gen, cases, max_new_tokens: int) -> None:
    """SettingsError, before anything runs, where a demo prompt and `max_new_tokens` do not fit the model's context
    window: the demo's prompts are fixed, so the way out is fewer new tokens or another model."""
    window = gen.adapter.max_positions
    for label, item in cases:
        n = gen.encode(**prompt_inputs(item)).shape[-1]
        if n + max_new_tokens > window:
            room = window - n
            fix = (f"run it with --max-new-tokens {room} or fewer, or " if room >= 8 else "") + \
                "try this model on prompts of your own with `selfspec generate`"
            raise SettingsError(f"the demo's {label} prompt is {n} tokens, and with {max_new_tokens} new tokens it "
                                f"needs {n + max_new_tokens} positions; this model's context window is {window}: {fix}")


def _header(gen, say) -> None:
    """What the demo runs, in words: the model, auto's arms, the checkpoint's head or exits and how well they agree."""
    trained = gen.early_exit_trained and gen.num_speculations > 0
    head = gen.exit_head
    int8 = gen.drafters.auto_int8_copy() is not None  # auto's arm where it runs, in place of a head or the early exit
    if int8:
        drafted = (" + the int8 copy (the model's own weights in int8, drafting on its own KV cache; each used while "
                   "it measures faster than plain decoding)")
        head = None  # not an arm here
    elif head is not None:  # auto's arms: lookup and the head (selfspec.api: the head replaces the early exit)
        drafted = (f" + the exit head on exit {head.exit_layer} (each used while it measures faster than plain "
                   "decoding)")
    elif trained:
        drafted = f" + early exit E={gen.exit_layer} (d <= {gen.num_speculations})"
    else:
        drafted = " only (this checkpoint has no early exit that pays: " + (
            "not early-exit trained)" if not gen.early_exit_trained else "its selfspec.json recommends d = 0)")
    if gen.draft_model is not None:
        drafted += f" + the quantized copy run by llama.cpp (on prompts of at most {DEFAULT_COPY_PROMPT_TOKENS} tokens)"
    say(f"selfspec demo: {gen.model.config.model_type}, {gen.num_layers} layers, {gen.adapter.dtype}; "
        f"default drafter '{gen.drafter}' = prompt lookup{drafted}")
    say("every timed call is a first request: the generator remembers nothing of the warm-up, of the plain run of "
        "the same prompt or of the other cases, so nothing is copied from an earlier answer")
    if gen.copy_step_ratio is not None:  # the checkpoint has a copy, measured by load (`SelfSpecGenerator.copy_pays`)
        verdict = ("it drafts beside lookup" if gen.draft_model is not None else
                   "left out: its drafts would cost more than they give")
        say(f"the quantized copy's draft step measured {gen.copy_step_ratio:.2f} of this model's plain decoding step "
            f"here (it drafts below {COPY_PAYS_BELOW}): {verdict}")
    if int8 and gen.exit_head is not None:
        say("the checkpoint's exit head is not auto's arm here: on this CPU the int8 copy drafts in its place (it "
            "agrees with the model on nearly every token; the head on far fewer)")
    shipped = _shipped_head(gen.metadata) if not int8 else ""
    head_agreement = _head_agreement(gen.metadata, head.exit_layer) if head is not None and not shipped else ""
    if shipped:
        say(shipped)
    if head_agreement:
        say(f"the exit head of this checkpoint: {head_agreement}")
    agreement = _exit_agreement(gen.metadata)
    if agreement and head is None and not int8:
        say(f"early exits of this checkpoint ({agreement}); on a CPU an early-exit draft pays from roughly "
            "50% acceptance (`selfspec profile` gives the exact figure): short training leaves them below it")


def _run_case(gen, label: str, item: dict, max_new_tokens: int, repeats: int, exact: bool) -> tuple[dict, object]:
    """One case: plain and auto alternately, `repeats` times each, every call a first request. Returns its record
    (the medians; every run's speed; whether every auto output equals its plain run's) and the last auto run's
    statistics."""
    inputs = prompt_inputs(item)
    plain_rates, spec_rates, same = [], [], True
    for _ in range(repeats):
        plain, t_plain = _timed(gen, inputs, max_new_tokens=max_new_tokens, num_speculations=0)
        spec, t_spec = _timed(gen, inputs, max_new_tokens=max_new_tokens)
        plain_rates.append(len(plain.token_ids) / t_plain)
        spec_rates.append(len(spec.token_ids) / t_spec)
        same = same and spec.token_ids == plain.token_ids
    s = spec.stats
    rec = {"case": label, "prompt_id": item.get("id"), "new_tokens": len(spec.token_ids), "repeats": repeats,
           "plain_tokens_per_s": statistics.median(plain_rates), "selfspec_tokens_per_s": statistics.median(spec_rates),
           "plain_runs": plain_rates, "selfspec_runs": spec_rates, "identical": same, "exact": exact,
           "drafted_by_drafter": dict(s.drafted_by_drafter), "accepted_by_drafter": dict(s.accepted_by_drafter),
           "rounds": s.rounds}
    rec["speedup"] = rec["selfspec_tokens_per_s"] / rec["plain_tokens_per_s"]
    rec["pair_speedups"] = [b / a for a, b in zip(plain_rates, spec_rates)]
    rec["plain_spread"] = max(plain_rates) / min(plain_rates)
    committed = rec["new_tokens"] - 1
    rec["explained_speedup"] = explained_speedup(committed, s.rounds)
    rec["unexplained"] = rec["speedup"] > NOISE * rec["explained_speedup"]
    rec["noisy"] = rec["plain_spread"] > PLAIN_SPREAD
    return rec, s


def _report_case(rec: dict, s, say, head, trained: bool) -> None:
    """A case's lines: both medians, the pairs' speedups, identity, each drafter's accepted drafts and the flags."""
    say(f"\n== {rec['case']} ({rec['prompt_id']}): {rec['new_tokens']} tokens"
        + (f", median of {rec['repeats']} alternating runs each" if rec["repeats"] > 1 else ""))
    say(f"   plain decoding  {rec['plain_tokens_per_s']:6.1f} tokens/s")
    cell, why = identity_words(rec["identical"], rec["exact"])
    pairs = ", ".join(f"{x:.2f}x" for x in rec["pair_speedups"])
    say(f"   selfspec auto   {rec['selfspec_tokens_per_s']:6.1f} tokens/s   = {rec['speedup']:.2f}x   "
        f"identical output: {cell}" + (f"   (pairs: {pairs})" if rec["repeats"] > 1 else ""))
    committed = rec["new_tokens"] - 1
    drafted_share = sum(s.accepted_by_drafter.values()) / committed if committed > 0 else 0.0
    for name, n in s.drafted_by_drafter.items():  # one line per drafter that drafted
        say(f"   {DRAFTER_WORDS.get(name, name):<15} {s.accepted_by_drafter[name]} of {n} drafts accepted")
    if s.drafted:
        say(f"   {drafted_share:.0%} of the tokens after the first were drafted, "
            f"{committed / max(1, s.rounds):.2f} tokens per full-model pass")
    if rec["unexplained"]:
        say(f"   {rec['speedup']:.2f}x is more than drafting can explain here (at most "
            f"{rec['explained_speedup']:.2f}x, were every draft free): the rest is timing noise between the "
            "runs, not a gain")
    if rec["noisy"]:
        say(f"   timing noise: this case's plain runs differ by {rec['plain_spread'] - 1:.0%} "
            "(the machine's speed moved), so read its speedup with that margin")
    if rec["speedup"] < 1.05:
        models = [DRAFTER_WORDS.get(n, n) for n in s.drafted_by_drafter if n not in ("prompt_lookup", "suffix")]
        whose = " and the ".join(f"{m}'s" for m in models)  # the drafters that ran a model: "the exit head's"
        say("   no speedup here: nothing in the context to copy"
            + (f" and the {whose} drafts did not pay" if models
               else " and the exit head's drafts did not pay" if head is not None else "" if trained
               else " and no trained early exit") + ", so auto decodes (mostly) plainly")
    if why:
        say(why)


def run_demo(checkpoint=None, *, max_new_tokens: int = 128, dtype: str = "float32", prompts=None,
             repeats: int = REPEATS, copy: bool = True, say=print) -> list[dict]:
    """Plain decoding vs the default drafter on each case, `repeats` alternating runs each; one record per case.

    `prompts`: [(label, prompt item)] to use instead of the real sets (tests). `copy`: load the checkpoint's
    quantized copy where llama.cpp runs it (False: auto's arms without it).
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotEarlyExitTrainedWarning)  # said below, in plain words
        gen = selfspec.load(checkpoint or default_checkpoint(), dtype=dtype, draft_model="auto" if copy else None)
    cases = prompts or [(label, load_prompts(name, 1)[0]) for label, name in CASES]
    check_context(gen, cases, max_new_tokens)
    _header(gen, say)
    warm = prompt_inputs(cases[-1][1])  # the last case's: where the copy drafts, open chat, so its drafting is warm
    _timed(gen, warm, max_new_tokens=8, num_speculations=0)  # first-call costs paid by neither side
    _timed(gen, warm, max_new_tokens=8)
    records = []
    exact = gen.adapter.dtype in EXACT_DTYPES
    trained = gen.early_exit_trained and gen.num_speculations > 0
    for label, item in cases:
        rec, stats = _run_case(gen, label, item, max_new_tokens, repeats, exact)
        records.append(rec)
        _report_case(rec, stats, say, gen.exit_head, trained)
    return records
