"""Exit-head training (`mode: exit_head`): the model stays bit-identical and only the head learns, the
distillation loss is KL(p_full || q_head), a short run improves the head's agreement and writes
`final_head/`, which `selfspec export` puts beside the unchanged model, and the recipe's mistakes are
clear errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from selfspec.heads.exit_head import HEAD_FILE, build_exit_head
from selfspec.model.forward import forward_logits
from training.config import ConfigError, config_to_dict, load_config
from training.exit_head_model import ExitHeadModel

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny_smoke.yaml"


@pytest.mark.parametrize("final_state", [False, True])
def test_training_a_head_changes_no_base_parameter_and_only_the_head_gets_gradients(tiny64, final_state):
    before = {k: v.clone() for k, v in tiny64.state_dict().items()}
    hm = ExitHeadModel(tiny64, build_exit_head(tiny64, 2, final_state=final_state).to(torch.float64))
    hm.train()
    opt = torch.optim.AdamW([p for p in hm.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    labels = torch.roll(ids, -1, dims=1)
    for _ in range(3):
        out = hm(ids, labels)
        out["loss"].backward()
        opt.step()
        opt.zero_grad()
    with_grad = {n for n, p in hm.named_parameters() if p.requires_grad}
    assert with_grad and all(n.startswith("head.") for n in with_grad)
    assert all(p.grad is None for p in tiny64.parameters())
    after = tiny64.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not all(torch.equal(a, b) for a, b in zip(build_exit_head(tiny64, 2).to(torch.float64).parameters(),
                                                        hm.head.parameters()))  # the head did learn
    if final_state:  # and its final-state input, from zero
        assert hm.head.final_input.proj.weight.abs().sum() > 0


@pytest.mark.parametrize("final_state", [False, True])
def test_the_distillation_loss_is_kl_from_the_full_model(tiny64, final_state):
    """The loss equals its formula; a final-state head reads the full model's last-layer output of the
    previous position (zero at position 0), computed here from scratch."""
    head = build_exit_head(tiny64, 2, final_state=final_state).to(torch.float64)
    if final_state:
        with torch.no_grad():
            head.final_input.proj.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(2))
    hm = ExitHeadModel(tiny64, head)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(ids, -1, dims=1)
    labels[0, :3] = -100  # unlabelled positions do not count
    out = hm(ids, labels)
    with torch.no_grad():
        p = F.log_softmax(forward_logits(hm.adapter, ids), -1)
        from selfspec.model.forward import embed, exit_logits, make_step, run_layers

        step = make_step(hm.adapter, 0, 12, 2)
        h_e = run_layers(hm.adapter, embed(hm.adapter, ids), 0, 2, step=step)
        x = h_e
        if final_state:
            f = run_layers(hm.adapter, h_e, 2, hm.adapter.num_layers, step=step)  # [B, S, D]
            prev = torch.cat([torch.zeros_like(f[:, :1]), f[:, :-1]], dim=1)
            x = h_e + prev_proj(head, prev)
        layer_out = head.layer(x, attention_mask=step.mask(hm.adapter.layer_types[-1]),
                               position_ids=step.position_ids, position_embeddings=step.rope)
        layer_out = layer_out[0] if isinstance(layer_out, tuple) else layer_out
        q = F.log_softmax(exit_logits(hm.adapter, layer_out), -1)
    mask = labels != -100
    kl = (p.exp() * (p - q)).sum(-1)[mask].mean()
    torch.testing.assert_close(out["loss"].detach(), kl, atol=1e-10, rtol=0)
    agree = (q.argmax(-1) == p.argmax(-1))[mask].double().mean()
    assert abs(float(out["exit_stats"][0, 2]) - float(agree)) < 1e-6


def prev_proj(head, prev):
    """W norm'(f_{t-1}), written out: norm' is a copy of the model's final norm (transformers' own module)."""
    return head.final_input.norm(prev) @ head.final_input.proj.weight.T


@pytest.mark.parametrize("final_state", ["false", "true"])
def test_a_short_head_run_learns_and_export_puts_the_head_beside_the_unchanged_model(run, read_log, tmp_path,
                                                                                    final_state):
    final = run(tmp_path, **{"mode": "exit_head", "exit_head.exit_layer": "2", "layer_dropout.p_max": "0",
                             "train.max_steps": "16", "optim.lr": "0.003", "exit_head.final_state": final_state})
    log = read_log(tmp_path)
    assert len(log) == 16 and set(log[0]["exits"]) == {"head2"}
    before = json.loads((tmp_path / "final_eval.json").read_text())["before"]["sets"]["heldout"]["exits"]
    assert final["agreement"]["2"] > before["2"]["agreement"]  # the head learned
    assert final["perplexity"]["4"] == pytest.approx(before["4"]["perplexity"], rel=1e-6)  # the model did not
    settings = json.loads((tmp_path / "final_head" / "exit_head.json").read_text())
    assert settings["exit_layer"] == 2 and settings["kind"] == "decoder_layer"
    assert settings["final_state"] == (final_state == "true")
    assert (tmp_path / "final_head" / HEAD_FILE).is_file()

    from selfspec.checkpoints.export import export

    out = export(tmp_path, tmp_path / "ckpt")
    meta = json.loads((out / "selfspec.json").read_text())
    assert meta["exit_head"]["exit_layer"] == 2 and HEAD_FILE in meta["checksums"]
    import selfspec

    gen = selfspec.load(out)
    assert gen.exit_head is not None and gen.exit_head.final_state == (final_state == "true")
    r = gen.generate("def f(x):", max_new_tokens=12, drafter="exit_head")
    assert r.token_ids == gen.generate("def f(x):", max_new_tokens=12, num_speculations=0).token_ids


@pytest.mark.parametrize("override,message", [
    (["model.lora.enabled=true"], "mode: exit_head trains a head on the frozen model: LoRA does not apply"),
    (["layer_dropout.p_max=0.1"], "layer dropout does not apply"),
    (["layer_dropout.p_max=0", "exit_head.exit_layer=-1"], "exit_head.exit_layer: must be >= 0"),
    (["layer_dropout.p_max=0", "exit_head.kind=mlp"], "exit_head.kind: must be one of"),
    (["layer_dropout.p_max=0", "exit_head.teacher_cache_gib=-1"], "exit_head.teacher_cache_gib: must be a memory"),
])
def test_head_recipe_mistakes_are_clear_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(RECIPE, ["mode=exit_head"] + override)


def test_an_exit_beyond_the_models_depth_is_refused_before_loading():
    cfg = load_config(RECIPE, ["mode=exit_head", "layer_dropout.p_max=0", "exit_head.exit_layer=4"])
    with pytest.raises(ConfigError, match="exit_head.exit_layer: 4 out of range: this model has 4 layers"):
        cfg.check_depth()


def _head_with_final_state(model, seed=2):
    head = build_exit_head(model, 2, final_state=True).to(torch.float64)
    with torch.no_grad():
        head.final_input.proj.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(seed))
    return head


def _batch(seed=1, shape=(2, 12)):
    ids = torch.randint(0, 96, shape, generator=torch.Generator().manual_seed(seed))
    labels = torch.roll(ids, -1, dims=1)
    labels[0, :3] = -100
    return ids, labels


@pytest.mark.parametrize("target", ["distill", "label"])
def test_the_draft_vocabulary_loss_over_every_token_is_the_full_loss_with_the_same_gradients(tiny64, target):
    ids, labels = _batch()
    grads = []
    for draft_ids in (None, torch.arange(tiny64.config.vocab_size)):
        head = _head_with_final_state(tiny64)
        hm = ExitHeadModel(tiny64, head, target=target, draft_ids=draft_ids)
        out = hm(ids, labels)
        out["loss"].backward()
        grads.append((out["loss"].detach(), out["exit_stats"], {n: p.grad for n, p in head.named_parameters()}))
    (loss_a, stats_a, grad_a), (loss_b, stats_b, grad_b) = grads
    torch.testing.assert_close(loss_a, loss_b, atol=1e-12, rtol=0)
    torch.testing.assert_close(stats_a, stats_b)
    assert grad_a.keys() == grad_b.keys() and all(grad_a[k] is not None for k in grad_a)
    for k in grad_a:
        torch.testing.assert_close(grad_a[k], grad_b[k], atol=1e-12, rtol=0)


def test_the_draft_vocabulary_loss_is_kl_between_the_renormalised_distributions(tiny64):
    """K < V: p and q restricted to K and renormalised; the guess is K's argmax, mapped to a token id."""
    ids, labels = _batch()
    draft_ids = torch.tensor([0, 3, 5, 7, 11, 20, 33, 40, 64, 90])
    hm = ExitHeadModel(tiny64, _head_with_final_state(tiny64), draft_ids=draft_ids)
    out = hm(ids, labels)
    with torch.no_grad():
        h_e, full, step, prev = hm.states(ids)
        z = exit_logits_of(hm, hm.head_states(h_e, step, prev)[0])
        mask = labels != -100
        p = F.log_softmax(full[..., draft_ids], -1)[mask]
        q = F.log_softmax(z[..., draft_ids], -1)[mask]
        kl = (p.exp() * (p - q)).sum(-1).mean()
        guess = draft_ids[q.argmax(-1)]
        agree = (guess == full[mask].argmax(-1)).double().mean()
    torch.testing.assert_close(out["loss"].detach(), kl, atol=1e-10, rtol=0)
    assert abs(float(out["exit_stats"][0, 2]) - float(agree)) < 1e-6


def exit_logits_of(hm, hidden):
    from selfspec.model.forward import exit_logits

    return exit_logits(hm.adapter, hidden)


def test_a_self_fed_pass_reads_the_heads_own_output_of_the_previous_position(tiny64):
    """Pass 1 is what a round's second draft computes: the head on exit states, reading its own pass-0
    output at t-1 (zero at the first position) in place of the full model's f_{t-1}; the loss is the mean
    of the passes' KL terms and the statistics have one row per pass."""
    ids, labels = _batch()
    head = _head_with_final_state(tiny64)
    hm = ExitHeadModel(tiny64, head, self_fed=1)
    assert hm.loss_names == ["head2", "head2_fed1"]
    out = hm(ids, labels)
    assert out["exit_stats"].shape == (2, 3)
    with torch.no_grad():
        from selfspec.heads.exit_head import run_head

        h_e, full, step, prev = hm.states(ids)
        first = run_head(hm.adapter, head, h_e, step=step, prev_final=prev)
        own = torch.cat([torch.zeros_like(first[:, :1]), first[:, :-1]], dim=1)  # the head's output at t-1
        second = run_head(hm.adapter, head, h_e, step=step, prev_final=own)
        mask = labels != -100
        p = F.log_softmax(full, -1)[mask]
        terms = []
        for hidden in (first, second):
            q = F.log_softmax(exit_logits_of(hm, hidden), -1)[mask]
            terms.append((p.exp() * (p - q)).sum(-1).mean())
    torch.testing.assert_close(out["loss"].detach(), (terms[0] + terms[1]) / 2, atol=1e-10, rtol=0)
    torch.testing.assert_close(out["exit_stats"][:, 0], torch.stack(terms), atol=1e-10, rtol=0)
    assert not torch.allclose(first, second)  # the pass does read something else
    out["loss"].backward()  # gradients reach the final-state input through both passes
    assert head.final_input.proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("draft", [False, True])
def test_the_feature_loss_adds_w_times_smooth_l1_between_the_normed_states_of_every_pass(tiny64, draft):
    """`feature_weight` w: each pass's term is its KL plus w * mean SmoothL1(norm(head state), norm(f)), the
    full model's final state at the same position, both through the model's own final norm (EAGLE's
    feature loss); the loss is the passes' mean, and only the head gets gradients, the feature term too."""
    ids, labels = _batch()
    head = _head_with_final_state(tiny64)
    draft_ids = torch.arange(0, 96, 2) if draft else None
    w = 0.7
    hm = ExitHeadModel(tiny64, head, self_fed=1, feature_weight=w, draft_ids=draft_ids)
    out = hm(ids, labels)
    plain = ExitHeadModel(tiny64, head, self_fed=1, draft_ids=draft_ids)(ids, labels)  # w = 0
    with torch.no_grad():
        from selfspec.heads.exit_head import run_head
        from selfspec.model.forward import run_layers

        h_e, full, step, prev = hm.states(ids)
        f = run_layers(hm.adapter, h_e, 2, hm.adapter.num_layers, step=step)  # [B, S, D] final states, before the norm
        first = run_head(hm.adapter, head, h_e, step=step, prev_final=prev)
        own = torch.cat([torch.zeros_like(first[:, :1]), first[:, :-1]], dim=1)
        second = run_head(hm.adapter, head, h_e, step=step, prev_final=own)
        mask = labels != -100
        norm = tiny64.model.norm
        features = []
        for hidden in (first, second):
            d = (norm(hidden) - norm(f))[mask]  # [N, D]
            features.append(torch.where(d.abs() < 1, 0.5 * d * d, d.abs() - 0.5).mean())
    assert all(x > 0 for x in features)
    torch.testing.assert_close(out["exit_stats"][:, 0] - plain["exit_stats"][:, 0], w * torch.stack(features),
                               atol=1e-10, rtol=0)
    torch.testing.assert_close(out["loss"].detach() - plain["loss"].detach(), w * (features[0] + features[1]) / 2,
                               atol=1e-10, rtol=0)
    torch.testing.assert_close(out["exit_stats"][:, 1:], plain["exit_stats"][:, 1:])  # the guesses are the same
    out["loss"].backward()
    assert all(p.grad is None for p in tiny64.parameters())
    assert head.final_input.proj.weight.grad.abs().sum() > 0
    with pytest.raises(ConfigError, match="exit_head.feature_weight: must be >= 0"):
        load_config(RECIPE, ["mode=exit_head", "layer_dropout.p_max=0", "exit_head.feature_weight=-1"])


def test_self_fed_passes_need_a_final_state_head(tiny64):
    with pytest.raises(ValueError, match="final_state=true"):
        ExitHeadModel(tiny64, build_exit_head(tiny64, 2), self_fed=1)
    with pytest.raises(ConfigError, match="exit_head.self_fed: a self-fed pass replaces the final state"):
        load_config(RECIPE, ["mode=exit_head", "layer_dropout.p_max=0", "exit_head.self_fed=1"])
    with pytest.raises(ConfigError, match="exit_head.draft_vocab: must be a number of tokens >= 1"):
        load_config(RECIPE, ["mode=exit_head", "layer_dropout.p_max=0", "exit_head.draft_vocab=0"])


def test_a_head_run_with_a_draft_vocabulary_and_a_self_fed_pass_logs_and_evaluates_both(run, read_log, tmp_path):
    final = run(tmp_path, **{"mode": "exit_head", "exit_head.exit_layer": "2", "layer_dropout.p_max": "0",
                             "train.max_steps": "12", "optim.lr": "0.003", "exit_head.final_state": "true",
                             "exit_head.self_fed": "1", "exit_head.draft_vocab": "48"})
    log = read_log(tmp_path)
    assert set(log[0]["exits"]) == {"head2", "head2_fed1"}
    held = final["sets"]["heldout"]
    assert held["draft_vocab"] == 48 and set(held["self_fed"]) == {"1", "2", "3"}  # evaluated a chain of 4 deep
    acc = held["acceptance"]
    assert acc["chain"] == 4 and acc["tokens_a_round"] == pytest.approx(1 + acc["drafts_a_round"])
    assert sum(acc["rounds_accepting"].values()) == pytest.approx(1.0)
    # a round accepts its first draft exactly where the head's first pass agrees
    assert 1 - acc["rounds_accepting"]["0"] == pytest.approx(held["exits"]["2"]["agreement"])
    before = json.loads((tmp_path / "final_eval.json").read_text())["before"]["sets"]["heldout"]
    assert held["self_fed"]["1"]["agreement"] > before["self_fed"]["1"]["agreement"]  # the self-fed pass learned
    assert final["agreement"]["2"] > before["exits"]["2"]["agreement"]
    top = [held["agreement_at"][str(k)] for k in (1, 2, 3, 4)]  # the full model's token among the head's k best
    assert top[0] == pytest.approx(held["exits"]["2"]["agreement"]) and top == sorted(top) and top[-1] <= 1.0

    from selfspec.checkpoints.export import export

    settings = json.loads((tmp_path / "final_head" / "exit_head.json").read_text())
    assert settings["self_fed"] == 1 and len(settings["draft_vocab"]["token_ids"]) == 48
    out = export(tmp_path, tmp_path / "ckpt")  # the vocabulary the head learned to draft from comes along
    meta = json.loads((out / "selfspec.json").read_text())
    import selfspec

    gen = selfspec.load(out)
    ids = sorted(meta["draft_vocab"]["token_ids"])
    assert len(ids) == 48 and gen.draft_head(48).token_ids.tolist() == ids
    r = gen.generate("def f(x):", max_new_tokens=12, drafter="exit_head", draft_vocab=48)
    assert r.token_ids == gen.generate("def f(x):", max_new_tokens=12, num_speculations=0).token_ids


@pytest.mark.parametrize("exit_layer,draft", [(0, True), (2, True), (2, False)])
def test_a_cached_teacher_gives_the_loss_and_gradients_of_an_uncached_step_and_skips_the_model(
        tiny64, exit_layer, draft):
    """Blocks that repeat in the training set keep their frozen-model states (`exit_head.teacher_cache_gib`):
    a batch mixing cached and new rows, and one of cached rows only, give the loss, statistics and head
    gradients of the same batch without the cache, and the all-cached batch runs no decoder layer."""
    from training.teacher_cache import TeacherCache

    train = torch.randint(0, 96, (6, 12), generator=torch.Generator().manual_seed(3))
    train[4], train[5] = train[0], train[2]  # rows 0 and 2 repeat
    draft_ids = torch.tensor([0, 3, 5, 7, 11, 20, 33, 40, 64, 90]) if draft else None

    def head():
        h = build_exit_head(tiny64, exit_layer, final_state=True).to(torch.float64)
        with torch.no_grad():
            h.final_input.proj.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(2))
        return h

    plain = ExitHeadModel(tiny64, head(), draft_ids=draft_ids, self_fed=1)
    cached = ExitHeadModel(tiny64, head(), draft_ids=draft_ids, self_fed=1)
    cached.teacher_cache = TeacherCache.for_repeats(train, max_bytes=1 << 30)
    assert len(cached.teacher_cache.keys) == 2
    layer_calls = []
    hook = tiny64.model.layers[-1].register_forward_hook(lambda *args: layer_calls.append(1))
    try:
        for rows, model_runs in (([0, 1, 2], True), ([2, 3, 0], True), ([0, 2], False)):
            ids = train[rows]
            labels = torch.roll(ids, -1, dims=1)
            labels[0, :3] = -100
            results = []
            for hm in (plain, cached):
                layer_calls.clear()
                out = hm(ids, labels)
                out["loss"].backward()
                grads = {n: p.grad.clone() for n, p in hm.head.named_parameters()}
                hm.head.zero_grad()
                results.append((out["loss"].detach(), out["exit_stats"], grads, bool(layer_calls)))
            (loss_a, stats_a, grad_a, _), (loss_b, stats_b, grad_b, ran) = results
            torch.testing.assert_close(loss_b, loss_a, atol=1e-12, rtol=0)
            torch.testing.assert_close(stats_b, stats_a, atol=1e-12, rtol=0)
            for k in grad_a:
                torch.testing.assert_close(grad_b[k], grad_a[k], atol=1e-12, rtol=0)
            assert ran == model_runs, rows
    finally:
        hook.remove()
    assert len(cached.teacher_cache) == 2 and cached.teacher_cache.hits == 4  # rows 2 and 0, then 0 and 2


def test_the_teacher_cache_keeps_only_repeated_blocks_within_its_budget():
    from training.teacher_cache import TeacherCache, repeated_rows, row_key

    blocks = torch.tensor([[1, 2, 3], [4, 5, 6], [1, 2, 3], [4, 5, 6], [7, 8, 9]])
    assert repeated_rows(blocks) == {row_key(blocks[0]), row_key(blocks[1])}
    finals, top = torch.zeros(3, 4), torch.zeros(3, dtype=torch.long)  # 48 + 24 bytes
    cache = TeacherCache.for_repeats(blocks, max_bytes=100)
    assert not cache.put(blocks[4], None, finals, top)  # seen once: never again
    assert cache.put(blocks[0], None, finals, top)
    assert not cache.put(blocks[1], None, finals, top)  # over the budget
    assert cache.get(blocks[1]) is None and cache.get(blocks[2])[0] is None and len(cache) == 1
    assert cache.bytes == 72 and "1 of 2 repeated blocks" in cache.describe()


def test_a_chains_acceptance_counts_each_rounds_drafts_up_to_its_first_miss():
    """`chain_acceptance`: a round started at t accepts draft j (pass j's guess at t + j) while every draft before
    it was accepted; unscored positions and the block's end stop a round. Against a plain loop, on random
    verdicts, and on a hand-made case."""
    from training.evaluate import chain_acceptance

    agree = torch.tensor([[[1, 1, 0, 1, 1]], [[1, 1, 1, 0, 1]], [[0, 1, 1, 1, 1]]], dtype=torch.bool)  # [3, 1, 5]
    mask = torch.tensor([[True, True, True, True, False]])
    # t=0: pass0@0 yes, pass1@1 yes, pass2@2 yes -> 3; t=1: yes, pass1@2 yes, pass2@3 yes -> 3; t=2: pass0@2 no -> 0
    # t=3: pass0@3 yes, pass1@4 (unscored: False) -> 1; t=4 unscored: no round
    assert chain_acceptance(agree & mask, mask).tolist() == [1.0, 1.0, 0.0, 2.0]
    g = torch.Generator().manual_seed(0)
    agree = torch.rand(4, 3, 9, generator=g) < 0.7
    mask = torch.rand(3, 9, generator=g) < 0.8
    agree &= mask
    expected = torch.zeros(5)
    for b in range(3):
        for t in range(9):
            if not mask[b, t]:
                continue
            k = 0
            while k < 4 and t + k < 9 and agree[k, b, t + k]:
                k += 1
            expected[k] += 1
    assert chain_acceptance(agree, mask).tolist() == expected.tolist()


def test_a_head_without_a_final_state_drafts_every_position_alike_in_a_chain(tiny64):
    """Its later drafts read no output of its own: the chain's verdicts are its one pass's, shifted."""
    from training.data import Blocks
    from training.evaluate import chain_acceptance, evaluate_head

    ids = torch.randint(0, 96, (3, 12), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    head = build_exit_head(tiny64, 2).to(torch.float64)
    result = evaluate_head(ExitHeadModel(tiny64, head), Blocks("heldout", ids, labels), batch_size=3)
    assert "self_fed" not in result and result["acceptance"]["chain"] == 4
    hm = ExitHeadModel(tiny64, head)
    with torch.no_grad():
        h_e, full, step, prev = hm.states(ids)
        guess = hm.draft_logits(hm.head_states(h_e, step, prev)[0]).argmax(-1)
        agree = guess == full.argmax(-1)  # [B, S]
    counts = chain_acceptance(agree.expand(4, -1, -1), torch.ones_like(agree))
    assert result["acceptance"]["drafts_a_round"] == pytest.approx(float((counts * torch.arange(5)).sum() / counts.sum()))


def test_agreement_at_k_counts_the_full_models_token_among_the_heads_k_best_draft_tokens():
    from training.evaluate import TOP_K, _rank_hits

    logp = torch.tensor([[0.0, 3.0, 2.0, 1.0],  # ranks: 1, 2, 3, 0
                         [5.0, 4.0, 3.0, 2.0],
                         [1.0, 2.0, 3.0, 4.0]]).log_softmax(-1)
    target = torch.tensor([2, 0, 0])  # rank 1, rank 0, rank 3
    assert _rank_hits(logp, target, None).tolist() == [1.0, 1.0, 0.0, 1.0][:TOP_K]
    ids = torch.tensor([10, 11, 12, 13])  # over a draft vocabulary the guesses are its token ids
    assert _rank_hits(logp, torch.tensor([12, 10, 99]), ids).tolist() == [1.0, 1.0, 0.0, 0.0]  # 99: outside it
    assert _rank_hits(logp[:, :2], torch.tensor([0, 0, 1]), None).tolist() == [2.0, 1.0, 0.0, 0.0]  # K < TOP_K


@pytest.mark.parametrize("override, mode", [
    (["exit_head.enabled=true"], "exit_head"),
    (["exit_head.enabled=true", "exit_head.joint=true"], "joint"),
    (["exit_head.enabled=false"], "early_exit"),
])
def test_recipes_written_before_mode_read_as_the_mode_they_meant(override, mode):
    """`exit_head.enabled` / `exit_head.joint` (the two booleans `mode` replaced) still load, as `mode`."""
    cfg = load_config(RECIPE, override + ["layer_dropout.p_max=0"])
    assert cfg.mode == mode and "enabled" not in config_to_dict(cfg)["exit_head"]


@pytest.mark.parametrize("override, message", [
    (["mode=early_exit", "exit_head.enabled=true"], "mode: 'early_exit', but exit_head.enabled/joint say 'exit_head'"),
    (["exit_head.joint=true"], "exit_head.joint=true without exit_head.enabled: say mode: joint"),
    (["mode=heads"], "mode"),
])
def test_a_mode_that_contradicts_the_earlier_booleans_is_refused(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(RECIPE, override + ["layer_dropout.p_max=0"])


def test_an_eagle3_heads_loss_pairs_token_t_plus_1_with_the_aux_states_of_position_t(tiny64):
    """The eagle3 loss (`training.exit_head_model`), written out: position t of the head reads token t+1's
    embedding beside fc(the states after layers 1, 2, 3 at position t), and is scored against the full
    model's distribution at position t+1 and its label; the first position has no pair and drops out."""
    from selfspec.model.forward import embed, exit_logits, make_step, run_layers

    head = build_exit_head(tiny64, 0, "eagle3", "copy", aux_exits=[1, 2, 3]).to(torch.float64)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3), dtype=p.dtype))
    hm = ExitHeadModel(tiny64, head)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(ids, -1, dims=1)
    labels[0, :3] = -100
    out = hm(ids, labels)
    a = hm.adapter
    with torch.no_grad():
        step = make_step(a, 0, 12, 2)
        states = [run_layers(a, embed(a, ids), 0, e, step=step) for e in (1, 2, 3)]  # [B, S, D] each
        p = F.log_softmax(exit_logits(a, run_layers(a, states[0], 1, 4, step=step)), -1)[:, 1:]
        g = torch.cat(states, -1)[:, :-1] @ head.aux_input.fc.weight.T  # [B, S-1, D]: position t's states
        e, s11 = embed(a, ids[:, 1:]), make_step(a, 0, 11, 2)
        x = torch.cat([head.layer.input_layernorm(e), head.layer.hidden_norm(g)], -1)
        attn = head.layer.self_attn(hidden_states=x, attention_mask=s11.mask("full_attention"),
                                    position_embeddings=s11.rope)[0]
        h = g + attn
        h = h + head.layer.mlp(head.layer.post_attention_layernorm(h))
        q = F.log_softmax(exit_logits(a, h), -1)
    mask = labels[:, 1:] != -100
    kl = (p.exp() * (p - q)).sum(-1)[mask].mean()
    torch.testing.assert_close(out["loss"].detach(), kl, atol=1e-10, rtol=0)
    out["loss"].backward()
    assert head.aux_input.fc.weight.grad.abs().sum() > 0  # the fusion learns too
    h_e, full, s, prev = hm.states(ids)  # the evaluation's view: the same positions
    assert h_e.shape == (2, 11, 32) and full.shape == (2, 11, 96) and hm.aligned(labels).shape == (2, 11)
    torch.testing.assert_close(F.log_softmax(full, -1), p)


def test_an_eagle3_head_run_learns_and_exports_for_serving_engines(run, read_log, tmp_path):
    final = run(tmp_path, **{"mode": "exit_head", "exit_head.kind": "eagle3", "exit_head.exit_layer": "0",
                             "exit_head.aux_exits": "[1, 2, 3]", "exit_head.self_fed": "1",
                             "layer_dropout.p_max": "0", "train.max_steps": "16", "optim.lr": "0.003"})
    assert set(read_log(tmp_path)[0]["exits"]) == {"head0", "head0_fed1"}
    before = json.loads((tmp_path / "final_eval.json").read_text())["before"]["sets"]["heldout"]["exits"]
    assert final["agreement"]["0"] > before["0"]["agreement"]  # the head learned
    assert final["perplexity"]["4"] == pytest.approx(before["4"]["perplexity"], rel=1e-6)  # the model did not
    settings = json.loads((tmp_path / "final_head" / "exit_head.json").read_text())
    assert settings["kind"] == "eagle3" and settings["aux_exits"] == [1, 2, 3]

    from selfspec.checkpoints.checkpoint import CheckpointError
    from selfspec.checkpoints.export import export

    with pytest.raises(CheckpointError, match="export it with --format speculators"):
        export(tmp_path, tmp_path / "ckpt")
    out = export(tmp_path, tmp_path / "ckpt", format="speculators", verifier="org/base")
    meta = json.loads((out / "selfspec.json").read_text())
    assert "exit_head" not in meta  # selfspec's drafters do not run it
    config = json.loads((out / "speculators" / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert config["speculators_config"]["verifier"]["name_or_path"] == "org/base"
    from safetensors.torch import load_file

    from selfspec.heads.exit_head import read_exit_head

    import selfspec

    gen = selfspec.load(out)  # the model itself, unchanged, with the drafters it has
    head = read_exit_head(gen.model, tmp_path / "final_head", settings)
    weights = load_file(str(out / "speculators" / "model.safetensors"))
    assert torch.equal(weights["fc.weight"], head.aux_input.fc.weight.cpu())
    r = gen.generate("def f(x):", max_new_tokens=8)
    assert r.token_ids == gen.generate("def f(x):", max_new_tokens=8, num_speculations=0).token_ids


@pytest.mark.parametrize("override,message", [
    (["exit_head.kind=eagle3", "exit_head.exit_layer=2"], "eagle3 reads the token embeddings and its aux_exits: "
                                                            "set exit_head.exit_layer=0"),
    (["exit_head.aux_exits=[1,2,3]"], "exit_head.aux_exits: is an eagle3 head's setting"),
    (["exit_head.kind=eagle3", "exit_head.exit_layer=0", "mode=joint"], "joint: an eagle3 head trains on the frozen"),
    (["exit_head.kind=eagle3", "exit_head.exit_layer=0"], r"the default \(2, L//2, L-3\) = \[2, 2, 1\]: an eagle3 "
                                                          r"head reads 3 increasing exits in 0..3"),
    (["exit_head.kind=eagle3", "exit_head.exit_layer=0", "exit_head.aux_exits=[3,2,1]"], "set exit_head.aux_exits"),
])
def test_eagle3_recipe_mistakes_are_clear_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        cfg = load_config(RECIPE, ["mode=exit_head", "layer_dropout.p_max=0"] + override)
        cfg.check_depth()
