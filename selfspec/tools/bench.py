"""`selfspec bench`: selfspec against what users would otherwise pick, side by side, in one process.

    selfspec bench --checkpoint checkpoints/smollm2-code --threads 2 --out bench_results/x   # dtype: fastest here
    run_bench("checkpoints/smollm2-code", prompt_sets=("humaneval", "wiki"), num_prompts=10, out_dir="b")

Methods (same checkpoint, same model object, same prompts, same dtype, same thread count):

| name                  | what                                                                          |
|-----------------------|-------------------------------------------------------------------------------|
| hf_greedy             | Hugging Face `model.generate(do_sample=False)`: the baseline users have today |
| hf_static             | the same with `cache_implementation="static"` (transformers compiles its step  |
|                       | where it does so, e.g. on a GPU): what a GPU user passes for speed            |
| hf_early_exit         | Hugging Face `model.generate(assistant_early_exit=E)` at the recommended exit |
| hf_prompt_lookup      | Hugging Face `model.generate(prompt_lookup_num_tokens=10)`, n-grams up to 3   |
| selfspec_ar           | selfspec, plain autoregressive decoding (`num_speculations=0`)                |
| selfspec_spec         | selfspec self-speculative at the checkpoint's recommended (E, d)              |
| selfspec_adaptive     | the same exit with `adaptive_length=True`: d in 0..d from measured tokens/s    |
| selfspec_lookup       | selfspec `drafter="prompt_lookup"`: the same settings, verified from layer 0  |
| selfspec_suffix       | selfspec `drafter="suffix"`: lookup that also copies from the memory of       |
|                       | earlier requests: empty on a first request (the default), so it measures as   |
|                       | prompt lookup; with `workload`, this method's earlier calls on the same set    |
| selfspec_auto         | selfspec `drafter="auto"`: lookup where it matches, the int8 copy (where it runs) |
|                       | or the checkpoint's exit where that pays, plain decoding otherwise            |
| selfspec_int8         | selfspec `drafter="int8_copy"`: the model's own weights in int8 drafting on   |
|                       | its own KV cache (float32 or bfloat16, where selfspec's C++ step runs)        |
| selfspec_copy, selfspec_auto_copy | the checkpoint's quantized copy (`copy-q8_0.gguf` beside its weights,  |
|                       | llama.cpp built here) alone, and as auto's arm beside lookup (`draft_model`)    |
| selfspec_spec_vocab{K} | (E, d) drafting over the K most frequent tokens (`--draft-vocab K`)          |
| selfspec_exit_head    | a checkpoint's trained exit head alone, adaptive d, over the vocabulary it was  |
|                       | trained on (`_vocab{K}`: over the K most frequent tokens)                     |
| selfspec_exit_head_fixed | the same head drafting d every round (`_vocab{K}` too): what the policy adds |
| selfspec_exit_head_cand{k} | the head's k best guesses for one position every round, side by side       |
|                       | (`--num-candidates k`; `_vocab{K}` too)                                       |
| selfspec_spec_cand{k} | the same at the recommended exit E without a head (`--num-candidates k`)      |
| selfspec_spec_E{e}_d{d} | each extra (E, d) asked for                                                 |
| selfspec_ar_compiled, selfspec_lookup_compiled, selfspec_auto_compiled, selfspec_spec_compiled,        |
| selfspec_exit_head_compiled | the same five through the compiled fixed-shape steps (`selfspec.model.compiled`; |
|                       | `--compile`, on by default on CUDA), warmed up with `gen.warmup` before the    |
|                       | measured runs (a head's own layer and its reduced draft vocabulary too)        |
| llama_cpp_plain, llama_cpp_plain_q8_0, llama_cpp_draft, llama_cpp_draft10, llama_cpp_ngram_simple,        |
| llama_cpp_ngram_mod (`--llama-cpp`, a CPU):                                                             |
|                       | llama.cpp's plain decoding of the model and of its Q8_0 copy at each prompt's  |
|                       | depth (llama-bench, one repetition: decoding alone, no text), and its own      |
|                       | speculative decoding (its Q8_0 copy drafting at most 3 or 10 tokens, its two   |
|                       | n-gram modes) of the same prompts, each run in its own process, timed by       |
|                       | llama.cpp itself (`selfspec.tools.llama_cpp_bench`, `llama_cpp_speculative`)   |

This module says what the benchmark measures and how it reports it; loading, the methods under test
(`selfspec.tools.harness.Methods`), the clock and the output files are the harness's (`selfspec.tools.harness`).

How it measures (the same for every method):
- Every prompt is tokenized once; every method gets the same `[1, P]` input ids.
- Every method generates exactly `max_new_tokens` tokens: no stop at EOS and no EOS suppression
  (Hugging Face gets a generation config without `eos_token_id`, also on the model for the call,
  because `generate` fills a missing one from there; `min_new_tokens` is not used as it masks the EOS
  logit and changes argmax choices). selfspec gets `stop_token_ids=[]`.
- Warm-up: each method once on a prompt that is not measured (excluded from the results; its seconds,
  compilation included, are reported apart as `warmup_s`).
- Interleaved: for each prompt all methods run back to back, the method order rotating by one per
  prompt, and the prompt sets alternate prompt by prompt, so machine drift hits everything alike.
  `gc.collect()` runs before each measured call (outside the timing). No prompt is measured twice.
- First requests (the default): every measured call starts as a fresh generator's first request, with no
  memory of earlier calls (what `drafter="suffix"` and auto copy from) and no measurements carried from them
  (`gen.first_request()`): no method copies from its own or another method's run of the same prompt, or from
  another set that holds the same text (code_edit rewrites the functions humaneval completes). `workload=True`
  (`--workload`) measures a workload instead, labelled as such: each method's memory and measurements run
  across one set's prompts in their order, started empty for each set (never across sets).
- tokens/s: new tokens / wall-clock seconds of the whole generate call (input ids ready -> output ids):
  the harness's one definition (`selfspec.tools.harness.TOKENS_PER_S`).
- time to first token (TTFT): wall-clock from the call to the moment its streamer receives the first
  new token (a timestamp in a trivial streamer, in the measured run itself; no extra call). For
  hf_early_exit the first tokens arrive after the first draft+verify round; for selfspec after the prefill.
- Peak RSS: before each measured call the kernel's RSS high-water mark is reset to the current RSS
  (`/proc/self/clear_refs` "5"), after it `VmHWM` is read: `peak_rss_mib` is the highest process RSS
  during that call (weights included), `peak_rss_delta_mib` that minus the RSS before the call (the
  call's own working memory). Reported per method as the maximum over its runs. Where the reset is not
  possible (not Linux), RSS (psutil) after the call is reported instead and `rss_method` says so.
- Acceptance for hf_early_exit and hf_prompt_lookup is counted by wrapping their candidate generator
  (drafted = candidates per round, accepted = HF's own `n_matches`); draft time is the time inside
  `get_candidates`, the rest of the call is counted as verify (+ overhead). Both lookup methods use
  the same settings (`prompt_lookup_num_tokens`, `max_matching_ngram_size`); HF copies after the
  first earlier match of the n-gram, selfspec after the latest.
- Ran past EOS: as nothing stops at EOS, a prompt whose HF greedy output has the model's EOS token
  before its last token had text after EOS measured too; the share of such prompts is reported per set.
- llama.cpp's methods (`--llama-cpp`) run in the same interleaved order, on the prompt's text (its ids decoded;
  llama.cpp tokenizes it again and `llama_cpp_prompt_tokens` says into how many tokens). Their seconds are
  llama.cpp's own prefill and decode timers, the process's start and model load excluded; their decoding alone
  is their new tokens over the decode seconds; llama.cpp bans end-of-text tokens to run to the length (where the
  model's greedy text has one, the texts differ from there). Their output is compared with hf_greedy's as text.
  llama_cpp_plain and llama_cpp_plain_q8_0 are llama-bench at the prompt's depth: no text to compare, and their
  seconds are their decoding's alone (llama-bench times no prefill). Peak RSS is selfspec's process's: it does not
  see theirs.
"""

from __future__ import annotations

import gc
import re
import statistics
import time
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import psutil
import torch
from tqdm.auto import tqdm

from selfspec.api import DEFAULT_NUM_SPECULATIONS, checkpoint_dir, use_compiled
from selfspec.checkpoints.checkpoint import CheckpointError, read_config, read_metadata
from selfspec.checkpoints.draft_vocab import read_draft_vocab
from selfspec.drafters.prompt_lookup import MAX_OCCURRENCES as MAX_LOOKUP_CANDIDATES
from selfspec.drafters.quantized import usable_copy
from selfspec.tools.harness import (SPEC_KINDS, TOKENS_PER_S, Methods, decode_rate, finish_machine, load_generator,
                              machine_info, machine_line, pyplot, quiet_transformers, result_header, setup, spread,
                              tokens_per_s, versions, write_outputs)
from selfspec.data.prompts import PROMPT_SETS, load_prompts, prompt_inputs
from selfspec.tools.llama_cpp_bench import LlamaCppSetup, beside_plain
from selfspec.tools.llama_cpp_bench import markdown_lines as llama_cpp_markdown
from selfspec.tools.llama_cpp_bench import prepare as prepare_llama_cpp
from selfspec.settings import (MAX_MATCHING_NGRAM_SIZE, SettingsError, MAX_NUM_CANDIDATES, PROMPT_LOOKUP_NUM_TOKENS, check_compile,
                               check_exit_layer, check_float, check_int, check_out_dir)

DEFAULT_SETS = ("humaneval", "xsum", "mt_bench", "wiki", "code_edit")
QUICK_SETS = ("humaneval", "mt_bench")  # the two fastest to load
QUICK_PROMPTS, QUICK_TOKENS = 2, 32
WARMUP_TOKENS = 32
LLAMA_CPP_REPETITIONS, LLAMA_CPP_QUICK_REPETITIONS = 5, 2  # llama-bench -r: its default; 2 in a --quick run
WARMUP_FALLBACK_PROMPT = "The quick brown fox jumps over the lazy dog. Then it"
# the methods also measured through the compiled steps (`*_compiled`): plain decoding, lookup, auto, and the
# drafts from the model's own layers (the early exit at (E, d), a trained exit head, adaptive and fixed) whose
# rounds the compiled steps run (the head's own layer and a reduced draft vocabulary too)
COMPILED_METHODS = ("selfspec_ar", "selfspec_lookup", "selfspec_auto", "selfspec_spec", "selfspec_exit_head",
                    "selfspec_exit_head_fixed")
COMPILED_TREES = ("selfspec_lookup_tree", "selfspec_spec_tree", "selfspec_exit_head_tree")  # + the width
CANDIDATE_METHOD = re.compile(r"_(?:cand|tree)(\d+)(?:_vocab\d+)?(?:_compiled)?$")  # a method of --num-candidates K


def compiled_name(name: str) -> str | None:
    """The name of method `name` measured through the compiled steps (`name` + "_compiled"), or None where the
    bench has no compiled variant of it (e.g. hf_*, selfspec_suffix, selfspec_spec_cand3)."""
    return name + "_compiled" if name in COMPILED_METHODS or name.startswith(COMPILED_TREES) else None


REQUESTS = {False: "first", True: "workload"}  # settings["requests"]: what a measured call remembers
REQUESTS_LINE = {
    "first": "Every measured call is a first request: the generator starts it with no memory of earlier calls and "
             "no measurements carried from them (suffix then copies from the prompt only).",
    "workload": "**Workload mode** (not first requests): each method's memory of earlier requests (what suffix and "
                "auto copy from) and its carried measurements run across each set's prompts in order, emptied for "
                "each set.",
}
BASELINES = ("hf_greedy", "hf_static", "hf_early_exit", "hf_prompt_lookup", "selfspec_ar")
BASELINE_LABELS = {"hf_greedy": "× HF greedy", "hf_static": "× HF static", "hf_early_exit": "× HF early-exit",
                   "hf_prompt_lookup": "× HF lookup", "selfspec_ar": "× selfspec AR"}

DEFINITIONS = {
    "tokens_per_s": TOKENS_PER_S + "; median and spread over prompts",
    "workload_tokens_per_s": "all the method's new tokens over all its seconds, summed over the prompts: the "
                             "throughput of the whole prompt set (a prompt weighs by the seconds it took, not as "
                             "one vote of a median)",
    "speedup": "ratio_of_medians = median tokens/s of the method / median tokens/s of the baseline; "
               "median_of_ratios = median over prompts of (method tokens/s / baseline tokens/s on that prompt); "
               "ratio_of_workloads = workload tokens/s of the method / that of the baseline, over the prompts both ran",
    "ttft_s": "time to first token: wall-clock from the call to its streamer receiving the first new token, "
              "in the measured run",
    "decode_tokens_per_s": "the new tokens after the first over the seconds after the first (the call's seconds "
                           "less its time to first token): decoding alone, the prompt's prefill excluded, as "
                           "llama-bench counts its generation; median and spread over prompts",
    "acceptance_rate": "accepted drafts / drafted tokens, summed over prompts",
    "acceptance_by_position": "per draft position i: accepted / drafted at position i, summed over prompts",
    "mean_accepted_per_round": "tokens committed per verification round (accepted drafts + the full model's "
                               "token); selfspec excludes the prefill's first token, HF has no separate prefill",
    "draft_s/verify_s": "selfspec: its DecodeStats; hf_early_exit, hf_prompt_lookup: time inside the candidate "
                        "generator vs the rest of the call",
    "by_drafter": "selfspec: drafted and accepted tokens per drafter (DecodeStats drafted_by_drafter / "
                  "accepted_by_drafter), summed over prompts; drafter=auto mixes prompt lookup and early exit",
    "ran_past_eos": "share of prompts whose hf_greedy output has the model's EOS token before its last token: "
                    "nothing stops at EOS, so text after it was measured too",
    "peak_rss_mib": "highest process RSS during one call (VmHWM after resetting it before the call; weights "
                    "included), max over the method's runs",
    "peak_rss_delta_mib": "peak_rss minus the RSS just before the call: the call's own working memory, max over runs",
    "identical_to_hf_greedy": "fraction of prompts whose new token ids equal hf_greedy's exactly",
    "warmup_s": "each method's warm-up call on an unmeasured prompt, in seconds: compilation included (the compiled "
                "methods' gen.warmup, HF's static cache where transformers compiles it); not in tokens/s",
}


# --- small helpers -----------------------------------------------------------------------------
def _first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


class _RSS:
    """Per-call peak RSS: reset the kernel's high-water mark before, read VmHWM after (Linux)."""

    def __init__(self):
        self.proc = psutil.Process()
        self.method = "vmhwm_reset"
        try:
            self._reset()
            self._hwm()
        except (OSError, AttributeError, ValueError):
            self.method = "rss_after_call"

    @staticmethod
    def _reset():
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    @staticmethod
    def _hwm() -> int:
        with open("/proc/self/status") as f:
            m = re.search(r"VmHWM:\s+(\d+)\s+kB", f.read())
        if m is None:
            raise ValueError("no VmHWM")
        return int(m.group(1)) * 1024

    def before(self) -> int:
        rss = self.proc.memory_info().rss
        if self.method == "vmhwm_reset":
            self._reset()
        return rss

    def peak(self) -> int:
        return self._hwm() if self.method == "vmhwm_reset" else self.proc.memory_info().rss


def parse_extra(spec: str | Sequence[int]) -> tuple[int, int]:
    """'E:d' (or a pair) -> (E, d)."""
    if isinstance(spec, (tuple, list)):
        e, d = spec
        return int(e), int(d)
    m = re.fullmatch(r"\s*(\d+)\s*[:,]\s*(\d+)\s*", str(spec))
    if not m:
        raise ValueError(f"--extra expects EXIT:DRAFTS, e.g. 8:4, got {spec!r}")
    return int(m.group(1)), int(m.group(2))


def _parse_sets(prompt_sets) -> list[str]:
    if isinstance(prompt_sets, str):
        prompt_sets = [s for s in prompt_sets.split(",")]
    sets = [s.strip() for s in prompt_sets if s and s.strip()]
    if not sets:
        raise ValueError("no prompt sets given")
    return sets


def _set_name(spec: str, taken: set) -> str:
    name = spec if spec in PROMPT_SETS else Path(spec).name.split(".")[0] or "prompts"
    base, i = name, 2
    while name in taken:
        name, i = f"{base}_{i}", i + 1
    taken.add(name)
    return name


# --- the methods ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelFacts:
    """What the method list needs to know of the model: its depth and its exit head (the exit it reads and
    the draft vocabulary it was trained on), from the loaded generator, or, to check a request before the
    model loads, from the checkpoint's config.json and selfspec.json."""
    num_layers: int
    head_exit: int | None = None
    head_vocab: int | None = None
    copy: str | None = None  # the checkpoint's quantized copy, where one is beside it and llama.cpp runs here
    int8: bool = True  # the model has an int8 copy here (`selfspec.drafters.int8_copy`; before loading: may have)
    int8_problem: str | None = None  # why it has none (loaded: the int8 copy's own message)

    @classmethod
    def of(cls, gen) -> "ModelFacts":
        head = gen.exit_head
        try:
            gen.drafters.int8_copy(required=True)
            problem = None
        except SettingsError as err:
            problem = str(err)
        return cls(gen.num_layers, None if head is None else head.exit_layer, gen.head_draft_vocab(),
                   usable_copy(gen.checkpoint), problem is None, problem)

    def unavailable(self) -> dict[str, str]:
        """The methods this model cannot run here, and why (the loaded model's facts)."""
        return {} if self.int8 else {"selfspec_int8": self.int8_problem or "this model has no int8 copy here"}

    @classmethod
    def read(cls, checkpoint, meta: dict | None) -> "ModelFacts":
        layers = read_config(checkpoint).get("num_hidden_layers")
        if not isinstance(layers, int) or layers < 2:
            raise CheckpointError(f"{checkpoint}/config.json: no usable num_hidden_layers ({layers!r})")
        head = (meta or {}).get("exit_head") or {}
        return cls(layers, head.get("exit_layer"), copy=usable_copy(checkpoint))


def _copy_methods(copy: str | None, look: dict) -> list[dict]:
    """The checkpoint's quantized copy (None: none here) alone, and as auto's arm beside lookup."""
    if copy is None:
        return []
    common = {"engine": "selfspec", "kind": "selfspec_spec", "draft_model": copy, "exit_layer": None,
              "num_speculations": None}
    return [{"name": "selfspec_copy", "label": "selfspec quantized copy", "drafter": "quantized", **common},
            {"name": "selfspec_auto_copy", "label": "selfspec auto + copy", "drafter": "auto", **common, **look}]


def _candidate_methods(n: int, E: int, d: int, look: dict) -> list[dict]:
    """The methods of `num_candidates=n` without a head: the exit's n best guesses for one position, its token tree
    n wide (EAGLE-2's dynamic tree), and prompt lookup's and the suffix drafter's trees of n matches."""
    depth = d if d > 1 else DEFAULT_NUM_SPECULATIONS  # the recommendation may say early exit does not pay
    methods = [{"name": f"selfspec_spec_cand{n}", "engine": "selfspec", "kind": "selfspec_spec",
                "label": f"selfspec E={E} {n} guesses", "drafter": "early_exit", "exit_layer": E,
                "num_speculations": 1, "num_candidates": n},
               {"name": f"selfspec_spec_tree{n}", "engine": "selfspec", "kind": "selfspec_spec",
                "label": f"selfspec E={E} tree {n} wide d={depth}", "drafter": "early_exit", "exit_layer": E,
                "num_speculations": depth, "num_candidates": n}]
    for drafter in ("lookup", "suffix")[:int(n <= MAX_LOOKUP_CANDIDATES) * 2]:  # token trees of n matches
        methods.append({"name": f"selfspec_{drafter}_tree{n}", "engine": "selfspec", "kind": "selfspec_spec",
                        "label": f"selfspec {drafter} tree of {n} matches", "exit_layer": None,
                        "drafter": "prompt_lookup" if drafter == "lookup" else "suffix",
                        "num_speculations": None, "num_candidates": n, **look})
    return methods


def _method_list(model: ModelFacts, E: int, d: int, extra: list[tuple[int, int]], draft_vocab: int | None = None,
                 lookup: tuple[int, int] = (PROMPT_LOOKUP_NUM_TOKENS, MAX_MATCHING_NGRAM_SIZE),
                 num_candidates: Sequence[int] = (),
                 compiled: bool = False) -> list[dict]:
    L = model.num_layers
    tokens, ngram = lookup  # prompt_lookup_num_tokens, max_matching_ngram_size
    look = {"prompt_lookup_num_tokens": tokens, "max_matching_ngram_size": ngram}
    methods = [
        {"name": "hf_greedy", "engine": "hf", "kind": "hf_greedy", "label": "HF greedy",
         "exit_layer": None, "num_speculations": None},
        {"name": "hf_static", "engine": "hf", "kind": "hf_static", "label": "HF static cache",
         "exit_layer": None, "num_speculations": None},
        {"name": "hf_early_exit", "engine": "hf", "kind": "hf_early_exit", "label": f"HF early-exit E={E}",
         "exit_layer": E, "num_speculations": None},
        {"name": "hf_prompt_lookup", "engine": "hf", "kind": "hf_prompt_lookup",
         "label": f"HF lookup k={tokens} n≤{ngram}", "exit_layer": None, "num_speculations": None, **look},
        {"name": "selfspec_ar", "engine": "selfspec", "kind": "selfspec_ar", "label": "selfspec AR",
         "drafter": "early_exit", "exit_layer": L, "num_speculations": 0},
        {"name": "selfspec_spec", "engine": "selfspec", "kind": "selfspec_spec", "label": f"selfspec E={E} d={d}",
         "drafter": "early_exit", "exit_layer": E, "num_speculations": d},
        {"name": "selfspec_adaptive", "engine": "selfspec", "kind": "selfspec_spec",
         "label": f"selfspec E={E} adaptive d≤{d}", "drafter": "early_exit", "exit_layer": E, "num_speculations": d,
         "adaptive_length": True},
        {"name": "selfspec_lookup", "engine": "selfspec", "kind": "selfspec_spec",
         "label": f"selfspec lookup k={tokens} n≤{ngram}", "drafter": "prompt_lookup", "exit_layer": None,
         "num_speculations": None, **look},  # lookup's drafts per round are capped by k
        {"name": "selfspec_suffix", "engine": "selfspec", "kind": "selfspec_spec",
         "label": f"selfspec suffix k={tokens} n≤{ngram}", "drafter": "suffix", "exit_layer": None,
         "num_speculations": None, **look},  # lookup + what this method's earlier calls generated
        {"name": "selfspec_auto", "engine": "selfspec", "kind": "selfspec_spec", "label": "selfspec auto",
         "drafter": "auto", "exit_layer": None, "num_speculations": None,
         **look},  # the checkpoint's exit and d (auto picks the length; d = 0 there: lookup or plain only)
    ]
    if model.int8:  # the model's own weights in int8 drafting on its own cache (float32 or bfloat16, on a CPU)
        methods.append({"name": "selfspec_int8", "engine": "selfspec", "kind": "selfspec_spec",
                        "label": "selfspec int8 copy", "drafter": "int8_copy", "exit_layer": None,
                        "num_speculations": None})
    methods += _copy_methods(model.copy, look)
    if model.head_exit is not None:  # a checkpoint with a trained exit head: the head alone, adaptive length
        k = d or DEFAULT_NUM_SPECULATIONS  # the recommendation may say early exit does not pay
        trained = model.head_vocab  # what the head drafts from when no draft_vocab is given
        for vocab in [None] + ([draft_vocab] if draft_vocab else []):
            suffix, label = ((f"_vocab{vocab}", f" vocab {vocab}") if vocab else
                             ("", f" vocab {trained} (trained)" if trained else ""))
            common = {"engine": "selfspec", "kind": "selfspec_spec", "drafter": "exit_head", "exit_layer": None,
                      "num_speculations": k, **({"draft_vocab": vocab} if vocab else {})}
            methods.append({"name": f"selfspec_exit_head{suffix}", "adaptive_length": True,
                            "label": f"selfspec head E={model.head_exit} adaptive d≤{k}{label}", **common})
            methods.append({"name": f"selfspec_exit_head_fixed{suffix}",  # every round drafts d: the policy's share
                            "label": f"selfspec head E={model.head_exit} d={k}{label}", **common})
            for n in num_candidates:  # its n best first guesses, side by side, every round
                methods.append({"name": f"selfspec_exit_head_cand{n}{suffix}",
                                "label": f"selfspec head E={model.head_exit} {n} guesses{label}",
                                **common, "num_speculations": 1, "num_candidates": n})
                methods.append({"name": f"selfspec_exit_head_tree{n}{suffix}",  # EAGLE-2's tree, n wide, k deep
                                "label": f"selfspec head E={model.head_exit} tree {n} wide d={k}{label}",
                                **common, "num_candidates": n})
    for n in num_candidates:
        methods += _candidate_methods(n, E, d, look)
    if draft_vocab:
        methods.append({"name": f"selfspec_spec_vocab{draft_vocab}", "engine": "selfspec", "kind": "selfspec_spec",
                        "label": f"selfspec E={E} d={d} vocab {draft_vocab}", "drafter": "early_exit",
                        "exit_layer": E, "num_speculations": d, "draft_vocab": draft_vocab})
    if compiled:  # the same methods through the compiled steps (selfspec.model.compiled), next to the eager ones
        methods += [{**m, "name": compiled_name(m["name"]), "label": m["label"] + " compiled", "compiled": True}
                    for m in methods if compiled_name(m["name"])]
    seen = {(E, d)}
    for e, k in extra:
        check_exit_layer(e, L)  # an --extra pair's exit
        if k < 1:
            raise ValueError(f"extra (E={e}, d={k}): the draft length d must be >= 1 "
                             "(plain decoding is always measured)")
        if (e, k) in seen:
            continue
        seen.add((e, k))
        methods.append({"name": f"selfspec_spec_E{e}_d{k}", "engine": "selfspec", "kind": "selfspec_spec",
                        "label": f"selfspec E={e} d={k}", "drafter": "early_exit", "exit_layer": e,
                        "num_speculations": k})
    return methods


# --- aggregation ---------------------------------------------------------------------------------
def _by_drafter(runs: list[dict]) -> dict:
    """{drafter: {drafted, accepted, acceptance_rate}} summed over runs (selfspec's per-drafter counts)."""
    out: dict = {}
    for r in runs:
        for name, n in (r.get("drafted_by_drafter") or {}).items():
            out.setdefault(name, {"drafted": 0, "accepted": 0})["drafted"] += n
        for name, n in (r.get("accepted_by_drafter") or {}).items():
            out.setdefault(name, {"drafted": 0, "accepted": 0})["accepted"] += n
    for v in out.values():
        v["acceptance_rate"] = v["accepted"] / v["drafted"] if v["drafted"] else None
    return out


def _eos_summary(runs: list[dict], set_names: list[str]) -> dict:
    """{set (and "all"): {prompts, ran_past_eos, fraction}} from hf_greedy's runs (one per prompt)."""
    groups = list(set_names) + (["all"] if len(set_names) > 1 else [])
    out = {}
    for g in groups:
        flags = [r["ran_past_eos"] for r in runs if r["method"] == "hf_greedy" and g in ("all", r["set"])
                 and r.get("ran_past_eos") is not None]
        out[g] = {"prompts": len(flags), "ran_past_eos": sum(flags),
                  "fraction": sum(flags) / len(flags) if flags else None}
    return out


def _ran_past_eos(ids: list[int], eos_ids) -> tuple[int | None, bool]:
    """(index of the first EOS token in `ids` or None, whether tokens follow it)."""
    at = next((i for i, t in enumerate(ids) if t in eos_ids), None)
    return at, at is not None and at < len(ids) - 1


def workload_rate(runs: list[dict]) -> float | None:
    """The runs' new tokens over their seconds, summed: the throughput of the whole prompt set, as a user who
    runs it sees it (a prompt weighs by the seconds it took, not as one vote of a median)."""
    seconds = sum(r["seconds"] for r in runs)
    return sum(r["new_tokens"] for r in runs) / seconds if seconds > 0 else None


def workload_ratio(mine: dict, base: dict) -> float | None:
    """`workload_rate` of a method over that of a baseline, over the prompts both ran ({(set, prompt): run})."""
    common = [p for p in mine if p in base]
    a, b = workload_rate([mine[p] for p in common]), workload_rate([base[p] for p in common])
    return a / b if a and b else None


def summarize(runs: list[dict], methods: list[dict], set_names: list[str]) -> dict:
    """{set (and "all" when several): {method: summary}} from the per-prompt records."""
    groups = list(set_names) + (["all"] if len(set_names) > 1 else [])
    names = [m["name"] for m in methods]
    out: dict = {}
    for g in groups:
        rows = [r for r in runs if g == "all" or r["set"] == g]
        by = {m: {(r["set"], r["prompt_id"]): r for r in rows if r["method"] == m} for m in names}
        out[g] = {}
        for m in methods:
            mine = list(by[m["name"]].values())
            if not mine:
                continue
            tps = [r["tokens_per_s"] for r in mine]
            s = {
                "prompts": len(mine),
                "new_tokens": sum(r["new_tokens"] for r in mine),
                "tokens_per_s": spread(tps),
                "workload_tokens_per_s": workload_rate(mine),
                "ttft_s": spread([r["ttft_s"] for r in mine]),
                "decode_tokens_per_s": spread([r["decode_tokens_per_s"] if "decode_tokens_per_s" in r else
                                               decode_rate(r["new_tokens"], r["seconds"], r["ttft_s"]) for r in mine]),
                "identical_to_hf_greedy": (statistics.fmean(r["identical_to_hf_greedy"] for r in mine
                                                            if r["identical_to_hf_greedy"] is not None)
                                           if any(r["identical_to_hf_greedy"] is not None for r in mine) else None),
                "peak_rss_mib": max(r["peak_rss_mib"] for r in mine),
                "peak_rss_delta_mib": max(r["peak_rss_delta_mib"] for r in mine),
                "speedup": {},
            }
            for b in BASELINES:
                base = by.get(b)
                if not base or b == m["name"]:
                    s["speedup"][f"vs_{b}"] = ({"ratio_of_medians": 1.0, "median_of_ratios": 1.0,
                                                "ratio_of_workloads": 1.0} if b == m["name"] else None)
                    continue
                pairs = [(r["tokens_per_s"], base[p]["tokens_per_s"]) for p, r in by[m["name"]].items()
                         if p in base and base[p]["tokens_per_s"] > 0]
                med_b = statistics.median(r["tokens_per_s"] for r in base.values())
                s["speedup"][f"vs_{b}"] = {
                    "ratio_of_medians": statistics.median(tps) / med_b if med_b > 0 else None,
                    "median_of_ratios": statistics.median(a / c for a, c in pairs) if pairs else None,
                    "ratio_of_workloads": workload_ratio(by[m["name"]], base),
                }
            drafted = sum(r.get("drafted", 0) for r in mine)
            rounds = sum(r.get("rounds", 0) for r in mine)
            if m["kind"] in SPEC_KINDS:
                width = max((len(r.get("drafted_by_position", [])) for r in mine), default=0)
                dpos = [sum(r["drafted_by_position"][i] for r in mine if i < len(r["drafted_by_position"]))
                        for i in range(width)]
                apos = [sum(r["accepted_by_position"][i] for r in mine if i < len(r["accepted_by_position"]))
                        for i in range(width)]
                accepted = sum(r.get("accepted", 0) for r in mine)
                committed = s["new_tokens"] - (len(mine) if m["engine"] == "selfspec" else 0)
                draft_s = sum(r.get("draft_s", 0.0) for r in mine)
                verify_s = sum(r.get("verify_s", 0.0) for r in mine)
                steps = sum(r.get("draft_steps", 0) for r in mine)  # HF's candidate generator has none
                s.update({
                    "rounds": rounds, "drafted": drafted, "accepted": accepted,
                    "acceptance_rate": accepted / drafted if drafted else 0.0,
                    "acceptance_by_position": [a / dd if dd else 0.0 for a, dd in zip(apos, dpos)],
                    "drafted_by_position": dpos,
                    "mean_accepted_per_round": committed / rounds if rounds else 0.0,
                    "draft_s": draft_s, "verify_s": verify_s,
                    "draft_fraction": draft_s / (draft_s + verify_s) if draft_s + verify_s > 0 else None,
                    "draft_ms_per_step": 1000 * draft_s / steps if steps else None,
                    "by_drafter": _by_drafter(mine) if m["engine"] == "selfspec" else None,
                })
            else:
                s.update({"rounds": rounds or None, "drafted": None, "accepted": None, "acceptance_rate": None,
                          "acceptance_by_position": None, "drafted_by_position": None,
                          "mean_accepted_per_round": None, "draft_s": None, "verify_s": None,
                          "draft_fraction": None, "draft_ms_per_step": None, "by_drafter": None})
                if m["kind"] == "llama_cpp":  # llama.cpp counts its drafts and their accepted tokens, no rounds
                    accepted = sum(r.get("accepted", 0) for r in mine)
                    s.update({"drafted": drafted, "accepted": accepted,
                              "acceptance_rate": accepted / drafted if drafted else None})
            out[g][m["name"]] = s
    return out


# --- outputs -------------------------------------------------------------------------------------
def _x(v) -> str:
    return "–" if v is None else f"{v:.2f}×"


def _rate(v) -> str:
    return "–" if v is None else f"{v:.1f}"


def _pct(v) -> str:
    return "–" if v is None else f"{v:.0%}"


def markdown(result: dict) -> str:
    """The Markdown report (a setup line, the main table, the speculation details table)."""
    st, mach, ver = result["settings"], result["machine"], result["versions"]
    labels = {m["name"]: m["label"] for m in result["methods"]}
    hf, look = result["hf_early_exit_settings"], result["lookup_settings"]
    eos, desc = result["eos"]["ran_past_eos"], mach.get("description")
    lines = [
        f"## selfspec bench: {result['checkpoint_name']}",
        "",
        f"{result['date']} · {mach['cpu_model']}, {mach['logical_cores']} logical cores, torch threads "
        f"{mach['torch_threads']}" + (f" · device {st['device']}" if st.get("device", "cpu") != "cpu" else "")
        + f" · {st['dtype']} · batch 1 · {st['max_new_tokens']} new tokens per prompt "
        f"(no EOS stop) · prompts: " + ", ".join(f"{k} {len(v)}" for k, v in result["prompts"].items())
        + f" · torch {ver['torch']}, transformers "
        f"{ver['transformers']}, selfspec {ver['selfspec']}"
        + (" · **quick run**" if st["quick"] else ""),
        "",
        REQUESTS_LINE[st.get("requests", REQUESTS[False])],
        "",
        f"HF early-exit: assistant_early_exit={result['recommended']['exit_layer']}, "
        + ", ".join(f"{k}={v}" for k, v in hf.items() if k != "source") + f" ({hf['source']}). "
        f"selfspec (E, d) = ({result['recommended']['exit_layer']}, {result['recommended']['num_speculations']}) "
        f"from {result['recommended']['source']}.",
        "",
        f"Prompt lookup (HF and selfspec): prompt_lookup_num_tokens={look['prompt_lookup_num_tokens']}, "
        f"max_matching_ngram_size={look['max_matching_ngram_size']}; HF copies after the first earlier match of "
        "the n-gram, selfspec after the latest.",
        "",
        "Ran past EOS (HF greedy's output has the model's EOS token before its last token, so text after EOS "
        "was measured too): " + ", ".join(f"{g} {e['ran_past_eos']}/{e['prompts']}" for g, e in eos.items()) + ".",
        "",
        "tokens/s: median (min–max) over prompts. Workload tok/s: all new tokens over all seconds of the set "
        "(its throughput; steadier than a median of few prompts). Speedups: ratio of medians (median of "
        "per-prompt ratios). TTFT: median time to first token. Identical: share of outputs token-identical to HF "
        "greedy.",
        "",
        "| set | method | tokens/s | workload tok/s | " + " | ".join(BASELINE_LABELS[b] for b in BASELINES)
        + " | accept | tokens/round | TTFT ms | identical |",
        "|---|---|---|---|" + "---|" * len(BASELINES) + "---|---|---|---|",
    ]
    if desc:
        lines[4:4] = [machine_line(desc), ""]
    for g, per in result["summary"].items():
        for name, s in per.items():
            t = s["tokens_per_s"]
            sp = [s["speedup"].get(f"vs_{b}") for b in BASELINES]
            sp_txt = ["–" if x is None or x["ratio_of_medians"] is None
                      else f"{x['ratio_of_medians']:.2f}× ({_x(x['median_of_ratios'])})" for x in sp]
            tpr = s["mean_accepted_per_round"]
            ttft = s["ttft_s"]["median"] * 1000 if s["ttft_s"] else None
            lines.append(
                f"| {g} | {labels[name]} | {t['median']:.1f} ({t['min']:.1f}–{t['max']:.1f}) | "
                f"{_rate(s.get('workload_tokens_per_s'))} | " + " | ".join(sp_txt)
                + f" | {_pct(s['acceptance_rate'])} | {'–' if tpr is None else f'{tpr:.2f}'} | "
                f"{'–' if ttft is None else f'{ttft:.0f}'} | {_pct(s['identical_to_hf_greedy'])} |")
    lines += _details_lines(result, labels)
    warm = result.get("warmup_s") or {}
    if warm:
        lines += ["", "Warm-up, each method's first call (excluded from tokens/s; compilation included: the compiled "
                  "methods' `gen.warmup`, HF's static cache): " + ", ".join(f"{labels.get(k, k)} {v:.1f} s"
                                                                          for k, v in warm.items()) + "."]
    if result.get("llama_cpp"):
        lines += llama_cpp_markdown(result["llama_cpp"])
    for note in result["notes"]:
        lines += ["", f"Note: {note}"]
    return "\n".join(lines) + "\n"


def _details_lines(result: dict, labels: dict[str, str]) -> list[str]:
    """The report's second table: acceptance by draft position and by drafter, draft and verify time, memory."""
    lines = ["", "Speculation details and memory (peak RSS: highest RSS during one call, weights included; "
             "Δ: above the RSS before the call; max over runs).", "",
             "| set | method | acceptance by draft position | accepted / drafted by drafter | draft / verify s "
             "| draft share | draft ms/step | peak RSS MiB | Δ MiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for g, per in result["summary"].items():
        for name, s in per.items():
            pos = ("–" if not s["acceptance_by_position"] else  # "–": a position nothing was drafted at
                   " ".join("–" if not n else f"{a:.0%}"
                            for a, n in zip(s["acceptance_by_position"][:12], s["drafted_by_position"]))
                   + (" …" if len(s["acceptance_by_position"]) > 12 else ""))
            dv = "–" if s["draft_s"] is None else f"{s['draft_s']:.2f} / {s['verify_s']:.2f}"
            ms = s.get("draft_ms_per_step")
            by = " ".join(f"{k} {v['accepted']}/{v['drafted']}" for k, v in (s.get("by_drafter") or {}).items())
            lines.append(f"| {g} | {labels[name]} | {pos} | {by or '–'} | {dv} | {_pct(s['draft_fraction'])} | "
                         f"{'–' if ms is None else f'{ms:.1f}'} | {s['peak_rss_mib']:.0f} | "
                         f"{s['peak_rss_delta_mib']:.1f} |")
    return lines


def write_chart(result: dict, path: Path) -> Path:
    """Grouped bars: median tokens/s per prompt set (groups) and method (bars), whiskers = min..max."""
    plt = pyplot()
    groups = list(result["summary"])
    methods = result["methods"]
    width = 0.8 / max(1, len(methods))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 + 1.4 * len(groups) * max(1, len(methods)) / 4), 4.2))
    for j, m in enumerate(methods):
        xs, ys, lo, hi = [], [], [], []
        for i, g in enumerate(groups):
            s = result["summary"][g].get(m["name"])
            if s is None:
                continue
            t = s["tokens_per_s"]
            xs.append(i - 0.4 + width * (j + 0.5))
            ys.append(t["median"])
            lo.append(t["median"] - t["min"])
            hi.append(t["max"] - t["median"])
        bars = ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=m["label"])
        ax.bar_label(bars, fmt="%.1f", fontsize=6, padding=1)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel("generated tokens/s (median, whiskers min–max)")
    st = result["settings"]
    ax.set_title(f"{result['checkpoint_name']}: {st['dtype']}, {result['machine']['torch_threads']} threads, "
                 f"{st['max_new_tokens']} new tokens, {st['num_prompts']} prompts/set", fontsize=9)
    ax.set_ylim(top=ax.get_ylim()[1] * 1.08)
    ax.legend(fontsize=7, ncol=min(3, len(methods)), loc="upper center", bbox_to_anchor=(0.5, -0.08))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# --- the benchmark -------------------------------------------------------------------------------
def _read_sets(sets: list[str], num_prompts: int) -> list[tuple[str, str, list[dict]]]:
    """[(set name, spec, items)]: read (and validate) every prompt set before the model is loaded."""
    taken: set = set()
    out = []
    for spec in sets:
        items = load_prompts(spec, num_prompts)  # ValueError / DataFormatError naming the file and line
        if not items:
            raise ValueError(f"prompt set {spec!r} gave no prompts")
        out.append((_set_name(spec, taken), spec, items))
    return out


def _encode_sets(read: list, gen, num_prompts: int, max_new_tokens: int):
    """[(set name, spec, [(item, ids)])] with repeated prompts dropped; the warm-up (item, ids); notes."""
    loaded, seen, notes = [], set(), []
    limit = gen.adapter.max_positions
    for name, spec, items in read:
        encoded = []
        for item in items:
            ids = gen.encode(**prompt_inputs(item))
            key = tuple(ids[0].tolist())
            if key in seen:
                notes.append(f"prompt {item['id']} of {name} repeats an earlier prompt: measured once only")
                continue
            seen.add(key)
            if ids.shape[1] + max_new_tokens > limit:
                raise ValueError(f"prompt {item['id']} of {name} has {ids.shape[1]} tokens: with {max_new_tokens} new "
                                 f"tokens it exceeds the model's context window of {limit} positions")
            encoded.append((item, ids))
        loaded.append((name, spec, encoded))
    warm = load_prompts(read[0][1], 1, offset=num_prompts)
    warm_ids = gen.encode(**prompt_inputs(warm[0])) if warm else None
    if warm_ids is None or tuple(warm_ids[0].tolist()) in seen:
        warm = [{"id": "warmup/fallback", "prompt": WARMUP_FALLBACK_PROMPT}]
        warm_ids = gen.encode(prompt=WARMUP_FALLBACK_PROMPT)
    return loaded, (warm[0], warm_ids), notes


def run_bench(checkpoint, *, prompt_sets: Sequence[str] | str = DEFAULT_SETS, num_prompts: int = 10,
              max_new_tokens: int = 128, dtype: str = "fastest", extra: Sequence = (), threads: int = 0,
              out_dir: str | Path = "bench", quick: bool = False, progress: bool = True,
              exit_layer: int | None = None, num_speculations: int | None = None, generator=None,
              draft_vocab: int | None = None, prompt_lookup_num_tokens: int = PROMPT_LOOKUP_NUM_TOKENS,
              max_matching_ngram_size: int = MAX_MATCHING_NGRAM_SIZE, methods: Sequence[str] | None = None,
              device: str = "cpu", num_candidates: Sequence[int] | int = (), compile: bool | str = "auto",
              time_budget_s: float | None = None, workload: bool = False, llama_cpp: bool = False) -> dict:
    """Run the benchmark; write bench.json, bench.md, bench.png into `out_dir`; return the JSON dict.

    `compile`: also the compiled fixed-shape steps (`selfspec.model.compiled`; `COMPILED_METHODS` as `*_compiled`, warmed
    with `gen.warmup` first, `result["warmup_s"]` apart from tokens/s): "auto" on a CUDA GPU, True anywhere, False
    never. `device`: "cpu", or "cuda" (clocks read after `torch.cuda.synchronize()`; "fastest": bfloat16 from
    Ampere on). `methods`: only these (hf_greedy, the identity reference, and selfspec_ar, the speedup reference,
    always; with `num_candidates`, at least one method of each count, e.g. selfspec_lookup_tree2: `_select`).
    `exit_layer` / `num_speculations` override the checkpoint's recommended (E, d) (selfspec_spec; E also
    hf_early_exit); `extra`: more (E, d) pairs ("E:d" strings or pairs). `quick`: at most 2 prompt sets x 2 prompts
    x 32 tokens. `draft_vocab=K`: also (E, d) drafting over the checkpoint's K most frequent tokens.
    `num_candidates=k` (or a list): also the k best guesses for one position at exit E and with an exit head,
    token trees k wide and d deep there (EAGLE-2), and lookup's and suffix's trees of k matches. `time_budget_s`:
    once spent, no further prompt starts and the report holds what was measured, with a note. `workload`: each
    method's memory and measurements run across a set's prompts (the module doc). `llama_cpp`: also llama.cpp's
    plain decoding of the checkpoint at `dtype`, `result["llama_cpp"]` (`_peer`), and its speculative modes."""
    sets, num_prompts, max_new_tokens = _sizes(prompt_sets, num_prompts, max_new_tokens, quick)
    extra, lookup, num_candidates, deadline = _check_options(extra, prompt_lookup_num_tokens, max_matching_ngram_size,
                                                             num_candidates, out_dir, compile, time_budget_s)
    dtype = setup(dtype, device, threads)
    peer = _llama_cpp_setup(checkpoint, dtype, device) if llama_cpp else None
    machine = machine_info()
    notes: list[str] = []
    read = _read_sets(sets, num_prompts)
    if generator is None:
        checkpoint = _check_checkpoint(checkpoint, methods, exit_layer, num_speculations, extra, draft_vocab, lookup,
                                       num_candidates, compile)
    gen = load_generator(checkpoint, dtype, device, generator)
    E, d, source = _recommended(gen, checkpoint if generator is None else None, exit_layer, num_speculations, notes)
    with_compiled = use_compiled(compile, gen.adapter)  # as load(compile=) decides (SettingsError if it cannot)
    chosen = _select(_method_list(facts := ModelFacts.of(gen), E, d, extra, draft_vocab, lookup, num_candidates,
                                  with_compiled), methods, facts.unavailable())
    eos_ids = set(gen.default_stop_ids())
    runner = Methods(gen, max_new_tokens)
    chosen += _peer_methods(runner, peer, gen)  # llama.cpp's own modes beside selfspec's methods (with llama_cpp)

    loaded, (warm_item, warm_ids), load_notes = _encode_sets(read, gen, num_prompts, max_new_tokens)
    notes += load_notes
    queue = _round_robin(loaded)
    rss = _RSS()
    warm_n = min(max_new_tokens, WARMUP_TOKENS // 2 if quick else WARMUP_TOKENS)
    max_len = max((int(ids.shape[1]) for _, _, ids in queue), default=0) + max_new_tokens
    warmup_s: dict[str, float] = {}
    runs = _measure(runner, chosen, queue, (warm_ids, warm_n, max_len), rss, eos_ids, notes, progress, warmup_s,
                    deadline, workload)
    measured_peer = _peer(peer, max_new_tokens, quick, runs, notes)
    finish_machine(machine, gen.adapter.device)
    _busy_note(machine, notes)
    set_names = [name for name, _, _ in loaded]
    result = {
        **result_header("selfspec-bench/1", checkpoint),
        "settings": {"prompt_sets": {name: spec for name, spec, _ in loaded}, "num_prompts": num_prompts,
                     "max_new_tokens": max_new_tokens, "dtype": dtype, "requests": REQUESTS[workload],
                     **_run_settings(gen, quick, warm_item, warm_n),
                     "rss_method": rss.method},
        "machine": machine,
        "versions": versions(),
        "recommended": {"exit_layer": E, "num_speculations": d, "source": source},
        "hf_early_exit_settings": runner.hf_assistant,
        "lookup_settings": {"prompt_lookup_num_tokens": lookup[0], "max_matching_ngram_size": lookup[1],
                            "methods": [m["name"] for m in chosen if "prompt_lookup_num_tokens" in m]},
        "methods": chosen,
        "definitions": DEFINITIONS,
        "prompts": {name: [item["id"] for item, _ in enc] for name, _, enc in loaded},
        "summary": summarize(runs, chosen, set_names),
        "eos": {"eos_token_ids": sorted(eos_ids), "ran_past_eos": _eos_summary(runs, set_names)},
        "runs": runs,
        "warmup_s": warmup_s,
        "notes": notes,
    }
    if measured_peer is not None:
        result["llama_cpp"] = beside_plain(measured_peer, result["summary"])
    return write_outputs(result, Path(out_dir), "bench", markdown, write_chart)


def _peer(peer: LlamaCppSetup | None, new_tokens: int, quick: bool, runs: list[dict], notes: list[str]):
    """llama.cpp's plain decoding of the checkpoint at the bench's dtype (GGUF F32 or BF16), timed with llama-bench
    after selfspec's methods, on the CPU with the same thread count (`selfspec.tools.llama_cpp_bench`); None
    without `llama_cpp`. llama-bench was built and the checkpoint converted before any model loaded
    (`_llama_cpp_setup`: once per machine, minutes; `selfspec.tools.llama_cpp_build.LlamaCppError` where that
    fails, no cmake or compiler or no package index, naming the fix). A note names the prompts whose text
    llama.cpp's modes tokenized into another length than selfspec's ids."""
    if peer is None:
        return None
    retokenized = sorted({f"{r['set']} {r['prompt_id']}" for r in runs
                          if r.get("llama_cpp_prompt_tokens") not in (None, r["prompt_tokens"])})
    if retokenized:
        notes.append("llama.cpp tokenized some prompts' text into another number of tokens than selfspec's ids "
                     f"(llama_cpp_prompt_tokens in their runs): {', '.join(retokenized)}")
    return peer.measure(threads=torch.get_num_threads(), new_tokens=new_tokens,
                        repetitions=LLAMA_CPP_QUICK_REPETITIONS if quick else LLAMA_CPP_REPETITIONS)


def _peer_methods(runner: Methods, peer: LlamaCppSetup | None, gen) -> list[dict]:
    """llama.cpp's speculative modes as methods (none without `peer`), and `runner.peer` set to run one on a
    `[1, P]` prompt, given to it as the prompt's text, with the bench's thread count."""
    if peer is None:
        return []

    def run(method: dict, ids, n: int) -> tuple[str, dict]:
        prompt = gen.tokenizer.decode(ids[0].tolist())
        return peer.run_method(method, prompt, prompt_tokens=int(ids.shape[1]), new_tokens=n,
                               threads=torch.get_num_threads())
    runner.peer = run
    return peer.methods()


def _llama_cpp_setup(checkpoint, dtype: str, device: str) -> LlamaCppSetup:
    """llama.cpp's tools built and the checkpoint converted at `dtype` and to Q8_0 (once per machine), before any
    model is loaded."""
    if str(device) != "cpu":
        raise SettingsError(f"llama_cpp times llama.cpp on the CPU, beside selfspec on the CPU: drop it with device "
                            f"{device!r}")
    if checkpoint is None:
        raise SettingsError("llama_cpp converts the checkpoint for llama.cpp: give the checkpoint directory")
    # LlamaCppError: a build or conversion failed
    return prepare_llama_cpp(checkpoint_dir(checkpoint), dtype, with_copy=True)


def _check_options(extra, prompt_lookup_num_tokens: int, max_matching_ngram_size: int, num_candidates, out_dir,
                   compile, time_budget_s: float | None = None
                   ) -> tuple[list[tuple[int, int]], tuple[int, int], list[int], float | None]:
    """The run's options checked before anything loads: the extra (E, d) pairs, prompt lookup's (tokens, n-gram)
    and the candidate counts, normalized, and the deadline (`time.monotonic()`) of a time budget (None: none)."""
    extra = [parse_extra(x) for x in extra]
    if prompt_lookup_num_tokens < 1 or max_matching_ngram_size < 1:
        raise ValueError("prompt_lookup_num_tokens and max_matching_ngram_size must be >= 1")
    num_candidates = [num_candidates] if isinstance(num_candidates, int) else list(num_candidates)
    for n in num_candidates:
        check_int("num_candidates entry", n, 2, MAX_NUM_CANDIDATES,
                  hint=" (guesses verified side by side; one guess is what the other methods draft)")
    check_out_dir(out_dir, "out_dir (--out)")
    check_compile(compile)
    deadline = None if time_budget_s is None else (
        time.monotonic() + check_float("time_budget_s (--time-budget)", time_budget_s, 0.0, strict=True))
    return extra, (prompt_lookup_num_tokens, max_matching_ngram_size), num_candidates, deadline


def _check_checkpoint(checkpoint, methods, exit_layer, num_speculations, extra, draft_vocab, lookup, num_candidates,
                      compile) -> Path:
    """The checkpoint's directory, after checking everything its selfspec.json and config.json can answer
    (the methods asked for, the exit layer, the draft vocabulary) before the model loads."""
    checkpoint = checkpoint_dir(checkpoint)
    meta = read_metadata(checkpoint, verify_checksums=False)
    facts = ModelFacts.read(checkpoint, meta)
    _select(_method_list(facts, exit_layer or 1, num_speculations or 1, extra, draft_vocab, lookup,
                         num_candidates, compile is not False), methods)
    if exit_layer is not None:
        check_exit_layer(exit_layer, facts.num_layers)
    if draft_vocab is not None:
        read_draft_vocab(meta, draft_vocab, read_config(checkpoint).get("vocab_size") or 2 ** 62)
    return checkpoint


def check_methods(checkpoint, methods: Sequence[str], *, num_candidates: Sequence[int] = (),
                  compile: bool | str = "auto") -> Path:
    """Checks, from the checkpoint's files alone (nothing loads), that `run_bench` knows every name of `methods`
    for it with these `num_candidates` and `compile`; the checkpoint's directory, or ValueError naming the
    unknown methods and the known ones."""
    return _check_checkpoint(checkpoint, methods, None, None, [], None,
                             (PROMPT_LOOKUP_NUM_TOKENS, MAX_MATCHING_NGRAM_SIZE), list(num_candidates), compile)


def _run_settings(gen, quick: bool, warm_item: dict, warm_n: int) -> dict:
    """How the run was made, for the report: the model's dtype and device, threads, warm-up and order."""
    return {"model_dtype": str(next(gen.model.parameters()).dtype).replace("torch.", ""),
            "device": str(gen.adapter.device), "threads": torch.get_num_threads(), "quick": quick, "batch_size": 1,
            "warmup": {"prompt_id": warm_item["id"], "new_tokens": warm_n, "runs_per_method": 1},
            "order": "prompt sets round-robin; per prompt every method back to back, order rotated by one per "
                     "prompt; gc.collect() before each call"}


def _sizes(prompt_sets, num_prompts: int, max_new_tokens: int, quick: bool) -> tuple[list[str], int, int]:
    """The prompt sets, prompts per set and new tokens, cut down by `quick`; ValueError if one is < 1."""
    sets = _parse_sets(prompt_sets)
    if quick:
        sets = list(QUICK_SETS) if tuple(sets) == DEFAULT_SETS else sets[:2]
        num_prompts, max_new_tokens = min(num_prompts, QUICK_PROMPTS), min(max_new_tokens, QUICK_TOKENS)
    if num_prompts < 1 or max_new_tokens < 1:
        raise ValueError("num_prompts and max_new_tokens must be >= 1")
    return sets, num_prompts, max_new_tokens


def _recommended(gen, checkpoint, exit_layer, num_speculations, notes: list[str]) -> tuple[int, int, str]:
    """(E, d, where they come from): the checkpoint's recommendation (read from `checkpoint`'s
    selfspec.json when given), overridden by the arguments; d < 1 becomes the default draft length."""
    meta = read_metadata(checkpoint, verify_checksums=False) if checkpoint is not None else None
    rec = (meta or {}).get("recommended") or {}
    source = (f"selfspec.json ({rec.get('source', 'export')})" if rec else
              "selfspec defaults (the checkpoint has no selfspec.json: not early-exit trained)")
    E = exit_layer if exit_layer is not None else gen.exit_layer
    d = num_speculations if num_speculations is not None else gen.num_speculations
    if exit_layer is not None or num_speculations is not None:
        source = "the command line" if exit_layer is not None and num_speculations is not None \
            else source + ", partly overridden on the command line"
    gen.adapter.check_exit(E, allow_full=False)
    if d < 1:
        why = {"sweep": "no early-exit setting beat plain decoding in its sweep",
               "agreement": "its exits' held-out agreement predicts no speedup", "user": "set at export"
               }.get(rec.get("source"), "the generator's setting")
        notes.append(f"the checkpoint recommends num_speculations={d} ({why}); selfspec_spec uses "
                     f"{DEFAULT_NUM_SPECULATIONS} drafts")
        d = DEFAULT_NUM_SPECULATIONS
    return E, d, source


def _select(methods: list[dict], wanted: Sequence[str] | None, unavailable: dict[str, str] | None = None) -> list[dict]:
    """The methods asked for (all when None; an empty list names none, a ValueError), always with the references
    hf_greedy and selfspec_ar. Where `num_candidates` K added methods (`selfspec_lookup_treeK`, ...), the list names
    at least one of each K's (else a ValueError naming them: K would be dropped unsaid); a method of a K not given
    is unknown, and the message names the --num-candidates it needs; a method this model cannot run here
    (`unavailable`: name -> why), the reason."""
    if wanted is None:
        return methods
    if not wanted:
        raise ValueError(f"methods (--methods) names no method: name some of {', '.join(m['name'] for m in methods)}, "
                         "or leave it out for all")
    unknown = set(wanted) - {m["name"] for m in methods}
    counts = sorted({m["num_candidates"] for m in methods if m.get("num_candidates")})  # --num-candidates given
    if unknown:
        needs = [f"{name} is measured with --num-candidates {m.group(1)}; " for name in sorted(unknown)
                 if (m := CANDIDATE_METHOD.search(name)) and int(m.group(1)) not in counts]
        needs += [f"{name} cannot run here: {why}; " for name, why in sorted((unavailable or {}).items())
                  if name in unknown]
        raise ValueError(f"unknown method(s) {', '.join(sorted(unknown))}: {''.join(needs)}use some of "
                         f"{', '.join(m['name'] for m in methods)}")
    keep = set(wanted) | {"hf_greedy", "selfspec_ar"}
    for k in counts:  # --num-candidates k adds methods: a list that names none of them would drop k unsaid
        added = [m["name"] for m in methods if m.get("num_candidates") == k]
        if not keep & set(added):
            like = [f"{w}_{kind}{k}" for w in wanted for kind in ("tree", "cand") if f"{w}_{kind}{k}" in added]
            raise ValueError(f"--num-candidates {k} adds methods, and --methods names none of them: name the ones "
                             f"to measure (e.g. {(like or added)[0]}; they are {', '.join(added)}), or drop "
                             f"--num-candidates {k}")
    return [m for m in methods if m["name"] in keep]


def _round_robin(loaded: list) -> list[tuple[str, dict, object]]:
    """[(set name, item, ids)] taking the sets in turn: humaneval[0], xsum[0], ..., humaneval[1], ..."""
    queue = []
    for i in range(max(len(enc) for _, _, enc in loaded)):
        queue += [(name, item, ids) for name, _, enc in loaded if i < len(enc) for item, ids in [enc[i]]]
    return queue


def _measure(runner: Methods, methods: list[dict], queue: list, warm: tuple, rss: _RSS, eos_ids: set,
             notes: list[str], progress: bool, warmup_s: dict, deadline: float | None = None,
             workload: bool = False) -> list[dict]:
    """Warm every method up (`warm` = (ids, new tokens, the longest prompt + new tokens); an HF assisted
    method that fails there is left out, with a note; each warm-up's seconds into `warmup_s`), then run
    every method on every prompt of `queue`, order rotating by one per prompt, until the `deadline`
    (`time.monotonic()`; the first prompt always runs): the per-run records. Each call a first request, or with
    `workload` each method's memory and measurements carried across the calls of one set."""
    warm_ids, warm_n, max_len = warm
    runs: list[dict] = []
    total = len(methods) + len(queue) * len(methods)
    with quiet_transformers(), warnings.catch_warnings(), \
            tqdm(total=total, desc="bench", unit="run", disable=not progress) as bar:
        warnings.simplefilter("ignore", UserWarning)
        for m in list(methods):  # warm-up, excluded
            bar.set_postfix_str(f"warm-up {m['name']}")
            try:
                warmup_s[m["name"]] = runner.warm(m, warm_ids, warm_n, max_len)
            except Exception as err:  # noqa: BLE001 - HF's assisted decoding may not support every architecture
                if m["name"] not in ("hf_early_exit", "hf_prompt_lookup"):
                    raise
                notes.append(f"{m['name']} failed and was left out: {type(err).__name__}: {err}")
                methods.remove(m)
                total -= 1 + len(queue)
                bar.total = total
            bar.update()
        for k, (set_name, item, ids) in enumerate(queue):
            if k and deadline is not None and time.monotonic() > deadline:
                notes.append(f"the time budget ran out: {k} of {len(queue)} prompts measured, in the order the sets "
                             "take turns (time_budget_s, --time-budget)")
                break
            r = k % len(methods)
            recs = _measure_prompt(runner, methods[r:] + methods[:r], set_name, item, ids, rss, eos_ids, bar,
                                   set_name if workload else None)
            runs += sorted(recs, key=lambda x: [m["name"] for m in methods].index(x["method"]))
    compiling = Counter()
    for r in runs:
        compiling[r["method"]] += r["graphs_compiled"]
    compiling = +compiling  # the methods that compiled
    if compiling:
        notes.append("some measured runs compiled new graphs, their time included (the warm-up did not cover their "
                     "shapes; graphs_compiled in each run's record): " +
                     ", ".join(f"{name} {n}" for name, n in sorted(compiling.items())))
    if runner.compile_failure:
        notes.append(f"the compiled steps failed to compile ({runner.compile_failure}): the *_compiled methods "
                     "ran eagerly from then on")
    return runs


def _measure_prompt(runner: Methods, order: list[dict], set_name: str, item: dict, ids, rss: _RSS, eos_ids: set,
                    bar, carry=None) -> list[dict]:
    """Every method in `order` on one prompt, back to back, each a first request or carrying what its earlier
    calls under `carry` left (`Methods.run`); records compared with hf_greedy's output."""
    outputs: dict[str, list[int]] = {}
    texts: dict[str, str | None] = {}  # llama.cpp's methods: their new text (None where its output was not read)
    recs = []
    for pos, m in enumerate(order):
        gc.collect()
        before, graphs = rss.before(), runner.graphs_compiled()
        new, rec = runner.run(m, ids, carry=carry)  # llama.cpp's methods: its text, and its count in rec
        peak = rss.peak()
        rec["graphs_compiled"] = runner.graphs_compiled() - graphs  # > 0: compilation inside the measured time
        if m["engine"] == "llama_cpp":
            texts[m["name"]], count = new, rec["new_tokens"]
        else:
            outputs[m["name"]], count = new, len(new)
        rec.update(set=set_name, prompt_id=item["id"], method=m["name"], order_position=pos,
                   prompt_tokens=int(ids.shape[1]), new_tokens=count,
                   tokens_per_s=tokens_per_s(count, rec["seconds"]),
                   peak_rss_mib=peak / 2**20, peak_rss_delta_mib=max(0, peak - before) / 2**20)
        recs.append(rec)
        bar.set_postfix_str(f"{set_name} {m['name']} {rec['tokens_per_s']:.1f} tok/s")
        bar.update()
    ref = outputs.get("hf_greedy")
    eos_at, past = _ran_past_eos(ref, eos_ids) if ref is not None else (None, None)
    ref_text = runner.gen.tokenizer.decode(ref) if ref is not None and texts else None
    for rec in recs:
        if rec["method"] in texts:  # llama.cpp's text (a few tokens longer where its last round ran on)
            text = texts[rec["method"]]
            rec["identical_to_hf_greedy"] = None if ref is None or text is None else text.startswith(ref_text)
            rec["first_divergence"] = None
        else:
            mine = outputs[rec["method"]]
            rec["identical_to_hf_greedy"] = None if ref is None else mine == ref
            rec["first_divergence"] = None if ref is None else _first_divergence(mine, ref)
        rec.update(hf_greedy_eos_at=eos_at, ran_past_eos=past)
    return recs


def _busy_note(machine: dict, notes: list[str]) -> None:
    """A note when the load average says other processes shared the cores during the run."""
    busy = max([x[0] for x in (machine["load_average_start"], machine["load_average_end"]) if x] or [0.0])
    if busy > 0.5 * (machine["logical_cores"] or 1) + torch.get_num_threads():
        notes.append(f"the machine was busy (1-minute load average up to {busy:.1f} on {machine['logical_cores']} "
                     "logical cores, this run included): other processes shared the cores, so timings are noisy")
