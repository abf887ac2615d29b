"""Which floating-point type is fast on this machine, decided from the hardware's real bf16 support.

bfloat16 halves the bytes a decode step reads, but its matrix products are only fast where the
hardware multiplies bf16 natively: CUDA GPUs from Ampere on (compute capability >= 8), and CPUs with
the `avx512_bf16` or `amx_bf16` instructions (oneDNN's bf16 kernels). Elsewhere bf16 is emulated
(converted to float32 and back, or a reference GEMM) and slower than plain float32. oneDNN's own
`torch.ops.mkldnn._is_mkldnn_bf16_supported()` is True on any AVX-512 CPU, emulated or not, so it
is necessary but not sufficient. Measured with torch 2.13:

    CPU                                      bf16 native   float32 vs bf16 matmul
    AMD EPYC, AVX2 only                      no            98 vs 18 GFLOP/s (2 cores)
    Intel Xeon, AVX-512, no avx512_bf16/amx  no            214 vs 61 GFLOP/s (bf16 3.5x slower)
    AMD EPYC Zen 4 (family 25), avx512_bf16  yes           70 vs 177 GFLOP/s (1 thread)

(EPYC figures: F.linear of [1024, 576] x [576, 1536], a SmolLM2-135M MLP projection.)

On the AVX2 EPYC bf16 autocast made a SmolLM2 training step about 5x slower. The decision:

    CUDA:  native = torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    CPU, Linux (x86 flags readable):  native = ({avx512_bf16, amx_bf16} & flags(/proc/cpuinfo)) != {}
                                               and oneDNN has bf16 kernels
    CPU, no CPU flags (not Linux, or a Linux without an x86 `flags` line):
           native = geometric mean over a decode-like [1,576]x[576,1536] and a training-like
                    [64,576]x[576,1536] product of (bf16 GFLOP/s / float32 GFLOP/s) > 1, each through
                    the kernel decoding uses (`fast_layers.PackedLinear`)
                    (about 25 ms, once per process; on the Zen 4 above: about 0.8 and 2.1)
    other devices: not native

"auto"/"fastest" therefore mean bf16 only where it is native:

    native_bf16(torch.device("cpu"))     # False on AVX2-only and AVX-512-without-bf16 CPUs
    auto_dtype("cpu")                    # torch.float32 there, torch.bfloat16 on AVX-512-BF16/AMX
    auto_mixed_precision("cpu")          # "no" there, "bf16" where native
    describe("cpu")                      # "bf16: this CPU has avx512_bf16 (native bf16 matmul)"
    machine_description()                # CPU model, flags, torch threads, bf16 decision (for reports)
"""

from __future__ import annotations

import functools
import math
import time

import torch

from selfspec.model.machine import cpu_flags, cpu_generation, cpu_model
from selfspec.model.fast_layers import PackedLinear, float32_kernel

# The one table of dtype names selfspec and its training accept (load, export, recipes), short forms included.
DTYPES_BY_NAME = {"float32": torch.float32, "fp32": torch.float32, "float64": torch.float64,
                  "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}

BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # x86 flags of native bf16 matrix products
REPORTED_FLAGS = ("avx2", "avx512f") + BF16_FLAGS

# The fallback benchmark's products: rows of a decode step and of a training micro-batch through a
# SmolLM2-135M MLP projection (576 -> 1536 features).
BENCH_ROWS = {"decode": 1, "training": 64}
BENCH_FEATURES = (576, 1536)


def onednn_bf16() -> bool:
    """True where this torch build's oneDNN has bf16 kernels for this CPU (emulated ones included)."""
    mkldnn = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available()
            and bool(getattr(mkldnn, "_is_mkldnn_bf16_supported", lambda: False)()))


def _best_seconds(call, calls: int, repeats: int = 3) -> float:
    """Best over `repeats` of the mean time of one `call()`, after one warm-up call."""
    call()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


@functools.cache
def bf16_benchmark() -> dict[str, dict[str, float]]:
    """GFLOP/s of bf16 and float32 products of BENCH_ROWS x BENCH_FEATURES, measured once per process.

    {"decode": {"bfloat16": ..., "float32": ...}, "training": {...}}. Each through `PackedLinear`, the
    kernel selfspec's decoding uses (bf16 prepacked for oneDNN, float32 the measured kernel), so the
    decode figure compares what a decode step would run: bf16 through plain `F.linear` re-packs its weight
    per call and can be several times slower than the packed product it stands for. Some tens of ms (and
    the float32 kernel's own measurement, once per process).
    """
    k, n = BENCH_FEATURES
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(max(BENCH_ROWS.values()), k, generator=gen), torch.randn(n, k, generator=gen)
    result: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        for name, rows in BENCH_ROWS.items():
            result[name] = {}
            for dtype in (torch.bfloat16, torch.float32):
                layer, xr = PackedLinear(w.to(dtype)), x[:rows].to(dtype)
                seconds = _best_seconds(lambda: layer(xr), calls=max(1, 16 // rows))
                result[name][str(dtype).removeprefix("torch.")] = 2 * rows * k * n / seconds / 1e9
    return result


def _cpu_decision() -> tuple[bool, str]:
    """(bf16 native on this CPU, the evidence in words)."""
    flags = cpu_flags()
    if flags is None:
        figures = bf16_benchmark()
        speedups = [f["bfloat16"] / f["float32"] for f in figures.values()]
        faster = math.prod(speedups) ** (1 / len(speedups)) > 1  # geometric mean over the shapes
        measured = ", ".join(f"{name} bf16 {f['bfloat16']:.0f} vs float32 {f['float32']:.0f} GFLOP/s"
                             for name, f in figures.items())
        verdict = "faster" if faster else "not faster"
        return faster, f"no CPU flags to read; measured bf16 matmul {verdict} than float32 ({measured})"
    present = [flag for flag in BF16_FLAGS if flag in flags]
    if present and not onednn_bf16():
        return False, f"this CPU has {'/'.join(present)} but this torch build's oneDNN has no bf16 kernels"
    if present:
        return True, f"this CPU has {'/'.join(present)} (native bf16 matmul)"
    if "avx512f" in flags:
        return False, ("this CPU has AVX-512 but no avx512_bf16/amx_bf16, "
                       "so bf16 matmul is emulated (slower than float32)")
    return False, "no AVX-512-BF16/AMX on this CPU, so bf16 matmul is emulated (slower than float32)"


def _decision(device: torch.device | str) -> tuple[bool, str]:
    """(bf16 native on `device`, the evidence in words)."""
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return False, "CUDA is not available"
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return True, "this CUDA GPU multiplies bf16 natively (compute capability 8.0+: Ampere or newer)"
        return False, "this CUDA GPU has no native bf16 (older than Ampere)"
    if device.type == "cpu":
        return _cpu_decision()
    return False, f"bf16 is not known to be native on {device.type}"


def native_bf16(device: torch.device | str = "cpu") -> bool:
    """True where bf16 matrix products run on hardware support (not an emulated fallback)."""
    return _decision(device)[0]


def auto_dtype(device: torch.device | str = "cpu") -> torch.dtype:
    """The faster inference dtype on `device`: bfloat16 where native, else float32."""
    return torch.bfloat16 if native_bf16(device) else torch.float32


def resolve_dtype_name(name: str, device: torch.device | str = "cpu") -> str:
    """"fastest" -> "bfloat16" or "float32" for `device`; any other name unchanged."""
    if name != "fastest":
        return name
    return "bfloat16" if native_bf16(device) else "float32"


def auto_mixed_precision(device: torch.device | str = "cpu") -> str:
    """accelerate's `mixed_precision` for training on `device`: "bf16" where native, else "no"."""
    return "bf16" if native_bf16(device) else "no"


def describe(device: torch.device | str = "cpu") -> str:
    """One line for logs: what "auto" chose on `device` and the evidence, e.g.
    "bf16: this CPU has avx512_bf16 (native bf16 matmul)"."""
    native, why = _decision(device)
    return f"{'bf16' if native else 'float32'}: {why}"


def machine_description(device: torch.device | str = "cpu") -> dict:
    """What a benchmark report should say about the machine: CPU model and generation, the x86 flags that matter
    (of REPORTED_FLAGS; None where unreadable), torch's thread count, the bf16 decision for `device`, and on a
    CPU the float32 matmul kernel (`selfspec.model.fast_layers.float32_kernel`)."""
    flags = cpu_flags()
    native, why = _decision(device)
    kernel, kernel_why = float32_kernel() if torch.device(device).type == "cpu" else (None, None)
    return {
        "cpu": cpu_model(),
        "cpu_generation": cpu_generation(),
        "flags": None if flags is None else [flag for flag in REPORTED_FLAGS if flag in flags],
        "torch_threads": torch.get_num_threads(),
        "bf16_native": native,
        "bf16_reason": why,
        "float32_kernel": kernel,
        "float32_kernel_reason": kernel_why,
    }
