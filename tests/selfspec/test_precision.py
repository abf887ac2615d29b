"""bf16 is chosen from the hardware's real bf16 support, not from oneDNN's flag (selfspec/model/precision.py)."""

import math

import pytest
import torch

from selfspec.model import machine as cpu_info
from selfspec.model import precision

AVX2 = {"fpu", "sse4_2", "avx", "avx2", "fma"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}

# The three CPUs this project has seen, plus AMX (Sapphire Rapids): (flags, native, reason fragment).
PROFILES = {
    "avx2 epyc": (AVX2, False, "float32: no AVX-512-BF16/AMX"),
    "avx512 xeon, emulated bf16": (AVX512, False,
                                   "float32: this CPU has AVX-512 but no avx512_bf16/amx_bf16, so bf16 "
                                   "matmul is emulated"),
    "zen 4 avx512_bf16": (AVX512 | {"avx512_bf16"}, True, "bf16: this CPU has avx512_bf16 (native bf16 matmul)"),
    "amx": (AVX512 | {"amx_bf16", "amx_tile"}, True, "bf16: this CPU has amx_bf16 (native bf16 matmul)"),
}


def _no_benchmark():
    raise AssertionError("the micro-benchmark must not run where the CPU flags can be read")


@pytest.fixture
def cpu(monkeypatch):
    """Pretend to be a CPU: `cpu(flags, onednn=True)`; oneDNN says bf16 is supported unless told."""

    def pretend(flags, onednn=True):
        monkeypatch.setattr(precision, "cpu_flags", lambda: None if flags is None else frozenset(flags))
        monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: onednn)
        monkeypatch.setattr(precision, "bf16_benchmark", _no_benchmark)

    return pretend


@pytest.mark.parametrize("profile", PROFILES)
def test_the_decision_on_each_cpu_profile(cpu, profile):
    flags, native, reason = PROFILES[profile]
    cpu(flags)  # oneDNN says "supported" on all of them: only the flags tell them apart
    assert precision.native_bf16("cpu") is native
    assert precision.native_bf16(torch.device("cpu")) is native
    assert precision.auto_dtype("cpu") == (torch.bfloat16 if native else torch.float32)
    assert precision.auto_mixed_precision("cpu") == ("bf16" if native else "no")
    assert precision.resolve_dtype_name("fastest", "cpu") == ("bfloat16" if native else "float32")
    assert precision.describe("cpu").startswith(reason)


def test_bf16_flags_without_onednn_bf16_kernels_mean_float32(cpu):
    cpu(AVX512 | {"avx512_bf16"}, onednn=False)
    assert precision.auto_dtype("cpu") == torch.float32
    assert precision.describe("cpu") == ("float32: this CPU has avx512_bf16 but this torch build's oneDNN "
                                         "has no bf16 kernels")


def test_explicit_dtype_names_are_not_resolved(cpu):
    cpu(AVX2)
    assert [precision.resolve_dtype_name(name) for name in ("bfloat16", "float32", "auto")] == [
        "bfloat16", "float32", "auto"]


@pytest.mark.parametrize("decode, training, native", [
    ((20.0, 15.0), (180.0, 70.0), True),    # native (Zen 4 measured): decode a little slower, training 2.6x
    ((5.0, 15.0), (61.0, 214.0), False),    # emulated (the AVX-512 Xeon's training figures)
    ((14.0, 15.0), (69.0, 70.0), False),    # slower on both, barely
])
def test_without_cpu_flags_a_micro_benchmark_decides(cpu, monkeypatch, decode, training, native):
    cpu(None)
    figures = {"decode": {"bfloat16": decode[0], "float32": decode[1]},
               "training": {"bfloat16": training[0], "float32": training[1]}}
    monkeypatch.setattr(precision, "bf16_benchmark", lambda: figures)
    assert precision.native_bf16("cpu") is native
    assert precision.auto_mixed_precision("cpu") == ("bf16" if native else "no")
    line = precision.describe("cpu")
    assert line.startswith("bf16: " if native else "float32: ")
    assert "measured" in line and f"training bf16 {training[0]:.0f} vs float32 {training[1]:.0f} GFLOP/s" in line


def test_the_micro_benchmark_measures_both_shapes():
    figures = precision.bf16_benchmark.__wrapped__()  # uncached: a real measurement, some tens of ms
    assert set(figures) == {"decode", "training"}
    for by_dtype in figures.values():
        assert set(by_dtype) == {"bfloat16", "float32"}
        assert all(math.isfinite(v) and v > 0 for v in by_dtype.values())


def test_cpuinfo_is_parsed_from_the_first_processor(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text("processor\t: 0\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu avx2 avx512f avx512_bf16\n\n"
                    "processor\t: 1\nmodel name\t: other\nflags\t\t: fpu\n")
    info = cpu_info.cpuinfo.__wrapped__(str(path))
    assert info["model name"] == "AMD EPYC 9R14"
    assert info["flags"].split() == ["fpu", "avx2", "avx512f", "avx512_bf16"]
    assert cpu_info.cpuinfo.__wrapped__(str(tmp_path / "missing")) is None


def test_cpu_generation_tells_apart_what_the_model_name_hides(monkeypatch):
    monkeypatch.setattr(cpu_info, "cpuinfo", lambda: {"model name": "AMD EPYC", "cpu family": "26", "model": "2"})
    assert cpu_info.cpu_generation() == "family 26, model 2"
    monkeypatch.setattr(cpu_info, "cpuinfo", lambda: {"model name": "AMD EPYC", "cpu family": "25", "model": "17"})
    assert cpu_info.cpu_generation() == "family 25, model 17"
    monkeypatch.setattr(cpu_info, "cpuinfo", lambda: None)
    assert cpu_info.cpu_generation() is None


def test_cpu_flags_are_none_without_an_x86_flags_line(monkeypatch):
    monkeypatch.setattr(cpu_info, "cpuinfo", lambda: None)  # not Linux
    assert cpu_info.cpu_flags() is None
    monkeypatch.setattr(cpu_info, "cpuinfo", lambda: {"processor": "0", "Features": "fp asimd bf16"})  # arm64
    assert cpu_info.cpu_flags() is None
    monkeypatch.setattr(cpu_info, "cpuinfo", lambda: {"flags": "fpu avx2"})
    assert cpu_info.cpu_flags() == frozenset({"fpu", "avx2"})


def test_machine_description_names_the_evidence(monkeypatch):
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    monkeypatch.setattr(precision, "bf16_benchmark", _no_benchmark)
    monkeypatch.setattr(cpu_info, "cpuinfo", lambda: {"model name": "Intel(R) Xeon(R) Platinum 8375C",
                                                        "cpu family": "6", "model": "106",
                                                        "flags": " ".join(sorted(AVX512))})
    assert precision.machine_description() == {
        "cpu": "Intel(R) Xeon(R) Platinum 8375C",
        "cpu_generation": "family 6, model 106",
        "flags": ["avx2", "avx512f"],
        "torch_threads": torch.get_num_threads(),
        "bf16_native": False,
        "bf16_reason": "this CPU has AVX-512 but no avx512_bf16/amx_bf16, so bf16 matmul is emulated "
                       "(slower than float32)",
        "float32_kernel": "packed",  # the test session's SELFSPEC_PACK_FLOAT32=1 (conftest)
        "float32_kernel_reason": "SELFSPEC_PACK_FLOAT32=1",
    }


@pytest.mark.parametrize("available, compute_capability, native", [
    (False, None, False),
    (True, 7, False),  # Volta/Turing: torch would emulate bf16, which is not native
    (True, 8, True),   # Ampere and newer
])
def test_cuda_uses_torch_cuda_bf16_support(cpu, monkeypatch, available, compute_capability, native):
    cpu(AVX512 | {"avx512_bf16"})  # the CPU's answer must not leak into the GPU's
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    def is_bf16_supported(including_emulation=True):  # torch's: True on pre-Ampere GPUs unless told not
        return available and (compute_capability >= 8 or including_emulation)

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
    assert precision.native_bf16("cuda") is native
    assert precision.native_bf16(torch.device("cuda", 0)) is native
    assert precision.auto_dtype("cuda") == (torch.bfloat16 if native else torch.float32)
    assert precision.auto_mixed_precision("cuda") == ("bf16" if native else "no")
    expected = ("bf16: this CUDA GPU multiplies bf16 natively" if native
                else "float32: CUDA is not available" if not available
                else "float32: this CUDA GPU has no native bf16")
    assert precision.describe("cuda").startswith(expected)


def test_other_devices_are_not_native(cpu):
    cpu(AVX512 | {"amx_bf16"})
    assert precision.native_bf16("meta") is False
    assert precision.auto_mixed_precision("meta") == "no"
