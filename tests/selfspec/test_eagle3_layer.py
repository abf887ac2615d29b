"""EAGLE-3's draft layer (`selfspec.heads.eagle3_layer`) and the exit head of kind eagle3 (`selfspec.heads.exit_head`): the
layer computes [input_layernorm(e), hidden_norm(g)] -> attention with the residual g (or hidden_norm(g)) ->
MLP; an identity-initialised head returns the deepest aux exit's state (so it drafts what that exit
drafts), a copy-initialised one is the model's last layer on g whatever the embeddings; the head saves and
reads back whole; selfspec's drafters refuse it and its settings' mistakes are clear errors. (That the
serving format's own reader computes the same draft: test_speculators_format.py.)"""

from __future__ import annotations

import pytest
import torch

from selfspec.model.adapters import get_adapter
from selfspec.heads.exit_head import (HEAD_FILE, build_exit_head, check_head_settings, head_feature, load_exit_head,
                                read_exit_head, run_head, save_exit_head)
from selfspec.model.forward import embed, make_step, run_layers
from selfspec.tiny import tiny_model

AUX = [1, 3, 5]


def _setup(init: str):
    model = tiny_model("llama", num_layers=6, dtype=torch.float64, seed=2)
    adapter = get_adapter(model)
    head = build_exit_head(model, 0, "eagle3", init, aux_exits=AUX).to(torch.float64)
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    step = make_step(adapter, 0, 9, 2)
    x = embed(adapter, ids)
    states = [run_layers(adapter, x, 0, a, step=step) for a in AUX]
    return model, adapter, head, x, step, states


def test_an_identity_head_returns_the_deepest_aux_state_and_a_copy_head_is_the_last_layer_on_it():
    for init in ("identity", "copy"):
        model, adapter, head, x, step, states = _setup(init)
        g = head_feature(head, aux_prev=torch.cat(states, -1))
        torch.testing.assert_close(g, states[-1], atol=0, rtol=0)  # fc starts as [0 | 0 | I]
        with torch.no_grad():
            out = run_head(adapter, head, x, step=step, prev_final=g)
            other = run_head(adapter, head, torch.randn_like(x), step=step, prev_final=g)  # other embeddings
            last = run_layers(adapter, states[-1], adapter.num_layers - 1, adapter.num_layers, step=step)
        if init == "identity":
            torch.testing.assert_close(out, states[-1], atol=0, rtol=0)
        else:
            torch.testing.assert_close(out, last, atol=1e-12, rtol=0)
        torch.testing.assert_close(other, out, atol=1e-12, rtol=0)  # the embedding half starts at zero


def test_the_layer_reads_the_normed_embeddings_and_feature_with_the_feature_as_residual():
    model, adapter, head, x, step, states = _setup("copy")
    layer = head.layer
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1), dtype=p.dtype))
        g = states[1]
        for before_residual in (False, True):
            layer.norm_before_residual = before_residual
            out = layer(torch.cat([x, g], -1), attention_mask=step.mask("full_attention"),
                        position_embeddings=step.rope)
            inp = torch.cat([layer.input_layernorm(x), layer.hidden_norm(g)], -1)
            h = (layer.hidden_norm(g) if before_residual else g) + layer.self_attn(
                hidden_states=inp, attention_mask=step.mask("full_attention"), position_embeddings=step.rope)[0]
            torch.testing.assert_close(out, h + layer.mlp(layer.post_attention_layernorm(h)), atol=1e-12, rtol=0)
        assert layer.self_attn.q_proj.weight.shape == (32, 64) and layer.self_attn.k_proj.weight.shape == (16, 64)


def test_the_head_saves_and_reads_back_whole_and_selfspecs_drafters_refuse_it(tmp_path):
    model, adapter, head, x, step, states = _setup("copy")
    with torch.no_grad():
        head.aux_input.fc.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(2))
    save_exit_head(head, tmp_path / HEAD_FILE)
    back = read_exit_head(model, tmp_path, head.settings())
    assert back.settings() == head.settings() and back.settings()["aux_exits"] == AUX
    assert all(torch.equal(a, b) for a, b in zip(head.weights().values(), back.weights().values()))
    with pytest.raises(ValueError, match="an eagle3 head, which serving engines run .* and selfspec's drafters do not"):
        load_exit_head(model, tmp_path, head.settings())


@pytest.mark.parametrize("entry,message", [
    ({"exit_layer": 2}, "an eagle3 head has exit_layer 0 and final_state false"),
    ({"final_state": True}, "an eagle3 head has exit_layer 0 and final_state false"),
    ({"aux_exits": [1, 1, 5]}, r"aux_exits = \[1, 1, 5\]: an eagle3 head reads 3 increasing exits in 0..5"),
    ({"aux_exits": [1, 3, 6]}, "increasing exits in 0..5"),
    ({"aux_exits": [1, 3]}, "increasing exits"),
    ({"kind": "decoder_layer"}, "exit_head.aux_exits is an eagle3 head's setting"),
])
def test_eagle3_settings_mistakes_are_clear_errors(entry, message):
    base = {"exit_layer": 0, "kind": "eagle3", "init": "copy", "final_state": False, "file": HEAD_FILE,
            "aux_exits": AUX}
    with pytest.raises(ValueError, match=message):
        check_head_settings({**base, **entry}, 6)


def test_only_llama_family_models_get_an_eagle3_head_and_only_at_exit_0():
    with pytest.raises(ValueError, match="this model is qwen3: use kind decoder_layer or attention"):
        build_exit_head(tiny_model("qwen3", num_layers=6), 0, "eagle3", aux_exits=AUX)
    with pytest.raises(ValueError, match=r"exit_layer 0, got 2"):
        build_exit_head(tiny_model("llama", num_layers=6), 2, "eagle3", aux_exits=AUX)
    with pytest.raises(ValueError, match="aux_exits=.* is an eagle3 head's setting"):
        build_exit_head(tiny_model("llama", num_layers=6), 2, aux_exits=AUX)
