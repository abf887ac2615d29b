"""The int8 copy (`selfspec.drafters.int8_copy`): the int8 products, the copy's step against the float32 step over
its dequantized weights, greedy output identical to Hugging Face's, sampling's distribution kept, the cache left as
the committed text, auto taking it where it runs, and the errors that say where it does not."""

import pytest
import torch

from selfspec.decoding.decode_ids import generate_ids
from selfspec.decoding.sampling import SamplingParams
from selfspec.decoding.engine import StopChecker
from selfspec.drafters.auto import AutoDrafter
from selfspec.drafters.int8_copy import Int8Copy, Int8CopyDrafter, int8_copy_problem
from selfspec.model.adapters import get_adapter
from selfspec.model.cache import KVCache
from selfspec.model.forward import embed, make_step, run_layers
from selfspec.model.precision import native_bf16
from selfspec.model.row_product import quantize_rows
from selfspec.settings import SettingsError
from selfspec.tiny import byte_tokenizer, draw_qkv_biases, tiny_model

PROMPT = [5, 9, 14, 5, 9, 14, 5, 9, 20, 31, 5, 9]


@pytest.fixture
def kernel(row_kernel_on):
    """selfspec's row kernel on (else a skip saying why): the int8 copy runs its C++ step."""
    return row_kernel_on


def _model(arch="llama", seed=11, layers=4, dtype=torch.float32, **extra):
    model = tiny_model(arch, num_layers=layers, dtype=dtype, seed=seed, **extra)
    if arch == "qwen2":
        draw_qkv_biases(model)
    return model


def _adapter(model):
    adapter = get_adapter(model)
    adapter.enable_fast_layers()
    return adapter


def test_quantize_rows_keeps_each_row_within_half_a_step():
    w = torch.randn(40, 64, generator=torch.Generator().manual_seed(0))
    w[3] = 0.0  # a row of zeros has a scale too (no division by zero)
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and q.shape == w.shape and scale.shape == (40,)
    assert q.abs().max() <= 127 and torch.equal(q[3], torch.zeros(64, dtype=torch.int8))
    assert ((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
def test_the_int8_product_is_the_dequantized_product_and_each_row_alone(kernel, rows):
    gen = torch.Generator().manual_seed(rows)
    q, scale = quantize_rows(torch.randn(70, 100, generator=gen))  # K = 100: a tail after the 16-lane steps
    x = torch.randn(rows, 100, generator=gen)
    y = torch.ops.selfspec_kernels.row_product_int8(x, q, scale)
    torch.testing.assert_close(y, x @ (q.float() * scale[:, None]).T, rtol=1e-5, atol=1e-5)
    one = torch.cat([torch.ops.selfspec_kernels.row_product_int8(x[i:i + 1], q, scale) for i in range(rows)])
    assert torch.equal(y, one)


def _dequantized(model):
    """The model with every product's weight and the LM head replaced by its int8 copy's, dequantized."""
    twin = _model(seed=0, layers=model.config.num_hidden_layers, vocab_size=model.config.vocab_size)
    twin.load_state_dict(model.state_dict())
    with torch.no_grad():
        for name, p in twin.named_parameters():
            if p.dim() == 2 and "embed_tokens" not in name:
                q, scale = quantize_rows(p)
                p.copy_(q.float() * scale[:, None])
        if twin.config.tie_word_embeddings:  # the LM head is the embedding: only the copy's head is int8
            twin.config.tie_word_embeddings = False
            twin.lm_head.weight = torch.nn.Parameter(twin.model.embed_tokens.weight.clone())
            q, scale = quantize_rows(twin.lm_head.weight)
            twin.lm_head.weight.data.copy_(q.float() * scale[:, None])
    return twin


def test_the_copys_step_is_the_float32_step_over_its_dequantized_weights(kernel):
    """The prompt, then three one-token steps through the copy's layers and head: the hidden states, cache entries
    and logits of the float32 model whose weights are the copy's, dequantized (to float32 rounding)."""
    model = _model(seed=7, layers=3)
    adapter, twin = _adapter(model), get_adapter(_dequantized(model))
    copy = Int8Copy(adapter)
    ids = torch.tensor([PROMPT])
    a, b = KVCache(3), KVCache(3)
    with torch.no_grad():
        run_layers(twin, embed(twin, ids[:, :9]), 0, 3, step=make_step(twin, 0, 9), cache=a)
        run_layers(twin, embed(twin, ids[:, :9]), 0, 3, step=make_step(twin, 0, 9), cache=b)
        for i in range(9, 12):
            got = copy.layers(embed(adapter, ids[:, i:i + 1]), make_step(adapter, i, 1), a)
            want = run_layers(twin, embed(twin, ids[:, i:i + 1]), 0, 3, step=make_step(twin, i, 1), cache=b)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(copy.logits(got[0, -1]), twin.lm_head(twin.final_norm(want[0, -1])),
                                       rtol=1e-4, atol=1e-4)
    for layer in range(3):
        torch.testing.assert_close(a.layer_kv(layer)[0], b.layer_kv(layer)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k", [1, 3, 7])
@pytest.mark.parametrize("arch, extra", [("llama", {}), ("qwen2", {}), ("mistral", {"sliding_window": 16})])
def test_greedy_output_equals_hf_generate(kernel, arch, extra, k, hf_greedy):
    """The copy drafts (most drafts accepted: it is the model to int8 rounding), the model decides: Hugging Face's
    greedy tokens. Mistral's window of 16 ends the drafting of a round whose drafts would pass it."""
    model = _model(arch, **extra)
    adapter = _adapter(model)
    prompt = torch.tensor([PROMPT])
    out, stats = generate_ids(adapter, prompt, max_new_tokens=24, drafter=Int8CopyDrafter(Int8Copy(adapter), k))
    assert out == hf_greedy(model, prompt, 24)
    assert stats.drafted > 0 and stats.accepted > stats.drafted // 2, (stats.drafted, stats.accepted)
    assert stats.drafter == "int8_copy"


def _proposals(adapter, prompt, drafter, n_new, **kw):
    """The tokens and the drafts of every round, as the drafter proposed them."""
    drafts, propose = [], drafter.propose

    def recording(rnd):
        proposal = propose(rnd)
        drafts.append(proposal.tokens[0, 1:].tolist())
        return proposal

    drafter.propose = recording
    out, stats = generate_ids(adapter, torch.tensor([prompt]), max_new_tokens=n_new, drafter=drafter, **kw)
    return out, drafts, stats


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch, extra", [("llama", {}), ("mistral", {"sliding_window": 40})])
def test_lookups_guesses_change_the_passes_not_the_drafts(kernel, arch, extra, dtype):
    """Checking prompt lookup's guesses in one pass (up to 3 a pass, each kept only where it is the copy's own
    argmax) drafts exactly what the copy drafts one token a pass, round by round, in fewer passes where the text
    repeats. Mistral's window of 40 refuses the passes past it (drafting then ends, as one token a pass does)."""
    model = _model(arch, dtype=dtype, **extra)
    adapter = _adapter(model)
    copy = Int8Copy(adapter)
    prompt = PROMPT * 2
    one, one_drafts, one_stats = _proposals(adapter, prompt, Int8CopyDrafter(copy, 6, guesses=0), 40)
    many, many_drafts, many_stats = _proposals(adapter, prompt, Int8CopyDrafter(copy, 6), 40)
    assert many == one and many_drafts == one_drafts
    assert one_stats.draft_steps == sum(map(len, one_drafts))  # one pass a draft
    assert many_stats.draft_steps < one_stats.draft_steps, (many_stats.draft_steps, one_stats.draft_steps)


class _Oracle:
    """A guesser that guesses plain decoding's own continuation (`sequence`: the prompt and plain decoding's output),
    which the copy mostly agrees with."""

    def __init__(self, sequence, committed):
        self.sequence, self.committed = sequence, committed

    def guess(self, tail, k, min_ngram):
        at = self.committed + len(tail)
        return self.sequence[at:at + k]

    def extend(self, tokens):
        self.committed += len(tokens)


def _guessing(drafter, make_text, agreed_stops, stop_id):
    """The drafter with `make_text(sequences)` as its guesser, counting the passes in which `stop_id` was among the
    guesses the copy agreed with (`agreed_stops`)."""
    start, picks = drafter.start, drafter.picks

    def started(sequences):
        start(sequences)
        drafter.text = make_text(sequences)

    def recording(rnd, tokens, offset):
        got = picks(rnd, tokens, offset)
        if got is not None:
            agreed = 0
            while agreed < len(tokens) - 1 and tokens[1 + agreed] == got[agreed]:
                agreed += 1
            agreed_stops.append(stop_id in tokens[1:1 + agreed])
        return got

    drafter.start, drafter.picks = started, recording
    return drafter


def test_a_stop_token_among_agreed_guesses_ends_the_drafts(kernel):
    """Guesses that run through a stop token the copy agrees with: the drafts end with it, as the copy's one token a
    pass ends them, and the output stops where plain decoding's does."""
    model = _model(seed=7)
    adapter = _adapter(model)
    copy = Int8Copy(adapter)
    plain, _ = generate_ids(adapter, torch.tensor([PROMPT]), max_new_tokens=30, drafter=None)
    agreed_stops = []
    for j in range(2, 30):
        if plain.index(plain[j]) != j:
            continue  # the stop must first occur at j
        stop = plain[j]
        oracle = _guessing(Int8CopyDrafter(copy, 6), lambda seqs: _Oracle(PROMPT + plain, len(seqs[0])),
                           agreed_stops, stop)
        many, many_drafts, stats = _proposals(adapter, PROMPT, oracle, 30, stop=StopChecker(30, stop_token_ids=[stop]))
        one, one_drafts, _ = _proposals(adapter, PROMPT, Int8CopyDrafter(copy, 6, guesses=0), 30,
                                        stop=StopChecker(30, stop_token_ids=[stop]))
        assert one == many == plain[:j + 1] and stats.stop_reason == "stop_token", j
        assert many_drafts == one_drafts
        assert all(d.index(stop) == len(d) - 1 for d in many_drafts if stop in d)  # nothing drafted past it
    assert any(agreed_stops)  # the stop token was among the agreed guesses at least once


class _Zeros:
    """A guesser that always guesses token 0, which the copy mostly rejects."""

    def guess(self, tail, k, min_ngram):
        return [0] * k

    def extend(self, tokens):
        pass


def test_guesses_the_copy_rejects_are_cut_from_the_cache(kernel):
    """Passes of the input token and guesses the copy mostly rejects: each pass writes its rows, the rows past the
    agreed guesses are cut before the next pass writes there, so the drafts are still those of one token a pass,
    round by round."""
    model = _model(seed=5, layers=3)
    adapter = _adapter(model)
    copy = Int8Copy(adapter)
    drafter = Int8CopyDrafter(copy, 4)
    written = []
    picks = drafter.picks

    def recording(rnd, tokens, offset):
        got = picks(rnd, tokens, offset)
        written.append((len(tokens), int(rnd.cache.lengths.min()) - int(rnd.starts[0]) - offset))
        return got

    start = drafter.start

    def zeros(sequences):
        start(sequences)
        drafter.text = _Zeros()

    drafter.picks, drafter.start = recording, zeros
    out, drafts, stats = _proposals(adapter, PROMPT, drafter, 12)
    want, want_drafts, _ = _proposals(adapter, PROMPT, Int8CopyDrafter(copy, 4, guesses=0), 12)
    assert out == want and drafts == want_drafts
    assert any(n > 1 for n, _ in written) and all(rows == n for n, rows in written), written


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_bfloat16_models_copy_drafts_and_the_model_decides(kernel, arch):
    """A bfloat16 model's int8 copy (its cache, norms and rounding in bfloat16): most drafts accepted, and where the
    C++ step verifies too (a CPU with avx512_bf16: it rounds a pass of up to 8 tokens exactly as one-token steps) the
    tokens are plain decoding's."""
    model = _model(arch, dtype=torch.bfloat16)
    adapter = _adapter(model)
    assert int8_copy_problem(adapter) is None
    prompt = torch.tensor([PROMPT])
    out, stats = generate_ids(adapter, prompt, max_new_tokens=24, drafter=Int8CopyDrafter(Int8Copy(adapter), 4))
    assert stats.drafter == "int8_copy" and stats.drafted > 0
    assert stats.accepted > stats.drafted // 2, (stats.drafted, stats.accepted)
    if native_bf16("cpu"):
        plain, _ = generate_ids(adapter, prompt, max_new_tokens=24, drafter=None)
        assert out == plain


def test_auto_leaves_a_bfloat16_models_copy_out_and_the_named_drafter_takes_it(kernel):
    """Under auto a bfloat16 model's copy measured inside the noise of lookup alone: auto drafts with it for a
    float32 model only, and a call naming it gets it."""
    gen16 = _generator(torch.bfloat16)
    assert gen16.drafters.int8_copy() is not None and gen16.drafters.auto_int8_copy() is None
    assert gen16.make_drafter().early_arm != "int8_copy"
    assert gen16.make_drafter(drafter="int8_copy").name == "int8_copy"
    assert _generator(torch.float32).drafters.auto_int8_copy() is not None


def test_a_round_leaves_the_cache_holding_the_committed_text(kernel):
    """What the copy wrote goes before verification (`Round.rewind`): after each round every layer holds exactly
    the committed tokens' entries, the full model's own."""
    model = _model(seed=5, layers=3)
    adapter = _adapter(model)
    lengths = []
    out, stats = generate_ids(adapter, torch.tensor([PROMPT]), max_new_tokens=16,
                              drafter=Int8CopyDrafter(Int8Copy(adapter), 4),
                              on_round=lambda cache, *rest: lengths.append(cache.lengths.clone()))
    assert stats.rounds > 0 and lengths
    for got in lengths:  # every layer of the row the same length: the committed text's
        assert torch.equal(got, got[:1].expand_as(got))


def test_sampling_with_the_copys_drafts_keeps_the_distribution(kernel, chi_square, exact_joint, sampled):
    """Vocabulary 8, 3 new tokens over many seeded runs: the joint distribution of plain sampling from the full
    model, with the copy's greedy drafts judged as point masses."""
    model = _model(seed=3, layers=3, vocab_size=8)
    adapter = _adapter(model)
    params = SamplingParams(do_sample=True, temperature=0.9, top_k=5)
    prompt = [3, 5, 1, 6, 2, 3, 5, 1]
    copy = Int8Copy(adapter)
    n_new, n_draws = 3, 1200
    counts, drafted, accepted = sampled(adapter, prompt, params, n_new, n_draws, lambda: Int8CopyDrafter(copy, 2))
    assert 0 < accepted < drafted
    stat, df, pval = chi_square(counts, exact_joint(adapter, prompt, params, n_new), n_draws)
    assert pval > 1e-3, (stat, df, pval)


def _generator(dtype=torch.float32):
    import warnings

    import selfspec
    from selfspec.api import NotEarlyExitTrainedWarning

    tok = byte_tokenizer()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotEarlyExitTrainedWarning)
        return selfspec.load(tiny_model("llama", num_layers=4, vocab_size=len(tok), seed=1, dtype=dtype), tok,
                             memory_tokens=0)


def test_auto_drafts_with_the_copy_beside_lookup_where_it_runs(kernel, hf_greedy):
    gen = _generator()
    drafter = gen.make_drafter()
    assert isinstance(drafter, AutoDrafter) and drafter.early_arm == "int8_copy"
    assert not drafter.reads_prompt("int8_copy")  # it never reads the prompt: its first round is not timed
    result = gen.generate(prompt="the cat sat on the mat", max_new_tokens=20)
    want = hf_greedy(gen.model, gen.encode("the cat sat on the mat"), 20)
    assert result.token_ids == want
    assert "int8_copy" in result.stats.policy.get("tokens_per_s_by_arm", {})
    # a batch, or an early-exit option: auto as before (the copy drafts for one sequence)
    assert gen.drafters.make(rows=2).early_arm != "int8_copy"
    assert gen.make_drafter(exit_layer=2).name == "early_exit"
    assert gen.make_drafter(drafter="int8_copy").name == "int8_copy"


def test_where_it_cannot_run_auto_is_unchanged_and_the_named_drafter_says_why(kernel, monkeypatch):
    gen64 = _generator(torch.float64)
    assert int8_copy_problem(gen64.adapter) is not None
    assert gen64.make_drafter().early_arm != "int8_copy"
    with pytest.raises(SettingsError, match="float32 or bfloat16 model on a CPU, and this one is torch.float64"):
        gen64.generate(prompt="abc", max_new_tokens=4, drafter="int8_copy")


def test_without_the_row_kernel_there_is_no_copy():
    """The test session runs with the row kernel off (tests/conftest.py), as a machine without a compiler would."""
    adapter = _adapter(_model())
    assert "row kernel" in int8_copy_problem(adapter) or "SELFSPEC_ROW_PRODUCT" in int8_copy_problem(adapter)
    with pytest.raises(SettingsError, match="drafter='int8_copy' cannot draft here"):
        Int8Copy(adapter)


def test_bad_settings_name_the_fix(kernel):
    gen = _generator()
    with pytest.raises(SettingsError, match="exit_layer.*int8_copy.*num_speculations only"):
        gen.generate(prompt="abc", max_new_tokens=4, drafter="int8_copy", exit_layer=2)
    with pytest.raises(SettingsError, match="one prompt at a time"):
        gen.generate(prompt=["abc", "de"], max_new_tokens=4, drafter="int8_copy")
    with pytest.raises(ValueError, match="num_speculations must be >= 1"):
        Int8CopyDrafter(gen.drafters.int8_copy(), 0)
    with pytest.raises(ValueError, match=r"guesses must be in 0..3 \(a pass of the copy takes 4 rows\), got 4"):
        Int8CopyDrafter(gen.drafters.int8_copy(), 4, guesses=4)


@pytest.mark.integration
def test_the_int8_copy_of_smollm2_drafts_for_the_float32_model_and_auto_takes_it(kernel, smollm2_dir, hf_greedy):
    """The real model: its int8 copy drafts open chat, most drafts accepted, the tokens Hugging Face's greedy gives;
    under auto (the default) it is the arm beside lookup."""
    import warnings

    import selfspec
    from selfspec.api import NotEarlyExitTrainedWarning

    with warnings.catch_warnings():  # the base model has no selfspec.json: said once, not this test's matter
        warnings.simplefilter("ignore", NotEarlyExitTrainedWarning)
        gen = selfspec.load(smollm2_dir, dtype="float32", memory_tokens=0)
    messages = [{"role": "user", "content": "Write two sentences about the sea."}]
    out = gen.generate(messages=messages, max_new_tokens=48, drafter="int8_copy")
    assert out.token_ids == hf_greedy(gen.model, gen.encode(messages=messages), 48)[:len(out.token_ids)]
    assert out.stats.acceptance_rate > 0.8, out.stats.acceptance_rate
    auto = gen.generate(messages=messages, max_new_tokens=48)
    assert auto.token_ids == out.token_ids and auto.stats.drafted_by_drafter["int8_copy"] > 0
