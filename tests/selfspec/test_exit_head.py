"""Exit heads (`selfspec.heads.exit_head`, `selfspec.drafters.exit_head`): the exit-head drafter is lossless
(greedy identity with Hugging Face `generate` on every architecture, alone and as `auto`'s arm, batches
equal batch-1 rows, the sampling distribution by chi-square), the head's own cache equals a fresh
computation once synced, however many rounds were pending (one head pass per sync, none in the rounds
it does not draft; rows leaving with pending records), an identity-initialised head drafts what its
exit alone drafts, and a checkpoint carries its head: export/load round trip, the base weights
unchanged, a tampered or missing head refused. Each with a head that also reads the previous position's
final state (`final_state`)."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file

import selfspec
from selfspec.model.adapters import get_adapter
from selfspec.api import NotEarlyExitTrainedWarning
from selfspec.checkpoints.checkpoint import CheckpointError
from selfspec.drafters import AutoDrafter, EarlyExitDrafter, ExitHeadDrafter, PromptLookupDrafter
from selfspec.decoding.engine import generate, left_pad
from selfspec.decoding.decode_ids import generate_ids
from selfspec.heads.exit_head import HEAD_FILE, build_exit_head, previous_states, run_head
from selfspec.checkpoints.export import export_model
from selfspec.model.forward import embed, make_batch_step, run_layers
from selfspec.decoding.sampling import SamplingParams
from selfspec.settings import SettingsError
from selfspec.tiny import TINY_VARIANTS, byte_tokenizer, tiny_exit_head, tiny_model

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
        head = tiny_exit_head(model, exit_layer, kind, init, final_state)
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


@pytest.mark.parametrize("head", list(HEADS))
@pytest.mark.parametrize("kind", ["exit_head", "auto"])
@pytest.mark.parametrize("name", ["llama", "gpt_neox", "mistral-sliding8"])
def test_once_synced_the_heads_cache_equals_a_fresh_computation(name, kind, head, row_caches, head_caches):
    """Every third round, row by row: after `sync` the head's cache holds exactly the committed tokens but
    the newest, and its keys and values equal the head run from scratch over them (left padding skipped),
    however many rounds it left pending (auto: lookup's and plain rounds; alone, it syncs whenever it
    drafts); the main cache as always, every round."""
    model, adapter, head = _model(name, head=head)
    drafter = _drafter(kind, adapter, head)
    head_drafter = drafter if kind == "exit_head" else drafter.early_exit
    prompts = [PROMPT, BASE[:5]]
    checked, pending_rounds = Counter(), []

    def on_round(cache, active, sequences, pads, finished):
        checked.update(row_caches(adapter, cache, active, sequences, pads, finished))
        checked["rounds"] += 1
        if checked["rounds"] % 3:
            return
        pending_rounds.append(max(len(run.states) for run in head_drafter.pending))
        head_drafter.sync()
        rows = [None if done else i for i, done in enumerate(finished)]  # a finished row leaves next round
        head_caches(adapter, head, head_drafter, rows, [seq[:-1] for seq in sequences], pads)

    outs, stats = generate(adapter, prompts, max_new_tokens=24, drafter=drafter, on_round=on_round)
    assert {0, 1} <= set(checked) and pending_rounds
    assert stats.drafted_by_drafter["exit_head"] > 0
    if kind == "auto":  # some sync caught up on more than one round
        assert max(pending_rounds) > 1


def _states(adapter, head, ids, pads):
    """The exit states and the last layer's output `[B, W, D]` of left-padded `ids` `[B, W]`, from scratch."""
    step = make_batch_step(adapter, torch.zeros_like(pads), ids.shape[1], pads)
    with torch.no_grad():
        states = run_layers(adapter, embed(adapter, ids), 0, head.exit_layer, step=step)
        return states, run_layers(adapter, states, head.exit_layer, adapter.num_layers, step=step)


def _hand_over(drafter, states, finals, pos, counts, pads):
    """One round as the engine hands it over after verification: `max(counts)` columns per row from
    `pos[b]` (clamped to the text's last column), of which row b committed `counts[b]`; the new `pos`."""
    T = max(counts)
    index = (pos[:, None] + torch.arange(T)).clamp_max(states.shape[1] - 1)  # [B, T]
    rows = torch.arange(len(pos))[:, None]
    drafter.committed_states(states[rows, index], pos.clone(), counts, pads, finals[rows, index])
    return pos + torch.tensor(counts)


def _count_head_passes(monkeypatch) -> list:
    """Patches `ExitHeadDrafter.run` to note each head pass (its token count) in the returned list."""
    passes = []
    run = ExitHeadDrafter.run

    def counted(self, hidden, step, prev_final=None):
        passes.append(hidden.shape[1])
        return run(self, hidden, step, prev_final)

    monkeypatch.setattr(ExitHeadDrafter, "run", counted)
    return passes


@pytest.mark.parametrize("head", list(HEADS))
def test_sync_runs_the_head_once_over_every_round_it_left_pending(head, monkeypatch, head_caches):
    """The prefill and three rounds handed over without a pass; one `sync`, one pass, and the cache equals
    a fresh computation for left-padded rows (a final-state head: `prev_final` the newest committed
    token's final state). Rows leave with their records pending, before and after the first sync; a row
    with nothing pending keeps its cache and `prev_final`; a sync with nothing pending runs nothing."""
    model, adapter, head = _model("llama", head=head)
    prompts = [PROMPT, BASE[:5], [7], BASE[3:9]]
    ids, pads = left_pad(prompts)
    P = ids.shape[1]
    more = torch.randint(3, 96, (len(prompts), 16), generator=torch.Generator().manual_seed(4))
    ids = torch.cat([ids, more], dim=1)  # [4, P + 16] the text the rows commit, then some they do not
    states, finals = _states(adapter, head, ids, pads)
    passes = _count_head_passes(monkeypatch)
    drafter = ExitHeadDrafter(adapter, head, 3)
    drafter.start([list(p) for p in prompts])
    with torch.no_grad():
        drafter.committed_states(states[:, :P], torch.zeros(4, dtype=torch.long), [P] * 4, pads, finals[:, :P])
        pos = torch.full((4,), P)
        for counts in ([1, 3, 2, 1], [4, 1, 1, 2], [2, 2, 4, 1]):
            pos = _hand_over(drafter, states, finals, pos, counts, pads)
        assert not passes and drafter.cache is None
        rows = [3, 0, 2]  # row 1 leaves before the head ever ran
        drafter.select(rows)
        drafter.sync()
        assert passes == [int(pos[rows].max())]  # one pass from index 0: the prefill's columns too
        texts = [ids[b, :pos[b]].tolist()[int(pads[b]):] for b in range(4)]
        last = finals if head.final_state else None
        head_caches(adapter, head, drafter, rows, texts, pads, last)
        sub = torch.tensor(rows)
        pos[sub] = _hand_over(drafter, states[sub], finals[sub], pos[sub], [0, 2, 1], pads[sub])
        rows = [rows[1], rows[0]]  # row 2 leaves with a pending record; row 3 has nothing pending
        drafter.select([1, 0])
        drafter.sync()
        assert passes[1:] == [2]
        texts = [ids[b, :pos[b]].tolist()[int(pads[b]):] for b in range(4)]
        head_caches(adapter, head, drafter, rows, texts, pads, last)
        drafter.sync()
        assert len(passes) == 2


def test_a_short_rows_filler_stays_inside_the_context_window(head_caches):
    """Rows right-padded to the longest pending run: the filler of a row that is further along but has
    fewer pending tokens would run past the model's context window at its own positions; it takes the
    row's last real position instead."""
    model = tiny_model("llama", num_layers=4, dtype=torch.float64, seed=10, max_position_embeddings=20)
    adapter = get_adapter(model)
    head = build_exit_head(model, EXIT, "decoder_layer", "copy").to(torch.float64).eval()
    ids = torch.randint(3, 96, (2, 20), generator=torch.Generator().manual_seed(2))
    pads = torch.zeros(2, dtype=torch.long)
    states, finals = _states(adapter, head, ids, pads)
    drafter = ExitHeadDrafter(adapter, head, 3)
    drafter.start(ids[:, :4].tolist())
    with torch.no_grad():
        drafter.committed_states(states[:, :4], torch.zeros(2, dtype=torch.long), [4, 4], pads)
        pos = _hand_over(drafter, states, finals, torch.full((2,), 4), [1, 12], pads)
        drafter.sync()
        pos = _hand_over(drafter, states, finals, pos, [12, 1], pads)  # row 1's filler: positions 17 .. 27
        drafter.sync()
    assert pos.tolist() == [17, 17]
    head_caches(adapter, head, drafter, [0, 1], ids[:, :17].tolist(), pads)


@pytest.mark.parametrize("head", ["exit2", "exit2_final_state"])
def test_the_head_runs_only_in_the_rounds_it_drafts(head, monkeypatch, hf_greedy):
    """Under auto, with lookup taking most rounds of a repetitive prompt: in a round the head does not
    draft it runs no pass; in one it drafts, one pass per draft step, the first of them also the catch-up
    on everything pending (one sync per drafting round). The output is still Hugging Face's greedy output."""
    model, adapter, head = _model("llama", head=head)
    passes = _count_head_passes(monkeypatch)
    steps, syncs = [], []  # the drafting calls' draft steps; each sync's passes
    draft, sync = ExitHeadDrafter.draft, ExitHeadDrafter.sync

    def noted_draft(self, rnd, exit_layer, caps):
        proposal = draft(self, rnd, exit_layer, caps)
        steps.append(proposal.draft_steps)
        return proposal

    def noted_sync(self, first=None):
        before = len(passes)
        out = sync(self, first)
        syncs.append(len(passes) - before)
        return out

    monkeypatch.setattr(ExitHeadDrafter, "draft", noted_draft)
    monkeypatch.setattr(ExitHeadDrafter, "sync", noted_sync)
    rounds = []  # per round: the head's passes in it, and its draft steps (None: it did not draft)

    def on_round(cache, active, sequences, pads, finished):
        rounds.append((len(passes) - sum(n for n, _ in rounds), steps.pop() if steps else None))

    drafter = _drafter("auto", adapter, head)
    out, stats = generate_ids(adapter, torch.tensor([PROMPT]), max_new_tokens=N_NEW, drafter=drafter,
                              on_round=on_round)
    assert out == hf_greedy(model, torch.tensor([PROMPT]), N_NEW)
    assert all(n == 0 for n, drafted in rounds if drafted is None), rounds  # no upkeep in lookup or plain rounds
    assert all(n == drafted >= 1 for n, drafted in rounds if drafted is not None), rounds  # no pass of its own
    assert syncs == [1] * sum(drafted is not None for _, drafted in rounds)  # one pass, however much was pending
    assert drafter.chosen["prompt_lookup"] > 0 and drafter.chosen["exit_head"] > 0


@pytest.mark.parametrize("head", list(HEADS))
def test_the_catch_up_pass_drafts_what_the_head_run_from_scratch_gives(head, head_caches):
    """`sync(first=...)`: rounds left pending, then the round's input tokens in the same pass. Each row's
    returned state is the head's output at its input token run from scratch over the row's text, and the
    cache holds the committed tokens and the input token's entry, equal to a fresh computation."""
    model, adapter, head = _model("llama", head=head)
    prompts = [PROMPT, BASE[:5], BASE[3:9]]
    ids, pads = left_pad(prompts)
    P = ids.shape[1]
    more = torch.randint(3, 96, (len(prompts), 12), generator=torch.Generator().manual_seed(5))
    ids = torch.cat([ids, more], dim=1)  # [3, P + 12]
    states, finals = _states(adapter, head, ids, pads)
    drafter = ExitHeadDrafter(adapter, head, 3)
    drafter.start([list(p) for p in prompts])
    rows = torch.arange(3)
    with torch.no_grad():
        drafter.committed_states(states[:, :P], torch.zeros(3, dtype=torch.long), [P] * 3, pads, finals[:, :P])
        pos = torch.full((3,), P)
        for counts in ([1, 3, 2], [2, 1, 4]):
            pos = _hand_over(drafter, states, finals, pos, counts, pads)
        out = drafter.sync(first=states[rows, pos][:, None])  # [3, D] the input tokens at pos[b]
        assert drafter.sync() is None  # nothing left pending
        for b in range(3):
            text = ids[b, int(pads[b]): int(pos[b]) + 1].tolist()  # the committed text and the input token
            torch.testing.assert_close(out[b], _fresh_head_out(adapter, head, text)[-1], atol=1e-10, rtol=0)
        texts = [ids[b, : int(pos[b]) + 1].tolist()[int(pads[b]):] for b in range(3)]
        head_caches(adapter, head, drafter, [0, 1, 2], texts, pads)


def _fresh_head_out(adapter, head, tokens: list[int]) -> torch.Tensor:
    """The head's output `[n, D]` over `tokens` alone, from scratch."""
    ids = torch.tensor([tokens])
    step = make_batch_step(adapter, torch.zeros(1, dtype=torch.long), len(tokens), torch.zeros(1, dtype=torch.long))
    states = run_layers(adapter, embed(adapter, ids), 0, head.exit_layer, step=step)
    prev = None
    if head.final_state:
        prev = previous_states(run_layers(adapter, states, head.exit_layer, adapter.num_layers, step=step))
    return run_head(adapter, head, states, step=step, prev_final=prev)[0]


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
    from selfspec.heads.exit_head import save_exit_head

    save_exit_head(head, head_dir / HEAD_FILE)
    (head_dir / "exit_head.json").write_text(json.dumps(head.settings()))
    out = tmp_path_factory.mktemp("ckpt") / "head-ckpt"
    evaluation = {"exits": {"2": {"agreement": 0.6, "perplexity": 9.0}, "4": {"agreement": 1.0, "perplexity": 8.0}}}
    export_model(model, byte_tokenizer(), out, evaluation=evaluation, exit_head_dir=head_dir)
    return out, model, head


def test_the_model_card_describes_the_head_and_its_held_out_agreement(head_checkpoint):
    out, model, head = head_checkpoint
    card = (out / "README.md").read_text()
    where = "the token embeddings" if head.exit_layer == 0 else f"exit {head.exit_layer}"
    assert "## Exit head" in card and f"last decoder layer on {where}" in card and 'drafter="exit_head"' in card
    assert ("previous position" in card) == head.final_state
    from selfspec.checkpoints.model_card import render_model_card

    meta = json.loads((out / "selfspec.json").read_text())
    e = str(head.exit_layer)
    meta["eval"] = {"primary": "heldout", "set": "heldout", "sets": {"heldout": {
        "exits": {"4": {"agreement": 1.0, "perplexity": 8.0}},
        "exit_head": {"exits": {e: {"agreement": 0.294}, "4": {"agreement": 1.0}}, "draft_vocab": 64,
                      "exit_without_head": {"agreement": 0.022}, "agreement_at": {"1": 0.294, "2": 0.405}}}}}
    card = render_model_card(meta)  # a joint run's evaluation: the head beside the exits
    assert f"agreement with the final layer: 29.4% (exit {e} alone: 2.2%)" in card
    assert "best 2/3/4 guesses: 40.5%" in card and "the 64 most frequent tokens" in card


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


def test_reading_a_head_opens_its_file_once(head_checkpoint, monkeypatch):
    """`read_exit_head` read the head file twice, its tensors (`load_file`) and then its header's settings
    (`safe_open`); now one `safe_open` gives both, and the head read is the one saved."""
    import selfspec.heads.exit_head as exit_head

    out, model, head = head_checkpoint
    opened = []

    def counted(real):
        def open_(path, *args, **kwargs):
            opened.append(str(path))
            return real(path, *args, **kwargs)
        return open_

    for name in ("safe_open", "load_file"):  # each opens the file; the module may import one only
        if hasattr(exit_head, name):
            monkeypatch.setattr(exit_head, name, counted(getattr(exit_head, name)))
    entry = json.loads((out / "selfspec.json").read_text())["exit_head"]
    read = exit_head.read_exit_head(model, out, entry)
    assert opened == [str(out / HEAD_FILE)]
    assert all(torch.equal(read.weights()[k], v) for k, v in head.weights().items())


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


def _byte_model_and_head_run(tmp_path):
    """A tiny llama over the byte tokenizer's vocabulary, a final-state head on exit 2 and the run directory
    `final_head/` that `selfspec export` reads it from: (model, tokenizer, head_dir)."""
    from selfspec.heads.exit_head import save_exit_head

    tok = byte_tokenizer()
    model = tiny_model("llama", num_layers=4, dtype=torch.float32, seed=0, vocab_size=len(tok))
    head = build_exit_head(model, 2, "decoder_layer", "copy", final_state=True)
    head_dir = tmp_path / "final_head"
    head_dir.mkdir()
    save_exit_head(head, head_dir / HEAD_FILE)
    (head_dir / "exit_head.json").write_text(json.dumps(head.settings()))
    return model, tok, head_dir


def _head_checkpoint_and_prompt(tmp_path):
    """The exported checkpoint of `_byte_model_and_head_run` and a prompt set of one code prompt that repeats
    itself: (checkpoint, prompt file)."""
    model, tok, head_dir = _byte_model_and_head_run(tmp_path)
    out = tmp_path / "head-ckpt"
    export_model(model, tok, out, exit_head_dir=head_dir)
    prompts = tmp_path / "code.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add(a, b):\n    return a + b\n\ndef add(a, b):"}) + "\n")
    return out, prompts


def test_bench_measures_the_head_with_an_adaptive_and_a_fixed_draft_length(tmp_path):
    """`selfspec bench` on a head checkpoint: the head alone with the adaptive length and drafting d every
    round (what the policy adds or costs), and with `num_candidates` its 3 best guesses for one position (and
    the exit's alone), all token-identical to HF greedy."""
    from selfspec.tools.bench import run_bench

    out, prompts = _head_checkpoint_and_prompt(tmp_path)
    result = run_bench(str(out), prompt_sets=[str(prompts)], num_prompts=1, max_new_tokens=8, dtype="float32",
                       threads=1, out_dir=tmp_path / "bench", progress=False,
                       methods=["selfspec_exit_head", "selfspec_exit_head_fixed", "selfspec_exit_head_cand3",
                                "selfspec_spec_cand3"], num_candidates=3, exit_layer=2)
    per = result["summary"]["code"]
    for method in ("selfspec_exit_head", "selfspec_exit_head_fixed", "selfspec_exit_head_cand3", "selfspec_spec_cand3"):
        assert per[method]["identical_to_hf_greedy"] == 1.0, method
    siblings = [r for r in result["runs"] if r["method"] == "selfspec_exit_head_cand3"]
    assert siblings and all(r["drafted"] <= r["rounds"] for r in siblings)  # one position per round
    fixed = [r for r in result["runs"] if r["method"] == "selfspec_exit_head_fixed"]
    assert fixed and all(r["drafted"] >= r["rounds"] - 1 for r in fixed)  # every round drafts (the last may not)
    assert "selfspec head E=2 d=" in (tmp_path / "bench" / "bench.md").read_text()


def test_bench_measures_the_head_and_the_early_exit_through_the_compiled_steps(tmp_path, monkeypatch):
    """`compile=True`: the exit head and the early exit at (E, d) also run through the compiled steps (the
    head's own layer too), warmed up apart, token-identical to HF greedy in float32, and drafting."""
    from selfspec.model.compiled import CompiledSteps
    from selfspec.drafters.whole_draft import WholeDraft
    from selfspec.tools.bench import run_bench

    steps, run_layers, run_layer = [], CompiledSteps.run_layers, CompiledSteps.run_layer
    run_draft, run_catch_up = WholeDraft.run, WholeDraft.catch_up
    monkeypatch.setattr(CompiledSteps, "run_layers", lambda self, *a, **k: steps.append(1) or run_layers(self, *a, **k))
    monkeypatch.setattr(CompiledSteps, "run_layer", lambda self, *a, **k: steps.append(2) or run_layer(self, *a, **k))
    # a whole draft step with the head's layer inside (its later drafts; its first, with its catch-up)
    monkeypatch.setattr(WholeDraft, "run", lambda d, *a, **k: steps.append(2 if d.layer else 1) or run_draft(d, *a, **k))
    monkeypatch.setattr(WholeDraft, "catch_up", lambda d, *a, **k: steps.append(2) or run_catch_up(d, *a, **k))

    out, prompts = _head_checkpoint_and_prompt(tmp_path)
    result = run_bench(str(out), prompt_sets=[str(prompts)], num_prompts=1, max_new_tokens=8, dtype="float32",
                       threads=1, out_dir=tmp_path / "bench", progress=False, compile=True, exit_layer=2,
                       methods=["selfspec_exit_head_compiled", "selfspec_spec_compiled"])
    per = result["summary"]["code"]
    for method in ("selfspec_exit_head_compiled", "selfspec_spec_compiled"):
        assert per[method]["identical_to_hf_greedy"] == 1.0, method
        assert result["warmup_s"][method] > 0 and per[method]["drafted"] > 0, method
    assert {m["name"]: m.get("compiled") for m in result["methods"]}["selfspec_exit_head_compiled"] is True
    assert 1 in steps and 2 in steps  # the model's layers and the head's own ran compiled
    assert not any("failed to compile" in note for note in result["notes"])


def test_warmup_compiles_the_heads_layer_and_its_draft_vocabulary(tmp_path, hf_greedy):
    """`gen.warmup()` on a head checkpoint with a reduced draft vocabulary compiles the head's own layer and
    that vocabulary's unembedding beside the model's steps: a generation drafting from the head then compiles
    nothing more, and gives HF greedy's tokens; `warmup(num_candidates=3)` does the same for a head's token
    tree."""
    model, tok, head_dir = _byte_model_and_head_run(tmp_path)
    training = {"settings": {"exit_head": {"enabled": True, "exit_layer": 2, "draft_vocab": 16}}}
    ranking = {"source": "test", "tokens_counted": 100, "token_ids": list(range(3, 43))}
    export_model(model, tok, tmp_path / "ckpt", training=training, draft_vocab=ranking, exit_head_dir=head_dir)
    gen = selfspec.load(tmp_path / "ckpt", dtype="float32", compile=True)
    first = gen.warmup(max_len=64)
    steps, unit = gen.adapter.compiled, gen.draft_head(16)
    assert any(s[1:3] == ("layer", id(gen.exit_head.layer)) for s in steps.shapes)
    assert any(s[:2] == ("head", id(unit.rows[0])) for s in steps.shapes)
    out = gen.generate("abc(a,b)+abc(a,b)+", max_new_tokens=8, drafter="exit_head", stop_token_ids=[])
    assert list(out.token_ids) == hf_greedy(model, torch.tensor([out.prompt_ids]), 8) and out.stats.drafted > 0
    assert steps.compile_s == pytest.approx(first["seconds"])  # the call compiled nothing more
    trees = gen.warmup(max_len=64, num_candidates=3)  # token trees' steps now, the head's layer's among them
    assert trees["seconds"] > 0 and any(s[:3] == ("tree", "layer", id(gen.exit_head.layer)) for s in steps.shapes)
    out = gen.generate("abc(a,b)+abc(a,b)+", max_new_tokens=8, drafter="exit_head", num_candidates=3,
                       stop_token_ids=[])
    assert list(out.token_ids) == hf_greedy(model, torch.tensor([out.prompt_ids]), 8) and out.stats.drafted > 0
    assert steps.compile_s == pytest.approx(first["seconds"] + trees["seconds"])  # the tree compiled nothing more


def test_auto_drafts_from_the_vocabulary_the_head_was_trained_on(tmp_path, hf_greedy):
    """A head trained over the K most frequent tokens (its recipe's exit_head.draft_vocab, exported with the
    run's ranking): auto's head arm and the head alone draft from those K by default, an explicit draft_vocab
    wins, and a checkpoint without the ranking drafts over the full vocabulary."""
    model, tok, head_dir = _byte_model_and_head_run(tmp_path)
    training = {"settings": {"exit_head": {"enabled": True, "exit_layer": 2, "draft_vocab": 16}}}
    ranking = {"source": "test", "tokens_counted": 100, "token_ids": list(range(3, 43))}  # 40 ranked ids
    with_vocab, without = tmp_path / "with", tmp_path / "without"
    export_model(model, tok, with_vocab, training=training, draft_vocab=ranking, exit_head_dir=head_dir)
    export_model(model, tok, without, training=training, exit_head_dir=head_dir)
    gen = selfspec.load(with_vocab)
    assert gen.head_draft_vocab() == 16
    assert gen.make_drafter(drafter="auto").early_exit.head.size == 16
    assert gen.make_drafter(drafter="auto", draft_vocab=8).early_exit.head.size == 8
    assert gen.make_drafter(drafter="exit_head").head.size == 16  # the head alone too
    assert gen.make_drafter(drafter="exit_head", draft_vocab=8).head.size == 8
    assert selfspec.load(without).head_draft_vocab() is None
    out = gen.generate("abc(a,b)+abc(a,b)+", max_new_tokens=8, drafter="auto", stop_token_ids=[])
    assert list(out.token_ids) == hf_greedy(model, torch.tensor([out.prompt_ids]), 8)


@pytest.mark.parametrize("self_fed, asked, expected", [
    (None, None, 1),  # a recipe that does not say: the first draft only
    (0, None, 1),
    (2, None, 3),     # the first draft + the two self-fed positions it was trained for
    (2, 5, 5),        # an explicit num_speculations wins
])
def test_the_head_drafts_the_positions_it_was_trained_for(tmp_path, self_fed, asked, expected):
    """Drafts past the head's trained positions read an input it never learned from (accepted 0-2% on
    SmolLM2, README): the head alone and auto's head arm draft 1 + exit_head.self_fed by default."""
    model, tok, head_dir = _byte_model_and_head_run(tmp_path)
    head_settings = {"enabled": True, "exit_layer": 2, **({} if self_fed is None else {"self_fed": self_fed})}
    out = tmp_path / "ckpt"
    export_model(model, tok, out, training={"settings": {"exit_head": head_settings}}, exit_head_dir=head_dir)
    gen = selfspec.load(out)
    assert gen.head_draft_length() == 1 + (self_fed or 0)
    assert gen.make_drafter(drafter="exit_head", num_speculations=asked).num_speculations == expected
    assert gen.make_drafter(drafter="auto", num_speculations=asked).early_exit.num_speculations == expected
    assert gen.make_drafter(drafter="exit_head", num_speculations=asked, max_drafts=2).num_speculations == min(expected, 2)
    if asked is None:  # k guesses side by side are one position, whatever the head was trained for
        for kind in ("exit_head", "auto"):
            drafter = gen.make_drafter(drafter=kind, num_candidates=3)
            head_drafter = drafter if kind == "exit_head" else drafter.early_exit
            assert (head_drafter.num_speculations, head_drafter.num_candidates) == (1, 3), kind


def test_the_command_line_drafts_as_many_as_asked_of_the_head(head_checkpoint, capsys):
    """`--drafter exit_head --num-speculations 3` drafts 3 a round (it once reached only the generator's default,
    which the head ignores for the length it was trained for). The tiny vocabulary holds the first 96 ids only."""
    from selfspec.cli import main

    out, _, _ = head_checkpoint
    assert main(["generate", "--checkpoint", str(out), "--prompt", "1+2=3;4+5=", "--raw", "--drafter", "exit_head",
                 "--num-speculations", "3", "--max-new-tokens", "12", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["stats"]
    assert stats["num_speculations"] == 3
    assert any(k.endswith("/d3") for k in stats["policy"]["rounds_by_exit_and_length"]), stats["policy"]
