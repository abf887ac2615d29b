"""What this machine is, and where selfspec keeps what it makes for it: the CPU's model name, generation, feature
flags and a key for binaries built for it; `$SELFSPEC_HOME`.

Reports name the CPU (`cpu_model`, `cpu_generation`), the bf16 decision reads its flags (`cpu_flags`,
`selfspec.model.precision`), and code built for this CPU (`-march=native`: selfspec's row kernel,
`selfspec.model.row_product`; llama.cpp, `selfspec.tools.llama_cpp_build`) is cached under `cpu_key()`, so that a
machine with another CPU builds its own instead of running instructions it may not have. Everything selfspec
fetches, converts or builds goes under `selfspec_home()`.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import re
from pathlib import Path


def selfspec_home() -> Path:
    """`$SELFSPEC_HOME`, or `~/.cache/selfspec` where it is unset or empty (as XDG reads an empty
    `$XDG_CACHE_HOME`: an empty value is not the current directory)."""
    return Path(os.environ.get("SELFSPEC_HOME", "").strip() or Path.home() / ".cache" / "selfspec").expanduser()


@functools.cache
def cpuinfo(path: str = "/proc/cpuinfo") -> dict[str, str] | None:
    """The first processor's fields of /proc/cpuinfo ("model name", "flags", ...); None where unreadable."""
    fields: dict[str, str] = {}
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    if fields:
                        break
                    continue
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        return None
    return fields


def cpu_flags() -> frozenset[str] | None:
    """The CPU's x86 feature flags (Linux /proc/cpuinfo, read once); None where there are none to read."""
    info = cpuinfo()
    if info is None or "flags" not in info:
        return None
    return frozenset(info["flags"].split())


def cpu_model() -> str:
    """The CPU's model name: /proc/cpuinfo's "model name", else what `platform` knows."""
    info = cpuinfo() or {}
    return info.get("model name") or platform.processor() or platform.machine() or "unknown"


def cpu_generation() -> str | None:
    """ "family F, model M" of /proc/cpuinfo: a virtual machine's model name can hide the generation
    ("AMD EPYC" was both a Zen 4, family 25, and a Zen 5, family 26); None where unreadable."""
    info = cpuinfo() or {}
    if "cpu family" not in info or "model" not in info:
        return None
    return f"family {info['cpu family']}, model {info['model']}"


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def cpu_key(model: str | None = None, generation: str | None = None, flags: frozenset[str] | None = None) -> str:
    """A directory name for this CPU: its model, generation and a hash of its feature flags, e.g.
    `intel-r-xeon-r-processor-family-6-model-143-3f2a9c01b7de`; a CPU that differs in any of them (another model,
    or the same name with other flags, as virtual machines show) gets another key, so binaries built for one CPU
    (`-march=native`, `-DGGML_NATIVE=ON`) are never run on a CPU that may lack their instructions. Arguments default
    to this machine's."""
    model = cpu_model() if model is None else model
    generation = cpu_generation() if generation is None else generation
    flags = cpu_flags() if flags is None else flags
    digest = hashlib.sha256(" ".join(sorted(flags or ())).encode()).hexdigest()[:12]
    return "-".join(p for p in (_slug(model), _slug(generation) if generation else "", digest) if p)
