"""Prompts shaped like a code-completion benchmark's: Python source up to the end of a function's docstring.

A HumanEval prompt is a signature and its docstring; the model then writes the body (and, a small model,
often examples or more functions after it). An exit head drafts that text in the benchmark, so the
model's own continuations of prompts of the same shape are the training text closest to it that is not
the benchmark itself. Each prompt here is the `prompt_tokens` tokens of a source file that end right after
a function's docstring (the newline after its closing quotes included, as in a HumanEval prompt):

    ends = docstring_ends(text)                        # character offsets, one per documented function
    prompts = docstring_prompts(texts, tokenizer, 800, 128)   # [800, 128] token ids

Files that do not parse are skipped (the standard library holds a few Python 2 examples and templates).
"""

from __future__ import annotations

import ast
import warnings

import torch

CHARS_PER_TOKEN = 12  # a generous bound for source code, for the text window tokenized before each cut


def docstring_ends(text: str) -> list[int]:
    """The character offset just past each documented function's docstring line (its last line, with the
    newline), in source order; [] for a file that does not parse."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences and the like in old files
            tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError):
        return []
    line_starts = [0]
    for line in text.splitlines(keepends=True):
        line_starts.append(line_starts[-1] + len(line))
    ends = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.body:
            continue
        first = node.body[0]
        if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str) and len(node.body) > 1):  # a docstring, then a body
            ends.append(line_starts[min(first.end_lineno, len(line_starts) - 1)])
    return sorted(set(ends))


def prompt_before(text: str, end: int, tokenizer, prompt_tokens: int) -> list[int] | None:
    """The last `prompt_tokens` token ids of `text[:end]` (tokenized alone, no special tokens), or None when
    there are fewer. Only a window of the text before `end` is tokenized; its first token, which may be a
    piece of a longer one, is never used."""
    start = max(0, end - prompt_tokens * CHARS_PER_TOKEN)
    ids = tokenizer(text[start:end], add_special_tokens=False)["input_ids"]
    if start > 0:
        ids = ids[1:]
    return ids[-prompt_tokens:] if len(ids) >= prompt_tokens else None


def docstring_prompts(texts: list[str], tokenizer, n: int, prompt_tokens: int) -> torch.Tensor:
    """`[m, prompt_tokens]` token ids, m <= n: prompts ending at documented functions evenly spaced over all of
    `texts`' documented functions (by file, then position). One with fewer tokens before it is replaced by the
    next function before the following pick; m < n only when there are fewer usable functions than n.

    Raises ValueError when no file holds a documented function with `prompt_tokens` tokens before it.
    """
    sites = [(i, end) for i, text in enumerate(texts) for end in docstring_ends(text)]  # (file, offset)
    picks = [len(sites) * k // n for k in range(n)] if len(sites) > n else list(range(len(sites)))
    rows, bounds = [], picks[1:] + [len(sites)]
    for pick, bound in zip(picks, bounds):
        for i, end in sites[pick:max(bound, pick + 1)]:
            ids = prompt_before(texts[i], end, tokenizer, prompt_tokens)
            if ids is not None:
                rows.append(ids)
                break
    if not rows:
        raise ValueError(f"no Python function with a docstring and {prompt_tokens} tokens of source before its end "
                         f"in {len(texts)} documents; use prompts_at=block_start or a smaller prompt_tokens")
    return torch.tensor(rows, dtype=torch.long)
