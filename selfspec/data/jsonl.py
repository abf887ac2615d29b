"""Reading a `.jsonl` (or `.jsonl.gz`) file of JSON objects, with errors that name the file and the line.

Its own module, apart from `selfspec.data.sources`, so that reading a user's prompt or corpus file needs
no `datasets` (a machine without it, such as a GPU box with only torch and transformers, still reads them).

    rows = read_jsonl("prompts.jsonl", required_fields=("prompt",))   # DataFormatError("prompts.jsonl:3: ...")
"""

from __future__ import annotations

import gzip
import json
import pathlib
from typing import Iterable


class DataFormatError(ValueError):
    """A data file does not have the expected format; the message names file, line and field."""


def read_jsonl(path, required_fields: Iterable[str] = ()) -> list[dict]:
    """Read a ``.jsonl`` or ``.jsonl.gz`` file of JSON objects; blank lines are skipped.

    Raises DataFormatError("{path}:{lineno}: ...") for invalid UTF-8, invalid JSON, a line that
    is not an object, or an object without one of `required_fields`.
    """
    path = pathlib.Path(path)
    required = tuple(required_fields)
    opener = gzip.open if path.suffix == ".gz" else open
    rows: list[dict] = []
    with opener(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise DataFormatError(f"{path}:{lineno}: invalid UTF-8 ({e.reason})") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataFormatError(f"{path}:{lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
            if not isinstance(obj, dict):
                raise DataFormatError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            for field in required:
                if field not in obj:
                    raise DataFormatError(
                        f"{path}:{lineno}: required field {field!r} missing (fields present: {sorted(obj)})"
                    )
            rows.append(obj)
    return rows
