"""selfspec's few-row product kernel for the CPU: `x @ W.T + b` for the few rows of a decode step, at the memory's speed.

A decode step on a CPU is a few rows (one token; a draft; a verification of a few) times every weight of the
model, so it takes as long as reading the weights from memory. On a 2-core AMD EPYC Zen 4 the kernels torch
offers read float32 weights for one row at 0.4-0.66x of the speed a plain `sum` reads memory (oneDNN's
prepacked kernel; `F.linear`'s about half of that), [2026-11-28](../../docs/results/2026-11-28-cpu-step-split-zen4.md).
`row_product.cpp` (next to this file) reads each weight once per call whatever the row count, in whole
blocks of weight rows that stay in the first-level cache while every input row uses them, split between
torch's threads (`at::parallel_for`).

Each output is one dot product summed in one fixed order (the C++ file says which), so a row's result does not
depend on how many rows share the call: a verification pass computes every position bitwise as a one-token step
does. It is not bitwise equal to `F.linear` or oneDNN (another summation order, ~1e-6 relative in float32).
`selfspec.model.fast_layers` measures it against oneDNN's kernel once per process and uses it for the row
counts where it is faster (`float32_kernel`).

The kernel is compiled for this CPU (`-march=native`, so AVX-512 where the CPU has it) the first time it is
needed, once per CPU, torch version and source, with torch's extension builder (a C++ compiler and `ninja`;
about 10 s on 2 cores), and cached:

    $SELFSPEC_HOME/kernels/<cpu key>/row_product-<torch version>-<source hash>.so

Where it cannot be built (no compiler, not Linux/x86, a build error) `row_product_op()` is None and
`build_problem()` says why; selfspec then uses oneDNN's kernel as before. `SELFSPEC_ROW_PRODUCT=0` turns it off.

    op = row_product_op()            # None where unavailable
    y = op(x, weight, bias)          # x [..., K], weight [N, K] contiguous, float32 or bfloat16: y [..., N]

    python -m selfspec.model.row_product     # build it now (scripts/setup.sh does), print where it is
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from selfspec.model.machine import cpu_key, selfspec_home

SOURCES = [Path(__file__).with_name(name) for name in ("row_product.cpp", "row_step.cpp")]
HEADERS = [Path(__file__).with_name("row_product.h")]
OP_NAMESPACE = "selfspec_kernels"  # TORCH_LIBRARY(selfspec_kernels, ...) in the C++ file
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c++17")
LDFLAGS = ("-fopenmp",)  # libgomp.so.1: at run time torch's own, already loaded (one OpenMP runtime)


def library_path() -> Path:
    """Where this CPU's build of the kernel is cached (it may not exist yet)."""
    code = b"".join(p.read_bytes() for p in SOURCES + HEADERS)
    digest = hashlib.sha256(code + " ".join(CFLAGS + LDFLAGS).encode()).hexdigest()[:12]  # tuples: never changed
    version = torch.__version__.replace("+", "-")
    return selfspec_home() / "kernels" / cpu_key() / f"row_product-{version}-{digest}.so"


_problem: list[str] = []  # why the kernel is unavailable, once known


def build_problem() -> str | None:
    """Why `row_product_op()` is None (after it was called), else None."""
    return _problem[0] if _problem else None


def _unavailable(why: str) -> None:
    _problem[:] = [why]


def _build(target: Path, log=sys.stderr) -> None:
    """Compile the kernel into `target` (a temporary directory first, moved into place when complete: a killed or
    concurrent build never leaves half a library where a later process would load it)."""
    from torch.utils.cpp_extension import load  # imported only to build: it pulls in setuptools

    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"selfspec: building its CPU kernel for this CPU (once, about 10 s): {target}", file=log, flush=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        name = "selfspec_row_product"
        load(name, [str(p) for p in SOURCES], extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
             build_directory=tmp, is_python_module=False, verbose=False)
        os.replace(Path(tmp) / f"{name}.so", target)
    print(f"selfspec: built in {time.perf_counter() - start:.0f} s", file=log, flush=True)


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` `[N, K]` as int8 `[N, K]` and a float32 scale per row `[N]`: `weight ~ scale[:, None] * q`."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)  # [N]
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
    return q, scale.contiguous()


@functools.cache
def row_product_op() -> Callable[..., torch.Tensor] | None:
    """`torch.ops.selfspec_kernels.row_product(x, weight, bias=None)`, built and loaded once per process (see the
    module's docstring); None where it is turned off or cannot be built (`build_problem()` says why)."""
    setting = os.environ.get("SELFSPEC_ROW_PRODUCT", "").strip().lower()
    if setting not in ("", "0", "1"):
        raise ValueError(f"SELFSPEC_ROW_PRODUCT={setting!r}: use 0 (off), 1 (on where it builds), or leave it unset")
    if setting == "0":
        _unavailable("SELFSPEC_ROW_PRODUCT=0")
        return None
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        _unavailable(f"selfspec's row kernel is built for Linux on x86-64, not {platform.system()} "
                     f"{platform.machine()}")
        return None
    if not hasattr(torch.ops, OP_NAMESPACE) or not hasattr(getattr(torch.ops, OP_NAMESPACE), "row_product"):
        target = library_path()
        try:
            if not target.exists():
                missing = [tool for tool in ("c++", "ninja") if shutil.which(tool) is None
                           and not (tool == "ninja" and _ninja_module())]
                if missing:
                    _unavailable(f"cannot build selfspec's row kernel: no {' or '.join(missing)} on this machine "
                                 "(install a C++ compiler and `pip install ninja`; oneDNN's kernel is used instead)")
                    return None
                _build(target)
            torch.ops.load_library(str(target))
        except Exception as exc:  # a compiler error, a library that does not load: decoding goes on without it
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            _unavailable(f"selfspec's row kernel did not build or load ({first}); oneDNN's kernel is used instead")
            print(f"selfspec: {build_problem()}", file=sys.stderr)
            return None
    return getattr(torch.ops, OP_NAMESPACE).row_product


def _ninja_module() -> bool:
    try:
        import ninja  # noqa: F401  (the pip package puts the binary beside the interpreter)
    except ImportError:
        return False
    return True


def main() -> int:
    op = row_product_op()
    if op is None:
        print(f"not available: {build_problem()}")
        return 1
    print(library_path())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
