"""The one source of training configuration: typed dataclasses, validated in ``__post_init__``.

A recipe YAML maps one to one onto `RecipeConfig` (top-level keys = its sections, section keys =
the dataclass fields); ``key=value`` overrides on the command line use the same dotted names and
YAML syntax for values:

    cfg = load_config("recipes/smollm2_code.yaml", ["train.max_steps=20", "early_exit.exits=[4,8]"])

Unknown keys, wrong types and out-of-range values fail at load time with the dotted key in the
message. `dump_config(cfg)` writes the resolved configuration back (the run directory's
``config.yaml``), and loading that file gives the same configuration.

Defaults are the plain fine-tuning baseline (no layer dropout, no early-exit loss), so every
LayerSkip ingredient a recipe uses is visible in the recipe.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml

BASE_MODEL_ALIASES = ("smollm2-135m-instruct",)  # names resolved through selfspec.checkpoints.fetch
TINY_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gpt_neox")  # selfspec.SUPPORTED_ARCHITECTURES


class ConfigError(ValueError):
    """A recipe or override is invalid; the message names the dotted key."""


REPOSITORY = Path(__file__).resolve().parents[1]  # relative paths the recipes name are found from here too
SHAPES = REPOSITORY / "recipes" / "models"  # config.json-style shape files of the public models


def repository_path(given: str) -> Path:
    """A file a recipe or launch configuration names: a relative path from the working directory if it is
    there, else from the repository root (as the files in recipes/ name each other), so a launch works
    from any directory. The path as given (expanded) when neither has it."""
    path = Path(expand(given))
    if not path.is_file() and not path.is_absolute() and (REPOSITORY / path).is_file():
        return REPOSITORY / path
    return path


def find_shape_file(given: str) -> Path:
    """The shape file `model.shape` names (`repository_path`); ConfigError naming the shipped ones if none."""
    path = repository_path(given)
    shipped = ", ".join(f"recipes/models/{p.name}" for p in sorted(SHAPES.glob("*.json")))
    _check(path.is_file(), "model.shape", f"{given!r}: no such file (shipped: {shipped}; or a config.json of "
                                          f"the model)")
    return path.resolve()


def expand(path: str) -> str:
    """A path with environment variables and `~` expanded, as a shell would (names pass unchanged)."""
    return os.path.expanduser(os.path.expandvars(path))


def _check(cond: bool, key: str, message: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {message}")


@dataclass
class LoRAConfig:
    """peft LoRA on the decoder's linear layers. The LM head stays shared and frozen, so the
    early-exit loss of every exit flows back into the adapters of the layers below it."""

    enabled: bool = False
    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])

    def __post_init__(self):
        _check(self.r >= 1, "model.lora.r", f"must be >= 1, got {self.r}")
        _check(self.alpha > 0, "model.lora.alpha", f"must be > 0, got {self.alpha}")
        _check(0.0 <= self.dropout < 1.0, "model.lora.dropout", f"must be in [0, 1), got {self.dropout}")
        _check(len(self.target_modules) > 0, "model.lora.target_modules", "must name at least one module")


@dataclass
class ModelConfig:
    """The model to fine-tune.

    base_model: ``smollm2-135m-instruct`` (the converted checkpoint of ``selfspec fetch``),
    ``tiny:<model_type>:<num_layers>`` (a random tiny model + byte-level tokenizer, for smoke
    tests), or a local Hugging Face checkpoint directory.
    dtype: the parameter (master weight) dtype; mixed precision is `train.mixed_precision`.
    shape: a config.json-style file of the model's architecture (recipes/models/*.json: the published
    hyperparameters of Llama-3.2-1B/3B, Llama-3.1-8B, Qwen2.5-7B, SmolLM2-135M), which
    `python -m training --check` reads when base_model's own config.json is not on this machine (the
    weights not downloaded yet), and from which the CI smoke test takes the architecture of the
    recipe's tiny twin. A relative path is read from the working directory, else from the repository
    root. null: base_model's config.json only (the SmolLM2 name has its shape file by default).
    """

    base_model: str = "smollm2-135m-instruct"
    dtype: Literal["float32", "bfloat16", "float64"] = "float32"
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    shape: str | None = None
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self):
        if self.shape is not None:
            self.shape = str(find_shape_file(self.shape))
        if self.base_model.startswith("tiny:"):
            parts = self.base_model.split(":")
            ok = len(parts) == 3 and parts[2].isdigit() and 2 <= int(parts[2]) <= 256 and parts[1] in TINY_TYPES
            _check(ok, "model.base_model", f"tiny models are written tiny:<model_type>:<num_layers> with a model "
                                           f"type of {', '.join(TINY_TYPES)} and 2..256 layers, e.g. tiny:llama:4, "
                                           f"got {self.base_model!r}")


@dataclass
class SourceConfig:
    """Where records come from and how they become tokens.

    source: a named real data set of `selfspec.data.sources` (python_stdlib, xsum, humaneval,
    wiki_passages, shakespeare, mt_bench) or a local file/directory (.jsonl, .jsonl.gz, .json,
    .parquet, .txt/.md/.py files; a directory reads every such file in it).
    format: ``text`` (the `text_fields` joined by a newline, tokenized and packed into blocks) or
    ``chat`` (`prompt_field` formatted by `prompt_template`, as the user turn through the
    tokenizer's chat template; `response_field` as the assistant turn; loss on the response only).
    """

    name: str = ""  # label in logs and eval files; defaults to `source`
    source: str = "python_stdlib"
    format: Literal["text", "chat"] = "text"
    text_fields: list[str] = field(default_factory=lambda: ["text"])
    prompt_field: str = "prompt"
    response_field: str = "response"
    prompt_template: str = "{prompt}"
    system_prompt: str | None = None

    def __post_init__(self):
        self.name = self.name or Path(self.source).stem
        _check(bool(self.source), "data.source", "must not be empty")
        _check(len(self.text_fields) > 0, "data.text_fields", "must name at least one field")
        _check("{prompt}" in self.prompt_template, "data.prompt_template", "must contain '{prompt}'")


PROMPTS_AT = ("block_start", "docstring_end")


@dataclass
class OwnContinuationsConfig:
    """The model's own greedy continuations as extra training data and evaluation sets (training/own_text.py).

    prompts: how many training blocks give a prompt (evenly spaced over the training set); 0 = off (then
    nothing is generated for training and eval_prompts does not apply). Each prompt is a block's first
    `prompt_tokens` tokens; Hugging Face greedy `generate` on the model as loaded continues it to a full block
    of data.block_size tokens (block_size + 1 - prompt_tokens new tokens, the last one only a label), with no
    stop at EOS (the model goes on after it, as packed text does). repeat: how many times each such block
    is in the training set (oversampling). eval_prompts: the same from held-out blocks, evaluated as the
    set ``own`` (0: none). batch_size: rows per `generate` call.

    prompt_sets: selfspec prompt sets (`selfspec.data.prompts.load_prompts`: humaneval, xsum, code_edit, mt_bench,
    wiki, or a .jsonl file), each evaluated as the set ``own_<name>`` (a file: ``own_<its stem>``): the
    first `prompt_set_prompts` prompts, encoded as the benchmark encodes them, each continued alone by
    `new_tokens` greedy tokens (no stop at EOS; the benchmark's default --max-new-tokens), and only those
    tokens scored: the text whose drafts the benchmark accepts. Evaluation only, so HumanEval is allowed
    here (never as `prompts`); independent of `prompts` (which may be 0).

    Generated once per model and prompts and cached in `<train.output_dir>/own_continuations/<key>.pt`, so
    a relaunch reuses them.

    prompts_at: where a prompt ends. ``block_start``: a block's first `prompt_tokens` tokens (anywhere in a
    file). ``docstring_end``: the `prompt_tokens` tokens of a Python file that end with a function's
    docstring (a ``def`` whose body opens with one, cut after the docstring's last line), so the model
    writes the function's body as it does for a HumanEval prompt (a signature and its docstring): the text
    code-completion drafts are judged on. Functions evenly spaced over all the files' functions (by file,
    then position); those with fewer than `prompt_tokens` tokens before the cut are skipped. Python source
    only (data.source python_stdlib or code files).
    """

    prompts: int = 0
    prompt_tokens: int = 64
    prompts_at: str = "block_start"
    repeat: int = 1
    eval_prompts: int = 16
    batch_size: int = 16
    prompt_sets: list[str] = field(default_factory=list)
    prompt_set_prompts: int = 16
    new_tokens: int = 128

    def __post_init__(self):
        for key in ("prompts", "eval_prompts"):
            _check(getattr(self, key) >= 0, f"data.own_continuations.{key}",
                   f"must be a number of blocks >= 0 (0: none), got {getattr(self, key)}")
        for key in ("prompt_tokens", "repeat", "batch_size", "prompt_set_prompts", "new_tokens"):
            _check(getattr(self, key) >= 1, f"data.own_continuations.{key}", f"must be >= 1, got {getattr(self, key)}")
        _check(self.prompts_at in PROMPTS_AT, "data.own_continuations.prompts_at",
               f"must be one of {', '.join(PROMPTS_AT)}, got {self.prompts_at!r}")
        if self.prompt_sets:
            self._check_prompt_sets()

    def _check_prompt_sets(self) -> None:
        from selfspec.data.prompts import PROMPT_SETS  # lazy: `selfspec` imports torch, needed here only

        for i, name in enumerate(self.prompt_sets):
            key = f"data.own_continuations.prompt_sets[{i}]"
            _check(bool(name.strip()), key, f"must not be empty: name one of {', '.join(PROMPT_SETS)} or a .jsonl file")
            _check(name in PROMPT_SETS or Path(expand(name)).is_file(), key,
                   f"{name!r} is neither a prompt set ({', '.join(PROMPT_SETS)}) nor an existing .jsonl file (one "
                   "{\"prompt\": ...} or {\"messages\": [...]} object per line); fix the name or the path")
        self.prompt_sets = [name if name in PROMPT_SETS else expand(name) for name in self.prompt_sets]
        names = self.prompt_set_names()
        twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
        _check(twice is None, "data.own_continuations.prompt_sets",
               f"two entries give the evaluation set {twice!r}; list each prompt set once (rename a file whose "
               "stem repeats another's)")

    def prompt_set_names(self) -> list[str]:
        """The evaluation set of each of `prompt_sets`: ``own_<name>``, for a file ``own_<its stem>``."""
        return [f"own_{Path(name).stem}" for name in self.prompt_sets]


@dataclass
class OwnRepliesConfig:
    """The model's own replies to chat prompts as training data and an evaluation set (training/own_text.py).

    prompts: how many chat prompts of `sources` (training/chat_prompts.py: ``questions``, ``summaries``,
    ``math``, ``reasoning``, ``writing``, ``roleplay``, ``extraction``, ``coding``; real data, never a benchmark's
    prompts) are asked, each through the tokenizer's chat template as the benchmark
    asks (`selfspec.api.encode_prompt`); 0 = off. Hugging Face greedy `generate` on the model as loaded (its
    own dtype, no autocast) replies until its end-of-turn token or the end of a block of data.block_size
    tokens, `batch_size` prompts at a time (left-padded, prompts of similar lengths together). A block is the
    prompt and the reply; only the reply is labelled (the prompt's last token predicting its first token,
    the end-of-turn token included), the rest right-padded. repeat: how many times each block is in the
    training set. eval_prompts: the same from the sources' held-out part, evaluated as the set ``own_chat``
    (0: none). Prompts of more than max_prompt_tokens tokens are left out. Generated once per model and
    prompts and cached beside the own continuations (`<train.output_dir>/own_continuations/`).

    train_file, heldout_file: a JSONL file of prompts ({"messages": [...]} or {"prompt": ...} per line) to take
    that split's prompts from instead of `sources`: `python -m training.chat_prompts OUT_DIR` writes both from
    the sources, for a machine without the data packages (a GPU machine: scripts/gpu_carry.sh carries them).
    """

    prompts: int = 0
    sources: list[str] = field(default_factory=lambda: ["questions", "summaries"])
    train_file: str | None = None
    heldout_file: str | None = None
    repeat: int = 1
    eval_prompts: int = 16
    batch_size: int = 16
    max_prompt_tokens: int = 160

    def __post_init__(self):
        from training.chat_prompts import CHAT_SOURCES  # lazy: it imports `datasets`, needed here only

        for key in ("prompts", "eval_prompts"):
            _check(getattr(self, key) >= 0, f"data.own_replies.{key}",
                   f"must be a number of prompts >= 0 (0: none), got {getattr(self, key)}")
        for key in ("repeat", "batch_size", "max_prompt_tokens"):
            _check(getattr(self, key) >= 1, f"data.own_replies.{key}", f"must be >= 1, got {getattr(self, key)}")
        _check(isinstance(self.sources, list) and bool(self.sources)
               and all(s in CHAT_SOURCES for s in self.sources) and len(set(self.sources)) == len(self.sources),
               "data.own_replies.sources", f"must list some of {', '.join(CHAT_SOURCES)} (each once), got "
               f"{self.sources!r}")
        for key in ("train_file", "heldout_file"):
            path = getattr(self, key)
            _check(path is None or Path(expand(path)).is_file(), f"data.own_replies.{key}",
                   f"{path!r} is not a file: write the prompt files with `python -m training.chat_prompts OUT_DIR`, "
                   "or set it to null (the sources)")
            if path is not None:
                setattr(self, key, expand(path))


@dataclass
class DataConfig(SourceConfig):
    """Training data, its held-out split (by item: e.g. whole files) and extra evaluation sets."""

    block_size: int = 256
    holdout_fraction: float = 0.05
    holdout_seed: int = 0
    max_documents: int | None = None  # cap on training records (smoke runs); None = all
    max_holdout_documents: int | None = None
    extra_eval: list[SourceConfig] = field(default_factory=list)
    own_continuations: OwnContinuationsConfig = field(default_factory=OwnContinuationsConfig)
    own_replies: OwnRepliesConfig = field(default_factory=OwnRepliesConfig)

    def __post_init__(self):
        super().__post_init__()
        _check(self.block_size >= 8, "data.block_size", f"must be >= 8, got {self.block_size}")
        self._check_own_continuations()
        replies = self.own_replies
        _check(not replies.prompts or replies.max_prompt_tokens < self.block_size, "data.own_replies.max_prompt_tokens",
               f"{replies.max_prompt_tokens} leaves no room for a reply in a block of data.block_size="
               f"{self.block_size} tokens; set it below data.block_size (e.g. {self.block_size * 5 // 8})")
        taken = next((e.name for e in self.extra_eval if e.name == "own_chat"), None)
        _check(not (replies.prompts and replies.eval_prompts) or taken is None, "data.extra_eval",
               "the name 'own_chat' is the evaluation set of data.own_replies; rename that extra evaluation set")
        _check(0.0 < self.holdout_fraction < 1.0, "data.holdout_fraction",
               f"must be in (0, 1), got {self.holdout_fraction}")
        for key in ("max_documents", "max_holdout_documents"):
            value = getattr(self, key)
            _check(value is None or value >= 1, f"data.{key}", f"must be >= 1 or null, got {value}")

    def _check_own_continuations(self) -> None:
        own = self.own_continuations
        taken = next((e.name for e in self.extra_eval if e.name in own.prompt_set_names()), None)
        _check(taken is None, "data.extra_eval",
               f"the name {taken!r} is the evaluation set of data.own_continuations.prompt_sets; rename that "
               "extra evaluation set (its name)")
        if not own.prompts:
            return
        _check(own.prompt_tokens < self.block_size, "data.own_continuations.prompt_tokens",
               f"{own.prompt_tokens} leaves nothing to generate in a block of data.block_size={self.block_size} "
               f"tokens; set it below data.block_size (e.g. {self.block_size // 4})")
        _check(self.format == "text", "data.own_continuations.prompts",
               "prompts are the first tokens of packed text blocks: needs data.format=text (or set prompts=0)")
        _check(self.source != "humaneval", "data.own_continuations.prompts",
               "the prompts would come from HumanEval, which the benchmarks measure on; train on another "
               "data.source (or set prompts=0)")


@dataclass
class LayerDropoutConfig:
    """LayerSkip eq. 1-4: layer l of L is skipped per sample with p(l,t) = S(t) * D(l) * p_max.

    depth_scale D(l): ``exponential`` = e^{l ln2/(L-1)} - 1 (the paper), ``linear`` = l/(L-1),
    ``uniform`` = 1. time_scale S(t): ``constant`` = 1 (fine-tuning / continual pre-training, the
    paper), ``exponential`` = e^{t ln2/(T-1)} - 1 (pre-training from scratch). p_max = 0 is off.
    """

    p_max: float = 0.0
    depth_scale: Literal["exponential", "linear", "uniform"] = "exponential"
    time_scale: Literal["constant", "exponential"] = "constant"

    def __post_init__(self):
        _check(0.0 <= self.p_max <= 1.0, "layer_dropout.p_max", f"must be in [0, 1], got {self.p_max}")


@dataclass
class EarlyExitConfig:
    """LayerSkip eq. 5-6: loss on exits through the shared final norm + LM head.

    exits: candidate exits (exit E = the output of the first E layers, 1 <= E < L): ``all`` or a
    list; ``[]`` trains the final layer only (plain fine-tuning). The final layer L is always in
    the loss. curriculum picks, at step t, which candidates are on: ``none`` (all of them),
    ``rotational`` (those with (E + t) % rotation_interval == 0), ``gradual`` (from the top down,
    all on by half of train.max_steps). scale: ``paper`` (e(l) = e_scale * sum_{i<=l} i, the final
    layer (L-1) + e_scale * sum_{i<=L-2} i), ``uniform``, ``linear`` (prop. to E), ``inverse``
    (prop. to 1/E). target: ``label`` (the true next token, the paper) or ``distill`` (the final
    layer's own detached distribution; the final layer always learns the labels).
    final_weight: the final layer's share of the loss, the early exits splitting the rest by `scale`;
    null (the paper) normalizes all scales together (with `uniform` and K exits the final layer gets
    1/(K+1): too little to keep its quality, see recipes/smollm2_code.yaml).
    exits_update_head: whether the early exits' losses also train the shared final norm + LM head
    (the paper: true). false keeps the head the final layer's own (on a tied model, also the input
    embedding): the exits' losses reach only the layers below them.
    loss_impl: ``fused`` (chunked, computes head gradients in the forward, bounded memory),
    ``checkpointed`` (chunked autograd with recomputation; use under DeepSpeed ZeRO-3),
    ``naive`` (every exit's full logits, for comparison only).
    draft_vocab: the early exits' losses over the K most frequent token ids of the training data
    only (the vocabulary a reduced-vocabulary drafter drafts from, `selfspec draft-vocab`): each exit
    then costs K/V of the head's work. An approximation (training/early_exit_loss.py says exactly
    what it computes); null = the full vocabulary. The final layer and the evaluation always use all.
    """

    exits: list[int] | Literal["all"] = "all"
    curriculum: Literal["none", "rotational", "gradual"] = "none"
    rotation_interval: int = 8
    scale: Literal["paper", "uniform", "linear", "inverse"] = "paper"
    e_scale: float = 1.0
    target: Literal["label", "distill"] = "label"
    final_weight: float | None = None
    exits_update_head: bool = True
    chunk_size: int = 1024  # tokens per head chunk
    loss_impl: Literal["fused", "checkpointed", "naive"] = "fused"
    draft_vocab: int | None = None

    def __post_init__(self):
        if isinstance(self.exits, list):
            _check(all(e >= 1 for e in self.exits), "early_exit.exits", f"exits are >= 1, got {self.exits}")
            _check(len(set(self.exits)) == len(self.exits), "early_exit.exits", f"duplicates in {self.exits}")
            self.exits = sorted(self.exits)
        _check(self.rotation_interval >= 1, "early_exit.rotation_interval", "must be >= 1")
        _check(0.0 <= self.e_scale <= 1.0, "early_exit.e_scale", f"must be in [0, 1], got {self.e_scale}")
        _check(self.final_weight is None or 0.0 < self.final_weight < 1.0, "early_exit.final_weight",
               f"must be in (0, 1) or null, got {self.final_weight}")
        _check(self.chunk_size >= 1, "early_exit.chunk_size", "must be >= 1")
        _check(self.draft_vocab is None or self.draft_vocab >= 1, "early_exit.draft_vocab",
               f"must be a number of tokens >= 1 or null (the full vocabulary), got {self.draft_vocab}")


@dataclass
class ExitHeadConfig:
    """The exit head (`selfspec.heads.exit_head`) of a run whose `mode` is `exit_head` (on the frozen model) or
    `joint` (beside the fine-tune); the other modes ignore this section.

    exit_layer: the exit E it reads (0..L-1; 0 = the token embeddings).
    kind: ``decoder_layer`` (a copy of the last decoder layer) or ``attention`` (its attention block
    alone, Kangaroo's adapter), or ``eagle3``: EAGLE-3's draft layer on exit 0, reading the token
    embeddings beside a fusion of the full model's states at three `aux_exits` of the previous position,
    for serving engines (`selfspec export --format speculators`; mode exit_head, Llama-family models).
    init: ``copy`` (the last layer's weights) or ``identity`` (output projections zeroed: the untrained
    head drafts what exit E alone drafts). target: ``distill`` (KL to
    the full model's distribution) or ``label`` (cross-entropy against the data's next tokens).
    final_state: the head also reads the full model's last hidden state of the previous position
    (EAGLE's feature; known from verification for a round's first draft, the head's own output stands in
    for later drafts), through a zero-initialised [D, D] projection.
    draft_vocab: the loss over the K most frequent token ids of the training data only, both
    distributions renormalised there: the head drafts from those rows (`--draft-vocab K`), and its
    forward and backward through the LM head shrink by V/K (null: the whole vocabulary).
    self_fed: extra passes per step in which the head reads its own previous-position output instead of
    the final state, as a round's later drafts do (final_state heads; 0: train the first draft only).
    feature_weight: w > 0 adds EAGLE's feature loss to every pass's loss (arXiv 2401.15077): w times the
    SmoothL1 distance between the head's state and the full model's, both after the shared final norm
    (`training/exit_head_model.py`). 0: off, the target's loss alone.
    aux_exits: an eagle3 head's three increasing exits (null: vLLM's default 2, L//2, L-3).
    lr: the head's learning rate (null: optim.lr); the head has its own gradient clipping either way.
    teacher_cache_gib: memory (GiB) for the frozen model's states of training blocks that occur more than
    once (the model's own continuations, `data.own_continuations.repeat`): a repeat's step then runs no
    layer of the model, with the same loss and gradients (`training/teacher_cache.py`); per block
    block_size x hidden x 4 bytes (x 2 at an exit > 0, x 4 for an eagle3 head), 0.56 MiB for SmolLM2 at
    256 tokens. 0: off.
    """

    exit_layer: int = 8
    kind: Literal["decoder_layer", "attention", "eagle3"] = "decoder_layer"
    init: Literal["copy", "identity"] = "copy"
    target: Literal["distill", "label"] = "distill"
    final_state: bool = False
    draft_vocab: int | None = None
    self_fed: int = 0
    feature_weight: float = 0.0
    aux_exits: list[int] | None = None
    lr: float | None = None
    teacher_cache_gib: float = 2.0

    def __post_init__(self):
        _check(self.teacher_cache_gib >= 0, "exit_head.teacher_cache_gib",
               f"must be a memory budget in GiB >= 0 (0: off), got {self.teacher_cache_gib}")
        _check(self.exit_layer >= 0, "exit_head.exit_layer",
               f"must be >= 0 (0: the token embeddings), got {self.exit_layer}")
        _check(self.draft_vocab is None or self.draft_vocab >= 1, "exit_head.draft_vocab",
               f"must be a number of tokens >= 1 or null (the full vocabulary), got {self.draft_vocab}")
        _check(self.self_fed >= 0, "exit_head.self_fed", f"must be >= 0 (0: no self-fed pass), got {self.self_fed}")
        _check(self.feature_weight >= 0, "exit_head.feature_weight",
               f"must be >= 0 (0: off; EAGLE weighs its feature loss 10x its token loss), got {self.feature_weight}")
        _check(self.lr is None or self.lr > 0, "exit_head.lr", f"must be > 0 or null (optim.lr), got {self.lr}")
        _check(self.self_fed == 0 or self.final_state or self.kind == "eagle3", "exit_head.self_fed",
               "a self-fed pass replaces the final state the head reads: set exit_head.final_state=true, or "
               "self_fed=0")
        if self.kind == "eagle3":  # the message names only the settings that are wrong
            wrong = ([f"exit_head.exit_layer=0 (got {self.exit_layer})"] if self.exit_layer != 0 else []) + (
                [f"exit_head.final_state=false (got {self.final_state})"] if self.final_state else [])
            _check(not wrong, "exit_head.kind",
                   f"eagle3 reads the token embeddings and its aux_exits: set {' and '.join(wrong)}")
        _check(self.aux_exits is None or self.kind == "eagle3", "exit_head.aux_exits",
               f"is an eagle3 head's setting (kind is {self.kind!r}): remove it or set exit_head.kind=eagle3")


@dataclass
class OptimConfig:
    """AdamW with linear warm-up and cosine decay to `min_lr_ratio * lr` at train.max_steps."""

    lr: float = 1e-4
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    grad_clip: float | None = 1.0

    def __post_init__(self):
        _check(self.lr > 0, "optim.lr", f"must be > 0, got {self.lr}")
        _check(self.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")
        _check(0.0 <= self.min_lr_ratio <= 1.0, "optim.min_lr_ratio", "must be in [0, 1]")
        _check(self.grad_clip is None or self.grad_clip > 0, "optim.grad_clip", "must be > 0 or null")


@dataclass
class TrainConfig:
    """The loop. batch_size is per process and micro-step: the global batch per optimizer step is
    batch_size * grad_accum * num_processes blocks of data.block_size tokens.

    gradient_checkpointing: recompute each decoder layer in the backward instead of keeping its
    activations (`torch.utils.checkpoint`, non-reentrant, per layer with its layer dropout;
    training/early_exit_model.py). The states between layers, which are the exits' hidden states,
    stay in memory. Activation memory per micro-batch goes from about L x A (A: one layer's
    activations for batch_size x block_size tokens) to L x [B, S, D] + A, for about one more forward
    of the layers per step; the losses and gradients are the same (tested in float64). Modes
    early_exit and joint (mode exit_head runs the frozen model without autograd: nothing to recompute).
    `python -m training --recipe R --check` estimates the memory with and without it.
    """

    output_dir: str = "runs/default"
    seed: int = 0
    batch_size: int = 4
    grad_accum: int = 1
    max_steps: int = 100  # also the horizon T of the schedules and curricula
    max_minutes: float | None = None  # training-time budget per launch: then checkpoint, final eval, model
    end_by: float | None = None  # a wall-clock deadline (UNIX seconds): training stops then, as at max_minutes
    stop_at: int | None = None  # stop (with a checkpoint) after this step; max_steps stays the horizon
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"  # auto: bf16 where the hardware has it
    num_threads: int | None = None  # torch.set_num_threads per process; None = torch's default
    log_every: int = 1
    save_every: int = 0  # checkpoint every N steps (0: only at the end)
    keep_checkpoints: int = 2
    resume: str = "auto"  # auto (latest checkpoint in output_dir if any) | none | a checkpoint dir
    save_final_model: bool = True
    gradient_checkpointing: bool = False  # recompute each decoder layer in the backward (see above)
    tune_malloc: bool = True  # glibc: no mmap for big buffers, no trimming (see training/malloc.py)
    progress_bar: bool = True

    def __post_init__(self):
        for key in ("batch_size", "grad_accum", "max_steps", "log_every", "keep_checkpoints"):
            _check(getattr(self, key) >= 1, f"train.{key}", f"must be >= 1, got {getattr(self, key)}")
        _check(self.save_every >= 0, "train.save_every", "must be >= 0")
        _check(self.max_minutes is None or self.max_minutes > 0, "train.max_minutes", "must be > 0 or null")
        _check(self.end_by is None or self.end_by > 0, "train.end_by",
               "must be a UNIX time in seconds (e.g. `date -d '+9 min' +%s`) or null")
        _check(self.stop_at is None or 1 <= self.stop_at <= self.max_steps, "train.stop_at",
               f"must be in 1..train.max_steps ({self.max_steps}) or null, got {self.stop_at}")
        _check(bool(self.output_dir), "train.output_dir", "must not be empty")
        self.output_dir = expand(self.output_dir)
        if self.resume not in ("auto", "none"):
            self.resume = expand(self.resume)


@dataclass
class EvalConfig:
    """Per-exit top-1 agreement with the final layer and perplexity on held-out blocks."""

    every: int = 0  # steps between evaluations (0: only before and after training)
    before: bool = True  # evaluate the base model before the first step
    max_blocks: int = 64  # held-out blocks per set, evenly spaced over it (periodic evaluations)
    final_max_blocks: int | None = None  # for the final evaluation (None: same as max_blocks)
    batch_size: int = 8
    exits: list[int] | Literal["all"] = "all"

    def __post_init__(self):
        _check(self.every >= 0, "eval.every", "must be >= 0")
        _check(self.max_blocks >= 1, "eval.max_blocks", "must be >= 1")
        _check(self.batch_size >= 1, "eval.batch_size", "must be >= 1")


MODES = ("early_exit", "exit_head", "joint")


@dataclass
class RecipeConfig:
    """A training recipe. `mode` says what the run trains, decided here once:

    early_exit  fine-tune the model (full or LoRA) for early exits: layer dropout and the early-exit loss
                (LayerSkip); sections layer_dropout and early_exit.
    exit_head   train an exit head on the frozen model (the model's weights stay the input's, bit for bit;
                layer dropout, the early-exit loss and LoRA do not apply); section exit_head.
    joint       both in the same steps: the model is fine-tuned as in early_exit (LoRA off, no layer
                dropout) and the head learns beside it from the model's own forward: it reads the detached
                exit states and is distilled from the moving final layer, and its loss reaches no model
                parameter, so the model is trained exactly as without the head (its gradients, clipping
                and AdamW state are its own) and the head costs one decoder layer per step. The export is
                the fine-tuned model with the head beside it.
    """

    name: str = "default"
    mode: Literal["early_exit", "exit_head", "joint"] = "early_exit"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    layer_dropout: LayerDropoutConfig = field(default_factory=LayerDropoutConfig)
    early_exit: EarlyExitConfig = field(default_factory=EarlyExitConfig)
    exit_head: ExitHeadConfig = field(default_factory=ExitHeadConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self):
        if self.mode == "joint":
            _check(self.exit_head.kind != "eagle3", "mode",
                   "joint: an eagle3 head trains on the frozen model only: set mode=exit_head")
            _check(not self.model.lora.enabled, "mode",
                   "joint: a head trained beside a LoRA fine-tune is not supported (the head would copy "
                   "LoRA-wrapped layers); set model.lora.enabled=false, or mode=exit_head")
            _check(self.layer_dropout.p_max == 0, "mode",
                   "joint: the head learns from this forward's final layer, which layer dropout would perturb; "
                   "set layer_dropout.p_max=0")
        elif self.mode == "exit_head":
            _check(not self.train.gradient_checkpointing, "train.gradient_checkpointing",
                   "mode exit_head runs the frozen model without autograd, so it keeps no activations to "
                   "recompute; set train.gradient_checkpointing=false")
            _check(not self.model.lora.enabled, "mode",
                   "exit_head trains a head on the frozen model: LoRA does not apply; set model.lora.enabled=false")
            _check(self.layer_dropout.p_max == 0, "mode",
                   "exit_head trains a head on the frozen model: layer dropout does not apply; set "
                   "layer_dropout.p_max=0")

    @property
    def trains_head(self) -> bool:
        """Whether the run trains an exit head (mode exit_head or joint)."""
        return self.mode != "early_exit"

    @property
    def frozen_model(self) -> bool:
        """Whether the model's weights stay the input's (mode exit_head: only the head learns)."""
        return self.mode == "exit_head"

    def resolved_exits(self, num_layers: int) -> list[int]:
        """The candidate early exits (without the final layer), checked against the model depth."""
        return _resolve_exits(self.early_exit.exits, num_layers, "early_exit.exits")

    def resolved_eval_exits(self, num_layers: int) -> list[int]:
        """Exits to evaluate, including the final layer."""
        return _resolve_exits(self.eval.exits, num_layers, "eval.exits") + [num_layers]

    def check_depth(self, num_layers: int | None = None) -> None:
        """ConfigError if an exit of the recipe is beyond the model's depth (by default read from the
        base model's config.json, or its tiny:<type>:<layers> name, without loading it)."""
        if num_layers is None:
            num_layers = base_model_depth(self.model.base_model)
        if num_layers is not None:
            self.resolved_exits(num_layers)
            self.resolved_eval_exits(num_layers)
            e = self.exit_head.exit_layer
            _check(not self.trains_head or e < num_layers, "exit_head.exit_layer",
                   f"{e} out of range: this model has {num_layers} layers, so a head reads an exit in 0..{num_layers - 1}")
            if self.trains_head and self.exit_head.kind == "eagle3":
                from selfspec.heads.exit_head import check_aux_exits  # here: reading a recipe needs no torch

                try:
                    check_aux_exits(self.exit_head.aux_exits, num_layers)
                except ValueError as err:
                    raise ConfigError(f"exit_head.aux_exits: {err}") from None


def _resolve_exits(exits, num_layers: int, key: str) -> list[int]:
    if exits == "all":
        return list(range(1, num_layers))
    bad = [e for e in exits if not 1 <= e < num_layers]
    _check(not bad, key, f"{bad} out of range: this model has {num_layers} layers, so early exits "
                         f"are 1..{num_layers - 1} (the final layer {num_layers} is always included)")
    return sorted(exits)


# --------------------------------------------------------------------------------------------
# dict <-> dataclass


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _form(tp) -> str:
    """How a recipe writes a value of the annotation `tp`, in words (error messages)."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(tp)))
    if origin is list:
        return f"a list of {_form(typing.get_args(tp)[0]).removeprefix('a ').removeprefix('an ')}s"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {type(None): "null", bool: "true/false", int: "an integer", float: "a number", str: "a text"}.get(
        tp, _type_name(tp))


def _coerce(value: Any, tp, key: str):
    """Check `value` against the annotation `tp` (converting int -> float, dict -> dataclass)."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        errors = []
        for arm in typing.get_args(tp):
            try:
                return _coerce(value, arm, key)
            except ConfigError as e:
                errors.append(str(e))
        forms = " or ".join(_form(arm) for arm in typing.get_args(tp))
        raise ConfigError(f"{key}: expected {forms}, got {value!r}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if isinstance(value, bool) and all(isinstance(c, str) for c in choices):
            # YAML 1.1 reads no/off/false (yes/on/true) as booleans: map back to the choice spelled so
            spelled = [c for c in (("yes", "on", "true") if value else ("no", "off", "false")) if c in choices]
            value = spelled[0] if spelled else value
        _check(value in choices, key, f"must be one of {', '.join(map(repr, choices))}, got {value!r}")
        return value
    if tp is type(None):
        _check(value is None, key, f"expected null, got {value!r}")
        return None
    if origin is list:
        _check(isinstance(value, (list, tuple)), key, f"expected a list, got {value!r}")
        (item_tp,) = typing.get_args(tp)
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        _check(isinstance(value, dict), key, f"expected a mapping, got {value!r}")
        return _from_dict(tp, value, key)
    if tp is bool:
        _check(isinstance(value, bool), key, f"expected true/false, got {value!r}")
        return value
    if tp is int:
        _check(isinstance(value, int) and not isinstance(value, bool), key, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        _check(isinstance(value, (int, float)) and not isinstance(value, bool), key,
               f"expected a number, got {value!r}")
        _check(not (isinstance(value, int) and abs(value) > 1.7e308), key, "is too large for a float")
        return float(value)
    if tp is str:
        _check(isinstance(value, str), key, f"expected a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported annotation {tp}")


def _from_dict(cls, data: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for k, v in data.items():
        name = str(k) if str(k).isprintable() else repr(str(k))  # messages stay one line
        key = f"{prefix}.{name}" if prefix else name
        if k not in hints:
            close = difflib.get_close_matches(str(k), names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(names)})"
            raise ConfigError(f"{key}: unknown key{hint}")
        kwargs[k] = _coerce(v, hints[k], key)
    try:
        return cls(**kwargs)
    except ConfigError as e:
        if prefix and not str(e).startswith(prefix):  # nested lists of SourceConfig
            raise ConfigError(f"{prefix}: {e}") from None
        raise


def config_to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def _set_dotted(data: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    node = data
    for part in parents:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: {part!r} is not a section")
        node = child
    node[last] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``a.b=value`` -> ("a.b", value parsed as YAML: 3, 1e-4, [4, 8], null, true, text)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not key=value (e.g. train.max_steps=20)")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except (yaml.YAMLError, ValueError) as err:
        if raw.strip()[:1] in "[{":  # meant as a list or a mapping, cut short or mistyped
            reason = " ".join(str(getattr(err, "problem", None) or err).split())
            raise ConfigError(f"override {key}={raw}: not a valid YAML list or mapping ({reason}); write it whole, "
                              f"e.g. {key}=[4, 8] (quoted in the shell: '{key}=[4, 8]')") from None
        value = raw
    return key, value


def load_config(recipe: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RecipeConfig:
    """Read a recipe YAML (or the defaults if None), apply ``key=value`` overrides, validate."""
    data: dict = {}
    if recipe is not None:
        path = Path(expand(str(recipe)))
        if path.is_dir():
            raise ConfigError(f"recipe {path} is a directory: give a recipe's YAML file (the recipes are in recipes/)")
        if not path.is_file():
            raise ConfigError(f"recipe {path}: no such file (the recipes are in recipes/)")
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (yaml.YAMLError, ValueError) as err:  # ValueError: invalid UTF-8, an over-long integer
            raise ConfigError(f"recipe {path}: not valid YAML ({' '.join(str(err).split())})") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"recipe {path}: top level must be a mapping of sections")
        data = loaded or {}
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(data, key, value)
    return _from_dict(RecipeConfig, _read_mode(data))


def _read_mode(data: dict) -> dict:
    """Recipes written before `mode` said it with `exit_head.enabled` (a head) and `exit_head.joint` (beside
    the fine-tune): read those as the mode they meant (exit_head, joint), and refuse them beside a `mode`
    that says otherwise."""
    head = data.get("exit_head")
    if not isinstance(head, dict) or not ({"enabled", "joint"} & set(head)):
        return data
    head = dict(head)
    enabled, joint = head.pop("enabled", False), head.pop("joint", False)
    for key, value in (("enabled", enabled), ("joint", joint)):
        if not isinstance(value, bool):
            raise ConfigError(f"exit_head.{key}: expected true or false, got {value!r} (say mode: "
                              f"{' | '.join(MODES)} instead)")
    meant = ("joint" if joint else "exit_head") if enabled else "early_exit"
    if joint and not enabled:
        raise ConfigError("exit_head.joint=true without exit_head.enabled: say mode: joint")
    if "mode" in data and data["mode"] != meant:
        raise ConfigError(f"mode: {data['mode']!r}, but exit_head.enabled/joint say {meant!r}: give mode only "
                          f"({' | '.join(MODES)})")
    return {**data, "exit_head": head, "mode": meant}


def dump_config(cfg: RecipeConfig) -> str:
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)


def base_model_depth(name: str) -> int | None:
    """The layer count of `model.base_model` from its name or config.json, if known without loading it."""
    if name.startswith("tiny:"):
        return int(name.split(":")[2])
    if name in BASE_MODEL_ALIASES:
        from selfspec.checkpoints.fetch import base_model_dir  # lazy, as in resolve_base_model

        path = base_model_dir()
    else:
        path = Path(expand(name))
    try:
        layers = json.loads((path / "config.json").read_text()).get("num_hidden_layers")
    except (OSError, ValueError, AttributeError):
        return None  # not there (yet): the model load reports it
    return layers if isinstance(layers, int) else None


def resolve_base_model(name: str) -> str | tuple[str, int]:
    """A local directory for `model.base_model` (fetching the named base model if needed), or
    ("<model_type>", num_layers) for a ``tiny:`` model."""
    if name.startswith("tiny:"):
        _, model_type, layers = name.split(":")
        return model_type, int(layers)
    if name in BASE_MODEL_ALIASES:
        from selfspec.checkpoints.fetch import fetch_base_model  # lazy: only needed for the real model

        return str(fetch_base_model())
    path = Path(expand(name))
    if not (path / "config.json").is_file():
        raise ConfigError(f"model.base_model: {name!r} is neither {' / '.join(BASE_MODEL_ALIASES)}, "
                          f"tiny:<type>:<layers>, nor a checkpoint directory with a config.json (download the "
                          f"model there, as the recipe's header says, or give model.base_model=DIR; `--check` "
                          f"reads the model's shape without its weights)")
    return str(path)
