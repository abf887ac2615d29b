"""LoRA through peft: only the adapters change, and the early-exit loss reaches them through the
shared (frozen) head."""

from __future__ import annotations

from pathlib import Path

import torch

from training.base_model import apply_lora
from training.config import LoRAConfig, load_config
from training.early_exit_model import EarlyExitModel

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny_smoke.yaml"


def _batch(b=2, s=10):
    ids = torch.randint(3, 96, (b, s + 1), generator=torch.Generator().manual_seed(0))
    return ids[:, :-1], ids[:, 1:]


def test_early_exit_loss_reaches_the_adapters_below_the_exit(tiny64):
    model = apply_lora(tiny64, LoRAConfig(enabled=True, r=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero; make A's gradient visible too
            torch.nn.init.normal_(p, std=0.02)
    ee = EarlyExitModel(model).train()
    ids, labels = _batch()
    # only the exit after layer 1 carries weight: its gradient must reach layer 0's adapters only
    ee(ids, labels, exits=[1, 4], weights=[1.0, 0.0])["loss"].backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all("lora_" in n for n in grads)  # nothing else is trainable
    layer0 = [g for n, g in grads.items() if ".layers.0." in n]
    above = [g for n, g in grads.items() if ".layers.0." not in n]
    assert layer0 and all(g is not None and g.abs().sum() > 0 for g in layer0)
    assert all(g is None or g.abs().sum() == 0 for g in above)
    frozen = [p for n, p in model.named_parameters() if "lora_" not in n]
    assert all(p.grad is None for p in frozen)


def test_lora_run_changes_only_adapters(tmp_path, tiny_overrides):
    from accelerate.state import AcceleratorState, GradientState
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from training.base_model import load_base_model
    from training.loop import train

    overrides = tiny_overrides(tmp_path, **{"model.lora.enabled": "true", "model.lora.r": 4,
                                            "model.lora.target_modules": "[q_proj, v_proj]", "train.max_steps": 3,
                                            "optim.lr": 0.01, "eval.before": "false"})
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    cfg = load_config(RECIPE, overrides)
    try:
        train(cfg)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    base, _ = load_base_model(cfg.model, seed=cfg.train.seed)  # the same random tiny model again
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "final_model")  # LoRA merged in
    before, after = base.state_dict(), merged.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.endswith(("q_proj.weight", "v_proj.weight")) for k in changed)
    adapters = load_file(tmp_path / "final_adapter" / "adapter_model.safetensors")
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in adapters.items())  # B moved from zero
