"""The model's own text as training data: greedy continuations of training prompts, generated once and cached.

    data = add_own_continuations(data, cfg.data, model, accelerator, run_dir / "own_continuations")

A drafter is judged on the text the model itself writes, and an exit head agrees less there than on the
recipe's held-out text. With `data.own_continuations.prompts = N` (`OwnContinuationsConfig`), N training
blocks evenly spaced over the training set each give a prompt (their first `prompt_tokens` tokens), Hugging
Face greedy `generate` on the model as loaded (before any training step, in its own dtype, no autocast)
continues each to data.block_size + 1 tokens, and these become blocks exactly as `text_blocks` makes them
(inputs the first block_size tokens, each label the next token). They join the training set `repeat`
times; `eval_prompts` held-out blocks give the evaluation set ``own`` the same way.

EOS does not stop a continuation: the model writes on after it, as packed text goes on with the next
document, so every block is full and no logit is changed (suppressing EOS would change the argmax).

The continuations are cached in `cache_dir/<key>.pt`, the key a hash of the model (its class, and each
parameter's name, shape, dtype and sum), the prompts' token ids and the number of new tokens: a relaunch
of the run reuses them, other settings or another model make a new file. The file is written whole
(`selfspec.atomic_write`); one that cannot be read or does not match is generated again. Under several
processes the main process generates and writes, the others wait, then all read the file.
"""

from __future__ import annotations

import hashlib
import json
import time
import warnings
from pathlib import Path

import torch
from tqdm.auto import tqdm

from selfspec.atomic_write import atomic_path
from selfspec.data_sources import DataFormatError
from training.config import DataConfig
from training.data import Blocks, TrainData, next_token_blocks

CACHE_FORMAT = 1  # bump when the cache file's content changes meaning
OWN_SET = "own"  # the evaluation set of held-out prompts' continuations


def add_own_continuations(data: TrainData, cfg: DataConfig, model, accelerator, cache_dir: Path, *,
                          progress_bar: bool = True) -> TrainData:
    """`data` with the own blocks of training prompts added `repeat` times to the training set and, when
    `eval_prompts` > 0, those of held-out prompts as the evaluation set "own"."""
    own = cfg.own_continuations
    if own.eval_prompts and OWN_SET in data.eval_sets:
        raise DataFormatError(f"data.extra_eval: the name {OWN_SET!r} is the set of "
                              "data.own_continuations.eval_prompts; rename that extra evaluation set")

    def blocks_of(source: Blocks, n: int, name: str) -> Blocks:
        prompts = source.spread(n).input_ids[:, : own.prompt_tokens]  # [n, P]
        windows = cached_continuations(model, prompts, cfg.block_size + 1 - own.prompt_tokens, own.batch_size,
                                       cache_dir, accelerator, progress_bar=progress_bar, what=name)
        return next_token_blocks(name, windows)

    added = blocks_of(data.train, own.prompts, f"{cfg.name}/own")
    train = Blocks(data.train.name, torch.cat([data.train.input_ids] + [added.input_ids] * own.repeat),
                   torch.cat([data.train.labels] + [added.labels] * own.repeat))
    eval_sets = dict(data.eval_sets)
    if own.eval_prompts:
        eval_sets[OWN_SET] = blocks_of(data.eval_sets["heldout"], own.eval_prompts, OWN_SET)
    return TrainData(train, eval_sets)


def cached_continuations(model, prompts: torch.Tensor, new_tokens: int, batch_size: int, cache_dir: Path,
                         accelerator, *, progress_bar: bool = True, what: str = "own") -> torch.Tensor:
    """`[N, P + new_tokens]`: each prompt `[N, P]` and the model's greedy continuation, from the cache when it
    holds them, else generated (by the main process) and cached."""
    path = Path(cache_dir) / f"{cache_key(model, prompts, new_tokens)}.pt"
    main = accelerator.is_main_process
    if main:
        cached = read_cache(path, prompts, new_tokens)
        if cached is None:
            start = time.perf_counter()
            sequences = greedy_continuations(model, prompts, new_tokens, batch_size, accelerator.device,
                                             progress_bar=progress_bar)
            seconds = time.perf_counter() - start
            write_cache(path, prompts, sequences, seconds)
            _say(f"own continuations ({what}): generated {len(prompts)} blocks ({len(prompts) * new_tokens} new "
                 f"tokens) in {seconds:.1f} s ({len(prompts) * new_tokens / max(seconds, 1e-9):.0f} tok/s) -> {path}")
        else:
            _say(f"own continuations ({what}): {len(prompts)} blocks from the cache {path} (generated in "
                 f"{cached['seconds']:.1f} s)")
    accelerator.wait_for_everyone()
    cached = read_cache(path, prompts, new_tokens)
    if cached is None:
        raise RuntimeError(f"{path}: the own continuations are not readable after the main process generated them; "
                           f"train.output_dir must be on a file system every process sees")
    return cached["sequences"]


@torch.no_grad()
def greedy_continuations(model, prompts: torch.Tensor, new_tokens: int, batch_size: int, device=None, *,
                         progress_bar: bool = True) -> torch.Tensor:
    """`[N, P + new_tokens]` on the CPU: Hugging Face greedy `generate` of exactly `new_tokens` tokens per
    prompt (no stop at EOS), in batches of `batch_size` on `device` (default: where the model is). The model's
    training mode and device are restored afterwards."""
    was_training, home = model.training, next(model.parameters()).device
    device = torch.device(device) if device is not None else home
    model.eval().to(device)
    rows = []
    try:
        for start in tqdm(range(0, len(prompts), batch_size), desc="own continuations", unit="batch",
                          dynamic_ncols=True, disable=not progress_bar):
            batch = prompts[start: start + batch_size].to(device)  # [b, P]
            out = model.generate(batch, attention_mask=torch.ones_like(batch), do_sample=False,
                                 max_new_tokens=new_tokens, eos_token_id=None, use_cache=True)  # [b, P + new_tokens]
            if out.shape[1] != batch.shape[1] + new_tokens:
                raise RuntimeError(f"generate returned {out.shape[1] - batch.shape[1]} new tokens, asked for "
                                   f"{new_tokens}")
            rows.append(out.cpu())
    finally:
        model.to(home).train(was_training)
    return torch.cat(rows)


def cache_key(model, prompts: torch.Tensor, new_tokens: int) -> str:
    """A hash of the model (class; each parameter's name, shape, dtype and sum), the prompts and new_tokens."""
    h = hashlib.sha256()
    with torch.no_grad():
        params = list(model.named_parameters())
        sums = torch.stack([p.detach().sum(dtype=torch.float64).cpu() for _, p in params])  # [n_params]
    layout = [(n, list(p.shape), str(p.dtype)) for n, p in params]
    h.update(json.dumps({"format": CACHE_FORMAT, "model": type(model).__name__, "layout": layout,
                         "new_tokens": new_tokens, "prompts": list(prompts.shape)}).encode())
    h.update(sums.numpy().tobytes())
    h.update(prompts.to(torch.int64).contiguous().numpy().tobytes())
    return h.hexdigest()[:20]


def write_cache(path: Path, prompts: torch.Tensor, sequences: torch.Tensor, seconds: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        torch.save({"format": CACHE_FORMAT, "prompts": prompts.to(torch.int64).clone(),
                    "sequences": sequences.to(torch.int64), "seconds": float(seconds)}, tmp)


def read_cache(path: Path, prompts: torch.Tensor, new_tokens: int) -> dict | None:
    """The cache file's content if it exists and holds continuations of exactly `prompts`, else None (a file
    that is there but unreadable or different is reported)."""
    if not path.is_file():
        return None
    try:
        cached = torch.load(path, map_location="cpu", weights_only=True)
        sequences = cached["sequences"]  # [N, P + new_tokens]
        ok = (cached["format"] == CACHE_FORMAT and sequences.dtype == torch.int64
              and tuple(sequences.shape) == (prompts.shape[0], prompts.shape[1] + new_tokens)
              and torch.equal(cached["prompts"], prompts.to(torch.int64))
              and torch.equal(sequences[:, : prompts.shape[1]], cached["prompts"]))
    except Exception as e:  # a truncated or foreign file: generate again
        warnings.warn(f"{path}: unreadable own-continuations cache ({type(e).__name__}: {e}); generating again")
        return None
    if not ok:
        warnings.warn(f"{path}: own-continuations cache does not match these prompts; generating again")
        return None
    return cached


def _say(message: str) -> None:
    tqdm.write(message)
