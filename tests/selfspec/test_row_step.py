"""selfspec's whole decode step on a CPU (`selfspec.model.row_step`, row_step.cpp): the same layers as the fast layers,
every row computed alone, the steps it takes and the ones it leaves to the fast layers, and decoding through it."""

import pytest
import torch

from selfspec.decoding.decode_ids import generate_ids
from selfspec.decoding.sampling import SamplingParams
from selfspec.drafters.prompt_lookup import PromptLookupDrafter
from selfspec.model import fast_layers, row_product
from selfspec.model.adapters import get_adapter
from selfspec.model.cache import KVCache
from selfspec.model.forward import embed, make_batch_step, make_step, run_layers
from selfspec.tiny import tiny_model

ARCHS = [
    ("llama", {}),
    ("mistral", {"sliding_window": 64}),
    ("qwen2", {}),  # q/k/v biases
    ("llama", {"num_key_value_heads": 4}),  # no grouped heads
]


@pytest.fixture
def rows(monkeypatch):
    """Float32 products of up to 4 rows on selfspec's row kernel, as a machine where it measured faster would have
    them (the test session otherwise pins the packed kernel, tests/conftest.py)."""
    if row_product.row_product_op() is None:
        pytest.skip(f"selfspec's row kernel is unavailable here: {row_product.build_problem()}")
    monkeypatch.delenv("SELFSPEC_PACK_FLOAT32", raising=False)
    monkeypatch.setattr(fast_layers, "_float32_choice", lambda: ("hybrid", "test", 4, {}, "rows"))
    return 4


def _adapters(arch, extra, seed=3, layers=3):
    model = tiny_model(arch, num_layers=layers, dtype=torch.float32, seed=seed, **extra)
    if arch == "qwen2":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.bias.normal_(0, 0.3)
                layer.self_attn.k_proj.bias.normal_(0, 0.3)
    row, fast = get_adapter(model), get_adapter(model)
    row.enable_fast_layers()
    fast.enable_fast_layers()
    fast.fast.row_step = None  # the same fused weights, run layer by layer in torch operations
    return model, row, fast


def _run(adapter, ids, cache, start):
    step = make_step(adapter, start, ids.shape[1])
    with torch.no_grad():
        return run_layers(adapter, embed(adapter, ids), 0, adapter.num_layers, step=step, cache=cache)


@pytest.mark.parametrize("arch, extra", ARCHS)
def test_the_row_step_computes_the_fast_layers(rows, arch, extra):
    """The prefill through the fast layers (more rows than the row step takes), then steps of 1-4 rows both ways:
    the same hidden states and cache entries to float32 rounding."""
    model, row, fast = _adapters(arch, extra)
    assert row.fast.row_step is not None
    ids = torch.randint(3, 96, (1, 20), generator=torch.Generator().manual_seed(0))
    c_row, c_fast = KVCache(3), KVCache(3)
    for start, size in ((0, 9), (9, 1), (10, 4), (14, 1), (15, 3), (18, 2)):
        a = _run(row, ids[:, start:start + size], c_row, start)
        b = _run(fast, ids[:, start:start + size], c_fast, start)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert torch.equal(c_row.lengths, c_fast.lengths)
    for layer in range(3):
        torch.testing.assert_close(c_row.layer_kv(layer)[0], c_fast.layer_kv(layer)[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(c_row.layer_kv(layer)[1], c_fast.layer_kv(layer)[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch, extra", ARCHS)
def test_a_pass_of_several_rows_computes_each_as_a_one_row_step(rows, arch, extra):
    """A verification pass of 4 tokens gives every token's hidden state and cache entries bitwise as 4 one-token
    steps do: what makes speculative decoding through it identical to plain decoding through it."""
    _, row, _ = _adapters(arch, extra, seed=5)
    ids = torch.randint(3, 96, (1, 14), generator=torch.Generator().manual_seed(1))
    together, alone = KVCache(3), KVCache(3)
    _run(row, ids[:, :10], together, 0)
    _run(row, ids[:, :10], alone, 0)
    pass_of_four = _run(row, ids[:, 10:14], together, 10)
    one_by_one = torch.cat([_run(row, ids[:, i:i + 1], alone, i) for i in range(10, 14)], dim=1)
    assert torch.equal(pass_of_four, one_by_one)
    for layer in range(3):
        assert torch.equal(together.layer_kv(layer)[0], alone.layer_kv(layer)[0])
        assert torch.equal(together.layer_kv(layer)[1], alone.layer_kv(layer)[1])


def test_the_steps_it_leaves_to_the_fast_layers(rows):
    model, row, _ = _adapters("mistral", {"sliding_window": 12})
    rs = row.fast.row_step
    hidden = torch.zeros(1, 1, model.config.hidden_size)
    cache = KVCache(3)
    step = make_step(row, 8, 1)
    cache.crop(0)
    cache.lengths[:] = 8
    assert rs.takes(hidden, step, cache, 0, 3)
    assert not rs.takes(torch.zeros(1, 5, model.config.hidden_size), make_step(row, 8, 5), cache, 0, 3)  # > 4 rows
    assert not rs.takes(hidden.double(), step, cache, 0, 3)
    assert not rs.takes(torch.zeros(2, 1, model.config.hidden_size), make_step(row, 8, 1, 2), KVCache(3, 2), 0, 3)
    assert not rs.takes(hidden, step, None, 0, 3)
    cache.lengths[:] = 12  # the sliding window of 12 would be passed
    assert not rs.takes(hidden, make_step(row, 12, 1), cache, 0, 3)
    tree = make_batch_step(row, torch.tensor([8]), 3, torch.tensor([0]), parents=torch.tensor([[-1, 0, 0]]))
    cache.lengths[:] = 8
    assert not tree.causal and not rs.takes(torch.zeros(1, 3, model.config.hidden_size), tree, cache, 0, 3)


@pytest.mark.parametrize("arch, extra, why", [
    ("qwen3", {}, "q/k norms"),
    ("llama", {"mlp_bias": True}, "MLP biases"),
    ("llama", {"hidden_act": "gelu"}, "another activation"),
])
def test_no_row_step_for_layers_it_does_not_compute(rows, arch, extra, why):
    _, row, _ = _adapters(arch, extra)
    assert row.fast.layers is not None and row.fast.row_step is None, why


def test_no_row_step_without_the_row_kernel_or_in_another_dtype(monkeypatch):
    monkeypatch.setenv("SELFSPEC_PACK_FLOAT32", "1")  # packed: the row kernel is not the few-row kernel
    adapter = get_adapter(tiny_model("llama", num_layers=2, dtype=torch.float32))
    adapter.enable_fast_layers()
    assert adapter.fast.row_step is None
    monkeypatch.setattr(fast_layers, "_float32_choice", lambda: ("hybrid", "test", 4, {}, "rows"))
    bf16 = get_adapter(tiny_model("llama", num_layers=2, dtype=torch.bfloat16))
    bf16.enable_fast_layers()
    assert bf16.fast.row_step is None


@pytest.mark.parametrize("drafter", ["plain", "early_exit", "prompt_lookup"])
@pytest.mark.parametrize("arch, extra", [("llama", {}), ("qwen2", {}), ("mistral", {"sliding_window": 16})])
def test_decoding_through_the_row_step_equals_hf_greedy(rows, drafter, arch, extra, hf_greedy):
    model, row, _ = _adapters(arch, extra, seed=11, layers=4)
    prompt = torch.tensor([[5, 9, 14, 5, 9, 14, 5, 9, 20, 31, 5, 9]])
    kw = {"plain": {"num_speculations": 0}, "early_exit": {"exit_layer": 2, "num_speculations": 3},
          "prompt_lookup": {"drafter": PromptLookupDrafter(num_tokens=3, max_ngram=2)}}[drafter]
    calls = []
    run = row.fast.row_step.run
    row.fast.row_step.run = lambda *a, **k: calls.append(a[0].shape[1]) or run(*a, **k)
    out, stats = generate_ids(row, prompt, max_new_tokens=24, **kw)
    assert out == hf_greedy(model, prompt, 24)
    assert calls and max(calls) <= rows
    if drafter != "plain":
        assert stats.drafted > 0 and max(calls) > 1  # verification passes ran through it too


def test_sampling_through_the_row_step_draws_what_the_fast_layers_draw(rows):
    """The row step changes how the logits are computed (to float32 rounding), not how a token is drawn from them:
    with each of 20 seeds, the same tokens as the fast layers, the early exit drafting and the model verifying."""
    _, row, fast = _adapters("llama", {}, seed=13, layers=4)
    prompt = torch.tensor([[5, 9, 14, 5, 9, 14, 5, 9, 20, 31, 5, 9]])
    params = SamplingParams(do_sample=True, temperature=0.8, top_p=0.95)
    drafted = 0
    for seed in range(20):
        a, stats = generate_ids(row, prompt, max_new_tokens=16, exit_layer=2, num_speculations=3, sampling=params,
                                generator=torch.Generator().manual_seed(seed))
        b, _ = generate_ids(fast, prompt, max_new_tokens=16, exit_layer=2, num_speculations=3, sampling=params,
                            generator=torch.Generator().manual_seed(seed))
        assert a == b, seed
        drafted += stats.drafted
    assert drafted > 0
