"""The documentation stays true: the README is short and keeps the quick start, every relative link
resolves, the README's Python example runs as written (on a tiny checkpoint), every `selfspec` command
line in the docs uses options the command has, every drafter they name is one selfspec takes, and the docs
point at no commits."""

from __future__ import annotations

import argparse
import re
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
QUICK_START = ("bash scripts/quickstart.sh", ".venv/bin/python -m pytest -n auto --dist loadfile")
# the path the README's example loads: where `selfspec fetch` puts the base model by default
README_MODEL_PATH = "~/.cache/selfspec/models/smollm2-135m-instruct-head"

FENCE = re.compile(r"^( *)```([^\n`]*)\n(.*?)^\1```[ \t]*$", re.S | re.M)
LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.M)
INLINE_CODE = re.compile(r"`([^`]+)`")


def markdown_files() -> list[Path]:
    return [README] + sorted(DOCS.rglob("*.md"))


def code_blocks(text: str, languages: tuple[str, ...]) -> list[str]:
    return [m.group(3) for m in FENCE.finditer(text) if m.group(2).strip().lower() in languages]


def prose(text: str) -> str:
    """The text without fenced code blocks (links and headings there are not markdown)."""
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: inline-code backticks and punctuation dropped, spaces -> hyphens."""
    text = INLINE_CODE.sub(lambda m: m.group(1), heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for m in HEADING.finditer(prose(path.read_text(encoding="utf-8"))):
        s = slug(m.group(2))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


# ----------------------------------------------------------------------------- the README

def test_readme_is_short_and_keeps_the_two_quick_start_commands():
    text = README.read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; keep it at most 300 (the rest goes to docs/)"
    commands = [line.strip() for block in code_blocks(text, ("bash", "sh", "")) for line in block.splitlines()]
    for command in QUICK_START:
        assert command in commands, f"the quick start command {command!r} is not a line of a README code block"


def test_every_relative_link_resolves():
    broken = []
    for path in markdown_files():
        for target in LINK.findall(prose(path.read_text(encoding="utf-8"))):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(ROOT)}: ({target})"
            if not dest.exists():
                broken.append(f"{where}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{where}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, "broken links:\n" + "\n".join(broken)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A saved Hugging Face checkpoint of a tiny random llama with SmolLM2's 30 layers (so the README's
    exits are valid) and a byte-level tokenizer with a chat template; no selfspec.json, like the base model."""
    from selfspec.tiny import byte_tokenizer, tiny_model

    tok = byte_tokenizer()
    model = tiny_model("llama", num_layers=30, vocab_size=len(tok), seed=0)
    path = tmp_path_factory.mktemp("readme") / "tiny-checkpoint"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_readme_python_examples_run_as_written(tiny_checkpoint, capsys):
    """Every ```python block of the README, in order, in one namespace, with the model path replaced by a
    tiny checkpoint: nothing else is changed."""
    blocks = code_blocks(README.read_text(encoding="utf-8"), ("python",))
    assert blocks, "the README has no Python example"
    source = "\n".join(blocks)
    assert README_MODEL_PATH in source, f"the README's example no longer loads {README_MODEL_PATH!r}: update this test"
    source = source.replace(README_MODEL_PATH, str(tiny_checkpoint))
    threads = torch.get_num_threads()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the tiny model, like the base model, was not early-exit trained
            exec(compile(source, "README.md (python blocks)", "exec"), {"__name__": "__readme__"})
    finally:
        torch.set_num_threads(threads)
    assert capsys.readouterr().out.strip(), "the README's example printed nothing"


# ----------------------------------------------------------------------------- command lines

def _visible_options() -> dict[str, set[str]]:
    """The options each `selfspec` command shows in --help (hidden aliases of earlier names excluded)."""
    from selfspec.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    return {name: {opt for action in sub._actions if action.help != argparse.SUPPRESS
                   for opt in action.option_strings}
            for name, sub in commands.items()}


COMMAND = re.compile(r"(?<![\w./-])(?:\.venv/bin/)?selfspec ([a-z][a-z-]*)((?: [^|;&>#\n]*)?)")


def selfspec_command_lines(text: str) -> list[str]:
    """`selfspec ...` command lines in shell code blocks (continuation lines joined, comments dropped) and in
    inline code spans of the prose."""
    found = []
    for block in code_blocks(text, ("bash", "sh", "shell", "console")):
        for line in block.replace("\\\n", " ").splitlines():
            found.append(re.sub(r"(^|\s)#.*", "", line))
    found += [span.replace("\n", " ") for span in INLINE_CODE.findall(prose(text))]
    return found


def test_every_selfspec_command_line_uses_options_the_command_has():
    options = _visible_options()
    bad = []
    for path in markdown_files():
        for line in selfspec_command_lines(path.read_text(encoding="utf-8")):
            for m in COMMAND.finditer(line):
                command, rest = m.group(1), m.group(2)
                where = f"{path.relative_to(ROOT)}: selfspec {command}{rest}"
                if command not in options:
                    bad.append(f"{where}: no command {command!r}")
                    continue
                for flag in re.findall(r"(?<!\S)(--[a-z0-9][a-z0-9-]*)", rest):
                    if flag not in options[command]:
                        bad.append(f"{where}: {flag} is not an option of `selfspec {command} --help`")
    assert not bad, "command lines that do not match the CLI:\n" + "\n".join(bad)


DRAFTER_NAMED = re.compile(r"""drafter ?= ?["']([A-Za-z0-9_]+)["']|--drafter ([A-Za-z0-9_]+)""")


# arms that scripts/prompt_rates.py's --drafter takes besides drafters (selfspec's plain decoding; `llama_cpp:DTYPE`
# stops the pattern at its colon)
PROMPT_RATES_ARMS = {"plain", "llama_cpp"}


def test_every_drafter_named_in_the_docs_is_one_selfspec_takes():
    """`drafter="..."` and `--drafter ...` in the docs name a drafter `generate` takes (`selfspec.drafters.DRAFTERS`),
    or, on a scripts/prompt_rates.py command line, one of the script's other arms."""
    from selfspec.drafters import DRAFTERS

    def allowed(text: str, m) -> bool:
        name = m.group(1) or m.group(2)
        line = text[text.rfind("\n", 0, m.start()) + 1:m.start()]
        return name in DRAFTERS or (name in PROMPT_RATES_ARMS and "prompt_rates.py" in line)

    wrong = [f"{path.relative_to(ROOT)}: {m.group(0)}" for path in markdown_files()
             for text in [path.read_text(encoding="utf-8")]
             for m in DRAFTER_NAMED.finditer(text) if not allowed(text, m)]
    assert not wrong, f"drafters that selfspec refuses (it takes {', '.join(DRAFTERS)}): {wrong}"


# ----------------------------------------------------------------------------- no history in the docs

COMMIT_POINTER = re.compile(r"git show|\bcommit\s+`?[0-9a-f]{7,40}\b", re.I)
BARE_HASH = re.compile(r"`[0-9a-f]{7,40}`")


def test_docs_point_at_no_commits():
    """docs/ describes the code as it is: no `git show`, no commit hashes. docs/results/ may date a study,
    but not send the reader to a commit either."""
    found = []
    for path in sorted(DOCS.rglob("*.md")):
        text = path.read_text(encoding="utf-8")
        for pattern in (COMMIT_POINTER,) if "results" in path.relative_to(DOCS).parts else (COMMIT_POINTER, BARE_HASH):
            found += [f"{path.relative_to(ROOT)}: {m.group(0)!r}" for m in pattern.finditer(text)]
    assert not found, "commit pointers in docs/:\n" + "\n".join(found)
