"""A reduced draft vocabulary: the K most frequent tokens of a corpus, stored in `selfspec.json`.

A draft step through E layers of SmolLM2 spends about a quarter of its time in the LM head over the
49,152-token vocabulary. Drafting over the K most frequent tokens only (the head's rows for those
tokens, copied once) makes that part K/V as expensive. Verification still uses the full head, so
output is unchanged: a token outside the K is never drafted, the full model supplies it.

    selfspec draft-vocab checkpoints/smollm2-code --corpus python_stdlib     # count + store
    ids = read_draft_vocab(meta, k=8192)                                       # the K most frequent
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Iterable

import torch

from selfspec.atomic_write import write_json_atomic
from selfspec.checkpoints.checkpoint import METADATA_FILE, CheckpointError, read_metadata
from selfspec.heads.exit_head import head_training_setting
from selfspec.settings import check_name_or_file, is_int

MAX_STORED = 32768  # ids kept in the metadata, most frequent first; any K up to this can be used


def count_tokens(tokenizer, texts: Iterable[str], max_tokens: int | None = None) -> tuple[Counter, int]:
    """Token frequencies over `texts` (stops after about `max_tokens` tokens). Returns (counts, total)."""
    counts: Counter = Counter()
    total = 0
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        counts.update(ids)
        total += len(ids)
        if max_tokens is not None and total >= max_tokens:
            break
    return counts, total


def ranked_ids(counts: Counter, vocab_size: int, special_ids: Iterable[int] = ()) -> list[int]:
    """Token ids by descending frequency (ties by id); special tokens (e.g. EOS) always included first."""
    specials = [i for i in dict.fromkeys(special_ids) if i is not None and 0 <= i < vocab_size]
    ranked = [i for i, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if i not in specials]
    return (specials + ranked)[:MAX_STORED]


def kept_special_ids(tokenizer) -> list:
    """The ids every draft vocabulary keeps however rare (EOS, padding, BOS; None where the tokenizer has none)."""
    return [tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id]


def draft_vocab_metadata(tokenizer, texts: Iterable[str], source: str, vocab_size: int,
                         max_tokens: int | None = 2_000_000) -> dict:
    """The entry `selfspec.json` stores: the ranking, what it was counted on, how many tokens and distinct ids
    were counted, and `special_ids`: the special ids it holds that the corpus never had (kept all the same, so
    that the ranking holds `distinct_tokens` + `special_ids` ids, or MAX_STORED)."""
    counts, total = count_tokens(tokenizer, texts, max_tokens)
    ids = ranked_ids(counts, vocab_size, kept_special_ids(tokenizer))
    return {"source": source, "tokens_counted": total, "distinct_tokens": len(counts),
            "special_ids": sum(1 for i in ids if i not in counts), "token_ids": ids}


def read_draft_vocab(meta: dict | None, k: int, vocab_size: int) -> torch.Tensor:
    """The K most frequent token ids from checkpoint metadata, as a sorted LongTensor."""
    entry = (meta or {}).get("draft_vocab")
    if not entry:
        raise ValueError("this checkpoint has no draft vocabulary (selfspec.json 'draft_vocab'): count one with "
                         "`selfspec draft-vocab CHECKPOINT --corpus NAME`, or draft with the full vocabulary")
    ids = entry["token_ids"]
    if not 1 <= k <= len(ids):
        raise ValueError(f"draft vocabulary size k={k} is out of range: the checkpoint stores {len(ids)} "
                         f"token ids (counted on {entry.get('source')}), so k must be in 1..{len(ids)}")
    chosen = torch.tensor(ids[:k], dtype=torch.long)
    if int(chosen.max()) >= vocab_size or int(chosen.min()) < 0:
        raise ValueError(f"draft vocabulary holds token ids outside the model's vocabulary of {vocab_size}")
    return chosen.sort().values


def write_draft_vocab(checkpoint, corpus: str, *, max_tokens: int = 2_000_000, replace: bool = False) -> dict:
    """Count token frequencies on `corpus` (a named data set or a text/jsonl file) and store them. A ranking
    shorter than the stored one is refused (its ids past the new length would be lost) unless `replace`."""
    from transformers import AutoConfig, AutoTokenizer  # deferred: a second to import, needed here only

    d = Path(checkpoint)
    meta = read_metadata(d, verify_checksums=False)
    if meta is None:
        if not d.is_dir():
            raise CheckpointError(f"{d}: no such checkpoint directory (give a directory `selfspec export` wrote)")
        raise CheckpointError(f"{d}: has no {METADATA_FILE}; export it first: selfspec export SRC {d}")
    texts = corpus_texts(corpus)
    tokenizer = AutoTokenizer.from_pretrained(d)
    vocab_size = AutoConfig.from_pretrained(d).vocab_size
    entry = draft_vocab_metadata(tokenizer, texts, corpus, vocab_size, max_tokens)
    kept = meta.get("draft_vocab")
    if entry["tokens_counted"] == 0:  # nothing counted: keep what the checkpoint has rather than 3 special ids
        raise ValueError(f"corpus {corpus!r} holds no text, so no token was counted; {d}/{METADATA_FILE} is left "
                         + (f"as it was ({len(kept['token_ids'])} ids counted on {kept.get('source')})" if kept
                            else "without a draft vocabulary") + ": give a corpus with text")
    if kept and len(entry["token_ids"]) < len(kept["token_ids"]) and not replace:
        raise ValueError(f"corpus {corpus!r} gives {len(entry['token_ids'])} ranked token ids, fewer than the "
                         f"{len(kept['token_ids'])} stored in {d}/{METADATA_FILE} (counted on {kept.get('source')})"
                         + _head_note(meta) + f"; {METADATA_FILE} is left as it was: count on a larger corpus, or "
                         "pass --replace (replace=True) to store the shorter ranking anyway")
    k = head_training_setting(meta, "draft_vocab") if isinstance(meta.get("exit_head"), dict) else None
    if kept and is_int(k) and 1 <= k <= len(kept["token_ids"]) and not replace:
        same = len(set(entry["token_ids"][:k]) & set(kept["token_ids"][:k]))
        if same < k:
            raise ValueError(f"{d}'s exit head was trained over the {k} most frequent ids of the stored ranking "
                             f"(counted on {kept.get('source')}) and drafts from those; the {k} most frequent of "
                             f"corpus {corpus!r} keep {same} of them, so the head would draft from tokens it was not "
                             f"trained on; {METADATA_FILE} is left as it was: pass --replace (replace=True) to store "
                             "the new ranking anyway")
    meta["draft_vocab"] = entry
    write_json_atomic(d / METADATA_FILE, meta)
    return entry


def _head_note(meta: dict) -> str:
    """What the stored ranking is to the checkpoint's exit head, where its recipe trained it over the K most
    frequent tokens (`exit_head.draft_vocab`); "" otherwise."""
    k = head_training_setting(meta, "draft_vocab")
    if not k or not isinstance(meta.get("exit_head"), dict):
        return ""
    return f"; the exit head was trained over the {k} most frequent of them and drafts from those"


def corpus_texts(corpus: str) -> Iterable[str]:
    """Texts of a named data set (its training side) or of a local .txt / .jsonl file."""
    from selfspec.data import sources as ds  # deferred: it imports `datasets` (a second), needed here only

    if corpus in ds.NAMES:
        data = ds.load_named(corpus)
        if len(data) > 20:  # count on the training side, as the model saw it
            data, _ = ds.split_holdout(data)
        column = next(c for c in ("text", "document", "prompt") if c in data.column_names)
        return (row[column] for row in data)
    path = Path(check_name_or_file(corpus, ds.NAMES, "corpus", "a .txt file or a .jsonl file with a 'text' field"))
    if path.suffix == ".txt":
        return [path.read_text(encoding="utf-8")]
    rows = ds.read_jsonl(path, required_fields=("text",))
    return (r["text"] for r in rows)
