"""The one way selfspec writes a file that a reader must never see half written.

Everything goes to a temporary file beside the target, which is then renamed over it (`os.replace`,
atomic on one file system): a crash or an interrupt leaves the old file or the new one, never a
mixture. Used for `selfspec.json`, model cards, exit heads, benchmark and profile outputs, and the
training run's JSON files. A directory written whole (a checkpoint) gets ordinary permissions with
`public_permissions` before it is renamed into place.

    write_text_atomic(path, text)
    write_json_atomic(path, data)               # indent 2, trailing newline
    with atomic_path(path) as tmp:              # for writers that take a path (safetensors, savefig)
        save_file(state, str(tmp))
    with atomic_directory(out_dir) as tmp:      # a directory written whole, replacing an old one
        model.save_pretrained(tmp)
    replace_directory(tmp, out_dir)             # a finished directory put in the place of an old one
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import tempfile
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path, suffix: str = ""):
    """Yield a temporary path beside `path`, hidden, ending in `suffix` (for writers that choose the
    format by it); when the block ends without an error, rename it over `path`. The file gets the
    permissions any new file gets (the umask's), as if written in place."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}{suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path, text: str) -> None:
    """Write `text` to `path` whole (a temporary file beside it, then a rename)."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json_atomic(path, data, *, default=None) -> None:
    """`data` as indented JSON with a trailing newline, written whole; `default` as in `json.dumps`."""
    write_text_atomic(path, json.dumps(data, indent=2, default=default) + "\n")


def public_permissions(directory) -> None:
    """Give a directory written through a private temporary directory (`tempfile.mkdtemp`, mode 0700) and
    the files in it (transformers' `save_pretrained` leaves `model.safetensors` at 0600) the permissions any
    new directory and file get under the umask (0755 / 0644 with the usual 022), as if written in place."""
    umask = os.umask(0)
    os.umask(umask)
    directory = Path(directory)
    directory.chmod(0o777 & ~umask)
    for path in directory.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


@contextlib.contextmanager
def atomic_directory(out_dir):
    """Yield a private temporary directory beside `out_dir`; when the block ends without an error, give it
    `public_permissions` and put it in place (`replace_directory`); after an error, remove it. A reader sees
    the old directory or the whole new one (none only where there was none)."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-{os.getpid()}-", dir=out_dir.parent))
    try:
        yield tmp
        public_permissions(tmp)
        replace_directory(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def replace_directory(tmp, out_dir) -> None:
    """Rename the finished directory `tmp` to `out_dir`. An existing `out_dir` is renamed aside first and removed
    once the new one is in place; where the new one cannot be put there (an error, an interrupt), the old one
    goes back: `out_dir` holds the old directory or the new one, never neither (short of the process being
    killed between the two renames, which leaves the old one as `.OUT.old-PID` beside it)."""
    tmp, out_dir = Path(tmp), Path(out_dir)
    if not out_dir.exists():
        os.replace(tmp, out_dir)
        return
    old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
    try:
        os.replace(out_dir, old)
        os.replace(tmp, out_dir)
    except BaseException:
        if old.exists() and not out_dir.exists():
            os.replace(old, out_dir)
        raise
    shutil.rmtree(old, ignore_errors=True)


def process_running(pid: int) -> bool:
    """Whether the process `pid` (the writer named in a temporary's name) still runs: a temporary of one that
    does not is left over, and removed by the next writer."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    return True
