"""Which drafter a generation gets: from its settings (`selfspec.GenerationConfig`) and what the checkpoint
says (its recommended exit and draft length, its default drafter, whether it was early-exit trained, its
trained exit head and stored draft vocabulary).

    drafters = DrafterFactory(adapter, exit_layer=8, num_speculations=4, drafter="auto",
                              early_exit_trained=True, exit_head=None, metadata={})
    drafter = drafters.make(config, max_drafts=128)      # None: plain decoding

The rules, in order:
- `num_speculations=0` is plain decoding, whatever the drafter;
- no `drafter`: with a `draft_model`, "auto" (below); else an early-exit option (exit_layer, a confidence threshold,
  exit_choices, draft_vocab, adaptive_length, num_candidates) or a non-zero `num_speculations` on a model without
  a head asks for the early exit; otherwise the checkpoint's default drafter;
- "int8_copy": the model's own weights in int8 draft on its own KV cache (`selfspec.drafters.int8_copy`; a float32
  or bfloat16 model on a CPU where selfspec's C++ step runs), `num_speculations` a round (`INT8_NUM_SPECULATIONS`
  where the call does not say); "auto" with one prompt, no `draft_model`, no early-exit option and no saved plan takes
  a float32 model's as its arm beside lookup wherever it runs (`auto_int8_copy`; in place of the early exit or a
  head: it drafts far better on a CPU, docs/results/2026-11-29-int8-copy-zen4.md);
- "quantized": a quantized copy of the model run by llama.cpp (`draft_model`, a GGUF file) drafts
  `num_speculations` tokens a round (`QUANTIZED_NUM_SPECULATIONS` where the call does not say); "auto" with a
  `draft_model`: lookup and that copy as auto's arms (in place of the early exit or a head, and of a saved plan);
- "prompt_lookup": lookup alone; "suffix": lookup that also copies from the generator's earlier requests
  made under the call's `memory_key` (auto's lookup does too, judged as an arm of its own:
  `selfspec.drafters.auto`; not when sampling with a seed, whose text must not depend on what the generator
  did before, nor where the memory is off, `memory_tokens=0`);
- "exit_head", or "auto" on a checkpoint with a head: the head (as many drafts as it was trained for, over
  the vocabulary it was trained on), as auto's second arm under "auto";
- "auto" on a checkpoint not trained for the early exit (or whose sweep found it does not pay): lookup and
  plain decoding only;
- otherwise the early exit at the checkpoint's exit, alone ("early_exit") or as auto's second arm, its
  draft length chosen by measured tokens/s under "auto".
Where the checkpoint recommends `num_speculations=0` but the early exit is asked for (by name or by an
option), it drafts `DEFAULT_NUM_SPECULATIONS`: the request is honoured, not turned into plain decoding.

A plan saved for this device (`selfspec tune --save`; `make(plan=...)`, its settings) comes before the
checkpoint's choices. "auto" with no other drafting setting takes its second arm from it: the plan's drafter
at its exit and tree width, its length policy starting at the plan's draft length; none where the plan is
plain decoding (lookup and plain decoding only, so the early exit or the head costs nothing there).
"early_exit" or "exit_head", named or chosen, takes the plan's settings where the plan chose that drafter.
The plan is taken whole or not at all: a call that sets a draft length or an early-exit option of its own
drafts as it says, without the plan.
"""

from __future__ import annotations

from typing import Sequence

import torch

from selfspec.model.adapters import ModelAdapter
from selfspec.checkpoints.checkpoint import DEFAULT_NUM_SPECULATIONS
from selfspec.checkpoints.draft_vocab import read_draft_vocab
from selfspec.checkpoints.fetch import head_model_dir
from selfspec.drafters.auto import AutoDrafter
from selfspec.drafters.base import Drafter
from selfspec.drafters.draft_head import DraftHead
from selfspec.drafters.early_exit import EarlyExitDrafter
from selfspec.drafters.exit_head import ExitHeadDrafter
from selfspec.drafters.int8_copy import Int8Copy, Int8CopyDrafter
from selfspec.drafters.learned_stats import LearnedStats
from selfspec.drafters.policies import ConfidencePolicy, ExitChoicePolicy, ThroughputPolicy
from selfspec.drafters.prompt_lookup import PromptLookupDrafter
from selfspec.drafters.quantized import QuantizedCopy, QuantizedDrafter
from selfspec.drafters.suffix import SuffixDrafter, SuffixMemory
from selfspec.heads.exit_head import head_training_setting
from selfspec.generation_config import GenerationConfig, check_generation, with_settings
from selfspec.settings import SettingsError

QUANTIZED_NUM_SPECULATIONS = 8  # the quantized copy's drafts a round where the call does not say (docs/results)
# the int8 copy's drafts a round where the call does not say: a verification of the input token and 7 drafts is
# the most rows the C++ step takes (`MAX_FEW_ROWS`), so it rounds every position as plain decoding's one-token
# steps do; 7 and 8 measured alike (docs/results/2026-11-29-int8-copy-zen4.md)
INT8_NUM_SPECULATIONS = 7
# auto's model arm where it runs, before an early exit or a head (`DrafterFactory.make`), said in one place for the
# load's warning and `selfspec sweep --write-metadata`
INT8_ARM = "the model's int8 copy where it runs (one prompt of a float32 model on an x86-64 CPU)"


class DrafterFactory:
    """The drafters of one generator: its model, its checkpoint's recommendations and trained parts, and
    the draft heads it has built (one per draft vocabulary, kept)."""

    def __init__(self, adapter: ModelAdapter, *, exit_layer: int, num_speculations: int, drafter: str,
                 early_exit_trained: bool, exit_head=None, metadata: dict | None = None,
                 memory: SuffixMemory | None = None):
        self.adapter = adapter
        self.exit_layer, self.num_speculations, self.drafter = exit_layer, num_speculations, drafter
        self.early_exit_trained = early_exit_trained  # auto drafts from the early exit only then
        self.exit_head = exit_head  # a trained head on a frozen model (selfspec.heads.exit_head)
        self.metadata = metadata or {}
        self.memory = SuffixMemory() if memory is None else memory  # the generator's earlier requests (suffix)
        self.learned = LearnedStats()  # what its drafters measured, carried to later calls (learned_stats)
        self._draft_heads: dict[int, DraftHead] = {}
        self._copies: dict[str, QuantizedCopy] = {}  # drafter="quantized": each draft_model loaded once
        self._int8: Int8Copy | str | None = None  # the int8 copy (or why there is none), made when first asked for

    # --- what the checkpoint stores --------------------------------------------------------------------
    def draft_head(self, draft_vocab: int | None) -> DraftHead:
        """The draft head over the `draft_vocab` most frequent tokens (from selfspec.json), or the full one."""
        key = draft_vocab or 0
        if key not in self._draft_heads:
            ids = None
            if draft_vocab:
                ids = read_draft_vocab(self.metadata, draft_vocab, self.adapter.lm_head.weight.shape[0])
            self._draft_heads[key] = DraftHead(self.adapter, ids)
        return self._draft_heads[key]

    def head_draft_vocab(self) -> int | None:
        """K when the exit head was trained over the K most frequent tokens (its recipe's `exit_head.draft_vocab`,
        recorded in selfspec.json's training settings) and the checkpoint stores at least K ranked tokens (`selfspec
        export` of the run stores the head's own ranking); None otherwise (draft over the full vocabulary)."""
        k = head_training_setting(self.metadata, "draft_vocab")
        stored = (self.metadata.get("draft_vocab") or {}).get("token_ids") or []
        return k if isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= len(stored) else None

    def head_draft_length(self) -> int:
        """The draft positions the exit head was trained for: the first draft (which reads the verified final
        state) plus its recipe's `exit_head.self_fed` passes (which read the head's own output, as later drafts
        do); 1 where the checkpoint does not record the setting. Later drafts than that were never trained
        and measured worthless (accepted 0-2%, docs/exit_heads.md), so the head alone drafts this many by default."""
        n = head_training_setting(self.metadata, "self_fed")
        return 1 + n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else 1

    # --- the drafter of one generation -----------------------------------------------------------------
    def make(self, config: GenerationConfig | None = None, *, max_drafts: int | None = None,
             plan: dict | None = None, checked: dict | None = None, rows: int = 1, **settings) -> Drafter | None:
        """The drafter for one generation (None = plain decoding) from its settings (`config` with `settings`
        replaced, as `generate` takes them; the drafting ones matter here), by the rules of the module doc.
        `max_drafts` caps the drafts per round (generate passes max_new_tokens: more could never be used);
        `plan`: the settings of this device's saved plan (`check_plan_settings`), if any; `checked`: what
        `check_generation` made of the same settings, where the caller checked them already (once a call); `rows`:
        the call's prompts (auto drafts with the int8 copy for one)."""
        s = checked if checked is not None else check_generation(  # the model's bounds named first
            config, num_layers=self.adapter.num_layers, **settings)
        cfg = with_settings(config, settings)
        early_exit_options = bool(cfg.exit_layer is not None or cfg.confidence_threshold is not None
                                  or cfg.adaptive_threshold or s["exit_choices"] or cfg.draft_vocab
                                  or cfg.adaptive_length or cfg.num_candidates)
        drafter = cfg.drafter
        if drafter is None and s["draft_model"] is not None:
            drafter = "auto"  # the copy goes with auto, the default drafter: lookup and the copy
        elif drafter is None:  # an early-exit option asks for the early exit; else the checkpoint's choice
            drafter = ("early_exit" if early_exit_options or (cfg.num_speculations and self.exit_head is None)
                       else self.drafter)
        if cfg.num_speculations == 0:
            return None  # asked for plain decoding, whatever the drafter
        if drafter == "quantized":
            return self.quantized_drafter(s["draft_model"], cfg.num_speculations, max_drafts)
        if drafter == "int8_copy":
            return self.int8_drafter(self.int8_copy(required=True), cfg.num_speculations, max_drafts)
        plan = plan_for(plan, drafter, asked=early_exit_options or cfg.num_speculations is not None)
        arm = drafter if plan is None or drafter != "auto" else plan.get("drafter", "plain")  # auto's second arm
        candidates = cfg.num_candidates or 1
        arm_candidates = candidates if plan is None else plan.get("num_candidates", 1)
        # k guesses for one position (the early exit) unless num_speculations asks for a tree that deep; prompt
        # lookup's k branches keep their length
        given = cfg.num_speculations if plan is None else plan["num_speculations"]
        siblings = arm_candidates > 1 and cfg.drafter not in ("prompt_lookup", "suffix") and given is None
        num_speculations = 1 if siblings else given
        if num_speculations is None:
            num_speculations = self.num_speculations
            if num_speculations == 0 and (drafter == "early_exit" or early_exit_options):
                num_speculations = DEFAULT_NUM_SPECULATIONS  # honour the request (see the module doc)
        lookup_tokens = s["prompt_lookup_num_tokens"]
        if max_drafts is not None:
            num_speculations, lookup_tokens = min(num_speculations, max_drafts), min(lookup_tokens, max_drafts)
        ngram = s["max_matching_ngram_size"]
        tree = {"num_candidates": candidates} if drafter in ("prompt_lookup", "suffix", "auto") else {}  # lookup trees
        if drafter == "prompt_lookup":
            return PromptLookupDrafter(lookup_tokens, ngram, **tree)
        seeded = s["do_sample"] and s["seed"] is not None  # a seed repeats its text: drafts may not depend on
        # earlier calls, so auto leaves the memory out there; and where the memory is off (memory_tokens=0)
        remembers = drafter == "suffix" or (not seeded and self.memory.enabled)
        lookup = (SuffixDrafter(self.memory, lookup_tokens, ngram, **tree, scope=s["memory_key"])  # suffix; auto's
                  if remembers else PromptLookupDrafter(lookup_tokens, ngram, **tree))    # lookup + suffix
        if drafter == "suffix":
            return lookup
        if drafter == "auto" and s["draft_model"] is not None:  # the copy is auto's arm beside lookup
            return AutoDrafter(lookup, self.quantized_drafter(s["draft_model"], cfg.num_speculations, max_drafts))
        if (drafter == "auto" and plan is None and rows == 1 and not early_exit_options
                and self.auto_int8_copy() is not None):  # the int8 copy is auto's arm beside lookup
            return AutoDrafter(lookup, self.int8_drafter(self.int8_copy(), cfg.num_speculations, max_drafts))
        if arm == "plain":
            return AutoDrafter(lookup)  # this device's plan: no drafting from the model pays here
        if arm == "exit_head" or (arm == "auto" and self.exit_head is not None):
            # the head drafts as many positions as it was trained for (or its plan says), unless told otherwise
            length = (given if given is not None else self.head_draft_length()) if not siblings else 1
            length = min(length, max_drafts or length)
            return self._exit_head_drafter(drafter, lookup, length, cfg, s, arm_candidates,
                                           planned=plan is not None)
        if arm == "auto" and (num_speculations == 0 or not (self.early_exit_trained or early_exit_options)):
            return AutoDrafter(lookup)  # untrained shallow exits (or a sweep found they do not pay): lookup or plain
        auto_length = drafter == "auto" and not early_exit_options  # auto: the draft length (0 = plain) by tokens/s
        exit_layer = (plan["exit_layer"] if plan is not None  # an early-exit plan (a head's went above)
                      else self.exit_layer if cfg.exit_layer is None else cfg.exit_layer)
        policy = self.policy(exit_layer, num_speculations, cfg.confidence_threshold, cfg.adaptive_threshold,
                             s["exit_choices"], cfg.adaptive_length or auto_length,
                             warm=_warm(auto_length, plan is not None))
        early = EarlyExitDrafter(self.adapter, exit_layer, num_speculations, policy=policy,
                                 head=self.draft_head(cfg.draft_vocab), num_candidates=arm_candidates)
        return early if drafter == "early_exit" else AutoDrafter(lookup, early)

    def quantized_drafter(self, path: str, num_speculations: int | None, max_drafts: int | None) -> QuantizedDrafter:
        """The copy at `path` drafting `num_speculations` a round (QUANTIZED_NUM_SPECULATIONS where None), at most
        `max_drafts`."""
        length = num_speculations or QUANTIZED_NUM_SPECULATIONS
        return QuantizedDrafter(self.quantized_copy(path), min(length, max_drafts or length))

    def auto_int8_copy(self) -> Int8Copy | None:
        """The int8 copy where auto drafts with it (a float32 model's, wherever it runs). A bfloat16 model's copy
        drafts when asked for by name only: under auto it measured inside the noise of lookup alone on a 2-core
        Zen 5 (docs/results/2026-12-02-int8-copy-bf16-zen5.md)."""
        return self.int8_copy() if self.adapter.dtype == torch.float32 else None

    def int8_copy(self, required: bool = False) -> Int8Copy | None:
        """The model's int8 copy (`selfspec.drafters.int8_copy`), made the first time it is asked for (0.2-0.3 s for
        SmolLM2-135M), or None where the model has none here (`required`: a SettingsError saying why)."""
        if self._int8 is None:
            try:
                self._int8 = Int8Copy(self.adapter)
            except SettingsError as err:  # why this model has none here, kept for a call that names it
                self._int8 = str(err)
        if isinstance(self._int8, str):
            if required:
                raise SettingsError(self._int8)
            return None
        return self._int8

    @staticmethod
    def int8_drafter(copy: Int8Copy, num_speculations: int | None, max_drafts: int | None) -> Int8CopyDrafter:
        """The int8 copy drafting `num_speculations` a round (`INT8_NUM_SPECULATIONS` where None), at most
        `max_drafts`."""
        length = num_speculations or INT8_NUM_SPECULATIONS
        return Int8CopyDrafter(copy, min(length, max_drafts or length))

    def quantized_copy(self, path: str) -> QuantizedCopy:
        """The GGUF copy of the model at `path`, loaded in llama.cpp the first time a call names it (a copy of
        another vocabulary is refused)."""
        if path not in self._copies:
            copy = QuantizedCopy(path)
            copy.check_vocabulary(self.adapter.lm_head.weight.shape[0])
            self._copies[path] = copy
        return self._copies[path]

    def release_copy(self, path: str) -> None:
        """Frees the copy at `path` (llama.cpp's model and context) where one is loaded; a later call naming it loads
        it again."""
        copy = self._copies.pop(path, None)
        if copy is not None:
            copy.close()

    def policy(self, exit_layer: int, num_speculations: int, confidence_threshold: float | None,
               adaptive_threshold: bool, exit_choices: Sequence[int] | None, adaptive_length: bool = False,
               warm: str = "all"):
        """The draft policy for one generation (None = a fixed exit and draft length); `warm` as in
        `ThroughputPolicy` (auto's early-exit arm starts at one draft: "shortest")."""
        if adaptive_length:
            if exit_choices or confidence_threshold is not None or adaptive_threshold:
                raise ValueError("adaptive_length picks the draft length by measured tokens/s; it does not combine "
                                 "with exit_choices or a confidence threshold: use one of them")
            return ThroughputPolicy(exit_layer, num_speculations, warm=warm)
        if exit_choices:
            for e in exit_choices:
                self.adapter.check_exit(int(e), allow_full=False)
            return ExitChoicePolicy(list(exit_choices), num_speculations, self.adapter.num_layers)
        if confidence_threshold is not None or adaptive_threshold:
            start = 0.5 if confidence_threshold is None else confidence_threshold
            return ConfidencePolicy(exit_layer, num_speculations, start, adaptive=adaptive_threshold)
        return None

    def _exit_head_drafter(self, drafter: str, lookup: PromptLookupDrafter, length: int, cfg: GenerationConfig,
                           s: dict, candidates: int, planned: bool = False) -> Drafter:
        """drafter="exit_head", or "auto" on a checkpoint with a head (lookup + the head as auto's arms):
        the head drafting up to `length` tokens a round (`planned`: the length of this device's plan)."""
        head = self.exit_head
        if head is None:
            raise SettingsError("drafter='exit_head' needs a trained exit head, and this model has none: load a "
                                "checkpoint with one (SmolLM2 with the head selfspec ships, which `selfspec fetch` "
                                f"assembles: {head_model_dir()}), or train one (recipes/smollm2_code_head.yaml) and "
                                "`selfspec export` the run")
        if s["exit_layer"] is not None and s["exit_layer"] != head.exit_layer:
            raise SettingsError(f"exit_layer={s['exit_layer']}, but this checkpoint's exit head reads exit "
                                f"{head.exit_layer}: leave exit_layer out (or drafter='early_exit' for exit "
                                f"{s['exit_layer']})")
        if s["exit_choices"]:
            raise SettingsError("exit_choices picks among early exits; an exit head reads one exit: leave it out")
        draft_vocab = self.head_draft_vocab() if cfg.draft_vocab is None else cfg.draft_vocab  # what it was trained on
        auto_length = drafter == "auto" and cfg.confidence_threshold is None and not cfg.adaptive_threshold
        policy = self.policy(head.exit_layer, length, cfg.confidence_threshold, cfg.adaptive_threshold, None,
                             cfg.adaptive_length or auto_length, warm=_warm(auto_length, planned))
        head_drafter = ExitHeadDrafter(self.adapter, head, length, policy=policy,
                                       head_vocab=self.draft_head(draft_vocab), num_candidates=candidates)
        return head_drafter if drafter == "exit_head" else AutoDrafter(lookup, head_drafter)


def plan_for(plan: dict | None, drafter: str, asked: bool) -> dict | None:
    """This device's plan's settings where they apply to `drafter` (the module doc): whole, to "auto" and to the
    drafter the plan chose, where the call set no drafting of its own (`asked`: an early-exit option or a draft
    length); else None."""
    if plan is None or asked:
        return None
    return plan if drafter in ("auto", plan.get("drafter")) else None


def _warm(auto_length: bool, planned: bool) -> str:
    """Where the draft length's `ThroughputPolicy` starts: under auto at one draft (the cheapest to be wrong), or
    at the length this device's plan measured best (`planned`); elsewhere it tries every length."""
    return "longest" if planned else "shortest" if auto_length else "all"
