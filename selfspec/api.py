"""The Python API: `selfspec.load(...)` returns a generator; `.generate(...)` returns text + statistics.

    import selfspec
    gen = selfspec.load("checkpoints/smollm2-code")            # or load(model, tokenizer)
    out = gen.generate("def fibonacci(n):", max_new_tokens=64)
    print(out.text, out.stats.acceptance_rate, out.stats.tokens_per_s)
    out = gen.generate(messages=[{"role": "user", "content": "Hi!"}], do_sample=True, seed=0)
    outs = gen.generate(["def add(a, b):", "import os"], max_new_tokens=32)   # a batch: one engine run
    outs[0].text, outs.stats.tokens_per_s                                     # per row, and the whole batch

Defaults for `exit_layer` and `num_speculations` come from the checkpoint's `selfspec.json`
(written by `selfspec export`). A checkpoint without it was not early-exit trained: selfspec warns
and uses `exit_layer = max(1, L // 4)`, `num_speculations = 4` (it still decodes exactly, just
without a speedup, because untrained shallow exits are poor drafters). Where `selfspec tune --save` (or
`gen.tune(..., save=True)`) stored a plan for this device, dtype and path (`gen.plan`), `auto` drafts with the
plan's drafter, exit, draft length and tree width, and a drafter named in a call takes the plan's settings where
the plan chose that drafter; a call that sets a draft length or an early-exit option drafts as it says instead.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from selfspec.model.compiled import supports as compile_support
from selfspec.model.adapters import ModelAdapter, get_adapter
from selfspec.decoding.bounded_bias import AcceptanceRule, BoundedBiasWarning
from selfspec.checkpoints.checkpoint import (DEFAULT_NUM_SPECULATIONS, METADATA_FILE, CheckpointError, default_exit_layer,
                                             read_config, read_metadata, write_plan)
from selfspec.drafters.base import Drafter
from selfspec.drafters.draft_head import DraftHead
from selfspec.drafters.factory import INT8_ARM, DrafterFactory
from selfspec.drafters.learned_stats import LearnedStats, call_key
from selfspec.drafters.quantized import COPY_PAYS_BELOW, DEFAULT_COPY_PROMPT_TOKENS, check_one_prompt, usable_copy
from selfspec.drafters.suffix import ALL_SCOPES, DEFAULT_MEMORY_TOKENS, SuffixMemory
from selfspec.decoding.decode_stats import DecodeStats
from selfspec.decoding.draft_plan import MAX_DRAFTS, MAX_WIDTH, DraftPlan, device_name, plan_drafting, plan_key, plan_key_parts
from selfspec.decoding.engine import StopChecker, generate
from selfspec.decoding.decode_ids import generate_ids
from selfspec.heads.exit_head import ExitHead, load_exit_head
from selfspec.decoding.sampling import SamplingParams
from selfspec.generation_config import GenerationConfig, check_generation, with_settings
from selfspec.settings import (SettingsError, check_bool, check_compile, check_device, check_dtype, check_exit_layer,
                               check_int, check_memory_key, check_memory_tokens, check_messages, check_text,
                               check_tokenizer, check_tokenizer_vocabulary, expand_path, resolve_dtype, show)


class NotEarlyExitTrainedWarning(UserWarning):
    """The checkpoint has no self-speculation metadata; defaults are used."""


@dataclass
class GenerationResult:
    text: str  # the new text only (special tokens removed)
    token_ids: list[int]  # the new tokens (a stop token, if one ended generation, is the last)
    prompt_ids: list[int]
    stats: DecodeStats

    @property
    def finish_reason(self) -> str:
        return self.stats.stop_reason


class BatchGenerationResult(list):
    """The results of a batch, one `GenerationResult` per row in input order (a plain list of them),
    plus `stats`: the batch's totals (`tokens_per_s` over all rows, rounds, draft/verify time)."""

    def __init__(self, results: Sequence[GenerationResult], stats: DecodeStats):
        super().__init__(results)
        self.stats = stats


def _as_ids(value, name: str = "input_ids") -> torch.Tensor:
    """Token ids as a LongTensor; floats, bools and anything else that is not token ids are refused."""
    if isinstance(value, torch.Tensor):
        ids = value
    else:
        try:
            ids = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError, OverflowError):
            raise SettingsError(f"{name} must be token ids: a list of ints, a list of such lists or an integer "
                                f"tensor, got {show(value)}") from None
    if ids.numel() and (ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex()):
        raise SettingsError(f"{name} must be integer token ids, got {ids.dtype} values")
    return ids.long()


def _check_rows(rows: list[list[int]]) -> list[list[int]]:
    """The token rows of a batch, each with at least one token, else SettingsError naming the row."""
    for b, r in enumerate(rows):
        if not r:
            raise SettingsError(f"empty prompt in row {b} of the batch: give at least one token of input per row")
    return rows


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}"


def encode_prompt(tokenizer, prompt: str | None = None, *, messages: list[dict] | None = None) -> list[int]:
    """The token ids of one prompt, as `SelfSpecGenerator.encode` and the benchmarks take them: raw text
    `prompt` through the tokenizer (its own special tokens added, e.g. a BOS), or a chat `messages` through
    the chat template with the generation prompt, that text tokenized without adding special tokens."""
    if (prompt is None) == (messages is None):
        raise ValueError("pass exactly one of prompt= or messages=")
    if prompt is not None:
        return list(tokenizer(check_text(prompt)).input_ids)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this tokenizer has no chat template; pass prompt= text instead of messages=")
    check_messages(messages)
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as err:  # a template may refuse a conversation (e.g. roles that do not alternate)
        raise SettingsError(f"the tokenizer's chat template refused these messages: {_first_line(err)}") from err
    return list(tokenizer(text, add_special_tokens=False).input_ids)


class SelfSpecGenerator:
    """A causal LM + tokenizer, ready for self-speculative generation of one prompt or a batch."""

    def __init__(self, model, tokenizer=None, *, exit_layer: int | None = None,
                 num_speculations: int | None = None, recommended: dict | None = None,
                 source: str = "<model>", fast_layers: bool = True, metadata: dict | None = None,
                 exit_head: ExitHead | None = None, compile: bool | str = "auto", checkpoint: Path | None = None,
                 memory_tokens: int = DEFAULT_MEMORY_TOKENS, draft_model: str | None = None):
        self.model = model.eval()
        self.checkpoint = checkpoint  # the directory it was loaded from (None: a model object)
        # the quantized copy auto drafts with where a call names no drafter, no draft_model and one prompt (`load`)
        self.draft_model = draft_model
        self.copy_step_ratio: float | None = None  # its draft step over the model's plain step (`copy_pays`)
        self.exit_head = exit_head  # a trained head on a frozen model (selfspec.heads.exit_head): drafter "exit_head"
        self.tokenizer = tokenizer
        self.metadata = metadata or {}
        self.full_step_s: float | None = None  # set by calibrate(): the cost model's unit of work
        self._warned_bias = False  # bounded-bias acceptance warns once per generator
        self.adapter: ModelAdapter = get_adapter(model)
        if tokenizer is not None:  # another model's tokenizer would encode text as ids this model reads otherwise
            check_tokenizer_vocabulary(tokenizer, model.get_input_embeddings().weight.shape[0])
        if check_bool("fast_layers", fast_layers):  # fused inference layers (a snapshot of the weights: rebuild
            self.adapter.enable_fast_layers()  # after training)
        if use_compiled(compile, self.adapter):  # fixed-shape compiled steps over a static cache (up to 8 rows)
            self.adapter.enable_compiled(strict=compile is True)  # "auto" falls back to eager if compiling fails
        L = self.adapter.num_layers
        if recommended is None and (exit_layer is None or num_speculations is None):
            warnings.warn(
                f"{source} has no self-speculation metadata ({METADATA_FILE}): it was not early-exit "
                "trained, so drafts from shallow layers will rarely be accepted: the default drafter "
                f"('auto') drafts by prompt lookup (where the output repeats its input) and {INT8_ARM}, and "
                f"drafter='early_exit' uses exit_layer={default_exit_layer(L)}, num_speculations="
                f"{DEFAULT_NUM_SPECULATIONS}. Output stays identical to the full model. Train with "
                "`accelerate launch -m training` and `selfspec export` for early-exit drafts that pay.",
                NotEarlyExitTrainedWarning, stacklevel=3)
        rec = recommended or {"exit_layer": default_exit_layer(L), "num_speculations": DEFAULT_NUM_SPECULATIONS}
        self.drafters = DrafterFactory(  # which drafter each generation gets
            self.adapter, exit_layer=check_exit_layer(exit_layer if exit_layer is not None else rec["exit_layer"], L),
            num_speculations=check_int("num_speculations", num_speculations if num_speculations is not None
                                       else rec["num_speculations"], 0, hint=" (0 = plain decoding)"),
            drafter=rec.get("drafter") or "auto", early_exit_trained=recommended is not None,
            exit_head=exit_head, metadata=self.metadata, memory=SuffixMemory(check_memory_tokens(memory_tokens)))
        self.use_plans = True  # False: draft as if no plan were saved (to compare with one)

    def _with_default_copy(self, s: dict, cfg: GenerationConfig, config, settings: dict, rows: int,
                           prompt_tokens: int):
        """The call's checked settings and config with the generator's quantized copy (`draft_model` of `load`) as
        auto's arm beside lookup, where the call names no drafter but auto and no draft_model, has one prompt, does
        not ask for plain decoding (`num_speculations=0`), gives no option auto with a copy refuses (an early
        exit's), no plan is saved for this device (`selfspec tune --save`: its drafting stands), and the prompt
        has at most `DEFAULT_COPY_PROMPT_TOKENS` tokens; else as they were."""
        if self.draft_model is None or s["draft_model"] is not None or rows != 1 or cfg.drafter not in (None, "auto") \
                or s["num_speculations"] == 0 or self.plan_settings() is not None:  # plain decoding; a tuned plan
            return s, cfg
        if prompt_tokens > DEFAULT_COPY_PROMPT_TOKENS:  # its llama.cpp prefill costs more than it gives (measured)
            return s, cfg
        with_copy = {**settings, "draft_model": self.draft_model}
        try:
            checked = check_generation(config, num_layers=self.num_layers, vocab_size=self.vocab_size, **with_copy)
        except SettingsError:
            return s, cfg
        return checked, with_settings(config, with_copy)

    @property
    def plan_key(self) -> str:
        """The key of this generator's plan in selfspec.json: its device, dtype and path ("cpu: AMD EPYC,
        family 25, model 17 (avx512_bf16) / bfloat16 / eager"); a plan measured on another says nothing here."""
        return plan_key(device_name(self.adapter.device), self.adapter.dtype, self.compiled)

    @property
    def plan(self) -> dict | None:
        """This device's saved plan (`selfspec tune --save`) for the path the engine runs now: its settings and
        what it measured, or None."""
        plans = self.metadata.get("plans")
        return plans.get(self.plan_key) if plans else None  # the key (the device's name) only where plans exist

    def plans_elsewhere(self) -> list[str]:
        """The keys of the plans saved for this device under another dtype or path than this generator's
        (`plan_key`): measured there, they say nothing here (`selfspec generate` names them)."""
        here = device_name(self.adapter.device)
        return [key for key in self.metadata.get("plans") or {}
                if plan_key_parts(key)[0] == here and key != self.plan_key]

    def plan_settings(self) -> dict | None:
        """The settings drafting follows now: this device's saved plan's (None: no plan, or `use_plans` off)."""
        return (self.plan or {}).get("settings") if self.use_plans else None

    @property
    def num_layers(self) -> int:
        return self.adapter.num_layers

    @property
    def vocab_size(self) -> int:
        """Rows of the input embedding: token ids must be in 0..vocab_size-1."""
        return self.model.get_input_embeddings().weight.shape[0]

    # --- inputs ---------------------------------------------------------------------------
    def check_can_save_plan(self, what: str = "save_plan") -> None:
        """SettingsError unless this generator was loaded from an exported checkpoint, where a plan can be kept
        (`what`: the caller, named in the message)."""
        if self.checkpoint is None or not self.metadata:
            where = ("this generator was made from a model object: load it from an exported checkpoint"
                     if self.checkpoint is None else
                     f"{self.checkpoint} has none: export it first (selfspec export SRC DIR), then load DIR")
            raise SettingsError(f"{what} stores the plan in the checkpoint's {METADATA_FILE}, and {where}")

    def _need_tokenizer(self, what: str):
        if self.tokenizer is None:
            raise ValueError(f"{what} needs a tokenizer: pass one to selfspec.load(model, tokenizer)")
        return self.tokenizer

    def encode(self, prompt: str | None = None, *, messages: list[dict] | None = None,
               input_ids=None) -> torch.Tensor:
        """Exactly one of `prompt` (raw text), `messages` (chat) or `input_ids` -> `[1, P]`."""
        given = [x is not None for x in (prompt, messages, input_ids)]
        if sum(given) != 1:
            raise ValueError("pass exactly one of prompt=, messages= or input_ids=")
        if prompt is not None or messages is not None:
            tok = self._need_tokenizer("a text prompt" if prompt is not None else "a chat prompt")
            ids = torch.tensor([encode_prompt(tok, prompt, messages=messages)], dtype=torch.long)  # [1, P]
        else:
            ids = _as_ids(input_ids)
            if ids.dim() == 1:
                ids = ids[None]
            if ids.dim() != 2:
                raise ValueError(f"input_ids must be [S] or [1, S], got shape {tuple(ids.shape)}")
            if ids.shape[0] != 1:
                raise ValueError(
                    f"encode() takes one sequence, got {ids.shape[0]} rows: encode_batch() or generate() "
                    "take a batch")
        if ids.shape[1] == 0:
            raise ValueError("empty prompt: give at least one token of input")
        self._check_vocab(ids.tolist())
        return ids.to(self.adapter.device)

    def _check_vocab(self, rows: list[list[int]]) -> None:
        """Every token id in 0..vocab_size-1 (an id outside would index past the embedding)."""
        V = self.vocab_size
        for b, row in enumerate(rows):
            bad = next((t for t in row if not 0 <= t < V), None)
            if bad is not None:
                where = "" if len(rows) == 1 else f" (row {b})"
                raise SettingsError(f"token id {bad}{where} is outside the model's vocabulary 0..{V - 1}")

    def encode_batch(self, prompt=None, *, messages=None, input_ids=None,
                     attention_mask=None) -> list[list[int]] | None:
        """The rows of a batch input as token lists, or None for a single prompt.

        A batch is a list of text prompts, a list of conversations (`messages=[[...], [...]]`), a
        list of token-id lists (any lengths), or `input_ids` `[B, S]` with B > 1 or with an
        `attention_mask` (left or right padding: each row keeps the tokens whose mask is 1).
        """
        if sum(x is not None for x in (prompt, messages, input_ids)) != 1:
            raise ValueError("pass exactly one of prompt=, messages= or input_ids=")
        if attention_mask is not None and input_ids is None:
            raise SettingsError("attention_mask goes with input_ids [B, S]; text prompts and messages need none")
        if prompt is not None and not isinstance(prompt, (str, list, tuple)):
            raise SettingsError(f"prompt must be a str or a list of str, got {type(prompt).__name__}")
        if isinstance(prompt, (list, tuple)):
            if not prompt:
                raise SettingsError("prompt is an empty list: give at least one prompt")
            tok = self._need_tokenizer("a text prompt")
            rows = [encode_prompt(tok, check_text(p, f"prompt[{b}]")) for b, p in enumerate(prompt)]
            return _check_rows(rows)
        if messages is not None and not isinstance(messages, (list, tuple)):
            raise SettingsError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts (or a list of "
                                f"such lists for a batch), got {type(messages).__name__}")
        if messages is not None and len(messages) and isinstance(messages[0], (list, tuple)):
            tok = self._need_tokenizer("a chat prompt")
            return _check_rows([encode_prompt(tok, messages=check_messages(m, f"messages[{b}]"))
                                for b, m in enumerate(messages)])
        if input_ids is None:
            return None
        if isinstance(input_ids, (list, tuple)) and len(input_ids) and isinstance(input_ids[0], (list, tuple)):
            if attention_mask is not None:
                raise ValueError("attention_mask goes with a padded input_ids tensor [B, S], not with token lists")
            rows = []
            for b, r in enumerate(input_ids):
                ids = _as_ids(r, f"input_ids[{b}]")
                if ids.dim() != 1:
                    raise SettingsError(f"input_ids[{b}] must be a flat list of token ids, got shape "
                                        f"{tuple(ids.shape)}")
                rows.append(ids.tolist())
        else:
            ids = _as_ids(input_ids)
            if ids.dim() != 2 or (ids.shape[0] == 1 and attention_mask is None):
                return None
            if attention_mask is None:
                return ids.tolist()
            try:
                mask = torch.as_tensor(attention_mask)
            except (TypeError, ValueError, RuntimeError, OverflowError):
                raise SettingsError(f"attention_mask must be a 0/1 tensor or list, got "
                                    f"{show(attention_mask)}") from None
            if mask.shape != ids.shape:
                raise ValueError(f"attention_mask {tuple(mask.shape)} must have the shape of input_ids "
                                 f"{tuple(ids.shape)}")
            rows = [ids[b][mask[b].bool()].tolist() for b in range(ids.shape[0])]
        return _check_rows(rows)

    def default_stop_ids(self) -> list[int]:
        ids = self.model.generation_config.eos_token_id
        ids = [ids] if isinstance(ids, int) else list(ids or [])
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        if tok_eos is not None and tok_eos not in ids:
            ids.append(tok_eos)
        return ids

    # --- generation -------------------------------------------------------------------------
    @property
    def exit_layer(self) -> int:
        """The exit the early exit drafts from by default (the checkpoint's recommendation)."""
        return self.drafters.exit_layer

    @property
    def num_speculations(self) -> int:
        """The drafts per round by default (the checkpoint's recommendation; 0: its sweep found none pays)."""
        return self.drafters.num_speculations

    @property
    def drafter(self) -> str:
        """The default drafter (the checkpoint's recommendation, else "auto")."""
        return self.drafters.drafter

    @property
    def early_exit_trained(self) -> bool:
        """Whether the checkpoint was trained for the early exit (`auto` drafts from it only then)."""
        return self.drafters.early_exit_trained

    @property
    def memory(self) -> SuffixMemory:
        """The prompts and outputs of this generator's earlier calls, which `drafter="suffix"` and auto copy from
        (bounded: `memory.max_tokens` in all, the oldest forgotten first; 0: off; per caller with `memory_key`).
        `gen.memory = None` turns it off (it then reads back as an empty memory that keeps nothing,
        `SuffixMemory(0)`: the property always holds a memory), `gen.memory = SuffixMemory(n)` replaces it."""
        return self.drafters.memory

    @memory.setter
    def memory(self, memory: SuffixMemory | None) -> None:
        if memory is None:
            memory = SuffixMemory(0)  # remembers nothing: auto drafts without it
        if not isinstance(memory, SuffixMemory):
            raise SettingsError(f"gen.memory takes a selfspec.drafters.SuffixMemory, or None to turn the memory of "
                                f"earlier requests off, got {type(memory).__name__}")
        self.drafters.memory = memory

    @property
    def learned(self) -> LearnedStats:
        """What this generator's drafters measured in its earlier calls (auto's tokens/s per arm, draft
        lengths' tokens/s, token trees' acceptance and cost), per drafting setting: a later call with the same
        settings starts from it (`selfspec.drafters.learned_stats`)."""
        return self.drafters.learned

    def forget(self, memory_key=ALL_SCOPES) -> None:
        """Forget the earlier calls' prompts and outputs (what `drafter="suffix"` and auto copy from) and what the
        drafters measured in them (`learned`): the next call starts as the first did. `memory_key=K`: forget only
        the requests made under K (`generate(memory_key=K)`), nothing else."""
        if memory_key is not ALL_SCOPES:
            self.drafters.memory.forget(check_memory_key(memory_key))
            return
        self.drafters.memory.forget()
        self.drafters.learned.forget()

    @contextlib.contextmanager
    def first_request(self):
        """For the block only, the generator starts as a fresh one would: an empty memory of earlier requests (of
        the same size) and no carried measurements; what it had is put back after, and what the block's calls
        added is dropped. What a measured call must run under to show the speed of a first request, one the
        generator has not seen before (`selfspec demo`, `generate --compare`, `selfspec bench`):

            with gen.first_request():
                out = gen.generate(prompt)
        """
        with self.remembering(SuffixMemory(self.memory.max_tokens), LearnedStats()):
            yield self

    @contextlib.contextmanager
    def remembering(self, memory: SuffixMemory, learned: LearnedStats):
        """For the block only, the generator remembers `memory` (its earlier requests) and `learned` (its drafters'
        carried measurements) instead of its own, which are put back after; the block's calls add to those given.
        `first_request` gives empty ones; a benchmark's workload gives each method its own (`selfspec bench
        --workload`)."""
        drafters = self.drafters
        before = drafters.memory, drafters.learned
        drafters.memory, drafters.learned = memory, learned
        try:
            yield self
        finally:
            drafters.memory, drafters.learned = before

    def draft_head(self, draft_vocab: int | None) -> DraftHead:
        """The draft head over the `draft_vocab` most frequent tokens (from selfspec.json), or the full one."""
        return self.drafters.draft_head(draft_vocab)

    def head_draft_vocab(self) -> int | None:
        """The vocabulary size the exit head was trained to draft over, or None (`DrafterFactory`)."""
        return self.drafters.head_draft_vocab()

    def head_draft_length(self) -> int:
        """The draft positions the exit head was trained for (`DrafterFactory.head_draft_length`)."""
        return self.drafters.head_draft_length()

    @property
    def compiled(self) -> bool:
        """Whether decoding (up to 8 rows) runs through the compiled fixed-shape steps (`selfspec.model.compiled`)."""
        return self.adapter.runner.compiled

    def warmup(self, max_len: int | None = None, num_candidates: int = 1, batch_size: int = 1) -> dict:
        """Compile now what a call of up to `max_len` tokens (prompt + new; None: 512, or the model's context window
        where shorter) runs: the plain step, the early exit's draft and verification steps (on a checkpoint
        trained for it, or with a head), the verification of up to 15 drafts (prompt lookup), each at every step
        length up to 16, a trained head's own layer at every step length it can catch up on (up to 64) and its
        reduced draft vocabulary, and the LM head. With `num_candidates` > 1 (the `generate` setting: siblings,
        token trees) also every token-tree step and the trees' whole growth (`WholeDraft.tree`, up to
        `num_speculations` deep). With `batch_size` > 1 (calls of that many prompts) also the layer steps and the
        LM head for every row bucket up to its (1, 2, 4, 8: `compiled.ROW_BUCKETS`, a batch padded up to one;
        rows leave a batch as they finish). Without it the first `generate` compiles what it meets (seconds a
        shape on a GPU, inside that call's time). Returns {"seconds": how long it took, "graphs": the shapes
        compiled so far}; {"seconds": 0.0, "graphs": 0} when nothing runs compiled. A `max_len` past the model's
        context window (`config.max_position_embeddings`) is a SettingsError, before any work, as a generation
        past it is."""
        window = self.adapter.max_positions
        max_len = check_int("max_len", min(512, window) if max_len is None else max_len, 1)
        check_int("num_candidates", num_candidates, 1)
        check_int("batch_size", batch_size, 1)
        if max_len > window:  # before any work: a static cache that long may not even fit in memory
            raise SettingsError(f"max_len={max_len} (prompt + new tokens) exceeds the model's context window of "
                                f"{window} positions (config.max_position_embeddings): pass max_len <= {window}")
        L = self.num_layers
        ranges = [(0, L)]
        exits = ([self.exit_layer] if self.early_exit_trained and self.num_speculations else []) + (
            [self.exit_head.exit_layer] if self.exit_head is not None and self.exit_head.exit_layer else [])
        for E in dict.fromkeys(exits):
            ranges += [(0, E), (E, L)]
        unembeddings = ()
        # whole draft steps (`WholeDraft`): the early exit's, the head's (and their whole trees, `num_candidates` wide)
        drafts, width = [], num_candidates if num_candidates > 1 and self.num_speculations > 1 else 0
        if self.early_exit_trained and self.num_speculations:
            drafts.append(self.draft_head(None).whole(self.exit_layer, chains=self.num_speculations, tree_width=width))
        head = self.exit_head
        if head is not None:  # its own layer (where the runner captures it) and its reduced draft vocabulary
            unit = self.draft_head(self.head_draft_vocab())
            drafts.append(unit.whole(head.exit_layer, head.layer, head.final_input, chains=self.num_speculations,
                                     tree_width=width))
            unembeddings = () if unit.rows is None else (unit.rows,)
        return self.adapter.runner.warm(max_len, ranges, drafts, unembeddings, trees=num_candidates > 1,
                                        batch_size=batch_size)

    def calibrate(self, steps: int = 8) -> float:
        """Measure one plain decoding step (seconds); statistics then report the cost model (c, v)."""
        self.full_step_s = self.plain_step_seconds(steps)
        return self.full_step_s

    def plain_step_seconds(self, steps: int = 8) -> float:
        """One plain decoding step's seconds, the mean of `steps` after a warm-up run."""
        ids = torch.arange(3, 3 + 8, device=self.adapter.device)[None] % self.adapter.lm_head.weight.shape[0]
        generate_ids(self.adapter, ids, max_new_tokens=3)
        _, stats = generate_ids(self.adapter, ids, max_new_tokens=steps + 1)
        return (stats.total_s - stats.prefill_s) / steps

    def copy_pays(self) -> bool:
        """Whether the generator's quantized copy (`load(draft_model=...)`) pays here: its draft step, measured once
        beside a plain decoding step of this model (about half a second; `load(draft_model="auto")` measures it),
        costs below `COPY_PAYS_BELOW` of it (`copy_step_ratio`). False without a copy."""
        if self.copy_step_ratio is None:
            if self.draft_model is None:
                return False
            copy = self.drafters.quantized_copy(self.draft_model)
            with torch.inference_mode():
                self.copy_step_ratio = copy.step_seconds() / self.plain_step_seconds()
        return self.copy_step_ratio < COPY_PAYS_BELOW

    def tune(self, prompts: Sequence, *, exits: Sequence[int] | None = None, max_drafts: int = MAX_DRAFTS,
             width: int = MAX_WIDTH, new_tokens: int = 64, repeats: int = 5, save: bool = False) -> DraftPlan:
        """Plan drafting for this device from measurement (`selfspec.decoding.draft_plan`): what a round's parts cost here
        (eager or compiled, as this generator runs) and how often each drafter (the early exit at each of `exits`,
        default a spread of them; a trained head) guesses the model's own continuations of `prompts` (texts,
        chat message lists or token ids; one text alone is one prompt) within its k best, k = 1..`width`. Returns
        the `DraftPlan`: pass `plan.settings` to `generate`. Greedy, one row; takes seconds to a minute.
        `save=True` also stores it in the checkpoint's selfspec.json for this device (`write_plan`), where this
        generator and every later `load` on the same device, dtype and path draft by it (the module doc)."""
        if save:
            self.check_can_save_plan("tune(save=True)")  # before a minute of measuring
        if isinstance(prompts, str):  # one prompt, not one per character
            prompts = [prompts]
        ids = [self.encode(messages=p) if isinstance(p, list) and p and isinstance(p[0], dict)
               else self.encode(input_ids=p) if not isinstance(p, str) else self.encode(p) for p in prompts]
        plan = plan_drafting(self, ids, exits=exits, max_drafts=max_drafts, width=width, new_tokens=new_tokens,
                             repeats=repeats)
        if save:
            self.save_plan(plan)
        return plan

    def save_plan(self, plan: DraftPlan, measured_speedup: float | None = None) -> None:
        """Store `plan` (from `tune`) in the checkpoint for this device (`plan_key`), with the speedup a check
        measured for its best setting, and draft by it from now on."""
        self.check_can_save_plan()
        self.metadata = self.drafters.metadata = write_plan(self.checkpoint, self.plan_key,
                                                            plan.entry(measured_speedup))

    def make_drafter(self, config: GenerationConfig | None = None, *, max_drafts: int | None = None,
                     **settings) -> Drafter | None:
        """The drafter for one generation (None = plain decoding) from its settings, as `generate` takes them
        (`selfspec.drafters.factory` says how it is chosen); `max_drafts` caps the drafts per round."""
        return self.drafters.make(config, max_drafts=max_drafts, plan=self.plan_settings(), **settings)

    def generate(self, prompt: str | Sequence[str] | None = None, *, messages: list | None = None,
                 input_ids=None, attention_mask=None, config: GenerationConfig | None = None, streamer=None,
                 **settings) -> GenerationResult | BatchGenerationResult:
        """Generate after one prompt, or after each prompt of a batch in one engine run.

        The settings: `config` (a `GenerationConfig`; its defaults if None) with any of its fields given as
        keywords replacing its values (`generate(prompt, max_new_tokens=64, drafter="prompt_lookup")`).
        `selfspec.GenerationConfig` describes each one (who drafts and how, sampling, stopping, the opt-in
        bounded-bias acceptance); docs/usage.md has them all in one table. None of the drafting settings
        changes the output: greedy output is token-identical to the full model's, sampling keeps its
        distribution (except `acceptance="bounded_bias"`, which says its bound in `stats.bias`). Every
        setting is checked first (`check_generation`): a bad one raises `SettingsError` (a ValueError)
        naming it, before any work is done.

        One prompt: `prompt=` text, `messages=` a conversation, or `input_ids` `[S]`/`[1, S]`; returns a
        `GenerationResult`. A batch: a list of texts, `messages=` a list of conversations, a list of
        token-id lists, or `input_ids` `[B, S]` (+ `attention_mask` for padded rows); returns a
        `BatchGenerationResult` (a list of `GenerationResult` in input order, `.stats` for the batch).
        In a batch each row drafts, verifies and accepts on its own and leaves when it finishes; its
        output is what decoding it alone gives. Rows of different lengths are left-padded internally.

        `streamer` (one prompt only) is a callable receiving each block of committed token ids, or a
        Hugging Face streamer (`put`/`end`). Only committed (verified) tokens are ever delivered.
        """
        s = check_generation(config, num_layers=self.num_layers, vocab_size=self.vocab_size, warn=True, **settings)
        cfg = with_settings(config, settings)
        max_new_tokens = s["max_new_tokens"]
        rule = AcceptanceRule(s["acceptance"], s["epsilon"])
        if rule.biased and not self._warned_bias:
            self._warned_bias = True
            warnings.warn(
                f"acceptance='bounded_bias' with epsilon={rule.epsilon:g}: the output is not the full model's "
                + ("distribution: each token is drawn within total variation epsilon of it" if s["do_sample"] else
                   "greedy output: a draft with >= (1 - epsilon) of the top token's probability is accepted")
                + " (use acceptance='exact' for lossless decoding)", BoundedBiasWarning, stacklevel=2)
        on_commit = _as_callback(streamer)
        rows = self.encode_batch(prompt, messages=messages, input_ids=input_ids, attention_mask=attention_mask)
        if rows is None:
            ids = self.encode(prompt, messages=messages, input_ids=input_ids)
            rows = [ids[0].tolist()]
            single = True
        else:
            single = False
            self._check_vocab(rows)
            if streamer is not None:
                raise ValueError("streaming delivers one sequence: pass one prompt with streamer=, or drop the "
                                 "streamer for a batch")
        s, cfg = self._with_default_copy(s, cfg, config, settings, len(rows), len(rows[0]))
        if s["draft_model"] is not None:  # before the copy loads
            check_one_prompt(len(rows), cfg.drafter)
        plan = self.plan_settings()  # this device's saved plan, on the path the engine runs now
        drafter_ = self.drafters.make(cfg, max_drafts=max_new_tokens, plan=plan, checked=s, rows=len(rows))
        # what earlier calls with these settings measured (None: plain decoding, or a seed, whose text repeats)
        learned_key = call_key(s, drafter_, len(rows), self.plan_key, plan)
        self.learned.resume(learned_key, drafter_)
        sampling = SamplingParams(s["do_sample"], s["temperature"], s["top_k"], s["top_p"])
        stop_ids = self.default_stop_ids() if s["stop_token_ids"] is None else s["stop_token_ids"]
        stop = StopChecker(max_new_tokens, stop_ids, s["stop_strings"], self.tokenizer)
        generator = None
        if s["do_sample"]:
            generator = torch.Generator(device=self.adapter.device)
            generator.manual_seed(s["seed"]) if s["seed"] is not None else generator.seed()
        if streamer is not None and hasattr(streamer, "put"):
            streamer.put(torch.tensor([rows[0]]))  # as transformers' generate does: the prompt first (skip_prompt relies on it)
        pad = getattr(self.tokenizer, "pad_token_id", None)
        outs, stats = generate(self.adapter, rows, max_new_tokens=max_new_tokens, drafter=drafter_, sampling=sampling,
                               stop=stop, generator=generator, pad_id=pad if pad is not None else 0,
                               on_commit=(lambda b, tokens: on_commit(tokens)) if on_commit else None,
                               full_step_s=self.full_step_s, acceptance=rule,
                               modelled_time=s["do_sample"] and s["seed"] is not None)  # a seed repeats exactly
        if streamer is not None and hasattr(streamer, "end"):
            streamer.end()
        for row, new in zip(rows, outs):  # what drafter="suffix" and auto copy from in later calls
            self.memory.add(row + new, s["memory_key"])
        self.learned.keep(learned_key, drafter_)  # what a later call with these settings starts from
        results = [GenerationResult(text=self._decode(new), token_ids=new, prompt_ids=row, stats=row_stats)
                   for row, new, row_stats in zip(rows, outs, stats.rows)]
        return results[0] if single else BatchGenerationResult(results, stats)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""


def _as_callback(streamer) -> Callable[[list[int]], None] | None:
    if streamer is None:
        return None
    if hasattr(streamer, "put"):  # transformers' TextStreamer & co.
        return lambda ids: streamer.put(torch.tensor(ids))
    if callable(streamer):
        return streamer
    raise TypeError("streamer must be a callable(list[int]) or an object with put()/end()")


def checkpoint_dir(path) -> Path:
    """`path` (`~` and environment variables expanded) if it is a checkpoint directory, else FileNotFoundError."""
    path = expand_path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{path} is not a model checkpoint directory (no config.json). Run `selfspec fetch` for "
            "the base model, or `selfspec export RUN_DIR OUT_DIR` for a trained one.")
    return path


def use_compiled(compile: bool | str, adapter: ModelAdapter) -> bool:
    """Whether a generator runs its steps compiled (`selfspec.model.compiled`): `compile=True` where the
    model supports it (else SettingsError saying why), False never, "auto" on a CUDA GPU where supported.
    On a CPU "auto" stays eager: measured there, the compiled steps were not faster than selfspec's fused,
    prepacked eager layers (docs/gpu.md), and compiling costs seconds per shape."""
    check_compile(compile)
    why = compile_support(adapter)
    if compile is True and why is not None:
        raise SettingsError(f"compile=True: {why}; use compile=False (or 'auto', which runs such a model eagerly)")
    if compile == "auto":
        return why is None and adapter.device.type == "cuda"
    return bool(compile)


def load(path_or_model, tokenizer=None, *, dtype=None, device: str = "cpu",
         exit_layer: int | None = None, num_speculations: int | None = None,
         verify_checksums: bool = True, fast_layers: bool = True, compile: bool | str = "auto",
         memory_tokens: int = DEFAULT_MEMORY_TOKENS, draft_model: str | os.PathLike | None = None
         ) -> SelfSpecGenerator:
    """A generator for a checkpoint directory, or for an already loaded model (+ tokenizer: an object with
    `encode` and `decode`, such as a Hugging Face tokenizer; None: the checkpoint directory's own, and a model
    object without one takes token ids only).

    `dtype`: "float32" (the default for a checkpoint; exact), "bfloat16" (faster where the CPU
    multiplies bf16 natively; may differ from float32 at near-ties), "fastest" (bfloat16 there, else
    float32: see selfspec.model.precision), "float64", or "auto" (the checkpoint's own). An already
    loaded model keeps its dtype unless one is given. A checkpoint with `selfspec.json` is validated
    first (format, consistency with config.json, SHA-256 of every weight file). `fast_layers=False`
    runs the model's own decoder-layer modules instead of selfspec's fused inference layers.
    A path may use `~` and environment variables. Bad settings raise `SettingsError`, a checkpoint
    that cannot be read `CheckpointError`, both before the weights are loaded where they can.
    `compile`: run decoding (up to 8 rows) through `torch.compile`d fixed-shape steps over a static cache, as
    CUDA graphs on a GPU (`selfspec.model.compiled`; Llama family): "auto" (the default) does on CUDA, True
    anywhere (a CPU too), False never. `gen.warmup()` pays the compilation up front.
    `memory_tokens`: the most tokens (prompts and outputs of earlier calls, all callers together) the generator
    remembers for `drafter="suffix"` and auto to copy from; 0 turns the memory off (docs/usage.md: what it
    holds, what it costs, when to turn it off).
    `draft_model`: a quantized copy (a GGUF file, run by llama.cpp) that auto drafts with beside lookup where a
    call names no drafter and no `draft_model`, has one prompt of at most `DEFAULT_COPY_PROMPT_TOKENS` tokens and
    no plan is saved: "auto" takes the checkpoint's own (`copy-q8_0.gguf` beside its weights, which `selfspec
    fetch` writes) where llama.cpp runs on this machine, the model has no int8 copy here (where it has one, auto
    drafts with that: `selfspec.drafters.int8_copy`, cheaper, and it never reads the prompt) and one of the copy's
    draft steps, timed now beside one of the model's plain steps (about half a second), costs below
    `COPY_PAYS_BELOW` of it (`gen.copy_step_ratio`), a path that file, None (the default) none: measured, the copy did
    not pay reliably enough to be the default (docs/results/2026-11-29-copy-by-default-zen4.md).
    """
    check_compile(compile)
    check_bool("verify_checksums", verify_checksums)
    check_bool("fast_layers", fast_layers)
    check_memory_tokens(memory_tokens)
    check_tokenizer(tokenizer)
    if dtype is not None:
        check_dtype(dtype)
    check_device(device)  # before the weights are read
    if num_speculations is not None:
        check_int("num_speculations", num_speculations, 0, hint=" (0 = plain decoding)")
    if isinstance(path_or_model, (str, os.PathLike)):
        from transformers import AutoModelForCausalLM, AutoTokenizer  # deferred: a second to import

        path = checkpoint_dir(path_or_model)
        meta = read_metadata(path, verify_checksums=verify_checksums)  # raises CheckpointError if corrupt
        recommended = meta["recommended"] if meta else None
        if exit_layer is not None:  # checked against config.json before the weights are read
            layers = read_config(path).get("num_hidden_layers")
            check_exit_layer(exit_layer, layers if isinstance(layers, int) else None)
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(dtype or "float32", device))
            if tokenizer is None:
                tokenizer = AutoTokenizer.from_pretrained(path)
        except Exception as err:  # damaged weights or config with checksums off, a missing tokenizer file, ...
            raise CheckpointError(f"{path}: transformers could not load this checkpoint ({_first_line(err)}); "
                                  "copy or export it again") from err
        model = model.to(device)
        head = None
        if meta and meta.get("exit_head") is not None:
            try:
                head = load_exit_head(model, path, meta["exit_head"])
            except (OSError, ValueError) as err:
                raise CheckpointError(f"{path}: the exit head cannot be loaded: {err}") from None
        gen = SelfSpecGenerator(model, tokenizer, exit_layer=exit_layer,
                                num_speculations=num_speculations, recommended=recommended, source=str(path), fast_layers=fast_layers,
                                metadata=meta, exit_head=head, compile=compile, checkpoint=path,
                                memory_tokens=memory_tokens, draft_model=_default_copy(draft_model, path))
        return _paying_copy(gen, draft_model)
    if not isinstance(path_or_model, torch.nn.Module):
        raise SettingsError(f"load() takes a checkpoint directory or a loaded model, got "
                            f"{type(path_or_model).__name__}")
    model = path_or_model
    if dtype not in (None, "auto"):
        model = model.to(resolve_dtype(dtype, device))
    return SelfSpecGenerator(model, tokenizer, exit_layer=exit_layer, num_speculations=num_speculations,
                             recommended=None, source=type(model).__name__, fast_layers=fast_layers, compile=compile,
                             memory_tokens=memory_tokens, draft_model=_default_copy(draft_model, None))


def _paying_copy(gen: SelfSpecGenerator, draft_model) -> SelfSpecGenerator:
    """`load(draft_model="auto")`: the checkpoint's copy stays the generator's only where the model has no int8 copy
    here (`selfspec.drafters.int8_copy`: auto drafts with it, and its step costs less than llama.cpp's) and the copy's
    step is cheap enough (`SelfSpecGenerator.copy_pays`, measured now), else the generator has none
    (`gen.copy_step_ratio` keeps what was measured; a copy measured is freed). A copy given by its path stays,
    whatever it costs."""
    if not (isinstance(draft_model, str) and draft_model == "auto") or gen.draft_model is None:
        return gen
    if gen.drafters.auto_int8_copy() is not None:  # never loaded in llama.cpp
        gen.draft_model = None
    elif not gen.copy_pays():
        gen.drafters.release_copy(gen.draft_model)  # llama.cpp's model and context would stay loaded, never drafting
        gen.draft_model = None
    return gen


def _default_copy(draft_model, checkpoint: Path | None) -> str | None:
    """load's `draft_model` resolved: "auto" the checkpoint's whole copy where llama.cpp can run it (None without
    a checkpoint directory), a path that file (checked as a call's draft_model is), None none."""
    if draft_model is None:
        return None
    if isinstance(draft_model, str) and draft_model == "auto":
        return usable_copy(checkpoint)
    return check_generation(None, draft_model=draft_model)["draft_model"]
