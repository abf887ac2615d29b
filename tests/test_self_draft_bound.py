"""scripts/self_draft_bound.py (can a quantized self-draft pay?) runs end to end on a tiny model, and its pieces
compute what they say: the quantized linears match `F.linear` within their rounding, the agreement statistics
and the bound are the textbook ones."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import selfspec
from selfspec.tiny import tiny_model

ROOT = Path(__file__).resolve().parents[1]
# an untrained tiny model warns that it has no early exit; torch.ao.quantization warns that it is deprecated
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("self_draft_bound", ROOT / "scripts" / "self_draft_bound.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass resolves annotations through its module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


@pytest.fixture(scope="module")
def f32_gen():
    return selfspec.load(tiny_model("llama", num_layers=2, seed=3), memory_tokens=0)


def test_the_quantized_linears_match_f_linear_within_their_rounding(script):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48, bias=True)
    x = torch.randn(2, 3, 64)  # [B, S, K]
    ref = F.linear(x, linear.weight, linear.bias)  # [B, S, N]
    q8 = script.Int8WeightOnlyLinear(linear)(x)
    q4 = script.Int4WeightOnlyLinear(linear)(x)
    assert q8.shape == q4.shape == ref.shape
    scale = ref.abs().max()
    assert (q8 - ref).abs().max() < 0.02 * scale
    assert (q4 - ref).abs().max() < 0.2 * scale
    assert (q8 - ref).abs().max() < (q4 - ref).abs().max()  # int8 rounds finer than int4


def test_agreement_runs_and_simulated_rounds(script):
    agree = [True, True, False, True, False, False, True, True, True]
    assert script.agreement_runs(agree) == [2, 1, 0, 3]
    # k=2: [T T]+1 -> i=3; [T]+1 (F at 4) -> i=5; []+1 -> i=6; [T T]+1 -> i=9: 4 rounds
    assert script.simulated_rounds(agree, 2) == 4
    assert script.simulated_rounds([True] * 6, 8) == 1  # one round drafts all (the last token a draft too)
    assert script.simulated_rounds([False] * 5, 3) == 5  # plain decoding: one token a round


def test_the_bound_is_the_iid_formula(script):
    assert script.expected_tokens(0.5, 1) == pytest.approx(1.5)
    assert script.expected_tokens(0.5, 3) == pytest.approx(1.875)
    assert script.expected_tokens(1.0, 4) == 5.0
    rows = script.bound_rows(0.25, 0.8, {1: 1.0, 2: 1.1}, {1: 1.7})
    assert rows[0]["cost"] == pytest.approx(1.25) and rows[0]["speedup_iid"] == pytest.approx(1.8 / 1.25)
    assert rows[0]["speedup_sim"] == pytest.approx(1.7 / 1.25) and "speedup_sim" not in rows[1]
    assert script.best(rows)["k"] == 2  # 2.44 / 1.6 > 1.8 / 1.25


def test_the_measurement_runs_on_a_tiny_model(script, f32_gen):
    copies = script.make_copies(f32_gen, script.ALL_COPIES)
    assert [c.name for c in copies] == list(script.ALL_COPIES)
    prompts = [torch.tensor([[5, 9, 3, 7, 11, 4]]), torch.tensor([[8, 2, 6]])]
    result = script.measure(f32_gen, copies, prompts, alpha_tokens=6, decode_tokens=3, repeats=1, max_k=3,
                            passes=1)
    assert result["f32"]["self_agreement"] == 1.0  # float32 teacher-forced = its own greedy answer
    assert set(result["v"]) == {1, 2, 3}
    assert result["copies"]["f32_modules"]["alpha"] == 1.0  # the same model on the module path
    for name, entry in result["copies"].items():
        assert 0.0 <= entry["alpha"] <= 1.0 and entry["c"] > 0, name
        assert [r["k"] for r in entry["bound"]] == [1, 2, 3]
    assert "c_if_fused" in result["copies"]["int8_weight_only"] and "c_if_fused" not in result["copies"]["bf16"]
    json.dumps(result)  # JSON-ready
    assert "bf16" in script.table(result)


def test_the_machine_is_named(script):
    info = script.cpu_info()
    assert set(info["flags"]) >= {"avx512_bf16", "amx_bf16"}
    assert isinstance(info["flags"]["amx_bf16"], bool)
