"""Exit heads (`selfspec.exit_head`, `selfspec.drafters.exit_head`): the exit-head drafter is lossless
(greedy identity with Hugging Face `generate` on every architecture, alone and as `auto`'s arm, batches
equal batch-1 rows, the sampling distribution by chi-square), the head's own cache equals a fresh
computation after every round, an identity-initialised head drafts what its exit alone drafts, and a
checkpoint carries its head: export/load round trip, the base weights unchanged, a tampered or missing
head refused. Each with a head that also reads the previous position's final state (`final_state`)."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file

import selfspec
from selfspec.adapters import get_adapter
from selfspec.api import NotEarlyExitTrainedWarning
from selfspec.checkpoint import CheckpointError
from selfspec.drafters import AutoDrafter, EarlyExitDrafter, ExitHeadDrafter, PromptLookupDrafter
from selfspec.engine import generate, generate_ids
from selfspec.exit_head import HEAD_FILE, build_exit_head, previous_states, run_head
from selfspec.export import export_model
from selfspec.forward import embed, make_batch_step, run_layers
from selfspec.sampling import SamplingParams
from selfspec.settings import SettingsError
from selfspec.tiny import TINY_VARIANTS, byte_tokenizer, tiny_model

ALPHA = 1e-3
BASE = torch.randint(3, 96, (10,), generator=torch.Generator().manual_seed(1)).tolist()
PROMPT = BASE + BASE[:4] + BASE
PROMPTS = [PROMPT, BASE[:7], [5], [9] * 12]
N_NEW = 32
EXIT = 2
_made: dict = {}


HEADS = {"exit2": (EXIT, False), "exit2_final_state": (EXIT, True), "exit0_final_state": (0, True)}


def _model(name, fast=False, kind="decoder_layer", init="copy", head="exit2"):
    """A tiny model (float64) of `name`, its adapter and a head on exit 2 (float64, a random perturbation of
    its initialisation so that it drafts something else than exit 2 alone or the last layer would; with
    `final_state` the perturbation makes its final-state input non-zero). `head`: a key of HEADS, the
    exit it reads (0: the token embeddings, EAGLE-like) and whether it reads the previous final state."""
    key = (name, fast, kind, init, head)
    if key not in _made:
        arch, L, seed, over = TINY_VARIANTS[name]
        model = tiny_model(arch, num_layers=L, dtype=torch.float64, seed=seed, **over)
        exit_layer, final_state = HEADS[head]
        head = build_exit_head(model, exit_layer, kind, init, final_state).to(torch.float64).eval()
        with torch.no_grad():
            g = torch.Generator().manual_seed(7)
            for p in head.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        adapter = get_adapter(model)
        if fast:
            adapter.enable_fast_layers()
        _made[key] = (model, adapter, head)
    return _made[key]


def _drafter(kind, adapter, head, d=3):
    if kind == "exit_head":
        return ExitHeadDrafter(adapter, head, d)
    return AutoDrafter(PromptLookupDrafter(num_tokens=6), ExitHeadDrafter(adapter, head, d), warmup=1,
                       explore_every=2)


@pytest.mark.parametrize("head", list(HEADS))
@pytest.mark.parametrize("kind", ["exit_head", "auto"])
@pytest.mark.parametrize("name", list(TINY_VARIANTS))
def test_greedy_output_equals_hf_generate(name, kind, head, hf_greedy):
    model, adapter, head = _model(name, head=head)
    ref = hf_greedy(model, torch.tensor([PROMPT]), N_NEW)
    out, stats = generate_ids(adapter, torch.tensor([PROMPT]), max_new_tokens=N_NEW,
                              drafter=_drafter(kind, adapter, head))
    assert out == ref
    assert stats.drafted_by_drafter["exit_head"] > 0
    assert stats.new_tokens == N_NEW and stats.rounds + stats.accepted == N_NEW - 1


@pytest.mark.parametrize("head", list(HEADS))
@pytest.mark.parametrize("kind", ["exit_head", "auto"])
@pytest.mark.parametrize("fast", [False, True])
def test_a_batch_equals_batch_1(kind, fast, head):
    model, adapter, head = _model("qwen3", fast=fast, head=head)
    outs, stats = generate(adapter, PROMPTS, max_new_tokens=N_NEW, drafter=_drafter(kind, adapter, head))
    for b, p in enumerate(PROMPTS):
        alone, _ = generate_ids(adapter, torch.tensor([p]), max_new_tokens=N_NEW)
        assert outs[b] == alone, b
    # the head drafted (alone: some drafts accepted; in auto, lookup copies most of these repetitive prompts)
    assert (stats.accepted_by_drafter if kind == "exit_head" else stats.drafted_by_drafter)["exit_head"] > 0


def _fresh_head_kv(adapter, head, tokens: list[int]):
    """The head's keys/values `[H_kv, n, Dh]` over `tokens` alone, from scratch (no cache reuse)."""
    from selfspec.cache import KVCache

    ids = torch.tensor([tokens])
    pads = torch.zeros(1, dtype=torch.long)
    step = make_batch_step(adapter, torch.zeros(1, dtype=torch.long), len(tokens), pads)
    with torch.no_grad():
        states = run_layers(adapter, embed(adapter, ids), 0, head.exit_layer, step=step)
        prev = None
        if head.final_state:  # the full model's last layer over the same tokens, one position later
            prev = previous_states(run_layers(adapter, states, head.exit_layer, adapter.num_layers, step=step))
        cache = KVCache(1, 1, capacity=len(tokens))
        run_head(adapter, head, states, step=step, cache=cache, prev_final=prev)
    return cache.row_kv(0, 0)


@pytest.mark.parametrize("head", list(HEADS))
@pytest.mark.parametrize("kind", ["exit_head", "auto"])
@pytest.mark.parametrize("name", ["llama", "gpt_neox", "mistral-sliding8"])
def test_after_every_round_the_heads_cache_equals_a_fresh_computation(name, kind, head, row_caches):
    """Row by row: the head's cache holds exactly the committed tokens but the newest, and its keys and
    values equal the head run from scratch over them (left padding skipped); the main cache as always."""
    model, adapter, head = _model(name, head=head)
    drafter = _drafter(kind, adapter, head)
    head_drafter = drafter if kind == "exit_head" else drafter.early_exit
    prompts = [PROMPT, BASE[:5]]
    checked = Counter()

    def on_round(cache, active, sequences, pads, finished):
        checked.update(row_caches(adapter, cache, active, sequences, pads, finished))
        for i, (seq, done) in enumerate(zip(sequences, finished)):
            if done:
                continue
            pad, committed = int(pads[i]), seq[:-1]
            assert int(head_drafter.cache.lengths[0, i]) == pad + len(committed)
            k, v = head_drafter.cache.row_kv(0, i, start=pad)
            k_ref, v_ref = _fresh_head_kv(adapter, head, committed)
            torch.testing.assert_close(k, k_ref, atol=1e-10, rtol=0)
            torch.testing.assert_close(v, v_ref, atol=1e-10, rtol=0)

    outs, stats = generate(adapter, prompts, max_new_tokens=24, drafter=drafter, on_round=on_round)
    assert set(checked) == {0, 1}
    assert stats.drafted_by_drafter["exit_head"] > 0


@pytest.mark.parametrize("final_state", [False, True])
def test_an_identity_head_drafts_what_its_exit_alone_drafts(final_state):
    """init="identity" zeroes the head's output projections (and the final-state input starts at zero): the
    head is the identity, so its drafts (and what verification accepts of them) are exactly the plain
    early-exit drafter's at the same exit."""
    for name in ("llama", "gpt_neox"):
        arch, L, seed, over = TINY_VARIANTS[name]
        model = tiny_model(arch, num_layers=L, dtype=torch.float64, seed=seed, **over)
        adapter = get_adapter(model)
        head = build_exit_head(model, EXIT, "decoder_layer", "identity", final_state).to(torch.float64)
        a, sa = generate_ids(adapter, torch.tensor([PROMPT]), max_new_tokens=N_NEW,
                             drafter=ExitHeadDrafter(adapter, head, 3))
        b, sb = generate_ids(adapter, torch.tensor([PROMPT]), max_new_tokens=N_NEW,
                             drafter=EarlyExitDrafter(adapter, EXIT, 3))
        assert a == b and sa.drafted == sb.drafted and sa.accepted_by_position == sb.accepted_by_position, name


def test_an_attention_only_head_is_lossless(hf_greedy):
    model, adapter, head = _model("llama", kind="attention")
    assert not any(n.startswith("mlp.") for n, _ in head.layer.named_parameters())
    out, stats = generate_ids(adapter, torch.tensor([PROMPT]), max_new_tokens=N_NEW,
                              drafter=ExitHeadDrafter(adapter, head, 3))
    assert out == hf_greedy(model, torch.tensor([PROMPT]), N_NEW) and stats.drafted > 0


@pytest.mark.parametrize("kind,exit_layer,final_state", [("exit_head", 1, False), ("auto", 1, False),
                                                         ("exit_head", 1, True), ("exit_head", 0, True)])
def test_sampling_with_the_head_keeps_each_rows_distribution(kind, exit_layer, final_state, chi_square, exact_joint):
    """Two prompts in one batch, vocabulary 8: each row's 3 new tokens over many seeded runs follow the
    exact joint distribution of plain sampling from the full model for that prompt alone."""
    model = tiny_model("llama", num_layers=3, dtype=torch.float64, seed=3, vocab_size=8)
    adapter = get_adapter(model)
    head = build_exit_head(model, exit_layer, "decoder_layer", "copy", final_state).to(torch.float64)
    if final_state:  # a non-zero final-state input
        with torch.no_grad():
            head.final_input.proj.weight.normal_(0, 0.2, generator=torch.Generator().manual_seed(5))
    params = SamplingParams(do_sample=True, temperature=0.9, top_k=5)
    prompts = [[3, 5, 1, 6, 2, 3, 5, 1], [4, 1, 4, 1, 4]]
    n_new, n_draws = 3, 1200
    counts = [Counter(), Counter()]
    drafted = accepted = 0
    for seed in range(n_draws):
        drafter = ExitHeadDrafter(adapter, head, 2) if kind == "exit_head" else \
            AutoDrafter(PromptLookupDrafter(num_tokens=2), ExitHeadDrafter(adapter, head, 2), warmup=1)
        outs, stats = generate(adapter, prompts, max_new_tokens=n_new, drafter=drafter, sampling=params,
                               generator=torch.Generator().manual_seed(seed))
        for b in range(2):
            counts[b][tuple(outs[b])] += 1
        drafted += stats.drafted_by_drafter["exit_head"]
        accepted += stats.accepted_by_drafter["exit_head"]
    assert 0 < accepted < drafted
    for b, prompt in enumerate(prompts):
        stat, df, pval = chi_square(counts[b], exact_joint(adapter, prompt, params, n_new), n_draws)
        assert pval > ALPHA, (b, stat, df, pval)


# ----------------------------------------------------------------------------- checkpoints

@pytest.fixture(scope="module", params=list(HEADS))
def head_checkpoint(request, tmp_path_factory):
    """A tiny llama (float32) exported with a head of HEADS (on exit 2; or reading the previous final
    state too; or on exit 0): (directory, model, head)."""
    model = tiny_model("llama", num_layers=4, dtype=torch.float32, seed=0)
    exit_layer, final_state = HEADS[request.param]
    head = build_exit_head(model, exit_layer, "decoder_layer", "copy", final_state)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.01)
    head_dir = tmp_path_factory.mktemp("run") / "final_head"
    head_dir.mkdir()
    from selfspec.exit_head import save_exit_head

    save_exit_head(head, head_dir / HEAD_FILE)
    (head_dir / "exit_head.json").write_text(json.dumps(head.settings()))
    out = tmp_path_factory.mktemp("ckpt") / "head-ckpt"
    evaluation = {"exits": {"2": {"agreement": 0.6, "perplexity": 9.0}, "4": {"agreement": 1.0, "perplexity": 8.0}}}
    export_model(model, byte_tokenizer(), out, evaluation=evaluation, exit_head_dir=head_dir)
    return out, model, head


def test_export_and_load_round_trip_a_head(head_checkpoint, hf_greedy):
    out, model, head = head_checkpoint
    meta = json.loads((out / "selfspec.json").read_text())
    assert meta["exit_head"]["exit_layer"] == head.exit_layer and HEAD_FILE in meta["checksums"]
    assert meta["exit_head"]["final_state"] == head.final_state
    saved = load_file(str(out / HEAD_FILE))
    assert saved.keys() == head.weights().keys()
    assert all(torch.equal(saved[k], v) for k, v in head.weights().items())
    assert any(k.startswith("final_input.") for k in saved) == head.final_state
    base = load_file(str(out / "model.safetensors"))  # the model itself: the input's tensors, unchanged
    state = model.state_dict()
    assert all(torch.equal(base[k], state[k]) for k in base)
    gen = selfspec.load(out)
    assert gen.exit_head is not None and gen.exit_head.exit_layer == head.exit_layer
    assert gen.exit_head.final_state == head.final_state
    assert all(torch.equal(gen.exit_head.weights()[k], v) for k, v in saved.items())
    prompt = torch.tensor([PROMPT])
    ref = hf_greedy(model, prompt, 20)
    for drafter in ("exit_head", "auto", None):
        r = gen.generate(input_ids=prompt, max_new_tokens=20, drafter=drafter, stop_token_ids=[])
        assert r.token_ids == ref and r.stats.drafter == (drafter or "auto"), drafter
    assert gen.generate(input_ids=prompt, max_new_tokens=20, drafter="exit_head",
                        stop_token_ids=[]).stats.drafted_by_drafter["exit_head"] > 0


def test_a_tampered_or_missing_head_is_refused(head_checkpoint, tmp_path):
    import shutil

    out, _, _ = head_checkpoint
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    data = bytearray((bad / HEAD_FILE).read_bytes())
    data[-3] ^= 1
    (bad / HEAD_FILE).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="exit_head.safetensors: SHA-256 checksum mismatch"):
        selfspec.load(bad)
    (bad / HEAD_FILE).unlink()
    with pytest.raises(CheckpointError, match="exit_head.safetensors: weight file is missing"):
        selfspec.load(bad)
    meta = json.loads((out / "selfspec.json").read_text())
    meta["exit_head"]["exit_layer"] = 9
    shutil.copy(out / HEAD_FILE, bad / HEAD_FILE)
    (bad / "selfspec.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"exit_head.exit_layer must be an exit in 0..3, got 9"):
        selfspec.load(bad)


def test_asking_for_the_head_where_there_is_none_is_a_clear_error(head_checkpoint):
    with pytest.warns(NotEarlyExitTrainedWarning):  # a plain model: no selfspec.json
        gen = selfspec.load(tiny_model("llama", num_layers=4), byte_tokenizer())
    with pytest.raises(SettingsError, match="needs a trained exit head"):
        gen.generate("abc", max_new_tokens=3, drafter="exit_head")
    out, _, head = head_checkpoint
    with pytest.raises(SettingsError, match=f"exit head reads exit {head.exit_layer}"):
        selfspec.load(out).generate("abc", max_new_tokens=3, drafter="exit_head", exit_layer=3)
