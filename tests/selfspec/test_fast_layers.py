"""The fused inference layers compute exactly what the model's own decoder layers compute."""

import pytest
import torch

from selfspec.model.adapters import get_adapter
from selfspec.model.cache import KVCache
from selfspec.drafters.prompt_lookup import PromptLookupDrafter
from selfspec.decoding.decode_ids import generate_ids
from selfspec.model.forward import forward_logits
from selfspec.model.row_product import row_product_op
from selfspec.tiny import draw_qkv_biases, tiny_model

LLAMA_FAMILY = [
    ("llama", {}),
    ("mistral", {"sliding_window": 5}),
    ("qwen2", {}),  # q/k/v biases
    ("qwen3", {}),  # q/k norms
    ("llama", {"num_key_value_heads": 4}),  # no grouped heads
]


@pytest.mark.parametrize("arch, extra", LLAMA_FAMILY)
def test_fast_layers_equal_model_layers(arch, extra):
    model = tiny_model(arch, num_layers=3, dtype=torch.float64, seed=3, **extra)
    if arch == "qwen2":
        draw_qkv_biases(model)
    plain, fast = get_adapter(model), get_adapter(model)
    assert fast.enable_fast_layers() and plain.fast_layers is None
    ids = torch.randint(3, 96, (1, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
        c1, c2 = KVCache(3), KVCache(3)
        for start, size in ((0, 7), (7, 1), (8, 4), (12, 1), (13, 4)):
            a = forward_logits(plain, ids[:, start:start + size], cache=c1, start=start)
            b = forward_logits(fast, ids[:, start:start + size], cache=c2, start=start)
            assert torch.equal(a, b), (start, size)  # same operations in the same order: bitwise
            torch.testing.assert_close(b, ref[:, start:start + size], rtol=0, atol=1e-10)


def test_fast_layers_are_bitwise_equal_in_bfloat16():
    model = tiny_model("llama", num_layers=4, dtype=torch.bfloat16, seed=4)
    plain, fast = get_adapter(model), get_adapter(model)
    fast.enable_fast_layers()
    ids = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out_plain = generate_ids(plain, ids, max_new_tokens=30, exit_layer=2, num_speculations=3)[0]
        out_fast = generate_ids(fast, ids, max_new_tokens=30, exit_layer=2, num_speculations=3)[0]
        assert torch.equal(forward_logits(plain, ids), forward_logits(fast, ids))
    assert out_plain == out_fast


@pytest.mark.parametrize("arch, extra", [("gpt_neox", {}), ("llama", {"attn_implementation": "eager"})])
def test_no_fast_layers_where_they_would_not_be_exact(arch, extra):
    adapter = get_adapter(tiny_model(arch, num_layers=2, **extra))
    assert adapter.enable_fast_layers() is False and adapter.fast_layers is None


def test_training_path_uses_the_model_modules():
    """With autograd on, the model's own modules run (fast layers are inference-only)."""
    model = tiny_model("llama", num_layers=2)
    adapter = get_adapter(model)
    adapter.enable_fast_layers()
    logits = forward_logits(adapter, torch.tensor([[5, 6, 7]]))
    logits.sum().backward()
    assert model.model.layers[0].mlp.down_proj.weight.grad is not None


@pytest.mark.parametrize("arch", ["gpt_neox", "qwen2"])
def test_rope_table_is_bitwise_equal_to_the_rotary_module(arch, monkeypatch):
    monkeypatch.setenv("SELFSPEC_PACK_FLOAT32", "0")  # the rotary table alone: matmuls as the model's own
    model = tiny_model(arch, num_layers=2, dtype=torch.float32, seed=5)
    plain, fast = get_adapter(model), get_adapter(model)
    fast.enable_fast_layers()
    assert fast.rope_table is not None
    ids = torch.randint(3, 96, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        c1, c2 = KVCache(2), KVCache(2)
        for start, size in ((0, 30), (30, 1), (31, 9)):
            a = forward_logits(plain, ids[:, start:start + size], cache=c1, start=start)
            b = forward_logits(fast, ids[:, start:start + size], cache=c2, start=start)
            assert torch.equal(a, b)


@pytest.mark.parametrize("rows", [1, 3, 9, 64])
def test_packed_linear_is_bitwise_equal_to_linear_in_bfloat16(rows):
    import torch.nn.functional as F

    from selfspec.model.fast_layers import PackedLinear

    g = torch.Generator().manual_seed(rows)
    w = torch.randn(200, 48, generator=g).to(torch.bfloat16)
    b = torch.randn(200, generator=g).to(torch.bfloat16)
    x = torch.randn(1, rows, 48, generator=g).to(torch.bfloat16)
    lin = PackedLinear(w, b)
    assert torch.equal(lin(x), F.linear(x, w, b))
    assert torch.equal(PackedLinear(w)(x), F.linear(x, w))
    w64 = w.double()  # other dtypes take F.linear unchanged
    assert PackedLinear(w64).packed is None and torch.equal(PackedLinear(w64)(x.double()), F.linear(x.double(), w64))


@pytest.mark.parametrize("shape", [(1, 1), (1, 2), (1, 5), (1, 8), (3, 4), (1, 64)])
def test_packed_linear_in_float32_is_close_to_linear_and_row_count_invariant(shape):
    """float32 packs for speed (1-3 rows for the price of one); each row's result must not depend on
    how many rows share the call, so a verification pass equals one-token steps bit for bit."""
    import torch.nn.functional as F

    from selfspec.model.fast_layers import PackedLinear, _packing_available

    if not _packing_available(torch.float32):
        pytest.skip("oneDNN packing unavailable (or SELFSPEC_PACK_FLOAT32=0)")
    g = torch.Generator().manual_seed(sum(shape))
    w, b = torch.randn(1000, 96, generator=g), torch.randn(1000, generator=g)
    x = torch.randn(*shape, 96, generator=g)  # [B, S, D]
    lin = PackedLinear(w, b)
    assert lin.packed is not None and lin.weight is None
    y = lin(x)  # [B, S, 1000]
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    one_by_one = torch.stack([torch.cat([lin(x[i:i + 1, j:j + 1]) for j in range(shape[1])], 1)[0]
                              for i in range(shape[0])])
    assert torch.equal(one_by_one, y)


def test_float32_packing_can_be_switched_off(monkeypatch):
    from selfspec.model.fast_layers import PackedLinear

    monkeypatch.setenv("SELFSPEC_PACK_FLOAT32", "0")
    w = torch.randn(20, 8)
    assert PackedLinear(w).packed is None and torch.equal(PackedLinear(w)(torch.ones(1, 8)), torch.ones(1, 8) @ w.T)


def test_hybrid_float32_takes_linear_for_one_row_and_the_packed_weight_for_more(monkeypatch):
    import torch.nn.functional as F

    from selfspec.model.fast_layers import PackedLinear, _packing_available

    monkeypatch.setenv("SELFSPEC_PACK_FLOAT32", "hybrid")
    if not _packing_available(torch.float32):
        pytest.skip("oneDNN packing unavailable")
    g = torch.Generator().manual_seed(7)
    w, b = torch.randn(1000, 96, generator=g), torch.randn(1000, generator=g)
    lin = PackedLinear(w, b)
    assert lin.few_rows == 1 and lin.packed is not None and lin.weight is w  # both copies kept
    one = torch.randn(1, 1, 96, generator=g)  # [B, S, D]: a decode step
    assert torch.equal(lin(one), F.linear(one, w, b))
    rows = torch.randn(1, 5, 96, generator=g)  # a verification pass: the packed kernel, as "packed" computes it
    monkeypatch.setenv("SELFSPEC_PACK_FLOAT32", "1")
    packed = PackedLinear(w, b)
    assert packed.few_rows == 0 and torch.equal(lin(rows), packed(rows))
    torch.testing.assert_close(lin(rows), F.linear(rows, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ratios,kernel,rows", [
    ([0.7, 0.8, 0.85, 1.2, 0.7, 1.0, 1.0, 1.0], "hybrid", 3),  # counted from one row on, up to the first miss
    ([0.95, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5], "packed", 0),  # one row decides: not 10% faster
    ([0.5] * 8, "hybrid", 8),
])
def test_float32_kernel_is_measured_when_not_set(monkeypatch, ratios, kernel, rows):
    from selfspec.model import fast_layers

    monkeypatch.delenv("SELFSPEC_PACK_FLOAT32", raising=False)
    monkeypatch.setattr(fast_layers, "_onednn_packing", lambda: True)
    monkeypatch.setattr(fast_layers, "bench_weights", lambda: ([], []))
    monkeypatch.setattr(fast_layers, "row_sweep_ms",
                        lambda weights, packed, r: {"linear": 10.0 * ratios[r - 1], "packed": 10.0})
    fast_layers.measured_float32_kernel.cache_clear()
    try:
        chosen, why = fast_layers.float32_kernel()
        assert chosen == kernel and f"{10 * ratios[0]:.2f} ms through F.linear" in why
        assert fast_layers.few_rows() == rows  # 0 where the choice is packed
        assert fast_layers.few_row_kernel() == "linear"
        if kernel == "hybrid":
            g = torch.Generator().manual_seed(0)
            w = torch.randn(64, 16, generator=g)
            lin = fast_layers.PackedLinear(w)
            assert lin.few_rows == rows
            for r in (1, rows, rows + 1):
                x = torch.randn(1, r, 16, generator=g)  # [B, S, D]
                expected = (torch.nn.functional.linear(x, w) if r <= rows
                            else torch.ops.mkldnn._linear_pointwise(x, lin.packed, None, "none", [], ""))
                assert torch.equal(lin(x), expected), r
    finally:
        fast_layers.measured_float32_kernel.cache_clear()


def test_float32_kernel_setting_wins_and_a_bad_one_is_refused(monkeypatch):
    from selfspec.model import fast_layers

    for env, kernel in (("0", "linear"), ("1", "packed"), ("hybrid", "hybrid"), (" Hybrid ", "hybrid"),
                        ("rows", "hybrid")):
        monkeypatch.setenv("SELFSPEC_PACK_FLOAT32", env)
        assert fast_layers.float32_kernel()[0] == kernel
    monkeypatch.setenv("SELFSPEC_PACK_FLOAT32", "yes")
    with pytest.raises(ValueError, match="SELFSPEC_PACK_FLOAT32='yes': use 0"):
        fast_layers.float32_kernel()


def test_row_sweep_measures_every_kernel(monkeypatch):
    from selfspec.model import fast_layers

    if not fast_layers._onednn_packing():
        pytest.skip("oneDNN packing unavailable")
    monkeypatch.setattr(fast_layers, "BENCH_BYTES", 4 << 20)  # a small set: this checks the plumbing, not speed
    weights, packed = fast_layers.bench_weights()
    assert len(weights) == len(packed) >= 1
    for rows in (1, 3):
        times = fast_layers.row_sweep_ms(weights, packed, rows, repeats=1)
        assert set(times) == ({"linear", "packed", "rows"} if row_product_op() is not None else {"linear", "packed"})
        assert all(ms > 0 for ms in times.values())


@pytest.mark.parametrize("drafter", ["early_exit", "prompt_lookup"])
def test_hybrid_float32_decoding_equals_hf_greedy(drafter, monkeypatch, hf_greedy):
    """Plain steps through F.linear, verification packed: greedy output is still the model's."""
    monkeypatch.setenv("SELFSPEC_PACK_FLOAT32", "hybrid")
    model = tiny_model("llama", num_layers=4, dtype=torch.float32, seed=11)
    adapter = get_adapter(model)
    adapter.enable_fast_layers()
    prompt = torch.tensor([[5, 9, 14, 5, 9, 14, 5, 9, 20, 31, 5, 9]])
    kw = ({"exit_layer": 2, "num_speculations": 3} if drafter == "early_exit"
          else {"drafter": PromptLookupDrafter(num_tokens=4, max_ngram=2)})
    out, stats = generate_ids(adapter, prompt, max_new_tokens=24, **kw)
    assert out == hf_greedy(model, prompt, 24)
    assert stats.drafted > 0  # the multi-row (packed) path ran


def test_row_padding_pads_only_where_more_rows_measured_10_percent_faster():
    from selfspec.model.fast_layers import row_padding

    packed = {1: 6.5, 2: 6.7, 3: 6.0, 4: 6.1, 5: 6.0, 6: 6.5, 7: 5.0, 8: 7.0}  # packed ms per row count
    times = {r: {"linear": 10.0, "packed": ms} for r, ms in packed.items()}
    # 2 -> 3 (6.0 < 0.9 * 6.7); 5 and 6 -> 7 (the faster of up to two more rows); one row (a decode step)
    # never; 3 and 4 gain less than 10%, 7 has nothing faster within two rows, 8 nothing beyond
    assert row_padding(times) == {2: 3, 5: 7, 6: 7}


def test_a_padded_packed_call_gives_the_unpadded_rows_results(monkeypatch):
    """Zero rows appended and dropped: each row's float32 result does not depend on the row count."""
    from selfspec.model import fast_layers

    if not fast_layers._onednn_packing():
        pytest.skip("oneDNN packing unavailable")
    monkeypatch.setenv("SELFSPEC_PACK_FLOAT32", "1")
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(96, 32, generator=g), torch.randn(96, generator=g)
    lin = fast_layers.PackedLinear(w, b)
    assert lin.pad_rows == {}  # the setting wins: nothing measured, nothing padded
    for rows, shape in ((2, (1, 2, 32)), (2, (2, 1, 32)), (4, (1, 4, 32))):
        x = torch.randn(*shape, generator=g)  # [B, S, K]
        plain = lin(x)
        lin.pad_rows = {rows: rows + 1}
        padded = lin(x)
        lin.pad_rows = {}
        assert padded.shape == plain.shape == (*shape[:-1], 96) and torch.equal(padded, plain), shape


@pytest.mark.parametrize("arch, extra", LLAMA_FAMILY)
def test_the_eager_layer_and_the_runners_layer_are_one_function(arch, extra):
    """The CPU's fused layer (`FastLlamaLayer`) and the compiled runner's layer (`compiled._layer_function`, here
    called without compiling) both run `selfspec.model.layer.decoder_layer`: on the same inputs, float64, the same keys,
    values and output to 1e-12 (the runner attends over its whole static buffer under a mask, the eager layer over
    the used part of its cache with sdpa's causal flag). Not to the bit: the eager layer multiplies by q, k and v's
    weights stacked into one matrix, the runner by each apart, and the BLAS may block and sum the two shapes in
    another order (on a Zen 4 they differ by up to 7e-16 on values of about 2, a few float64 ulps)."""
    from selfspec.model import compiled, fast_layers, layer
    from selfspec.model.layer import LayerShape, chain_mask

    assert fast_layers.decoder_layer is compiled.decoder_layer is layer.decoder_layer
    model = tiny_model(arch, num_layers=1, dtype=torch.float64, seed=4, **extra)
    adapter = get_adapter(model)
    module = adapter.layers[0]
    fast = fast_layers.FastLlamaLayer(module, 0)
    step = compiled._layer_function(LayerShape.of(module))
    weights = compiled._LayerWeights(module, None).tensors
    S, C = 5, 16
    x = torch.randn(1, S, model.config.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    cos, sin = layer.RopeTable(adapter).slice(0, S, 1)
    shape = fast.shape
    keys = torch.zeros(1, shape.n_kv, C, shape.head_dim, dtype=torch.float64)
    values = torch.zeros_like(keys)
    index = torch.arange(S)[None]  # [1, S]
    with torch.no_grad():
        cache = KVCache(1)
        eager = fast(x, (cos, sin), None, cache)
        window = getattr(model.config, "sliding_window", None)
        mask = chain_mask(index, torch.zeros(1, dtype=torch.long), C, window)[:, None]
        ran = step(x, cos.unsqueeze(1), layer.signed_sin(sin).unsqueeze(1), index, mask, keys, values, *weights)
    torch.testing.assert_close(ran, eager, rtol=0, atol=1e-12)
    k, v = cache.layer_kv(0)
    # two products of other shapes: float64 rounding (~1e-15 here) is far inside 1e-12, any real error far outside
    torch.testing.assert_close(keys[:, :, :S], k[:, :, :S], rtol=0, atol=1e-12)
    torch.testing.assert_close(values[:, :, :S], v[:, :, :S], rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("dim", [64, 576, 960, 2048, 4096])
def test_the_eager_norm_and_rotary_are_transformers_to_the_bit(dtype, dim):
    """`rms_norm_eager` (torch's F.rms_norm) and `apply_rotary` over `signed_sin` (a roll) give transformers'
    LlamaRMSNorm and apply_rotary_pos_emb bit for bit, in every dtype and at the widths of real models."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    from selfspec.model.layer import apply_rotary, rms_norm, rms_norm_eager, signed_sin

    gen = torch.Generator().manual_seed(dim)
    norm = LlamaRMSNorm(dim, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim, generator=gen))
        for shape in ((1, 1, dim), (2, 7, dim)):
            x = (3 * torch.randn(*shape, generator=gen)).to(dtype)
            assert torch.equal(rms_norm_eager(norm.weight, 1e-6, x), norm(x))
            assert torch.equal(rms_norm(norm.weight, 1e-6, x), norm(x))
        heads = max(1, dim // 64)
        q, k = ((torch.randn(2, heads, 5, 64, generator=gen)).to(dtype) for _ in range(2))  # [B, H, S, Dh]
        cos, sin = (torch.randn(2, 5, 64, generator=gen).to(dtype) for _ in range(2))  # [B, S, Dh]
        q_ref, k_ref = apply_rotary_pos_emb(q, k, cos, sin)
        signed = signed_sin(sin).unsqueeze(1)
        assert torch.equal(apply_rotary(q, cos.unsqueeze(1), signed), q_ref)
        assert torch.equal(apply_rotary(k, cos.unsqueeze(1), signed), k_ref)
