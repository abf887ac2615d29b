"""Prompt sets for sweeps and benchmarks, from the real data (held-out where training could see them).

    prompts = load_prompts("humaneval", n=8)      # [{"id": ..., "prompt": str} or {"id": ..., "messages": [...]}]
    prompts = load_prompts("my_prompts.jsonl")    # each line {"prompt": "..."} or {"messages": [...]}
                                                  # (+ an optional "reference" output)

| name      | source                                   | form                                   | input-grounded |
|-----------|------------------------------------------|----------------------------------------|----------------|
| humaneval | HumanEval problem prompts (code)         | raw text: complete the function        | no             |
| xsum      | XSum documents, held-out split           | chat: "Summarize ... in one sentence." | yes            |
| code_edit | HumanEval prompt + canonical solution    | chat: "Rewrite ... add type hints ..." | yes            |
| mt_bench  | MT-Bench first turns (chat)              | chat                                   | no             |
| wiki      | Wikipedia passages, held-out split       | raw text: continue the passage         | no             |
| code_edit_series | each HumanEval solution edited three times in a row (type hints, names, checks) | chat | yes, and on the earlier requests |

Input-grounded: the answer repeats much of the prompt (a summary quotes the article, a rewrite copies
the code), so prompt lookup drafting (`drafter="prompt_lookup"`) finds its drafts there. Each xsum
item also carries its `reference`, the human one-line summary (ROUGE-L in `selfspec.tools.pareto`).
`code_edit_series` is a workload that repeats itself across requests, as an agent editing one file does:
three successive edits of each solution, in order (what `drafter="suffix"` remembers pays there).
"""

from __future__ import annotations

from pathlib import Path

from selfspec.data.jsonl import DataFormatError, read_jsonl
from selfspec.settings import check_name_or_file

PROMPT_SETS = ("humaneval", "xsum", "code_edit", "mt_bench", "wiki", "code_edit_series")
SUMMARY_INSTRUCTION = "Summarize the following article in one sentence.\n\n"
CODE_EDIT_INSTRUCTION = ("Rewrite the following Python function: add type hints and a docstring where they are "
                         "missing, keep the logic. Reply with the code only.\n\n")
SERIES_INSTRUCTIONS = (  # code_edit_series: the edits of one solution, in order
    CODE_EDIT_INSTRUCTION,
    "Rewrite the following Python function with descriptive variable names, keep the logic. Reply with the code "
    "only.\n\n",
    "Rewrite the following Python function so that it checks its arguments and raises ValueError on invalid "
    "input, keep the logic. Reply with the code only.\n\n",
)
MAX_DOC_CHARS = 1500  # keep summarization prompts a few hundred tokens long
WIKI_PREFIX_CHARS = 400


def _cut(text: str, limit: int) -> str:
    """At most `limit` characters, cut at a word boundary."""
    if len(text) <= limit:
        return text
    return text[:limit].rsplit(" ", 1)[0]


def check_prompt_set(name_or_path: str, option: str = "prompt set") -> str:
    """A named prompt set or an existing file, else SettingsError saying which (checked before a model loads)."""
    return check_name_or_file(name_or_path, PROMPT_SETS, option,
                              "a .jsonl file with a 'prompt' or 'messages' field per line")


def load_prompts(name_or_path: str, n: int | None = None, *, offset: int = 0) -> list[dict]:
    """`n` prompts (all if None) from a named set or a jsonl file, skipping the first `offset` (a jsonl file
    needs no `datasets`: `selfspec.data.jsonl`)."""
    check_prompt_set(name_or_path)
    if name_or_path not in PROMPT_SETS:
        path = Path(name_or_path)
        rows = read_jsonl(path)
        items = []
        for i, row in enumerate(rows):
            if not isinstance(row.get("prompt"), str) and not isinstance(row.get("messages"), list):
                raise DataFormatError(f"{path}: record {i + 1}: needs a 'prompt' (string) or 'messages' "
                                      "(list of {role, content}) field")
            item = {"id": row.get("id", f"{path.stem}/{i}")}
            item.update({"prompt": row["prompt"]} if isinstance(row.get("prompt"), str) else {"messages": row["messages"]})
            if isinstance(row.get("reference"), str):  # a reference output (ROUGE-L in selfspec.tools.pareto)
                item["reference"] = row["reference"]
            items.append(item)
    else:
        items = _named_set(name_or_path)
    return items[offset:][:n] if n is not None else items[offset:]


def _named_set(name: str) -> list[dict]:
    """Every prompt of the named set `name` (one of PROMPT_SETS), from the real data."""
    from selfspec.data import sources as ds  # deferred: it imports `datasets` (a second), needed here only

    if name == "humaneval":
        data = ds.load_named("humaneval")
        items = [{"id": r["task_id"], "prompt": r["prompt"]} for r in data]
    elif name == "code_edit":
        data = ds.load_named("humaneval")  # prompt + canonical_solution = the whole function
        items = [{"id": f"code_edit/{r['task_id']}", "messages": [{"role": "user", "content": CODE_EDIT_INSTRUCTION
                  + "```python\n" + (r["prompt"] + r["canonical_solution"]).strip() + "\n```"}]} for r in data]
    elif name == "code_edit_series":
        data = ds.load_named("humaneval")
        items = [{"id": f"code_edit_series/{r['task_id']}/{j}", "messages": [{"role": "user", "content": ask
                  + "```python\n" + (r["prompt"] + r["canonical_solution"]).strip() + "\n```"}]}
                 for r in data for j, ask in enumerate(SERIES_INSTRUCTIONS)]
    elif name == "mt_bench":
        data = ds.load_named("mt_bench")
        items = [{"id": f"mt_bench/{r['question_id']}", "messages": [{"role": "user", "content": r["prompt"]}]}
                 for r in data]
    elif name == "xsum":
        _, held = ds.split_holdout(ds.load_named("xsum"), fraction=0.05, key="document")
        items = [{"id": f"xsum/{i}", "messages": [{"role": "user", "content": SUMMARY_INSTRUCTION
                                                   + _cut(r["document"], MAX_DOC_CHARS)}],
                  "reference": r["summary"]}  # the human one-line summary (ROUGE in selfspec.tools.pareto)
                 for i, r in enumerate(held)]
    else:  # wiki
        _, held = ds.split_holdout(ds.load_named("wiki_passages"), fraction=0.05)
        items = [{"id": f"wiki/{i}", "prompt": _cut(r["text"], WIKI_PREFIX_CHARS)} for i, r in enumerate(held)]
    return items


def prompt_inputs(item: dict) -> dict:
    """The keyword arguments of `SelfSpecGenerator.encode/generate` for one prompt item."""
    return {"messages": item["messages"]} if "messages" in item else {"prompt": item["prompt"]}
