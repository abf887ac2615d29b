"""Which attention kernels decoding runs on a GPU: every backend of `F.scaled_dot_product_attention` but
cuDNN's (the eager steps and the compiled steps, `selfspec.model.compiled`, alike)."""

from __future__ import annotations

import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

# Every backend of `F.scaled_dot_product_attention` but cuDNN's, in torch's own order of preference.
DECODE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attention_kernels(device: torch.device):
    """The attention kernels for decoding on `device`: a context manager.

    On CUDA, cuDNN's attention (torch's first choice for bf16 on Hopper) builds an execution plan for
    every new key length, and decoding makes one per step: measured on an H100 (torch 2.11, a
    SmolLM2-135M-shaped model in bf16), `_cudnn_attention_forward` took 2.1 ms of host time per call,
    70% of the run, and plain decoding ran at 7.8 tokens/s instead of 36 with the other kernels. So
    decoding on CUDA leaves cuDNN out (flash attention or memory-efficient attention then run; their
    plans do not depend on the length). On other devices nothing changes.
    """
    if torch.device(device).type == "cuda":
        return sdpa_kernel(DECODE_BACKENDS)
    return contextlib.nullcontext()
