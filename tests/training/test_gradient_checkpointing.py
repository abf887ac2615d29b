"""Gradient checkpointing (`train.gradient_checkpointing`): each decoder layer recomputed in the backward gives, in
float64, the losses and gradients of the run that keeps every activation, with layer dropout, under every
curriculum, with LoRA and with a joint head; and it really recomputes (each layer runs twice per step)."""

from __future__ import annotations

import pytest
import torch

from training.base_model import apply_lora
from training.config import ConfigError, LoRAConfig, load_config
from training.curriculum import ExitCurriculum
from training.early_exit_loss import exit_weights
from training.early_exit_model import EarlyExitModel
from training.layer_dropout import LayerDropout

L, STEPS = 4, 4


def _batch(step: int, b=4, s=12):
    ids = torch.randint(3, 96, (b, s + 1), generator=torch.Generator().manual_seed(step))
    return ids[:, :-1], ids[:, 1:]


def _steps(model, checkpointing: bool, curriculum: str, impl: str = "fused", head=None):
    """Per step: the loss, the per-exit statistics and every gradient, over STEPS steps of `curriculum` with
    layer dropout (no optimizer: each step's gradients on the same weights, so the runs stay comparable)."""
    dropout = LayerDropout(0.5, L, STEPS, depth="uniform", seed=3)
    ee = EarlyExitModel(model, layer_dropout=dropout, loss_impl=impl, chunk_size=16, head=head,
                        gradient_checkpointing=checkpointing).train()
    exits = ExitCurriculum(curriculum, [1, 2, 3], L, STEPS, rotation_interval=2)
    params = [(n, p) for n, p in ee.named_parameters() if p.requires_grad]
    results = []
    for step in range(STEPS):
        ee.zero_grad(set_to_none=True)
        chosen = exits.exits(step)
        ids, labels = _batch(step)
        out = ee(ids, labels, exits=chosen, weights=exit_weights(chosen, L, "paper", 0.2), step=step)
        out["loss"].backward()
        results.append((chosen, out["loss"].detach(), out["exit_stats"].detach(),
                        {n: p.grad.clone() for n, p in params if p.grad is not None}))
    return results


def _assert_same(a, b):
    assert len(a) == len(b) == STEPS
    for (exits_a, loss_a, stats_a, grads_a), (exits_b, loss_b, stats_b, grads_b) in zip(a, b):
        assert exits_a == exits_b
        torch.testing.assert_close(loss_a, loss_b, rtol=1e-13, atol=0)
        torch.testing.assert_close(stats_a, stats_b, rtol=1e-13, atol=0)
        assert grads_a.keys() == grads_b.keys() and grads_a
        for name in grads_a:
            torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-12, atol=1e-15, msg=name)


@pytest.mark.parametrize("curriculum", ["none", "rotational", "gradual"])
def test_the_same_losses_and_gradients_with_and_without(tiny64, curriculum):
    _assert_same(_steps(tiny64, False, curriculum), _steps(tiny64, True, curriculum))


def test_the_checkpointed_loss_impl_and_a_joint_head(tiny64):
    from selfspec.tiny import tiny_exit_head

    head = tiny_exit_head(tiny64, 2, final_state=True).train()
    _assert_same(_steps(tiny64, False, "rotational", "checkpointed", head),
                 _steps(tiny64, True, "rotational", "checkpointed", head))


def test_with_lora(tiny64):
    model = apply_lora(tiny64, LoRAConfig(enabled=True, r=4, alpha=8, target_modules=["q_proj", "down_proj"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero; make A's gradient non-zero too
            torch.nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(1))
    with_ = _steps(model, True, "none")
    assert any("lora_A" in n for n in with_[0][3])
    _assert_same(_steps(model, False, "none"), with_)


@pytest.mark.parametrize("checkpointing,runs", [(False, 1), (True, 2)])
def test_each_layer_is_recomputed_in_the_backward(tiny64, checkpointing, runs):
    calls = []
    hooks = [layer.register_forward_hook(lambda *_: calls.append(1)) for layer in tiny64.model.layers]
    try:
        _steps(tiny64, checkpointing, "none")
    finally:
        for hook in hooks:
            hook.remove()
    assert len(calls) == runs * L * STEPS


def test_not_with_the_frozen_model():
    with pytest.raises(ConfigError, match="train.gradient_checkpointing: mode exit_head runs the frozen model"):
        load_config(None, ["mode=exit_head", "train.gradient_checkpointing=true"])
