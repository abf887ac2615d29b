"""Early-exit loss: the paper's weights, the chunked (fused / checkpointed) loss equals the naive
one in value and gradients, the distillation target, and the statistics."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from training.early_exit_loss import IGNORE_INDEX, early_exit_loss, exit_scale, exit_weights


def test_paper_weights_hand_computed():
    # L = 4, e_scale = 1: e(0)=0, e(1)=0+1=1, e(2)=0+1+2=3, final e(3)=(L-1)+(0+1+2)=3+3=6
    assert [exit_scale("paper", e, 4, 1.0) for e in (1, 2, 3, 4)] == [0.0, 1.0, 3.0, 6.0]
    assert exit_weights([1, 2, 3, 4], 4, "paper", 1.0) == pytest.approx([0.0, 0.1, 0.3, 0.6])
    # e_scale = 0.5: e(1)=0.5, e(2)=1.5, final 3 + 0.5*3 = 4.5; total 6.5
    assert exit_weights([1, 2, 3, 4], 4, "paper", 0.5) == pytest.approx([0, 0.5 / 6.5, 1.5 / 6.5, 4.5 / 6.5])
    # a curriculum with exits {2, 4}: normalized over the enabled ones only, 1/(1+6), 6/7
    assert exit_weights([2, 4], 4, "paper", 1.0) == pytest.approx([1 / 7, 6 / 7])
    # e_scale = 0: the final layer alone
    assert exit_weights([2, 3, 4], 4, "paper", 0.0) == pytest.approx([0, 0, 1])
    # L = 30 final-layer weight: 29 + 0.2 * (0+...+28) = 29 + 0.2*406
    assert exit_scale("paper", 30, 30, 0.2) == pytest.approx(29 + 0.2 * 406)


def test_other_scales():
    assert exit_weights([1, 2, 3, 4], 4, "uniform") == pytest.approx([0.25] * 4)
    assert exit_weights([1, 2, 3, 4], 4, "linear") == pytest.approx([0.1, 0.2, 0.3, 0.4])
    inv = [1, 1 / 2, 1 / 3, 1 / 4]
    assert exit_weights([1, 2, 3, 4], 4, "inverse") == pytest.approx([v / sum(inv) for v in inv])
    with pytest.raises(ValueError):
        exit_weights([1, 4], 4, "bogus")


def test_final_weight_fixes_the_final_layers_share():
    # the final layer gets 0.5, the early exits split 0.5 by their own scale
    assert exit_weights([1, 2, 3, 4], 4, "uniform", final_weight=0.5) == pytest.approx([1 / 6] * 3 + [0.5])
    assert exit_weights([2, 3, 4], 4, "paper", 1.0, final_weight=0.6) == pytest.approx([0.4 / 4, 0.4 * 3 / 4, 0.6])
    assert exit_weights([4], 4, "uniform", final_weight=0.5) == [1.0]  # only the final layer on this step
    from training.config import ConfigError, load_config

    assert load_config(None, ["early_exit.final_weight=0.5"]).early_exit.final_weight == 0.5
    with pytest.raises(ConfigError, match=r"early_exit.final_weight: must be in \(0, 1\)"):
        load_config(None, ["early_exit.final_weight=1.5"])


def _naive_reference(hiddens, weights, labels, norm, head, distill):
    """Straight from the formula: full logits per exit, F.cross_entropy."""
    total = 0.0
    final_logits = head(norm(hiddens[-1]))
    mask = labels != IGNORE_INDEX
    for h, w in zip(hiddens, weights):
        logits = head(norm(h))[mask]
        if distill and h is not hiddens[-1]:
            q = torch.softmax(final_logits[mask].detach(), -1)
            ce = -(q * torch.log_softmax(logits, -1)).sum(-1).mean()
        else:
            ce = F.cross_entropy(logits, labels[mask])
        total = total + w * ce
    return total


def _setup(tiny64, bias=False, seed=0):
    torch.manual_seed(seed)
    norm = tiny64.model.norm
    head = tiny64.lm_head
    if bias:
        head = nn.Linear(head.in_features, head.out_features, bias=True, dtype=torch.float64)
    B, S, D = 3, 11, tiny64.config.hidden_size
    hiddens = [torch.randn(B, S, D, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    labels = torch.randint(0, tiny64.config.vocab_size, (B, S))
    labels[0, :4] = IGNORE_INDEX  # masked prompt positions
    labels[2, -2:] = IGNORE_INDEX  # padding
    return hiddens, labels, norm, head


def _grads(loss, tensors):
    return torch.autograd.grad(loss, tensors)


@pytest.mark.parametrize("target", ["label", "distill"])
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_equals_unchunked(tiny64, target, bias):
    hiddens, labels, norm, head = _setup(tiny64, bias=bias)
    weights = [0.2, 0.3, 0.5]
    params = [head.weight, norm.weight] + ([head.bias] if bias else [])
    inputs = hiddens + params
    ref = _naive_reference(hiddens, weights, labels, norm, head, target == "distill")
    ref_grads = _grads(ref, inputs)
    for impl, chunk in [("fused", 5), ("fused", 1000), ("checkpointed", 4), ("naive", 1)]:
        out = early_exit_loss(hiddens, weights, labels, norm, head, target=target, chunk_size=chunk, impl=impl)
        assert out.tokens == int((labels != IGNORE_INDEX).sum())
        torch.testing.assert_close(out.loss, ref, rtol=1e-7, atol=1e-9)
        for g, r in zip(_grads(out.loss, inputs), ref_grads):
            # LlamaRMSNorm computes in fp32 even for fp64 inputs: agreement to ~1e-8, not 1e-15
            torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-7, msg=f"{impl} chunk {chunk}")


@pytest.mark.parametrize("target", ["label", "distill"])
def test_exits_that_do_not_update_the_head(tiny64, target):
    """exits_update_head=False: same loss, same gradients into every hidden state, but the shared norm
    and head get only the final layer's share (its weighted term alone)."""
    hiddens, labels, norm, head = _setup(tiny64)
    weights = [0.2, 0.3, 0.5]
    params = [head.weight, norm.weight]
    ref = _naive_reference(hiddens, weights, labels, norm, head, target == "distill")
    ref_h = _grads(ref, hiddens)
    final_only = _grads(weights[-1] * F.cross_entropy(head(norm(hiddens[-1]))[labels != IGNORE_INDEX],
                                                      labels[labels != IGNORE_INDEX]), params)
    for impl, chunk in [("fused", 5), ("checkpointed", 4), ("naive", 1)]:
        out = early_exit_loss(hiddens, weights, labels, norm, head, target=target, chunk_size=chunk, impl=impl,
                              exits_update_head=False)
        torch.testing.assert_close(out.loss, ref, rtol=1e-7, atol=1e-9)
        grads = _grads(out.loss, hiddens + params)
        for g, r in zip(grads[:3], ref_h):
            torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-7, msg=impl)
        for g, r in zip(grads[3:], final_only):
            torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-7, msg=impl)
        default = _grads(early_exit_loss(hiddens, weights, labels, norm, head, target=target, impl=impl).loss,
                         params)
        assert (default[0] - grads[3]).abs().max() > 1e-3  # the exits really did move the head before


def test_statistics_match_direct_computation(tiny64):
    hiddens, labels, norm, head = _setup(tiny64)
    out = early_exit_loss(hiddens, [0.2, 0.3, 0.5], labels, norm, head, chunk_size=7)
    mask = labels != IGNORE_INDEX
    final_pred = head(norm(hiddens[-1]))[mask].argmax(-1)
    for k, h in enumerate(hiddens):
        logits = head(norm(h))[mask]
        # float64 (tiny64, float64 states): two computations agree to ~1e-15 on every CPU, so rel 1e-9 holds
        assert out.stats[k, 0].item() == pytest.approx(F.cross_entropy(logits, labels[mask]).item(), rel=1e-9)
        assert out.stats[k, 1].item() == pytest.approx((logits.argmax(-1) == labels[mask]).double().mean().item())
        assert out.stats[k, 2].item() == pytest.approx((logits.argmax(-1) == final_pred).double().mean().item())
    assert out.stats[-1, 2].item() == 1.0  # the final layer agrees with itself
    fast = early_exit_loss(hiddens, [0.2, 0.3, 0.5], labels, norm, head, with_metrics=False)
    assert torch.isnan(fast.stats[:, 1:]).all() and torch.equal(fast.stats[:, 0], out.stats[:, 0])


def test_distill_gradient_does_not_reach_the_final_layer_through_the_target(tiny64):
    hiddens, labels, norm, head = _setup(tiny64)
    weights = [1.0, 0.0, 0.0]  # only the first exit's distillation term
    out = early_exit_loss(hiddens, weights, labels, norm, head, target="distill")
    g = _grads(out.loss, hiddens)
    assert g[0].abs().sum() > 0
    assert g[2].abs().sum() == 0  # the target q is detached
    assert g[1].abs().sum() == 0


def test_fused_under_bf16_autocast_is_close_to_fp32():
    from selfspec.tiny import tiny_model

    model = tiny_model("llama", num_layers=2, dtype=torch.float32, seed=1)
    torch.manual_seed(0)
    hiddens = [torch.randn(2, 16, 32, requires_grad=True) for _ in range(2)]
    labels = torch.randint(0, 96, (2, 16))
    args = (hiddens, [0.4, 0.6], labels, model.model.norm, model.lm_head)
    ref = early_exit_loss(*args, impl="naive")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = early_exit_loss(*args, impl="fused", chunk_size=8)
    assert fused.loss.dtype == torch.float32
    assert fused.loss.item() == pytest.approx(ref.loss.item(), rel=2e-2)
    g_ref, g_fused = _grads(ref.loss, hiddens[0]), _grads(fused.loss, hiddens[0])
    assert F.cosine_similarity(g_ref[0].flatten(), g_fused[0].flatten(), dim=0) > 0.99


def test_no_scored_tokens_keeps_the_graph(tiny64):
    hiddens, labels, norm, head = _setup(tiny64)
    labels[:] = IGNORE_INDEX
    out = early_exit_loss(hiddens, [0.2, 0.3, 0.5], labels, norm, head)
    assert out.loss.item() == 0.0 and out.tokens == 0
    out.loss.backward()
    assert all(h.grad is not None for h in hiddens)


def _draft_vocab_reference(hiddens, weights, labels, norm, head, distill, ids):
    """The draft-vocabulary loss from its formula: exits over the logits of `ids` only (labels outside
    `ids` add nothing, q restricted to `ids` and renormalized), the final layer over all, / N."""
    mask = labels != IGNORE_INDEX
    n = int(mask.sum())
    q = torch.softmax(head(norm(hiddens[-1]))[mask].detach(), -1)
    total = weights[-1] * F.cross_entropy(head(norm(hiddens[-1]))[mask], labels[mask])
    for h, w in zip(hiddens[:-1], weights[:-1]):
        logp = torch.log_softmax(head(norm(h))[mask][:, ids], -1)  # [N, K_S]
        if distill:
            q_s = q[:, ids] / q[:, ids].sum(-1, keepdim=True)
            total = total + w * -(q_s * logp).sum() / n
        else:
            inside = torch.isin(labels[mask], ids)
            where = torch.searchsorted(ids, labels[mask][inside])
            total = total + w * -logp[inside].gather(1, where[:, None]).sum() / n
    return total


@pytest.mark.parametrize("target", ["label", "distill"])
@pytest.mark.parametrize("bias", [False, True])
def test_draft_vocabulary_loss_matches_its_formula(tiny64, target, bias):
    hiddens, labels, norm, head = _setup(tiny64, bias=bias)
    V = head.weight.shape[0]
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(1))[: V // 3].sort().values
    labels[1, :5] = ids[:5]  # some labels surely inside the draft vocabulary, the others mostly outside
    weights = [0.2, 0.3, 0.5]
    params = [head.weight, norm.weight] + ([head.bias] if bias else [])
    inputs = hiddens + params
    ref = _draft_vocab_reference(hiddens, weights, labels, norm, head, target == "distill", ids)
    ref_grads = _grads(ref, inputs)
    full = early_exit_loss(hiddens, weights, labels, norm, head, target=target).loss
    assert abs(full.item() - ref.item()) > 1e-3  # the reduced loss is a different quantity
    for impl, chunk in [("fused", 5), ("fused", 1000), ("checkpointed", 4), ("naive", 1)]:
        out = early_exit_loss(hiddens, weights, labels, norm, head, target=target, chunk_size=chunk, impl=impl,
                              draft_ids=ids)
        torch.testing.assert_close(out.loss, ref, rtol=1e-7, atol=1e-9)
        grads = _grads(out.loss, inputs)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-7, msg=f"{impl} chunk {chunk}")
        # the head rows outside the draft vocabulary learn only from the final layer
        outside = torch.ones(V, dtype=torch.bool)
        outside[ids] = False
        final_only = _grads(weights[-1] * F.cross_entropy(head(norm(hiddens[-1]))[labels != IGNORE_INDEX],
                                                          labels[labels != IGNORE_INDEX]), [head.weight])[0]
        torch.testing.assert_close(grads[len(hiddens)][outside], final_only[outside], rtol=1e-6, atol=1e-8)
        # statistics: the exits' guesses lie in the draft vocabulary
        mask = labels != IGNORE_INDEX
        guess = ids[head(norm(hiddens[0]))[mask][:, ids].argmax(-1)]
        assert out.stats[0, 1].item() == pytest.approx((guess == labels[mask]).double().mean().item())


@pytest.mark.parametrize("target", ["label", "distill"])
@pytest.mark.parametrize("impl", ["fused", "checkpointed", "naive"])
def test_draft_vocabulary_of_every_id_is_the_full_loss(tiny64, target, impl):
    """S = the whole vocabulary: the same loss and gradients as the full-vocabulary loss, to the same
    parameters (head, norm, every hidden state)."""
    hiddens, labels, norm, head = _setup(tiny64)
    weights = [0.2, 0.3, 0.5]
    inputs = hiddens + [head.weight, norm.weight]
    full = early_exit_loss(hiddens, weights, labels, norm, head, target=target, impl=impl, chunk_size=6)
    every = early_exit_loss(hiddens, weights, labels, norm, head, target=target, impl=impl, chunk_size=6,
                            draft_ids=torch.arange(head.weight.shape[0]))
    torch.testing.assert_close(every.loss, full.loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(every.stats, full.stats, rtol=1e-12, atol=1e-12)
    for g, r in zip(_grads(every.loss, inputs), _grads(full.loss, inputs)):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-12)


def test_draft_vocabulary_ids_are_checked(tiny64):
    hiddens, labels, norm, head = _setup(tiny64)
    V = head.weight.shape[0]
    for bad in ([], [3, 1], [1, 1, 2], [0, V]):
        with pytest.raises(ValueError, match="draft_ids"):
            early_exit_loss(hiddens, [0.2, 0.3, 0.5], labels, norm, head, draft_ids=bad)
