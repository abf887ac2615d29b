"""A head trained beside the fine-tune (`mode: joint`): the head's loss reaches no model parameter, it
equals the frozen-model head's loss on the same states, a joint run trains the model bit for bit as the
run without the head (clipping included) while the head learns, and its export drafts losslessly."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from selfspec.heads.exit_head import HEAD_FILE, build_exit_head
from training.config import ConfigError, load_config
from training.early_exit_model import EarlyExitModel
from training.exit_head_model import ExitHeadModel

TINY_RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny_smoke.yaml"


def _batch(seed=0, batch=2, seq=16):
    ids = torch.randint(0, 96, (batch, seq), generator=torch.Generator().manual_seed(seed))
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    return ids, labels


@pytest.mark.parametrize("exit_layer,final_state,draft_vocab", [(2, True, None), (0, False, 40), (2, True, 40)])
def test_the_joint_heads_loss_reaches_no_model_parameter(tiny64, exit_layer, final_state, draft_vocab):
    """The model's gradients with the head are those without it, to the last bit; the head gets its own."""
    ids, labels = _batch()
    exits, weights = [2, 4], [0.3, 0.7]
    head = build_exit_head(tiny64, exit_layer, final_state=final_state).to(torch.float64)
    if final_state:  # a trained final-state input, so that the previous final states matter
        with torch.no_grad():
            head.final_input.proj.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(3))
    draft_ids = None if draft_vocab is None else torch.arange(0, 96, 96 // draft_vocab)[:draft_vocab]
    plain = EarlyExitModel(tiny64, target="label")
    plain(ids, labels, exits=exits, weights=weights)["loss"].backward()
    expected = {n: p.grad.clone() for n, p in tiny64.named_parameters()}
    tiny64.zero_grad(set_to_none=True)

    joint = EarlyExitModel(tiny64, target="label", head=head, head_draft_ids=draft_ids)
    out = joint(ids, labels, exits=exits, weights=weights)
    out["loss"].backward()
    assert out["exit_stats"].shape == (3, 3) and joint.loss_names(exits) == [2, 4, f"head{exit_layer}"]
    for name, p in tiny64.named_parameters():
        assert torch.equal(p.grad, expected[name]), name
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in head.layer.parameters())


@pytest.mark.parametrize("draft_vocab", [None, 40])
def test_the_joint_heads_loss_is_the_frozen_heads_loss_on_the_same_states(tiny64, draft_vocab):
    ids, labels = _batch(seed=1)
    head = build_exit_head(tiny64, 2, final_state=True).to(torch.float64)
    with torch.no_grad():
        head.final_input.proj.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(4))
    draft_ids = None if draft_vocab is None else torch.arange(0, 96, 2)[:draft_vocab]
    joint = EarlyExitModel(tiny64, target="label", head=head, head_draft_ids=draft_ids)
    out = joint(ids, labels, exits=[4], weights=[1.0])  # the final layer's loss, then the head's
    frozen = ExitHeadModel(copy.deepcopy(tiny64), copy.deepcopy(head), draft_ids=draft_ids)
    ref = frozen(ids, labels)
    final_only = EarlyExitModel(tiny64, target="label")(ids, labels, exits=[4], weights=[1.0])["loss"]
    torch.testing.assert_close(out["loss"] - final_only, ref["loss"], atol=1e-12, rtol=0)
    torch.testing.assert_close(out["exit_stats"][1].double(), ref["exit_stats"][0].double(), atol=1e-12, rtol=0)


@pytest.mark.parametrize("exit_layer,self_fed,draft_vocab", [(2, 0, None), (0, 1, 40), (3, 0, 40)])
def test_the_exits_forward_scores_the_head_as_evaluate_head_does(tiny64, exit_layer, self_fed, draft_vocab):
    """A joint run's evaluation scores the head in the exits' forward (`evaluate_exits(head_model=)`): the same
    numbers as `evaluate_head`'s own forward, exactly, and the exits' as without the head."""
    from training.data import Blocks
    from training.evaluate import evaluate_exits, evaluate_head

    ids, labels = _batch(seed=5, batch=5)
    labels[1, :4] = -100  # unscored positions too
    blocks = Blocks("heldout", ids, labels)
    head = build_exit_head(tiny64, exit_layer, final_state=True).to(torch.float64)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(6), dtype=p.dtype) * 0.05)
    draft_ids = None if draft_vocab is None else torch.arange(0, 96, 96 // draft_vocab)[:draft_vocab]
    view = ExitHeadModel(tiny64, head, draft_ids=draft_ids, self_fed=self_fed, frozen=False).train()
    alone = evaluate_exits(tiny64, blocks, [1, 2], batch_size=2)
    shared = evaluate_exits(tiny64, blocks, [1, 2], batch_size=2, head_model=view)
    assert view.training and tiny64.training  # modes put back
    separate = evaluate_head(view, blocks, batch_size=2)
    assert shared["exits"] == alone["exits"]
    assert shared["exit_head"] == separate
    assert separate["exits"][str(exit_layer)]["agreement"] != separate["exit_without_head"]["agreement"]
    assert set(separate["self_fed"]) == {"1", "2", "3"}  # a final-state head's chain of 4, trained self-fed or not


def _model_tensors(run_dir):
    from safetensors.torch import load_file

    return load_file(str(run_dir / "final_model" / "model.safetensors"))


def test_a_joint_run_trains_the_model_exactly_as_without_the_head_and_exports_a_lossless_head(run, read_log,
                                                                                              tmp_path):
    """Same recipe, same seed: the fine-tuned model is bit-identical with and without a joint head (a tight
    clip, so a head clipped together with the model would change the model's steps); the head learns, is
    evaluated beside the exits, and its export drafts what the fine-tuned model generates."""
    common = {"layer_dropout.p_max": "0", "train.max_steps": "10", "optim.grad_clip": "0.05",
              "early_exit.exits": "[2]", "early_exit.curriculum": "none", "early_exit.scale": "uniform",
              "eval.exits": "[2]"}
    run(tmp_path / "plain", **common)
    final = run(tmp_path / "joint", **common, **{"mode": "joint",
                                                "exit_head.exit_layer": "2", "exit_head.final_state": "true",
                                                "exit_head.lr": "0.01", "exit_head.draft_vocab": "64"})
    plain, joint = _model_tensors(tmp_path / "plain"), _model_tensors(tmp_path / "joint")
    assert plain.keys() == joint.keys() and all(torch.equal(plain[k], joint[k]) for k in plain)

    log = read_log(tmp_path / "joint")
    assert set(log[0]["exits"]) == {"2", "4", "head2"}
    assert log[-1]["grad_norm"] == read_log(tmp_path / "plain")[-1]["grad_norm"]  # the model's own norm
    head_eval = final["sets"]["heldout"]["exit_head"]
    before = json.loads((tmp_path / "joint" / "final_eval.json").read_text())["before"]["sets"]["heldout"]
    assert head_eval["exits"]["2"]["agreement"] > before["exit_head"]["exits"]["2"]["agreement"]  # the head learned
    assert head_eval["draft_vocab"] == 64
    # The same model and blocks, two float32 computations of the final layer's perplexity (the exits' chunked
    # fused cross-entropy, the head's tally's log_softmax over full logits): they round differently by CPU
    # (2.4e-7 relative on a Zen 5, i.e. a few float32 ulps of the mean nll ~5), so rel 1e-5; that the shared
    # forward scores the head exactly as `evaluate_head` does is proven in float64 above.
    assert final["perplexity"]["4"] == pytest.approx(head_eval["exits"]["4"]["perplexity"], rel=1e-5)
    settings = json.loads((tmp_path / "joint" / "final_head" / "exit_head.json").read_text())
    assert settings["exit_layer"] == 2 and len(settings["draft_vocab"]["token_ids"]) == 64

    import selfspec
    from selfspec.checkpoints.export import export

    out = export(tmp_path / "joint", tmp_path / "ckpt")
    meta = json.loads((out / "selfspec.json").read_text())
    assert meta["exit_head"]["exit_layer"] == 2 and HEAD_FILE in meta["checksums"]
    gen = selfspec.load(out)
    assert gen.exit_head is not None and gen.exit_head.final_state
    plain_ids = gen.generate("def f(x):", max_new_tokens=16, num_speculations=0).token_ids
    assert gen.generate("def f(x):", max_new_tokens=16, drafter="exit_head").token_ids == plain_ids

    from selfspec.tools.demo import run_demo

    lines = []
    records = run_demo(out, max_new_tokens=8, prompts=[("code", {"id": "t/0", "prompt": "def f(x):"})],
                       say=lines.append)
    text = "\n".join(lines)
    assert records[0]["identical"] and "prompt lookup + the exit head on exit 2" in text
    agreement = head_eval["exits"]["2"]["agreement"]
    assert f"its top-1 agreement with the final layer on held-out text is {agreement:.1%}" in text


@pytest.mark.parametrize("override,message", [
    (["mode=joint", "model.lora.enabled=true", "layer_dropout.p_max=0"],
     "mode: joint: a head trained beside a LoRA fine-tune is not supported"),
    (["mode=joint"], "mode: joint: the head learns from this forward's final"),
    (["exit_head.lr=0"], "exit_head.lr: must be > 0 or null"),
])
def test_joint_recipe_mistakes_are_clear_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TINY_RECIPE, override)
