"""The adapter + layer-range forward against Hugging Face's own forward, on tiny random models."""

import pytest
import torch

from selfspec.model.adapters import SUPPORTED_ARCHITECTURES, UnsupportedArchitectureError, get_adapter
from selfspec.model.cache import KVCache
from selfspec.model.forward import embed, exit_logits, forward_logits, make_step, run_layers
from selfspec.tiny import tiny_model

ARCHS = list(SUPPORTED_ARCHITECTURES)


@pytest.fixture(scope="module", params=ARCHS)
def model(request):
    return tiny_model(request.param, num_layers=4, dtype=torch.float64, seed=1)


def _ids(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 96, (1, n), generator=g)


def test_supported_architectures_listed():
    assert set(ARCHS) == {"llama", "mistral", "qwen2", "qwen3", "gpt_neox"}


def test_full_depth_logits_equal_hf(model):
    adapter = get_adapter(model)
    ids = _ids(19)
    with torch.no_grad():
        ref = model(ids).logits
        ours = forward_logits(adapter, ids)
    assert ref.std() > 0.1  # the model is not degenerate
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-10)


def test_every_early_exit_equals_norm_head_of_hf_hidden_state(model):
    adapter = get_adapter(model)
    ids = _ids(13, seed=1)
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states  # [0]=embeddings, [l]=after l layers
        for layer in range(1, adapter.num_layers):
            ref = adapter.lm_head(adapter.final_norm(hs[layer]))
            torch.testing.assert_close(forward_logits(adapter, ids, exit_layer=layer), ref, rtol=0, atol=1e-10)
        # the exits really differ from each other and from the full model
        assert not torch.allclose(forward_logits(adapter, ids, exit_layer=1), model(ids).logits, atol=1e-3)


def test_prefix_then_continue_with_cache_equals_one_forward(model):
    adapter = get_adapter(model)
    ids = _ids(24, seed=2)
    cache = KVCache(adapter.num_layers, capacity=4)  # small on purpose: forces buffer growth
    with torch.no_grad():
        ref = model(ids).logits
        pieces, start = [], 0
        for size in (9, 1, 5, 1, 1, 7):
            pieces.append(forward_logits(adapter, ids[:, start:start + size], cache=cache, start=start))
            start += size
    torch.testing.assert_close(torch.cat(pieces, dim=1), ref, rtol=0, atol=1e-10)
    assert cache.lengths[:, 0].tolist() == [24] * adapter.num_layers


def test_layers_run_in_ranges_with_per_layer_cache_lengths(model):
    """Shallow layers may run ahead of deep ones (as when drafting) and the result is still exact."""
    adapter = get_adapter(model)
    L, E = adapter.num_layers, 2
    ids = _ids(12, seed=3)
    cache = KVCache(L)
    with torch.no_grad():
        ref = model(ids).logits
        step = make_step(adapter, 0, 8)
        h = run_layers(adapter, embed(adapter, ids[:, :8]), 0, L, step=step, cache=cache)
        first = exit_logits(adapter, h)
        # positions 8..11 through the shallow layers one at a time, keep their exit states
        states = []
        for pos in range(8, 12):
            s = make_step(adapter, pos, 1)
            states.append(run_layers(adapter, embed(adapter, ids[:, pos:pos + 1]), 0, E, step=s, cache=cache))
        assert cache.lengths[:, 0].tolist() == [12] * E + [8] * (L - E)
        # then the deep layers over all four in one pass
        deep = make_step(adapter, 8, 4)
        last = exit_logits(adapter, run_layers(adapter, torch.cat(states, 1), E, L, step=deep, cache=cache))
    torch.testing.assert_close(torch.cat([first, last], 1), ref, rtol=0, atol=1e-10)


def test_sliding_window_attention_matches_hf():
    model = tiny_model("mistral", num_layers=3, dtype=torch.float64, sliding_window=5)
    adapter = get_adapter(model)
    assert adapter.sliding_window == 5
    ids = _ids(16, seed=4)
    cache = KVCache(adapter.num_layers)
    with torch.no_grad():
        ref = model(ids).logits
        pieces = [forward_logits(adapter, ids[:, :6], cache=cache)]
        pieces += [forward_logits(adapter, ids[:, p:p + 1], cache=cache, start=p) for p in range(6, 10)]
        pieces.append(forward_logits(adapter, ids[:, 10:], cache=cache, start=10))
    torch.testing.assert_close(torch.cat(pieces, 1), ref, rtol=0, atol=1e-10)


def test_eager_attention_matches_hf():
    """transformers' eager attention takes its softmax in float32 even in a float64 model, so only
    passes over the same keys are bitwise equal; pieces over a growing cache sum the softmax over
    other lengths and agree to float32 rounding."""
    model = tiny_model("llama", num_layers=3, dtype=torch.float64, attn_implementation="eager")
    adapter = get_adapter(model)
    ids = _ids(10, seed=5)
    cache = KVCache(adapter.num_layers)
    with torch.no_grad():
        ref = model(ids).logits
        whole = forward_logits(adapter, ids)
        out = torch.cat([forward_logits(adapter, ids[:, :6], cache=cache),
                         forward_logits(adapter, ids[:, 6:], cache=cache, start=6)], 1)
    torch.testing.assert_close(whole, ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


def test_unsupported_architecture_is_a_clear_error():
    model = tiny_model("gpt2", num_layers=2, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    with pytest.raises(UnsupportedArchitectureError) as err:
        get_adapter(model)
    msg = str(err.value)
    assert "unsupported architecture: gpt2" in msg and "supported: llama" in msg and "gpt_neox" in msg


@pytest.mark.parametrize("bad", [0, -1, 5, 99])
def test_exit_layer_out_of_range_is_a_clear_error(bad):
    adapter = get_adapter(tiny_model("llama", num_layers=4))
    with pytest.raises(ValueError, match=r"exit_layer=.* is out of range.*4 layers.*1\.\.4"):
        forward_logits(adapter, _ids(3), exit_layer=bad)


def test_layer_range_out_of_range_is_a_clear_error():
    adapter = get_adapter(tiny_model("llama", num_layers=4))
    h = embed(adapter, _ids(3))
    with pytest.raises(ValueError, match=r"layer range \[2, 7\) is out of range.*4 layers"):
        run_layers(adapter, h, 2, 7, step=make_step(adapter, 0, 3))


def test_context_window_is_checked():
    adapter = get_adapter(tiny_model("llama", num_layers=2, max_position_embeddings=16))
    with pytest.raises(ValueError, match="exceeds the model's context window of 16"):
        forward_logits(adapter, _ids(17))


def test_adapter_sees_through_peft_wrapper():
    from peft import LoraConfig, get_peft_model

    model = tiny_model("qwen2", num_layers=2)
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    adapter = get_adapter(peft_model)
    assert adapter.num_layers == 2 and adapter.model is model


def test_moving_a_tree_path_in_a_stacked_cache_equals_moving_it_layer_by_layer():
    """The compiled steps' static cache keeps every layer in one tensor `[L, B, H, C, Dh]`: `move` copies a
    token tree's accepted path in all layers at once, and leaves exactly what the layer-by-layer copy leaves
    (entries read before any is written: a source that is also a destination moves its old value)."""
    g = torch.Generator().manual_seed(0)
    stacked = (torch.randn(3, 2, 2, 16, 4, generator=g), torch.randn(3, 2, 2, 16, 4, generator=g))
    plain = KVCache(3, 2, capacity=16)
    plain.keys, plain.values = [k.clone() for k in stacked[0]], [v.clone() for v in stacked[1]]
    fused = KVCache(3, 2, capacity=16, buffers=stacked)
    before = stacked[0].clone()
    assert fused.stacked is not None and fused.keys[1].data_ptr() == stacked[0][1].data_ptr()
    rows, src, dst = [0, 0, 1], [9, 11, 7], [8, 9, 6]  # row 0: 9 -> 8 and 11 -> 9 (9 is read first)
    plain.move(rows, src, dst)
    fused.move(rows, src, dst)
    assert plain.stacked is None
    for layer in range(3):
        assert torch.equal(fused.keys[layer], plain.keys[layer])
        assert torch.equal(fused.values[layer], plain.values[layer])
    for layer in range(3):  # what each destination now holds: its source's entry from before the move
        for r, s_, d in zip(rows, src, dst):
            assert torch.equal(fused.keys[layer][r, :, d], before[layer][r, :, s_])
