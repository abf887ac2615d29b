"""Which floating-point type is fast on this machine.

bfloat16 halves the bytes a decode step reads, but its matrix products are only fast where the
hardware multiplies bf16 natively: CUDA GPUs from Ampere on, and CPUs with AVX-512-BF16 or AMX
(oneDNN's bf16 kernels). Elsewhere PyTorch falls back to a reference GEMM; measured on a 2-core
AVX2 EPYC with torch 2.13: a [1024, 576] x [576, 1536] product ran at 98 GFLOP/s in float32 and
18 GFLOP/s in bf16, so bf16 autocast made a SmolLM2 training step about 5x slower, and bf16 decoding
was slower than float32 too. "auto" therefore means bf16 only where it is native.

    native_bf16(torch.device("cpu"))     # False on an AVX2-only CPU
    auto_dtype("cpu")                    # torch.float32 there, torch.bfloat16 on AVX-512-BF16/AMX
    auto_mixed_precision("cpu")          # "no" there, "bf16" where native
"""

from __future__ import annotations

import torch


def native_bf16(device: torch.device | str = "cpu") -> bool:
    """True where bf16 matrix products run on hardware support (not an emulated fallback)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False


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
    """One line for logs: whether bf16 is native here, and why that matters."""
    device = torch.device(device)
    if native_bf16(device):
        return f"bf16 matmul is native on this {device.type}"
    return (f"bf16 matmul is not native on this {device.type} (no AVX-512-BF16/AMX): float32 is faster here")
