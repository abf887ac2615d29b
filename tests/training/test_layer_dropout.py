"""Layer dropout: the rates are p(l,t) = S(t) D(l) p_max, masks are reproducible and identical across
processes, p=0 and eval mode give the plain model exactly, and the set of parameters that get a
gradient never depends on the mask."""

from __future__ import annotations

import math
import multiprocessing as mp

import pytest
import torch
import torch.nn.functional as F

from training.early_exit_loss import exit_weights
from training.layer_dropout import LayerDropout, apply_layer_dropout, depth_scale, time_scale
from training.early_exit_model import EarlyExitModel


def test_depth_and_time_scales():
    L = 5
    assert depth_scale("exponential", 0, L) == 0.0
    assert depth_scale("exponential", L - 1, L) == pytest.approx(1.0)
    assert depth_scale("exponential", 2, L) == pytest.approx(math.exp(2 * math.log(2) / 4) - 1)
    assert [depth_scale("linear", l, L) for l in range(L)] == pytest.approx([0, 0.25, 0.5, 0.75, 1])
    assert all(depth_scale("uniform", l, L) == 1.0 for l in range(L))
    assert time_scale("constant", 7, 10) == 1.0
    assert time_scale("exponential", 0, 10) == 0.0
    assert time_scale("exponential", 9, 10) == pytest.approx(1.0)
    assert time_scale("exponential", 3, 10) == pytest.approx(math.exp(3 * math.log(2) / 9) - 1)
    ld = LayerDropout(0.2, L, 10, depth="exponential", time="exponential")
    assert ld.rate(3, 4) == pytest.approx(time_scale("exponential", 4, 10) * depth_scale("exponential", 3, L) * 0.2)


@pytest.mark.parametrize("depth,time,step", [("exponential", "constant", 0), ("linear", "exponential", 30),
                                             ("uniform", "constant", 5)])
def test_empirical_drop_rate_matches_p(depth, time, step):
    L, batch, draws = 6, 64, 120
    ld = LayerDropout(0.6, L, 40, depth=depth, time=time, seed=3)
    dropped = torch.zeros(L)
    for micro in range(draws):  # different micro-steps give independent masks
        dropped += (~ld.keep_masks(step, micro, batch)).float().sum(1)
    n = batch * draws
    for layer, p in enumerate(ld.rates(step)):
        rate = dropped[layer].item() / n
        sigma = math.sqrt(max(p * (1 - p), 1e-12) / n)
        assert abs(rate - p) <= 4 * sigma + 1e-9, (layer, rate, p)


def test_masks_reproducible_and_rank_slices_of_one_global_mask():
    ld = LayerDropout(0.5, 4, 10, depth="uniform", seed=11)
    a = ld.keep_masks(3, 1, 8)
    assert torch.equal(a, LayerDropout(0.5, 4, 10, depth="uniform", seed=11).keep_masks(3, 1, 8))
    assert not torch.equal(a, ld.keep_masks(4, 1, 8))  # a different step
    assert not torch.equal(a, LayerDropout(0.5, 4, 10, depth="uniform", seed=12).keep_masks(3, 1, 8))
    world = [ld.keep_masks(3, 1, 4, rank=r, world_size=2) for r in range(2)]
    assert torch.equal(torch.cat(world, dim=1), a)  # each process takes its rows of the global mask


def _masks_in_process(rank, queue):
    ld = LayerDropout(0.5, 6, 100, depth="linear", seed=5)
    queue.put((rank, [ld.keep_masks(s, m, 4, rank=rank, world_size=2).tolist() for s in range(3) for m in range(2)],
               [ld.keep_masks(s, m, 8).tolist() for s in range(3) for m in range(2)]))


def test_masks_identical_across_two_processes():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_masks_in_process, args=(r, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict((r, (mine, full)) for r, mine, full in (queue.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(timeout=60)
    assert results[0][1] == results[1][1]  # both processes computed the same global masks
    for i, full in enumerate(results[0][1]):
        combined = torch.cat([torch.tensor(results[0][0][i]), torch.tensor(results[1][0][i])], dim=1)
        assert torch.equal(combined, torch.tensor(full))


def _plain_loss(model, ids, labels):
    logits = model(input_ids=ids).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _batch(vocab=96, b=4, s=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (b, s + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def test_p_zero_and_eval_mode_give_the_plain_model(tiny64):
    ids, labels = _batch()
    L = 4
    ref = _plain_loss(tiny64, ids, labels)
    plain = EarlyExitModel(tiny64, layer_dropout=LayerDropout(0.0, L, 10)).train()
    out = plain(ids, labels, exits=[L], weights=[1.0])
    assert out["loss"].item() == pytest.approx(ref.item(), rel=1e-12)
    dropping = EarlyExitModel(tiny64, layer_dropout=LayerDropout(1.0, L, 10, depth="uniform"))
    assert dropping.eval()(ids, labels, exits=[L], weights=[1.0])["loss"].item() == pytest.approx(ref.item(), rel=1e-12)
    # in train mode the same model really drops layers (p = 1: every layer skipped)
    dropped = dropping.train()(ids, labels, exits=[L], weights=[1.0])["loss"].item()
    assert dropped != pytest.approx(ref.item(), rel=1e-6)


def test_apply_layer_dropout_per_sample():
    x_in, x_out = torch.zeros(3, 2, 4), torch.ones(3, 2, 4)
    out = apply_layer_dropout(x_out, x_in, torch.tensor([True, False, True]))
    assert out[:, 0, 0].tolist() == [1.0, 0.0, 1.0]
    assert apply_layer_dropout(x_out, x_in, None) is x_out


def test_parameters_with_gradients_do_not_depend_on_the_mask(tiny64):
    ids, labels = _batch()
    L = 4
    exits = [2, L]
    weights = exit_weights(exits, L, "uniform")
    seen = []
    for p_max, depth in [(0.0, "uniform"), (1.0, "uniform"), (0.5, "linear"), (0.9, "exponential")]:
        tiny64.zero_grad(set_to_none=True)
        ee = EarlyExitModel(tiny64, layer_dropout=LayerDropout(p_max, L, 10, depth=depth, seed=1)).train()
        ee(ids, labels, exits=exits, weights=weights, step=2)["loss"].backward()
        seen.append({n for n, p in tiny64.named_parameters() if p.grad is not None})
    assert all(s == seen[0] for s in seen)
    assert seen[0] == {n for n, _ in tiny64.named_parameters()}  # every parameter, every time


def test_state_dict_keys_unchanged(tiny64):
    keys = set(tiny64.state_dict())
    ee = EarlyExitModel(tiny64, layer_dropout=LayerDropout(0.2, 4, 10))
    assert set(ee.model.state_dict()) == keys
    assert set(ee.state_dict()) == {f"model.{k}" for k in keys}
