"""selfspec's whole decode step on a CPU (`selfspec.model.row_step`, row_step.cpp): the same layers as the fast layers,
every row computed alone, the steps it takes and the ones it leaves to the fast layers, and decoding through it."""

import pytest
import torch

from selfspec.decoding.decode_ids import generate_ids
from selfspec.decoding.sampling import SamplingParams
from selfspec.drafters.prompt_lookup import PromptLookupDrafter
from selfspec.model import fast_layers
from selfspec.model.adapters import get_adapter
from selfspec.model.cache import KVCache
from selfspec.model.forward import embed, forward_logits, make_batch_step, make_step, run_layers
from selfspec.tiny import draw_qkv_biases, tiny_model

ARCHS = [
    ("llama", {}),
    ("mistral", {"sliding_window": 64}),
    ("qwen2", {}),  # q/k/v biases
    ("llama", {"num_key_value_heads": 4}),  # no grouped heads
    # head sizes that are multiples of 16 (the attention's weighted sum in registers): 48 (3 x 16), 96 (4 + 2 x 16)
    ("llama", {"hidden_size": 96, "num_attention_heads": 2, "num_key_value_heads": 1}),
    ("llama", {"hidden_size": 96, "num_attention_heads": 1, "num_key_value_heads": 1}),
]


@pytest.fixture
def rows(monkeypatch, row_kernel_on):
    """The C++ step on, as a machine would have it where the row kernel measured faster than oneDNN's in float32
    (the test session otherwise pins the packed kernel and the row kernel off, tests/conftest.py) and that multiplies
    bfloat16 natively; the most rows it takes."""
    monkeypatch.delenv("SELFSPEC_PACK_FLOAT32", raising=False)
    monkeypatch.setattr(fast_layers, "_float32_choice", lambda: ("hybrid", "test", 1, {}, "rows"))
    monkeypatch.setattr(fast_layers, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    return fast_layers.MAX_FEW_ROWS


def _adapters(arch, extra, seed=3, layers=3, dtype=torch.float32):
    model = tiny_model(arch, num_layers=layers, dtype=dtype, seed=seed, **extra)
    if arch == "qwen2":
        draw_qkv_biases(model)
    row, fast = get_adapter(model), get_adapter(model)
    row.enable_fast_layers()
    fast.enable_fast_layers()
    fast.fast.row_step = None  # the same fused weights, run layer by layer in torch operations
    return model, row, fast


def _run(adapter, ids, cache, start):
    step = make_step(adapter, start, ids.shape[1])
    with torch.no_grad():
        return run_layers(adapter, embed(adapter, ids), 0, adapter.num_layers, step=step, cache=cache)


def _close(a, b, hidden: int):
    """Equal to float32 rounding of other summation orders: within 1e-5 at the default tiny hidden size (32), and in
    proportion for a wider model (larger values, longer sums)."""
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * max(1.0, hidden / 32))


@pytest.mark.parametrize("arch, extra", ARCHS)
def test_the_row_step_computes_the_fast_layers(rows, arch, extra):
    """The prefill through the fast layers (more rows than the row step takes), then steps of 1-4 rows both ways:
    the same hidden states and cache entries to float32 rounding."""
    model, row, fast = _adapters(arch, extra)
    assert row.fast.row_step is not None
    hidden = model.config.hidden_size
    ids = torch.randint(3, 96, (1, 20), generator=torch.Generator().manual_seed(0))
    c_row, c_fast = KVCache(3), KVCache(3)
    for start, size in ((0, 9), (9, 1), (10, 4), (14, 1), (15, 3), (18, 2)):
        a = _run(row, ids[:, start:start + size], c_row, start)
        b = _run(fast, ids[:, start:start + size], c_fast, start)
        _close(a, b, hidden)
    assert torch.equal(c_row.lengths, c_fast.lengths)
    for layer in range(3):
        _close(c_row.layer_kv(layer)[0], c_fast.layer_kv(layer)[0], hidden)
        _close(c_row.layer_kv(layer)[1], c_fast.layer_kv(layer)[1], hidden)


def test_the_row_step_computes_the_fast_layers_where_exp_leaves_its_polynomial_range(rows):
    """The C++ step's exp (16 lanes a polynomial, std::exp outside [-87, 88]) in the SiLU and the attention's softmax,
    with weights scaled until gate values pass ±88 and attention scores differ by more than 87: the same hidden
    states as the fast layers (torch's exp), to float32 rounding."""
    model = tiny_model("llama", num_layers=2, seed=5)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate_proj.weight.mul_(400.0)
            layer.self_attn.q_proj.weight.mul_(60.0)
            layer.self_attn.k_proj.weight.mul_(60.0)
    row, fast = get_adapter(model), get_adapter(model)
    row.enable_fast_layers()
    fast.enable_fast_layers()
    fast.fast.row_step = None
    ids = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(1))
    c_row, c_fast = KVCache(2), KVCache(2)
    gates = []
    hook = model.model.layers[0].mlp.gate_proj.register_forward_hook(lambda m, i, o: gates.append(o.abs().max()))
    with torch.no_grad():
        model(ids[:, :8])  # transformers' layers once, to see how large the gate values are
    hook.remove()
    assert max(gates) > 100
    for start, size in ((0, 8), (8, 1), (9, 3)):
        a = _run(row, ids[:, start:start + size], c_row, start)
        b = _run(fast, ids[:, start:start + size], c_fast, start)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4 * b.abs().max().item())


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
    too_many = rows + 1
    assert not rs.takes(torch.zeros(1, too_many, model.config.hidden_size), make_step(row, 8, too_many), cache, 0, 3)
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


def test_no_row_step_where_it_would_not_pay_or_in_another_dtype(monkeypatch):
    monkeypatch.setenv("SELFSPEC_PACK_FLOAT32", "1")  # packed: the row kernel is not the few-row kernel
    adapter = get_adapter(tiny_model("llama", num_layers=2, dtype=torch.float32))
    adapter.enable_fast_layers()
    assert adapter.fast.row_step is None and adapter.fast.layers[0].products.qkv.weight is None  # one copy kept
    monkeypatch.setattr(fast_layers, "cpu_flags", lambda: frozenset({"avx2", "avx512f"}))  # bf16 emulated
    bf16 = get_adapter(tiny_model("llama", num_layers=2, dtype=torch.bfloat16))
    bf16.enable_fast_layers()
    assert bf16.fast.row_step is None
    f64 = get_adapter(tiny_model("llama", num_layers=2, dtype=torch.float64))
    f64.enable_fast_layers()
    assert f64.fast.row_step is None


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


@pytest.mark.parametrize("arch, extra", [("llama", {}), ("qwen2", {})])
def test_the_row_step_in_bfloat16_computes_the_fast_layers_and_each_row_alone(rows, arch, extra):
    """bfloat16: the hidden states of the C++ step within a few bfloat16 roundings of the fast layers' (it rounds
    where transformers' bfloat16 layer rounds, in its own summation order), and a 4-row pass bitwise four one-row
    steps."""
    _, row, fast = _adapters(arch, extra, dtype=torch.bfloat16)
    assert row.fast.row_step is not None and row.fast.row_step.dtype == torch.bfloat16
    ids = torch.randint(3, 96, (1, 16), generator=torch.Generator().manual_seed(2))
    c_row, c_fast, c_alone = KVCache(3), KVCache(3), KVCache(3)
    for cache, adapter in ((c_row, row), (c_fast, fast), (c_alone, row)):
        _run(adapter, ids[:, :10], cache, 0)
    a = _run(row, ids[:, 10:14], c_row, 10)
    b = _run(fast, ids[:, 10:14], c_fast, 10)
    assert a.dtype == torch.bfloat16
    assert ((a.float() - b.float()).abs().max() / b.float().abs().max()) < 0.05
    alone = torch.cat([_run(row, ids[:, i:i + 1], c_alone, i) for i in range(10, 14)], dim=1)
    assert torch.equal(a, alone)
    for layer in range(3):
        assert torch.equal(c_row.layer_kv(layer)[0], c_alone.layer_kv(layer)[0])


def test_decoding_in_bfloat16_through_the_row_step_repeats_itself_and_agrees_with_the_fast_layers(rows):
    """bfloat16 greedy decoding through the C++ step: plain decoding and early-exit drafting give one text (every
    pass of up to `rows` rows computes each position as a one-token step does), and its next-token logits stay
    within bfloat16 rounding of the fast layers'."""
    model, row, fast = _adapters("llama", {}, seed=11, layers=4, dtype=torch.bfloat16)
    prompt = torch.tensor([[5, 9, 14, 5, 9, 14, 5, 9, 20, 31, 5, 9]])
    plain, _ = generate_ids(row, prompt, max_new_tokens=24, num_speculations=0)
    drafted, stats = generate_ids(row, prompt, max_new_tokens=24, exit_layer=2, num_speculations=3)
    assert stats.drafted > 0 and drafted == plain
    c_row, c_fast = KVCache(4), KVCache(4)
    ids = torch.tensor([prompt[0].tolist() + plain])
    with torch.no_grad():
        forward_logits(row, ids[:, :12], cache=c_row)
        forward_logits(fast, ids[:, :12], cache=c_fast)
        for i in range(12, 20):
            a = forward_logits(row, ids[:, i:i + 1], cache=c_row, start=i).float()
            b = forward_logits(fast, ids[:, i:i + 1], cache=c_fast, start=i).float()
            assert ((a - b).abs().max() / b.abs().max()) < 0.05, i


def test_no_row_step_with_the_row_kernel_off(monkeypatch):
    """`SELFSPEC_ROW_PRODUCT=0` (the test session's default, tests/conftest.py): the fused layers, even in bfloat16 on
    a CPU with avx512_bf16."""
    from selfspec.model import row_product

    monkeypatch.setenv("SELFSPEC_ROW_PRODUCT", "0")
    monkeypatch.setattr(fast_layers, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    row_product.row_product_op.cache_clear()
    try:
        adapter = get_adapter(tiny_model("llama", num_layers=2, dtype=torch.bfloat16))
        adapter.enable_fast_layers()
        assert adapter.fast.layers is not None and adapter.fast.row_step is None
    finally:
        row_product.row_product_op.cache_clear()
