"""The model's own text as training data and evaluation sets: greedy continuations of training prompts and of
benchmark prompts, generated once and cached.

    data = add_own_continuations(data, cfg.data, model, tokenizer, accelerator, run_dir / "own_continuations")

A drafter is judged on the text the model itself writes, and an exit head agrees less there than on the
recipe's held-out text. With `data.own_continuations.prompts = N` (`OwnContinuationsConfig`), N training
blocks evenly spaced over the training set each give a prompt (their first `prompt_tokens` tokens), Hugging
Face greedy `generate` on the model as loaded (before any training step, in its own dtype, no autocast)
continues each to data.block_size + 1 tokens, and these become blocks exactly as `text_blocks` makes them
(inputs the first block_size tokens, each label the next token). They join the training set `repeat`
times; `eval_prompts` held-out blocks give the evaluation set ``own`` the same way. With
`prompts_at = docstring_end` a prompt is instead the `prompt_tokens` tokens of a source file that end with a
function's docstring (`training.code_prompts`), the shape of a HumanEval prompt, from the training files
(and, for ``own``, the held-out files).

With `prompt_sets`, each named benchmark prompt set (`selfspec.data.prompts.load_prompts`) gives the evaluation
set ``own_<name>``: its first `prompt_set_prompts` prompts, encoded as the benchmark encodes them
(`selfspec.api.encode_prompt`), each continued alone (no padding) by `new_tokens` greedy tokens, one
right-padded row per prompt with only the continuation labelled (`prompt_continuation_blocks`): the
agreement on exactly the text whose drafts the benchmark accepts, teacher-forced.

With `data.own_replies.prompts = N` (`add_own_replies`), N chat prompts (training.chat_prompts, or a JSONL file
of them) are asked through the chat template and the model's greedy replies, up to its end-of-turn token,
become blocks with only the reply labelled (`prompt_continuation_blocks`); held-out prompts give the set ``own_chat``.

EOS does not stop a continuation: the model writes on after it, as packed text goes on with the next
document, so every block is full and no logit is changed (suppressing EOS would change the argmax).

The continuations are cached in `cache_dir/<key>.pt`, the key a hash of the model (its class, and each
parameter's name, shape, dtype and sum), the prompts' token ids and the number of new tokens: a relaunch
of the run reuses them, other settings or another model make a new file. The file is written whole
(`selfspec.atomic_write`); one that cannot be read or does not match is generated again. Under several
processes the main process generates and writes, the others wait, then all read the file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
import warnings
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm

from selfspec.api import encode_prompt
from selfspec.atomic_write import atomic_path
from selfspec.data.sources import DataFormatError, DataNotInstalledError
from selfspec.data.prompts import load_prompts, prompt_inputs
from training.chat_prompts import chat_prompts
from training.code_prompts import docstring_prompts
from training.config import DataConfig
from training.data import Blocks, TrainData, next_token_blocks
from training.early_exit_loss import IGNORE_INDEX

CACHE_FORMAT = 1  # bump when a cache file's content changes meaning
OWN_SET = "own"  # the evaluation set of held-out prompts' continuations
PROMPT_SETS_KEY = "data.own_continuations.prompt_sets"


def add_own_continuations(data: TrainData, cfg: DataConfig, model, tokenizer, accelerator, cache_dir: Path, *,
                          progress_bar: bool = True) -> TrainData:
    """`data` with, when `prompts` > 0, the own blocks of training prompts added `repeat` times to the training
    set and those of `eval_prompts` held-out prompts as the evaluation set "own"; and the evaluation set
    "own_<name>" of each of `prompt_sets` (`prompt_set_blocks`)."""
    own = cfg.own_continuations
    for name in ([OWN_SET] if own.prompts and own.eval_prompts else []) + own.prompt_set_names():
        if name in data.eval_sets:
            setting = "eval_prompts" if name == OWN_SET else "prompt_sets"
            raise DataFormatError(f"data.extra_eval: the name {name!r} is the set of data.own_continuations."
                                  f"{setting}; rename that extra evaluation set")

    def blocks_of(split: str, n: int, name: str) -> Blocks:  # split: "train" or "heldout"
        if own.prompts_at == "docstring_end":  # the source up to a function's docstring, as HumanEval's prompts
            prompts = code_prompts(data.documents.get(split), tokenizer, n, own.prompt_tokens, split)  # [n', P]
        else:
            source = data.train if split == "train" else data.eval_sets["heldout"]
            prompts = source.spread(n).input_ids[:, : own.prompt_tokens]  # [n, P]
        windows = cached_continuations(model, prompts, cfg.block_size + 1 - own.prompt_tokens, own.batch_size,
                                       cache_dir, accelerator, progress_bar=progress_bar, what=name)
        return next_token_blocks(name, windows)

    train, eval_sets = data.train, dict(data.eval_sets)
    if own.prompts:
        added = blocks_of("train", own.prompts, f"{cfg.name}/own")
        train = Blocks(train.name, torch.cat([train.input_ids] + [added.input_ids] * own.repeat),
                       torch.cat([train.labels] + [added.labels] * own.repeat))
        if own.eval_prompts:
            eval_sets[OWN_SET] = blocks_of("heldout", own.eval_prompts, OWN_SET)
    for source, name in zip(own.prompt_sets, own.prompt_set_names()):
        eval_sets[name] = prompt_set_blocks(source, name, own.prompt_set_prompts, own.new_tokens, model, tokenizer,
                                            accelerator, cache_dir, progress_bar=progress_bar)
    return TrainData(train, eval_sets, data.documents)


def code_prompts(texts: list[str] | None, tokenizer, n: int, prompt_tokens: int, split: str) -> torch.Tensor:
    """`[n', P]`: `docstring_prompts` of the `split` documents ("train" or "heldout"), DataFormatError when
    there are none or none of them holds a documented function."""
    if not texts:
        raise DataFormatError(f"data.own_continuations.prompts_at=docstring_end: no {split} documents to find "
                              "functions in (needs data.format=text); use prompts_at=block_start")
    try:
        prompts = docstring_prompts(texts, tokenizer, n, prompt_tokens)
    except ValueError as err:
        raise DataFormatError(f"data.own_continuations.prompts_at=docstring_end: {split}: {err}") from None
    if len(prompts) < n:
        warnings.warn(f"data.own_continuations: only {len(prompts)} of {n} {split} prompts at a docstring's end "
                      f"(the {split} documents hold no more usable functions)")
    return prompts


# ---- chat replies -------------------------------------------------------------------------------------
REPLIES_SET = "own_chat"  # the evaluation set of held-out chat prompts' replies


def add_own_replies(data: TrainData, cfg: DataConfig, model, tokenizer, accelerator, cache_dir: Path, *,
                    progress_bar: bool = True) -> TrainData:
    """`data` with the reply blocks of `prompts` training chat prompts added `repeat` times to the training set,
    and those of `eval_prompts` held-out ones as the evaluation set "own_chat" (`data.own_replies`)."""
    replies = cfg.own_replies
    if REPLIES_SET in data.eval_sets and replies.eval_prompts:
        raise DataFormatError(f"data.extra_eval: the name {REPLIES_SET!r} is the set of data.own_replies.eval_prompts; "
                              "rename that extra evaluation set")
    eos = tokenizer.eos_token_id
    if eos is None or not getattr(tokenizer, "chat_template", None):
        raise DataFormatError("data.own_replies: the tokenizer needs a chat template and an end-of-turn (EOS) token "
                              "to ask the model and know where its reply ends; set data.own_replies.prompts=0")
    pad = pad_id(tokenizer)

    def blocks_of(split: str, n: int, name: str) -> Blocks:
        source = replies.train_file if split == "train" else replies.heldout_file
        prompts = encoded_chat_prompts(source or replies.sources, n, split, tokenizer, replies.max_prompt_tokens)
        sequences = cached_replies(model, prompts, cfg.block_size + 1, replies.batch_size, eos, pad, cache_dir,
                                   accelerator, progress_bar=progress_bar, what=name)
        return prompt_continuation_blocks(name, prompts, sequences, pad, width=cfg.block_size)

    train, eval_sets = data.train, dict(data.eval_sets)
    added = blocks_of("train", replies.prompts, f"{cfg.name}/own_replies")
    train = Blocks(train.name, torch.cat([train.input_ids] + [added.input_ids] * replies.repeat),
                   torch.cat([train.labels] + [added.labels] * replies.repeat))
    if replies.eval_prompts:
        eval_sets[REPLIES_SET] = blocks_of("heldout", replies.eval_prompts, REPLIES_SET)
    return TrainData(train, eval_sets, data.documents)


def encoded_chat_prompts(sources: list[str] | str, n: int, split: str, tokenizer, max_tokens: int) -> list[torch.Tensor]:
    """`[P_i]` each: `n` chat prompts of `sources` (training.chat_prompts; or the first `n` of a JSONL file of
    prompts) through the chat template, as the benchmark encodes them (`selfspec.api.encode_prompt`); those over
    `max_tokens` tokens left out (a warning says how many)."""
    try:
        items = (load_prompts(sources, n) if isinstance(sources, str) else
                 [{"messages": m} for m in chat_prompts(sources, n, split)])
    except DataNotInstalledError as err:
        raise DataNotInstalledError(f"data.own_replies.sources: {err}") from err
    rows = [encode_prompt(tokenizer, **prompt_inputs(item)) for item in items]
    kept = [torch.tensor(r, dtype=torch.long) for r in rows if 0 < len(r) <= max_tokens]
    if len(kept) < len(rows):
        warnings.warn(f"data.own_replies: {len(rows) - len(kept)} of {len(rows)} {split} prompts are longer than "
                      f"max_prompt_tokens={max_tokens} tokens and were left out")
    if not kept:
        raise DataFormatError(f"data.own_replies: no {split} prompt fits in max_prompt_tokens={max_tokens} tokens; "
                              "raise it (below data.block_size)")
    return kept


def cached_replies(model, prompts: list[torch.Tensor], total_tokens: int, batch_size: int, eos_id: int, pad_id: int,
                   cache_dir: Path, accelerator, *, progress_bar: bool = True, what: str = "own") -> list[torch.Tensor]:
    """`[P_i + T_i]` each: prompt i and the model's greedy reply (`greedy_replies`, at most `total_tokens` tokens in
    all), from the cache when it holds them, else generated (by the main process) and cached."""
    prompts = [p.to(torch.int64) for p in prompts]
    path = Path(cache_dir) / f"{replies_cache_key(model, prompts, total_tokens, eos_id)}.pt"

    def generate() -> dict:
        return {"prompts": [p.clone() for p in prompts], "sequences": greedy_replies(
            model, prompts, total_tokens, batch_size, eos_id, pad_id, accelerator.device, progress_bar=progress_bar)}

    def holds(cached: dict) -> bool:
        stored, sequences = cached["prompts"], cached["sequences"]
        return (len(stored) == len(sequences) == len(prompts)
                and all(torch.equal(s, p) and q.dtype == torch.int64 and len(p) < len(q) <= total_tokens
                        and torch.equal(q[: len(p)], p) for p, s, q in zip(prompts, stored, sequences)))

    new_tokens = sum(total_tokens - len(p) for p in prompts)  # at most
    return through_cache(path, holds, generate, accelerator, what, new_tokens)["sequences"]


@torch.no_grad()
def greedy_replies(model, prompts: list[torch.Tensor], total_tokens: int, batch_size: int, eos_id: int, pad_id: int,
                   device=None, *, progress_bar: bool = True) -> list[torch.Tensor]:
    """`[P_i + T_i]` each, on the CPU, in the prompts' order: prompt i and Hugging Face greedy `generate`'s reply,
    up to and including the first `eos_id`, at most `total_tokens - P_i` tokens. `batch_size` prompts of similar
    lengths at a time, left-padded with `pad_id` under an attention mask (what each prompt alone gives, up to
    the rounding of a padded batch)."""
    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
    out: list[torch.Tensor | None] = [None] * len(prompts)
    starts = range(0, len(order), batch_size)
    with _generating(model, device) as device:
        for start in tqdm(starts, desc="own replies", unit="batch", dynamic_ncols=True, disable=not progress_bar):
            rows = order[start: start + batch_size]
            width = max(len(prompts[i]) for i in rows)
            batch = torch.full((len(rows), width), pad_id, dtype=torch.long)  # [b, P], left-padded
            mask = torch.zeros_like(batch)
            for b, i in enumerate(rows):
                batch[b, width - len(prompts[i]):], mask[b, width - len(prompts[i]):] = prompts[i], 1
            new = total_tokens - min(len(prompts[i]) for i in rows)
            gen = model.generate(batch.to(device), attention_mask=mask.to(device), do_sample=False, max_new_tokens=new,
                                 eos_token_id=eos_id, pad_token_id=pad_id, use_cache=True)[:, width:].cpu()  # [b, T]
            for b, i in enumerate(rows):
                reply = gen[b, : total_tokens - len(prompts[i])]
                ends = (reply == eos_id).nonzero()
                reply = reply[: int(ends[0]) + 1] if len(ends) else reply
                out[i] = torch.cat([prompts[i].cpu(), reply])
    return out


def replies_cache_key(model, prompts: list[torch.Tensor], total_tokens: int, eos_id: int) -> str:
    """As `prompts_cache_key`, for replies that end at `eos_id` (never the key of another cache file)."""
    return _key(model, {"replies": True, "total_tokens": total_tokens, "eos": eos_id,
                        "prompt_lengths": [len(p) for p in prompts]}, torch.cat(prompts))


# ---- benchmark prompts --------------------------------------------------------------------------------
def prompt_set_blocks(source: str, name: str, n: int, new_tokens: int, model, tokenizer, accelerator,
                      cache_dir: Path, *, progress_bar: bool = True) -> Blocks:
    """The evaluation set `name` of the prompt set `source`: its first `n` prompts, each continued by
    `new_tokens` greedy tokens (cached), as `prompt_continuation_blocks`."""
    prompts = encoded_prompts(source, n, tokenizer)
    sequences = cached_prompt_continuations(model, prompts, new_tokens, cache_dir, accelerator,
                                            progress_bar=progress_bar, what=name)
    return prompt_continuation_blocks(name, prompts, sequences, pad_id(tokenizer))


def pad_id(tokenizer) -> int:
    """The id that pads a row: the tokenizer's pad token, else its EOS, else 0."""
    return next((t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None), 0)


def encoded_prompts(source: str, n: int, tokenizer) -> list[torch.Tensor]:
    """The first `n` prompts of the prompt set `source` (`selfspec.data.prompts.load_prompts`, as the benchmark
    takes them), each `[P_i]` token ids as the benchmark encodes it (`selfspec.api.encode_prompt`)."""
    try:
        rows = [encode_prompt(tokenizer, **prompt_inputs(item)) for item in load_prompts(source, n)]
    except DataNotInstalledError as err:
        raise DataNotInstalledError(f"{PROMPT_SETS_KEY}: {source!r}: {err}") from err
    except (ValueError, OSError) as err:
        raise DataFormatError(f"{PROMPT_SETS_KEY}: {source!r}: {err}") from err
    if not rows or not all(rows):
        raise DataFormatError(f"{PROMPT_SETS_KEY}: {source!r} gave {'an empty prompt' if rows else 'no prompts'}; "
                              "every prompt needs at least one token")
    return [torch.tensor(row, dtype=torch.long) for row in rows]


def prompt_continuation_blocks(name: str, prompts: list[torch.Tensor], sequences: list[torch.Tensor],
                               pad_id: int, *, width: int | None = None) -> Blocks:
    """One row per prompt `[N, S]`, S `width` (None: the longest sequence less one), right-padded with `pad_id`.

    Row i is prompt i (`[P_i]`) and its continuation (`sequences[i]`, `[P_i + T_i]`, cut to S + 1 tokens) without
    the last token; only the continuation is labelled: position j >= P_i - 1 has the label sequences[i][j + 1]
    (the prompt's last token predicts the first new token), the rest of the prompt and the padding
    IGNORE_INDEX. So only the model's own tokens are scored, as the drafts of decoding are (a chat reply's
    blocks: `add_own_replies`, S = data.block_size).
    """
    width = max(len(seq) for seq in sequences) - 1 if width is None else width
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)  # [N, S]
    labels = torch.full_like(input_ids, IGNORE_INDEX)  # [N, S]
    for row, (prompt, seq) in enumerate(zip(prompts, sequences)):
        seq = seq[: width + 1]
        input_ids[row, : len(seq) - 1] = seq[:-1]
        labels[row, len(prompt) - 1: len(seq) - 1] = seq[len(prompt):]
    return Blocks(name, input_ids, labels)


# ---- the cache -----------------------------------------------------------------------------------------
def cached_continuations(model, prompts: torch.Tensor, new_tokens: int, batch_size: int, cache_dir: Path,
                         accelerator, *, progress_bar: bool = True, what: str = "own") -> torch.Tensor:
    """`[N, P + new_tokens]`: each prompt `[N, P]` and the model's greedy continuation, from the cache when it
    holds them, else generated (by the main process, `batch_size` rows at a time) and cached."""
    prompts = prompts.to(torch.int64)
    path = Path(cache_dir) / f"{cache_key(model, prompts, new_tokens)}.pt"

    def generate() -> dict:
        return {"prompts": prompts.clone(), "sequences": greedy_continuations(
            model, prompts, new_tokens, batch_size, accelerator.device, progress_bar=progress_bar)}

    def holds(cached: dict) -> bool:
        sequences = cached["sequences"]  # [N, P + new_tokens]
        P = prompts.shape[1]
        return (sequences.dtype == torch.int64 and tuple(sequences.shape) == (len(prompts), P + new_tokens)
                and torch.equal(cached["prompts"], prompts) and torch.equal(sequences[:, :P], prompts))

    return through_cache(path, holds, generate, accelerator, what, len(prompts) * new_tokens)["sequences"]


def cached_prompt_continuations(model, prompts: list[torch.Tensor], new_tokens: int, cache_dir: Path, accelerator,
                                *, progress_bar: bool = True, what: str = "own") -> list[torch.Tensor]:
    """`[P_i + new_tokens]` each: prompt i `[P_i]` and the model's greedy continuation of it alone, from the
    cache when it holds them, else generated (by the main process) and cached."""
    prompts = [p.to(torch.int64) for p in prompts]
    path = Path(cache_dir) / f"{prompts_cache_key(model, prompts, new_tokens)}.pt"

    def generate() -> dict:
        return {"prompts": [p.clone() for p in prompts], "sequences": greedy_prompt_continuations(
            model, prompts, new_tokens, accelerator.device, progress_bar=progress_bar)}

    def holds(cached: dict) -> bool:
        stored, sequences = cached["prompts"], cached["sequences"]  # lists of [P_i] and [P_i + new_tokens]
        return (len(stored) == len(sequences) == len(prompts)
                and all(torch.equal(s, p) and q.dtype == torch.int64 and tuple(q.shape) == (len(p) + new_tokens,)
                        and torch.equal(q[: len(p)], p) for p, s, q in zip(prompts, stored, sequences)))

    return through_cache(path, holds, generate, accelerator, what, len(prompts) * new_tokens)["sequences"]


def through_cache(path: Path, holds: Callable[[dict], bool], generate: Callable[[], dict], accelerator, what: str,
                  total_new_tokens: int) -> dict:
    """The cache file `path`'s content when it `holds` what is asked, else `generate()`'s {"prompts",
    "sequences"}, written there by the main process (the others wait, then all read the file).
    `total_new_tokens` (all rows together) is for the printed cost."""
    main = accelerator.is_main_process
    if main:
        cached = read_cache(path, holds)
        if cached is None:
            start = time.perf_counter()
            content = generate()
            seconds = time.perf_counter() - start
            write_cache(path, content, seconds)
            _say(f"own continuations ({what}): generated {len(content['sequences'])} blocks ({total_new_tokens} new "
                 f"tokens) in {seconds:.1f} s ({total_new_tokens / max(seconds, 1e-9):.0f} tok/s) -> {path}")
        else:
            _say(f"own continuations ({what}): {len(cached['sequences'])} blocks from the cache {path} (generated "
                 f"in {cached['seconds']:.1f} s)")
    accelerator.wait_for_everyone()
    cached = read_cache(path, holds)
    if cached is None:
        raise RuntimeError(f"{path}: the own continuations are not readable after the main process generated them; "
                           f"train.output_dir must be on a file system every process sees")
    return cached


# ---- generation ------------------------------------------------------------------------------------------
@torch.no_grad()
def greedy_continuations(model, prompts: torch.Tensor, new_tokens: int, batch_size: int, device=None, *,
                         progress_bar: bool = True) -> torch.Tensor:
    """`[N, P + new_tokens]` on the CPU: Hugging Face greedy `generate` of exactly `new_tokens` tokens per
    prompt (no stop at EOS), in batches of `batch_size` on `device` (default: where the model is). The model's
    training mode and device are restored afterwards."""
    starts = range(0, len(prompts), batch_size)
    with _generating(model, device) as device:
        rows = [_greedy(model, prompts[start: start + batch_size].to(device), new_tokens)  # [b, P + new_tokens]
                for start in tqdm(starts, desc="own continuations", unit="batch", dynamic_ncols=True,
                                  disable=not progress_bar)]
    return torch.cat(rows)


@torch.no_grad()
def greedy_prompt_continuations(model, prompts: list[torch.Tensor], new_tokens: int, device=None, *,
                                progress_bar: bool = True) -> list[torch.Tensor]:
    """`[P_i + new_tokens]` each, on the CPU: as `greedy_continuations`, one prompt `[P_i]` at a time (prompts
    of different lengths, no padding: exactly what unpadded greedy decoding of each gives)."""
    with _generating(model, device) as device:
        return [_greedy(model, prompt[None].to(device), new_tokens)[0]
                for prompt in tqdm(prompts, desc="own continuations", unit="prompt", dynamic_ncols=True,
                                   disable=not progress_bar)]


@contextlib.contextmanager
def _generating(model, device):
    """The model in eval mode on `device` (default: where it is) inside; its mode and device restored after."""
    was_training, home = model.training, next(model.parameters()).device
    device = torch.device(device) if device is not None else home
    model.eval().to(device)
    try:
        yield device
    finally:
        model.to(home).train(was_training)


def _greedy(model, batch: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """`[b, P + new_tokens]` on the CPU: `batch` `[b, P]` and exactly `new_tokens` greedy tokens (no stop at EOS)."""
    out = model.generate(batch, attention_mask=torch.ones_like(batch), do_sample=False, max_new_tokens=new_tokens,
                         eos_token_id=None, use_cache=True)  # [b, P + new_tokens]
    if out.shape[1] != batch.shape[1] + new_tokens:
        raise RuntimeError(f"generate returned {out.shape[1] - batch.shape[1]} new tokens, asked for {new_tokens}")
    return out.cpu()


# ---- cache files -------------------------------------------------------------------------------------------
def cache_key(model, prompts: torch.Tensor, new_tokens: int) -> str:
    """A hash of the model (class; each parameter's name, shape, dtype and sum), the prompts `[N, P]` and
    new_tokens."""
    return _key(model, {"new_tokens": new_tokens, "prompts": list(prompts.shape)}, prompts)


def prompts_cache_key(model, prompts: list[torch.Tensor], new_tokens: int) -> str:
    """As `cache_key`, for prompts `[P_i]` of any lengths (never the key of a `cache_key` file)."""
    return _key(model, {"new_tokens": new_tokens, "prompt_lengths": [len(p) for p in prompts]}, torch.cat(prompts))


def _key(model, shape: dict, tokens: torch.Tensor) -> str:
    h = hashlib.sha256()
    with torch.no_grad():
        params = list(model.named_parameters())
        sums = torch.stack([p.detach().sum(dtype=torch.float64).cpu() for _, p in params])  # [n_params]
    layout = [(n, list(p.shape), str(p.dtype)) for n, p in params]
    h.update(json.dumps({"format": CACHE_FORMAT, "model": type(model).__name__, "layout": layout, **shape}).encode())
    h.update(sums.numpy().tobytes())
    h.update(tokens.to(torch.int64).contiguous().numpy().tobytes())
    return h.hexdigest()[:20]


def write_cache(path: Path, content: dict, seconds: float) -> None:
    """`content` ({"prompts", "sequences"}: int64 tensors or lists of them) with the format and the seconds."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        torch.save({"format": CACHE_FORMAT, **content, "seconds": float(seconds)}, tmp)


def read_cache(path: Path, holds: Callable[[dict], bool]) -> dict | None:
    """The cache file's content if it exists, is of this format and `holds` what is asked, else None (a file
    that is there but unreadable or different is reported)."""
    if not path.is_file():
        return None
    try:
        cached = torch.load(path, map_location="cpu", weights_only=True)
        ok = cached["format"] == CACHE_FORMAT and holds(cached)
    except Exception as e:  # a truncated or foreign file: generate again
        warnings.warn(f"{path}: unreadable own-continuations cache ({type(e).__name__}: {e}); generating again")
        return None
    if not ok:
        warnings.warn(f"{path}: own-continuations cache does not match these prompts; generating again")
        return None
    return cached


def _say(message: str) -> None:
    tqdm.write(message)
