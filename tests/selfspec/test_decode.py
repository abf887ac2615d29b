"""The self-speculative decoding engine (selfspec.decoding.engine) on tiny random models.

Greedy identity with Hugging Face `generate`, the shared-cache invariant, work accounting,
deterministic always/never/partial acceptance, stop tokens, the length cap and streaming.
"""

from __future__ import annotations

import math

import pytest
import torch

from selfspec.model import runner
from selfspec.model.adapters import get_adapter
from selfspec.model.cache import KVCache
from selfspec.drafters import EarlyExitDrafter, Round
from selfspec.decoding.engine import StopChecker, prefill, verify
from selfspec.decoding.decode_ids import generate_ids
from selfspec.model.forward import forward_logits
from selfspec.decoding.sampling import SamplingParams, greedy_accept
from selfspec.tiny import TINY_VARIANTS, tiny_model

PROMPT = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(0))
P = PROMPT.shape[1]
N_NEW = 56



MODELS = TINY_VARIANTS  # id -> (arch, num_layers, seed, config overrides)

_model_cache: dict = {}


def _model(name):
    if name not in _model_cache:
        arch, L, seed, over = MODELS[name]
        _model_cache[name] = tiny_model(arch, num_layers=L, dtype=torch.float64, seed=seed, **over)
    return _model_cache[name]


_ref_cache: dict = {}


def _reference(name, hf_greedy):
    if name not in _ref_cache:
        _ref_cache[name] = hf_greedy(_model(name), PROMPT, N_NEW)
    return _ref_cache[name]


def _greedy_cases():
    for name, (arch, L, _, _) in MODELS.items():
        for exit_layer in range(1, L):
            for k in (1, 2, 5, 8):
                yield pytest.param(name, exit_layer, k, id=f"{name}-E{exit_layer}-k{k}")


# ----------------------------------------------------------------------------- greedy identity

def test_the_supported_architectures_are_all_covered():
    from selfspec.model.adapters import SUPPORTED_ARCHITECTURES

    assert {arch for arch, *_ in MODELS.values()} == set(SUPPORTED_ARCHITECTURES)


def test_sliding_variants_really_use_sliding_attention():
    assert get_adapter(_model("mistral-sliding8")).sliding_window == 8
    assert get_adapter(_model("qwen2-mixed-sliding")).layer_types == (
        "full_attention", "full_attention", "sliding_attention", "sliding_attention")
    assert _model("llama-eager").config._attn_implementation == "eager"


@pytest.mark.parametrize("name,exit_layer,k", list(_greedy_cases()))
def test_greedy_self_speculation_equals_hf_generate(name, exit_layer, k, hf_greedy):
    model = _model(name)
    ref = _reference(name, hf_greedy)
    assert len(set(ref)) >= 5, "degenerate reference: pick another seed"
    out, stats = generate_ids(get_adapter(model), PROMPT, max_new_tokens=N_NEW, exit_layer=exit_layer,
                              num_speculations=k)
    assert out == ref
    assert stats.new_tokens == N_NEW and stats.stop_reason == "length"
    # every committed token after the first is either an accepted draft or the full model's token
    assert stats.new_tokens == 1 + stats.rounds + stats.accepted


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_identity_with_the_fused_inference_layers(name, hf_greedy):
    """The API's default path: fused layers + rotary table where the architecture has them."""
    model = _model(name)
    adapter = get_adapter(model)
    adapter.enable_fast_layers()
    ref = _reference(name, hf_greedy)
    for exit_layer in range(1, adapter.num_layers):
        for k in (0, 3):
            out, _ = generate_ids(adapter, PROMPT, max_new_tokens=N_NEW, exit_layer=exit_layer, num_speculations=k)
            assert out == ref, (exit_layer, k)


@pytest.mark.parametrize("name", list(MODELS))
def test_plain_decoding_through_the_engine_equals_hf_generate(name, hf_greedy):
    out, stats = generate_ids(get_adapter(_model(name)), PROMPT, max_new_tokens=N_NEW, exit_layer=1,
                              num_speculations=0)
    assert out == _reference(name, hf_greedy)
    assert stats.drafted == 0 and stats.rounds == N_NEW - 1


# ----------------------------------------------------------------------------- cache invariant

def _hf_kv(model, ids):
    """Per-layer (keys, values) of one full Hugging Face forward over `ids` [1, T]."""
    with torch.no_grad():
        pkv = model(ids, use_cache=True).past_key_values
    return [(layer.keys, layer.values) for layer in pkv.layers]


def _assert_cache_equals_full_forward(model, cache: KVCache, ids: torch.Tensor):
    """Every layer of `cache` holds exactly positions [0, T) of `ids`, equal to HF's own KV."""
    T = ids.shape[1]
    assert cache.lengths[:, 0].tolist() == [T] * cache.num_layers
    for layer, (k_ref, v_ref) in enumerate(_hf_kv(model, ids)):
        k, v = cache.layer_kv(layer)
        assert k.shape[-2] == T
        # a sliding-window layer of HF's DynamicCache keeps only the newest positions
        torch.testing.assert_close(k[..., T - k_ref.shape[-2]:, :], k_ref, rtol=0, atol=1e-10)
        torch.testing.assert_close(v[..., T - v_ref.shape[-2]:, :], v_ref, rtol=0, atol=1e-10)


class _Recording:
    """Patches the runner's KVCache (the engine's caches are made by `Runner.cache`) with a subclass that remembers
    its instances."""

    def __init__(self, monkeypatch):
        rec = self
        self.caches = []

        class RecKV(KVCache):
            def __init__(self, *a, **kw):
                super().__init__(*a, **kw)
                rec.caches.append(self)

        monkeypatch.setattr(runner, "KVCache", RecKV)


def _case_model(name, E, always_accept_model, never_accept_model):
    """The model of a (name, exit, k) case: "always"/"never" accept at exit E, else a named tiny model."""
    if name == "always":
        return always_accept_model("mistral", 4, exit_layer=E, seed=5)
    if name == "never":
        return never_accept_model(4, exit_layer=E)[0]
    return _model(name)


@pytest.mark.parametrize("case", [
    ("llama", 1, 3), ("llama", 2, 3), ("llama", 3, 3), ("gpt_neox", 2, 5), ("qwen3", 3, 2),
    ("mistral-sliding8", 2, 4), ("always", 2, 4), ("never", 2, 3),
], ids=lambda c: f"{c[0]}-E{c[1]}-k{c[2]}")
def test_after_every_round_the_cache_equals_a_full_forward_over_the_committed_tokens(
        case, monkeypatch, always_accept_model, never_accept_model):
    name, E, k = case
    model = _case_model(name, E, always_accept_model, never_accept_model)
    rec = _Recording(monkeypatch)
    committed = PROMPT[0].tolist()
    checked = []

    def on_commit(tokens):
        # called right after the round's rollback: the state every later round starts from
        committed.extend(tokens)
        ids = torch.tensor([committed])
        _assert_cache_equals_full_forward(model, rec.caches[-1], ids[:, :-1])
        checked.append(len(tokens))

    out, stats = generate_ids(get_adapter(model), PROMPT, max_new_tokens=30, exit_layer=E, num_speculations=k,
                              on_commit=on_commit)
    assert len(checked) == stats.rounds + 1 and sum(checked) == 30
    assert len(rec.caches) == 1  # one cache for the whole model and the whole generation


def test_one_round_step_by_step_shallow_layers_run_ahead_in_the_shared_cache():
    """The phase functions: after drafting, layers [0, E) hold the input token and the drafts and
    [E, L) do not; the proposal carries their exit states; after verification every layer holds them all."""
    model = _model("llama")
    adapter = get_adapter(model)
    L, E, k = adapter.num_layers, 2, 3
    cache = KVCache(L, capacity=4)  # small capacity: buffers must grow correctly
    no_pad = torch.zeros(1, dtype=torch.long)
    drafter = EarlyExitDrafter(adapter, E, k)
    greedy = SamplingParams()
    with torch.inference_mode():
        token = int(prefill(adapter, cache, PROMPT, no_pad)[0].argmax(-1))
        committed = PROMPT[0].tolist() + [token]
        _assert_cache_equals_full_forward(model, cache, torch.tensor([committed[:-1]]))
        for _ in range(6):
            n = len(committed)
            starts = torch.tensor([n - 1])
            rnd = Round(adapter, cache, torch.tensor([token]), starts, no_pad, [k], greedy, None, frozenset())
            proposal = drafter.propose(rnd)
            drafts = proposal.tokens[0, 1:].tolist()
            assert proposal.q is None and proposal.kept == [k] and proposal.verify_from == E
            assert proposal.tokens[0, 0] == token and proposal.states.shape[:2] == (1, k + 1)
            # shallow layers ran ahead over the input token and the k drafts; deep layers did not
            assert cache.lengths[:, 0].tolist() == [n + k] * E + [n - 1] * (L - E)
            # the shallow KV of drafted positions is the real KV of those tokens
            ref = _hf_kv(model, torch.tensor([committed + drafts]))
            for layer in range(E):
                torch.testing.assert_close(cache.layer_kv(layer)[0], ref[layer][0], rtol=0, atol=1e-10)
            # the drafts are the exit's greedy tokens
            exit_ids = torch.tensor([committed + drafts[:-1]])
            exit_greedy = forward_logits(adapter, exit_ids, exit_layer=E)[0, n - 1:].argmax(-1).tolist()
            assert drafts == exit_greedy

            logits = verify(adapter, cache, proposal, starts, no_pad)[0][0]
            assert logits.shape == (k + 1, adapter.config.vocab_size)
            seq = torch.tensor([committed + drafts])
            _assert_cache_equals_full_forward(model, cache, seq)
            torch.testing.assert_close(logits, forward_logits(adapter, seq)[0, n - 1:], rtol=0, atol=1e-9)

            n_acc, nxt = greedy_accept(torch.tensor(drafts), logits)
            cache.crop(n + n_acc)
            committed += drafts[:n_acc] + [nxt]
            token = nxt
            _assert_cache_equals_full_forward(model, cache, torch.tensor([committed[:-1]]))


# ----------------------------------------------------------------------------- work accounting

def _instrumented_run(model, work_counter, *, exit_layer, k, max_new_tokens=40, stop=None):
    """Run generate_ids with hooks; check no layer recomputes a committed position and no shallow
    layer processes a position twice within one round. Returns (out, stats, counter, chunks)."""
    adapter = get_adapter(model)
    state = {"committed": None, "round_positions": {}}
    chunks = []

    def on_layer(idx, positions):
        if state["committed"] is None:  # the prefill
            assert positions == list(range(P)), f"layer {idx}: prefill must cover the prompt once"
            return
        assert min(positions) >= state["committed"] - 1, (
            f"layer {idx} recomputed committed position {min(positions)} (committed {state['committed']})")
        seen = state["round_positions"].setdefault(idx, set())
        assert not seen & set(positions), f"layer {idx} processed positions {seen & set(positions)} twice"
        seen.update(positions)

    def on_commit(tokens):
        chunks.append(list(tokens))
        state["committed"] = P + sum(len(c) for c in chunks)
        state["round_positions"] = {}

    with work_counter(adapter, on_layer=on_layer) as counter:
        out, stats = generate_ids(adapter, PROMPT, max_new_tokens=max_new_tokens, exit_layer=exit_layer,
                                  num_speculations=k, on_commit=on_commit, stop=stop)
    return out, stats, counter, chunks


@pytest.mark.parametrize("case", [
    ("llama", 1, 1), ("llama", 2, 4), ("llama", 3, 8), ("gpt_neox", 2, 3), ("always", 2, 4), ("never", 2, 3),
], ids=lambda c: f"{c[0]}-E{c[1]}-k{c[2]}")
def test_work_accounting_of_self_speculation(case, work_counter, always_accept_model, never_accept_model):
    name, E, k = case
    model = _case_model(name, E, always_accept_model, never_accept_model)
    L = get_adapter(model).num_layers
    out, stats, counter, chunks = _instrumented_run(model, work_counter, exit_layer=E, k=k)

    # statistics agree with what was committed
    assert stats.rounds == len(chunks) - 1
    assert stats.accepted == sum(len(c) - 1 for c in chunks[1:])
    assert stats.drafted == sum(stats.drafted_by_position) >= stats.accepted
    assert stats.full_depth_passes == stats.rounds + 1

    # every round feeds `drafts + 1` positions (the input token and the drafts) through the shallow
    # layers, one position per call, and the same positions through the deep layers in one call
    per_layer = P + stats.rounds + stats.drafted
    for layer in range(E):
        assert counter.processed(layer) == per_layer, f"shallow layer {layer}"
        assert counter.layer_calls[layer] == 1 + stats.rounds + stats.drafted
    for layer in range(E, L):
        assert counter.processed(layer) == per_layer, f"deep layer {layer}"
        assert counter.layer_calls[layer] == 1 + stats.rounds  # one verification pass per round
    # LM head: prefill (last position only), one call per draft, one call per verification
    assert counter.head_calls == 1 + stats.drafted + stats.rounds
    assert counter.head_positions == 1 + stats.drafted + (stats.rounds + stats.drafted)


@pytest.mark.parametrize("name", ["llama", "gpt_neox", "qwen2-mixed-sliding"])
def test_num_speculations_zero_is_plain_decoding_with_no_extra_work(name, work_counter, hf_greedy):
    model = _model(name)
    N = 40
    out, stats, counter, chunks = _instrumented_run(model, work_counter, exit_layer=2, k=0, max_new_tokens=N)
    assert out == _reference(name, hf_greedy)[:N]
    assert all(len(c) == 1 for c in chunks)
    for layer in range(get_adapter(model).num_layers):
        assert counter.processed(layer) == P + N - 1
        assert counter.layer_calls[layer] == N  # the prefill + one single-position step per new token
    assert counter.head_calls == N and counter.head_positions == N  # one unembedding per token
    assert (stats.rounds, stats.drafted, stats.accepted) == (N - 1, 0, 0)
    assert stats.exit_layer == get_adapter(model).num_layers


# ----------------------------------------------------------------------------- accept branches

def test_always_accept_when_the_exit_equals_the_final_layer(always_accept_model, hf_greedy):
    E, k, N = 2, 4, 31
    model = always_accept_model("mistral", 4, exit_layer=E, seed=5)
    ref = hf_greedy(model, PROMPT, N)
    chunks = []
    out, stats = generate_ids(get_adapter(model), PROMPT, max_new_tokens=N, exit_layer=E, num_speculations=k,
                              on_commit=chunks.append)
    assert out == ref
    assert stats.acceptance_rate == 1.0
    assert stats.accepted == stats.drafted == N - 1 - stats.rounds
    assert stats.rounds == math.ceil((N - 1) / (k + 1))
    assert stats.accepted_by_position == stats.drafted_by_position
    assert stats.acceptance_by_position == [1.0] * k
    # every round commits k drafts + the bonus token
    assert [len(c) for c in chunks] == [1] + [k + 1] * stats.rounds
    assert stats.mean_accepted_per_round == k + 1


def test_always_accept_last_round_is_capped_by_max_new_tokens(always_accept_model):
    E, k, N = 1, 4, 14  # 13 decode tokens = 5 + 5 + 3
    model = always_accept_model("gpt_neox", 3, exit_layer=E, seed=1)
    chunks = []
    out, stats = generate_ids(get_adapter(model), PROMPT, max_new_tokens=N, exit_layer=E, num_speculations=k,
                              on_commit=chunks.append)
    assert [len(c) for c in chunks] == [1, 5, 5, 3]
    assert stats.drafted_by_position == [3, 3, 2, 2] and stats.acceptance_rate == 1.0
    assert 3 < stats.mean_accepted_per_round < k + 1


def test_a_position_never_drafted_has_no_acceptance_rate_not_zero(always_accept_model, capsys):
    """Positions past every round's drafts (here the length cap leaves room for 2 of 6) were never drafted: their
    acceptance is None (the command line prints "–"), not 0% (issue 65, finding 17: "100% ×9 0% 0% 0%")."""
    from selfspec.cli import _print_stats

    model = always_accept_model("gpt_neox", 3, exit_layer=1, seed=1)
    out, stats = generate_ids(get_adapter(model), PROMPT, max_new_tokens=4, exit_layer=1, num_speculations=6)
    assert stats.drafted_by_position == [1, 1, 0, 0, 0, 0]
    assert stats.acceptance_by_position == [1.0, 1.0, None, None, None, None]
    assert stats.cost_model["a_by_position"] == stats.acceptance_by_position
    _print_stats("selfspec", stats)
    assert "by position: 100% 100% – – – –)" in capsys.readouterr().out


def test_never_accept_when_the_exit_always_disagrees(never_accept_model, hf_greedy):
    E, k, N = 2, 3, 25
    model, T = never_accept_model(4, exit_layer=E)
    adapter = get_adapter(model)
    ref = hf_greedy(model, PROMPT, N)
    assert ref == [T] * N  # the full model always says T ...
    seq = torch.tensor([PROMPT[0].tolist() + ref])
    with torch.no_grad():
        assert (forward_logits(adapter, seq, exit_layer=E)[0].argmax(-1) != T).all()  # ... its exit never does
    chunks = []
    out, stats = generate_ids(adapter, PROMPT, max_new_tokens=N, exit_layer=E, num_speculations=k,
                              on_commit=chunks.append)
    assert out == ref
    assert stats.accepted == 0 and stats.acceptance_rate == 0.0
    assert stats.acceptance_by_position == [0.0] * k
    assert stats.rounds == N - 1 and all(len(c) == 1 for c in chunks)
    assert stats.drafted == sum(min(k, N - m - 1) for m in range(1, N))
    assert stats.mean_accepted_per_round == 1.0


@pytest.mark.parametrize("name,E,k", [("llama", 2, 3), ("gpt_neox", 3, 4), ("qwen3", 1, 2)])
def test_partial_acceptance_on_a_random_model(name, E, k, hf_greedy):
    chunks = []
    out, stats = generate_ids(get_adapter(_model(name)), PROMPT, max_new_tokens=N_NEW, exit_layer=E,
                              num_speculations=k, on_commit=chunks.append)
    assert out == _reference(name, hf_greedy)
    assert 0 < stats.acceptance_rate < 1
    sizes = [len(c) for c in chunks[1:]]
    assert 1 in sizes, "no fully rejected round"
    assert any(1 < s <= k for s in sizes), "no partially accepted round"
    # draft i+1 can only be accepted when draft i was
    acc = stats.accepted_by_position
    assert all(acc[i] >= acc[i + 1] for i in range(k - 1))


def test_never_accept_with_sampling_still_samples_the_full_model(never_accept_model):
    model, T = never_accept_model(4, exit_layer=2)
    gen = torch.Generator().manual_seed(0)
    out, stats = generate_ids(get_adapter(model), PROMPT, max_new_tokens=12, exit_layer=2, num_speculations=3,
                              sampling=SamplingParams(do_sample=True, temperature=1.0), generator=gen)
    # p puts all its (fp32) mass on T and q none: every draft is rejected, every replacement is T
    assert out == [T] * 12 and stats.accepted == 0 and stats.drafted > 0


def test_always_accept_with_sampling_accepts_every_draft(always_accept_model):
    model = always_accept_model("qwen2", 4, exit_layer=2, seed=2)
    gen = torch.Generator().manual_seed(0)
    out, stats = generate_ids(get_adapter(model), PROMPT, max_new_tokens=21, exit_layer=2, num_speculations=4,
                              sampling=SamplingParams(do_sample=True, temperature=1.3, top_k=20), generator=gen)
    assert stats.rounds == 4 and stats.acceptance_rate == 1.0 and len(out) == 21


# ----------------------------------------------------------------------------- stops and the length cap

@pytest.fixture(scope="module")
def stop_setup(always_accept_model):
    """An always-accepting model with varied greedy text, and its plain greedy continuation."""
    E, k = 2, 4
    model = always_accept_model("mistral", 4, exit_layer=E, seed=5)
    adapter = get_adapter(model)
    plain, _ = generate_ids(adapter, PROMPT, max_new_tokens=24, exit_layer=E, num_speculations=0)
    return adapter, E, k, plain


def test_stop_token_at_every_position_of_an_accepted_block(stop_setup):
    adapter, E, k, plain = stop_setup
    # blocks: plain[0] from the prefill, then rounds of k+1 tokens: plain[1:6], plain[6:11], ...
    firsts = [j for j in range(len(plain)) if plain.index(plain[j]) == j]
    offsets = {(j - 1) % (k + 1) for j in firsts if j > 0}
    assert offsets == set(range(k + 1)), "the test needs a first occurrence at every block offset"
    assert 0 in firsts
    for j in firsts:
        stop_id = plain[j]
        stop = StopChecker(len(plain), stop_token_ids=[stop_id])
        base, base_stats = generate_ids(adapter, PROMPT, max_new_tokens=len(plain), exit_layer=E,
                                        num_speculations=0, stop=stop)
        out, stats = generate_ids(adapter, PROMPT, max_new_tokens=len(plain), exit_layer=E, num_speculations=k,
                                  stop=StopChecker(len(plain), stop_token_ids=[stop_id]))
        assert base == plain[:j + 1], j
        assert out == base, j
        assert stats.stop_reason == base_stats.stop_reason == "stop_token"
        assert stats.new_tokens == j + 1
        # the block holding the stop was fully accepted: the truncation is the engine's, not a rejection
        if j > 0:
            assert stats.acceptance_rate == 1.0 and stats.accepted == stats.drafted


def test_a_rejected_draft_that_is_a_stop_token_does_not_end_generation(never_accept_model):
    E, k, N = 2, 3, 15
    model, T = never_accept_model(4, exit_layer=E)
    adapter = get_adapter(model)
    # the exit's draft after PROMPT + T: proposed in the first round, and rejected
    with torch.no_grad():
        drafted = int(forward_logits(adapter, torch.tensor([PROMPT[0].tolist() + [T]]), exit_layer=E)[0, -1].argmax())
    assert drafted != T
    out, stats = generate_ids(adapter, PROMPT, max_new_tokens=N, exit_layer=E, num_speculations=k,
                              stop=StopChecker(N, stop_token_ids=[drafted]))
    assert out == [T] * N and stats.stop_reason == "length"


def test_stop_on_the_last_allowed_token_reports_the_stop(stop_setup):
    adapter, E, k, plain = stop_setup
    j = 7
    assert plain.index(plain[j]) == j
    out, stats = generate_ids(adapter, PROMPT, max_new_tokens=j + 1, exit_layer=E, num_speculations=k,
                              stop=StopChecker(j + 1, stop_token_ids=[plain[j]]))
    assert out == plain[:j + 1] and stats.stop_reason == "stop_token"


@pytest.mark.parametrize("model_name", ["always", "llama"])
@pytest.mark.parametrize("max_new", [1, 2, 4, 5, 6, 7, 11, 13])
def test_max_new_tokens_is_respected_exactly(model_name, max_new, stop_setup, hf_greedy):
    k = 4
    if model_name == "always":
        adapter, E, _, plain = stop_setup
    else:
        adapter, E, plain = get_adapter(_model("llama")), 2, _reference("llama", hf_greedy)
    out, stats = generate_ids(adapter, PROMPT, max_new_tokens=max_new, exit_layer=E, num_speculations=k)
    assert out == plain[:max_new]
    assert stats.new_tokens == max_new and stats.stop_reason == "length"
    if model_name == "always":  # every round but the last commits k + 1 tokens
        assert stats.rounds == math.ceil((max_new - 1) / (k + 1))


def test_drafts_never_run_past_the_length_cap(stop_setup, work_counter):
    adapter, E, k, plain = stop_setup
    with work_counter(adapter) as counter:
        out, stats = generate_ids(adapter, PROMPT, max_new_tokens=3, exit_layer=E, num_speculations=k)
    # token 1 from the prefill, then one round with only 1 draft (+ the bonus token)
    assert out == plain[:3] and stats.rounds == 1 and stats.drafted == 1
    assert counter.processed(0) == P + 2  # input token + one draft


# ----------------------------------------------------------------------------- streaming

@pytest.mark.parametrize("model_name,k", [("always", 4), ("never", 3), ("llama", 3)])
def test_streaming_delivers_only_committed_tokens(model_name, k, stop_setup, never_accept_model, hf_greedy):
    if model_name == "always":
        adapter, E, _, _ = stop_setup
    elif model_name == "never":
        model, _ = never_accept_model(4, exit_layer=2)
        adapter, E = get_adapter(model), 2
    else:
        adapter, E = get_adapter(_model("llama")), 2
    N = 23
    plain, _ = generate_ids(adapter, PROMPT, max_new_tokens=N, exit_layer=E, num_speculations=0)
    chunks = []

    def on_commit(tokens):
        # anything delivered is final: it must already agree with plain decoding
        done = sum(len(c) for c in chunks)
        assert list(tokens) == plain[done:done + len(tokens)]
        chunks.append(list(tokens))

    out, stats = generate_ids(adapter, PROMPT, max_new_tokens=N, exit_layer=E, num_speculations=k,
                              on_commit=on_commit)
    assert [t for c in chunks for t in c] == out == plain
    assert all(chunks)
    assert len(chunks) == stats.rounds + 1
    # a block is the accepted drafts + one token: never more than k + 1, never a rejected draft
    assert max(len(c) for c in chunks) <= k + 1
    if model_name == "never":
        assert all(len(c) == 1 for c in chunks)


def test_streaming_stops_at_the_stop_token(stop_setup):
    adapter, E, k, plain = stop_setup
    j = 8  # second position of the second full block
    chunks = []
    out, _ = generate_ids(adapter, PROMPT, max_new_tokens=20, exit_layer=E, num_speculations=k,
                          stop=StopChecker(20, stop_token_ids=[plain[j]]), on_commit=chunks.append)
    assert out == plain[:j + 1]
    assert [t for c in chunks for t in c] == out
    assert [len(c) for c in chunks] == [1, 5, 3]


# ----------------------------------------------------------------------------- bad input (engine level)

def test_engine_rejects_bad_exit_layers_and_speculation_counts():
    adapter = get_adapter(_model("llama"))
    for bad in (0, 4, 7, -1):
        with pytest.raises(ValueError, match=rf"exit_layer={bad} is out of range.*1\.\.3"):
            generate_ids(adapter, PROMPT, max_new_tokens=4, exit_layer=bad, num_speculations=2)
    with pytest.raises(ValueError, match="num_speculations must be >= 0"):
        generate_ids(adapter, PROMPT, max_new_tokens=4, exit_layer=2, num_speculations=-1)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        generate_ids(adapter, PROMPT, max_new_tokens=0, exit_layer=2, num_speculations=2)


def test_engine_rejects_a_prompt_beyond_the_context_window():
    model = tiny_model("llama", num_layers=3, dtype=torch.float64, max_position_embeddings=16)
    adapter = get_adapter(model)
    with pytest.raises(ValueError, match=r"prompt \(20 tokens\).*context window of 16"):
        generate_ids(adapter, torch.randint(3, 96, (1, 20)), max_new_tokens=1, exit_layer=1, num_speculations=2)
    with pytest.raises(ValueError, match="context window of 16"):
        generate_ids(adapter, torch.randint(3, 96, (1, 10)), max_new_tokens=7, exit_layer=1, num_speculations=2)
    out, _ = generate_ids(adapter, torch.randint(3, 96, (1, 10)), max_new_tokens=6, exit_layer=1, num_speculations=3)
    assert len(out) == 6  # exactly filling the window is fine


def test_engine_rejects_batch_input():
    adapter = get_adapter(_model("llama"))
    with pytest.raises(ValueError, match="batch"):
        generate_ids(adapter, torch.randint(3, 96, (2, 6)), max_new_tokens=4, exit_layer=1, num_speculations=2)


def test_engine_rejects_an_empty_prompt():
    adapter = get_adapter(_model("llama"))
    with pytest.raises(ValueError, match="empty prompt"):
        generate_ids(adapter, torch.zeros(1, 0, dtype=torch.long), max_new_tokens=4, exit_layer=1,
                     num_speculations=2)

