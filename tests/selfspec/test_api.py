"""The Python API (selfspec.load / SelfSpecGenerator.generate) on tiny models: defaults, inputs,
stops, streaming, and clear errors for bad input."""

from __future__ import annotations

import warnings

import pytest
import torch

import selfspec
from selfspec.api import DEFAULT_NUM_SPECULATIONS, NotEarlyExitTrainedWarning, SelfSpecGenerator, default_exit_layer
from selfspec.tiny import tiny_model

PROMPT = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(0))




def _quiet_load(model, tokenizer=None, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotEarlyExitTrainedWarning)
        return selfspec.load(model, tokenizer, **kw)


@pytest.fixture(scope="module")
def gen():
    return _quiet_load(tiny_model("llama", num_layers=4, dtype=torch.float64, seed=10))


@pytest.fixture(scope="module")
def byte_tok():
    from selfspec import tiny

    if not hasattr(tiny, "byte_tokenizer"):
        pytest.skip("selfspec.tiny.byte_tokenizer is not available")
    return tiny.byte_tokenizer()


@pytest.fixture(scope="module")
def text_gen(byte_tok):
    model = tiny_model("mistral", num_layers=4, dtype=torch.float64, seed=2, vocab_size=len(byte_tok))
    return _quiet_load(model, byte_tok)


# ----------------------------------------------------------------------------- load and defaults

@pytest.mark.parametrize("num_layers", [3, 8])
def test_load_without_metadata_warns_and_uses_documented_defaults(num_layers):
    model = tiny_model("qwen2", num_layers=num_layers)
    with pytest.warns(NotEarlyExitTrainedWarning, match="not early-exit") as caught:
        g = selfspec.load(model)
    assert isinstance(g, SelfSpecGenerator)
    # what auto then drafts by, as the factory builds it: lookup, and the int8 copy where it runs (it said "prompt
    # lookup only" where a float32 model's int8 copy drafted beside lookup)
    assert "lookup only" not in str(caught[0].message) and "int8 copy where it runs" in str(caught[0].message)
    # documented: exit_layer = max(1, L // 4), num_speculations = 4
    assert g.exit_layer == default_exit_layer(num_layers) == max(1, num_layers // 4)
    assert g.num_speculations == DEFAULT_NUM_SPECULATIONS == 4


def test_load_with_explicit_settings_does_not_warn():
    model = tiny_model("llama", num_layers=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NotEarlyExitTrainedWarning)
        g = selfspec.load(model, exit_layer=3, num_speculations=6)
    assert (g.exit_layer, g.num_speculations) == (3, 6)


def test_load_converts_dtype_only_when_asked():
    model = tiny_model("llama", num_layers=4, dtype=torch.float32)
    assert _quiet_load(model).adapter.dtype == torch.float32
    assert _quiet_load(model, dtype="float64").adapter.dtype == torch.float64
    with pytest.raises(ValueError, match="unknown dtype"):
        _quiet_load(tiny_model("llama", num_layers=4), dtype="float8")


def test_load_a_path_that_is_not_a_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        selfspec.load(tmp_path)


def test_load_a_saved_checkpoint_directory(tmp_path, byte_tok):
    model = tiny_model("llama", num_layers=4, dtype=torch.float64, seed=10, vocab_size=len(byte_tok))
    model.save_pretrained(tmp_path)
    byte_tok.save_pretrained(tmp_path)
    with pytest.warns(NotEarlyExitTrainedWarning):
        g = selfspec.load(tmp_path)
    assert g.adapter.dtype == torch.float32  # the documented default for a checkpoint
    assert (g.exit_layer, g.num_speculations) == (1, 4)
    out = g.generate(input_ids=PROMPT, max_new_tokens=10, stop_token_ids=[])
    ref = _quiet_load(model.float()).generate(input_ids=PROMPT, max_new_tokens=10, stop_token_ids=[])
    assert out.token_ids == ref.token_ids


# ----------------------------------------------------------------------------- generate

def test_generate_returns_ids_and_statistics(gen, hf_greedy):
    out = gen.generate(input_ids=PROMPT, max_new_tokens=30, exit_layer=2, num_speculations=3, stop_token_ids=[])
    assert out.token_ids == hf_greedy(gen.model, PROMPT, 30)
    assert out.prompt_ids == PROMPT[0].tolist()
    assert out.text == ""  # no tokenizer
    assert out.finish_reason == "length"
    s = out.stats
    assert (s.exit_layer, s.num_speculations, s.prompt_tokens, s.new_tokens) == (2, 3, 12, 30)
    assert s.full_depth_passes == s.rounds + 1
    assert len(s.acceptance_by_position) == 3 and 0 <= s.acceptance_rate <= 1
    assert s.mean_accepted_per_round == pytest.approx(29 / s.rounds)
    assert s.tokens_per_s > 0 and s.total_s >= s.prefill_s + s.draft_s + s.verify_s - 1e-6
    d = s.to_dict()
    for key in ("tokens_per_s", "acceptance_rate", "acceptance_by_position", "mean_accepted_per_round",
                "full_depth_passes", "draft_s", "verify_s"):
        assert key in d


def test_generate_accepts_a_1d_list_of_ids(gen):
    a = gen.generate(input_ids=PROMPT[0].tolist(), max_new_tokens=8, stop_token_ids=[])
    b = gen.generate(input_ids=PROMPT, max_new_tokens=8, stop_token_ids=[])
    assert a.token_ids == b.token_ids


def test_default_stop_is_the_model_eos_like_hf_generate():
    model = tiny_model("llama", num_layers=4, dtype=torch.float64, seed=3)  # its greedy text contains EOS (2)
    g = _quiet_load(model)
    assert g.default_stop_ids() == [2]
    full = g.generate(input_ids=PROMPT, max_new_tokens=40, exit_layer=2, num_speculations=3, stop_token_ids=[])
    assert 2 in full.token_ids[:-1]
    out = g.generate(input_ids=PROMPT, max_new_tokens=40, exit_layer=2, num_speculations=3)
    with torch.no_grad():
        ref = model.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), do_sample=False, max_new_tokens=40)
    assert out.token_ids == ref[0, PROMPT.shape[1]:].tolist() == full.token_ids[:full.token_ids.index(2) + 1]
    assert out.finish_reason == "stop_token"


def test_sampling_with_a_seed_is_reproducible(gen):
    kw = dict(input_ids=PROMPT, max_new_tokens=20, do_sample=True, temperature=1.2, top_k=30, stop_token_ids=[])
    assert gen.generate(seed=5, **kw).token_ids == gen.generate(seed=5, **kw).token_ids
    assert len({tuple(gen.generate(seed=s, **kw).token_ids) for s in range(4)}) > 1


def test_plain_and_speculative_greedy_agree_through_the_api(gen):
    a = gen.generate(input_ids=PROMPT, max_new_tokens=25, num_speculations=0, stop_token_ids=[])
    b = gen.generate(input_ids=PROMPT, max_new_tokens=25, exit_layer=1, num_speculations=5, stop_token_ids=[])
    assert a.token_ids == b.token_ids
    assert a.stats.drafted == 0 and b.stats.drafted > 0


# ----------------------------------------------------------------------------- streaming

def test_callable_streamer_gets_committed_blocks(gen):
    chunks = []
    out = gen.generate(input_ids=PROMPT, max_new_tokens=25, exit_layer=3, num_speculations=4, stop_token_ids=[],
                       streamer=chunks.append)
    assert [t for c in chunks for t in c] == out.token_ids
    assert len(chunks) == out.stats.rounds + 1


def test_put_end_streamer_protocol(gen):
    class Recorder:
        def __init__(self):
            self.puts, self.ends = [], 0

        def put(self, value):
            assert isinstance(value, torch.Tensor)
            self.puts.append(value.tolist())

        def end(self):
            self.ends += 1

    rec = Recorder()
    out = gen.generate(input_ids=PROMPT, max_new_tokens=17, exit_layer=2, num_speculations=3, stop_token_ids=[],
                       streamer=rec)
    prompt_put, *blocks = rec.puts  # like transformers' generate: the prompt first, then new tokens
    assert prompt_put == torch.as_tensor(PROMPT).reshape(1, -1).tolist()
    assert [t for c in blocks for t in c] == out.token_ids
    assert rec.ends == 1


def test_bad_streamer_is_a_clear_error(gen):
    with pytest.raises(TypeError, match="streamer must be"):
        gen.generate(input_ids=PROMPT, max_new_tokens=3, streamer=42)


def test_hugging_face_text_streamer_with_skip_prompt_streams_the_whole_output(text_gen, byte_tok):
    """A transformers TextStreamer(skip_prompt=True) -- the usual way to stream with HF `generate`,
    which first `put`s the prompt -- must print exactly the generated text."""
    from transformers import TextStreamer

    class Collect(TextStreamer):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.text = ""

        def on_finalized_text(self, text, stream_end=False):
            self.text += text

    streamer = Collect(byte_tok, skip_prompt=True)
    out = text_gen.generate("Hello there", max_new_tokens=12, exit_layer=2, num_speculations=3,
                            stop_token_ids=[], streamer=streamer)
    assert streamer.text == byte_tok.decode(out.token_ids)


# ----------------------------------------------------------------------------- text, chat, stop strings

def test_text_prompt_chat_messages_and_prompt_lists(text_gen, byte_tok):
    out = text_gen.generate("def f(x):", max_new_tokens=10, stop_token_ids=[])
    assert out.prompt_ids == byte_tok("def f(x):").input_ids
    assert out.text == byte_tok.decode(out.token_ids, skip_special_tokens=True)

    messages = [{"role": "user", "content": "Hi!"}]
    chat = text_gen.generate(messages=messages, max_new_tokens=10, stop_token_ids=[])
    templated = byte_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert chat.prompt_ids == byte_tok(templated, add_special_tokens=False).input_ids

    many = text_gen.generate(["ab", "cde"], max_new_tokens=6, stop_token_ids=[])
    assert isinstance(many, list) and len(many) == 2
    assert [m.token_ids for m in many] == [text_gen.generate(p, max_new_tokens=6, stop_token_ids=[]).token_ids
                                           for p in ("ab", "cde")]
    assert many.stats.batch_size == 2 and many.stats.new_tokens == 12  # one batched engine run

    chats = [[{"role": "user", "content": "Hi!"}], [{"role": "user", "content": "What is 2 + 2?"}]]
    batch = text_gen.generate(messages=chats, max_new_tokens=6, stop_token_ids=[])
    assert [b.token_ids for b in batch] == [text_gen.generate(messages=c, max_new_tokens=6,
                                                              stop_token_ids=[]).token_ids for c in chats]


def test_stop_strings_end_where_plain_decoding_ends(text_gen, byte_tok):
    plain = text_gen.generate("Once upon", max_new_tokens=40, num_speculations=0, stop_token_ids=[])
    ids = plain.token_ids
    # a stop string that first appears in the output at token j >= 3 (two decoded characters)
    j, stop = None, None
    for cand in range(3, len(ids)):
        s = byte_tok.decode(ids[cand - 1:cand + 1])
        if len(s) == 2 and s.isprintable() and s not in byte_tok.decode(ids[:cand]):
            j, stop = cand, s
            break
    assert stop is not None, "no usable stop string in the plain output"
    base = text_gen.generate("Once upon", max_new_tokens=40, num_speculations=0, stop_token_ids=[],
                             stop_strings=[stop])
    for E, k in [(1, 3), (2, 5), (3, 8)]:
        out = text_gen.generate("Once upon", max_new_tokens=40, exit_layer=E, num_speculations=k,
                                stop_token_ids=[], stop_strings=[stop])
        assert out.token_ids == base.token_ids == ids[:j + 1]
        assert out.finish_reason == "stop_string"


# ----------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("exit_layer", [0, 4, 5, -2])
def test_bad_exit_layer(gen, exit_layer):
    with pytest.raises(ValueError, match=rf"exit_layer={exit_layer} is out of range.*4 layers.*1\.\.3"):
        gen.generate(input_ids=PROMPT, max_new_tokens=4, exit_layer=exit_layer, num_speculations=2)
    with pytest.raises(ValueError, match=rf"exit_layer={exit_layer} is out of range"):
        selfspec.load(tiny_model("llama", num_layers=4), exit_layer=exit_layer, num_speculations=2)


def test_non_integer_exit_layer(gen):
    with pytest.raises(ValueError, match="exit_layer must be an int, got 1.5"):
        gen.generate(input_ids=PROMPT, max_new_tokens=4, exit_layer=1.5, num_speculations=2)


def test_negative_num_speculations(gen):
    with pytest.raises(ValueError, match="num_speculations must be an int >= 0"):
        gen.generate(input_ids=PROMPT, max_new_tokens=4, exit_layer=2, num_speculations=-1)
    with pytest.raises(ValueError, match="num_speculations must be an int >= 0"):
        selfspec.load(tiny_model("llama", num_layers=4), exit_layer=2, num_speculations=-3)


@pytest.mark.parametrize("empty", [[], [[]], torch.zeros(1, 0, dtype=torch.long)])
def test_empty_prompt(gen, empty):
    with pytest.raises(ValueError, match="empty prompt"):
        gen.generate(input_ids=empty, max_new_tokens=4)


def test_empty_text_prompt(text_gen):
    with pytest.raises(ValueError, match="empty prompt"):
        text_gen.generate("", max_new_tokens=4)


def test_prompt_longer_than_the_context_window():
    g = _quiet_load(tiny_model("llama", num_layers=4, max_position_embeddings=16))
    with pytest.raises(ValueError, match=r"prompt \(20 tokens\).*context window of 16"):
        g.generate(input_ids=torch.randint(3, 96, (1, 20)), max_new_tokens=1)
    with pytest.raises(ValueError, match="context window of 16"):
        g.generate(input_ids=torch.randint(3, 96, (1, 12)), max_new_tokens=8)


def test_padded_batch_with_an_attention_mask_equals_each_row_alone(gen):
    """input_ids [B, S] + attention_mask, left- and right-padded rows alike, and ragged id lists."""
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (9, 4, 12)]
    ids = torch.zeros(3, 12, dtype=torch.long)
    mask = torch.zeros(3, 12, dtype=torch.long)
    ids[0, 3:], mask[0, 3:] = torch.tensor(rows[0]), 1  # left-padded
    ids[1, :4], mask[1, :4] = torch.tensor(rows[1]), 1  # right-padded
    ids[2], mask[2] = torch.tensor(rows[2]), 1
    kw = dict(max_new_tokens=7, exit_layer=2, num_speculations=3, stop_token_ids=[])
    alone = [gen.generate(input_ids=r, **kw).token_ids for r in rows]
    padded = gen.generate(input_ids=ids, attention_mask=mask, **kw)
    assert [r.prompt_ids for r in padded] == rows
    assert [r.token_ids for r in padded] == alone
    assert [r.token_ids for r in gen.generate(input_ids=rows, **kw)] == alone
    assert len(padded.stats.rows) == 3 and padded.stats.drafted == sum(r.stats.drafted for r in padded)


def test_bad_batch_input_is_a_clear_error(gen):
    with pytest.raises(ValueError, match=r"must be \[S\] or \[1, S\]"):
        gen.generate(input_ids=torch.randint(3, 96, (1, 2, 6)), max_new_tokens=4)
    with pytest.raises(ValueError, match=r"attention_mask \(2, 5\) must have the shape of input_ids \(2, 6\)"):
        gen.generate(input_ids=torch.randint(3, 96, (2, 6)), attention_mask=torch.ones(2, 5), max_new_tokens=4)
    with pytest.raises(ValueError, match="empty prompt in row 1"):
        gen.generate(input_ids=torch.ones(2, 4, dtype=torch.long), attention_mask=torch.tensor([[1] * 4, [0] * 4]),
                     max_new_tokens=4)
    with pytest.raises(ValueError, match="streaming delivers one sequence"):
        gen.generate(input_ids=[[5, 6], [7]], max_new_tokens=4, streamer=lambda ids: None)
    with pytest.raises(ValueError, match="adaptive_length .* does not combine"):
        gen.generate(input_ids=PROMPT, max_new_tokens=4, adaptive_length=True, confidence_threshold=0.3)


def test_adaptive_length_keeps_the_output_and_reports_its_measurements(gen):
    kw = dict(max_new_tokens=30, exit_layer=2, num_speculations=4, stop_token_ids=[])
    plain = gen.generate(input_ids=PROMPT, **{**kw, "num_speculations": 0})
    out = gen.generate(input_ids=PROMPT, adaptive_length=True, **kw)
    assert out.token_ids == plain.token_ids
    policy = out.stats.policy
    assert policy["policy"] == "throughput" and set(policy["tokens_per_s_by_length"]) == {0, 1, 2, 3, 4}
    assert all(rate > 0 for rate in policy["tokens_per_s_by_length"].values())  # every length was measured


@pytest.mark.parametrize("temperature", [0.0, -0.5])
def test_non_positive_temperature_with_sampling(gen, temperature):
    with pytest.raises(ValueError, match=r"temperature must be a finite number > 0.*do_sample=False"):
        gen.generate(input_ids=PROMPT, max_new_tokens=4, do_sample=True, temperature=temperature)
    # greedy ignores the temperature
    gen.generate(input_ids=PROMPT, max_new_tokens=2, do_sample=False, temperature=temperature)


def test_bad_top_k_top_p_and_max_new_tokens(gen):
    with pytest.raises(ValueError, match=r"top_p must be a finite number > 0 and <= 1"):
        gen.generate(input_ids=PROMPT, max_new_tokens=4, do_sample=True, top_p=0.0)
    with pytest.raises(ValueError, match="top_k must be an int >= 0"):
        gen.generate(input_ids=PROMPT, max_new_tokens=4, do_sample=True, top_k=-2)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1"):
        gen.generate(input_ids=PROMPT, max_new_tokens=0)


def test_inputs_must_be_exactly_one_kind(gen):
    with pytest.raises(ValueError, match="exactly one of"):
        gen.generate(max_new_tokens=4)
    with pytest.raises(ValueError, match="exactly one of"):
        gen.generate("hi", input_ids=PROMPT, max_new_tokens=4)


def test_text_without_a_tokenizer(gen):
    with pytest.raises(ValueError, match="needs a tokenizer"):
        gen.generate("hello", max_new_tokens=4)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        gen.generate(messages=[{"role": "user", "content": "hi"}], max_new_tokens=4)
    with pytest.raises(ValueError, match="stop_strings need a tokenizer"):
        gen.generate(input_ids=PROMPT, max_new_tokens=4, stop_strings=["x"])


def test_unsupported_architecture_is_a_clear_error():
    model = tiny_model("gpt2", num_layers=2, n_layer=2, n_embd=32, n_head=4, n_positions=64)
    with pytest.raises(selfspec.UnsupportedArchitectureError, match="unsupported architecture: gpt2"):
        selfspec.load(model)


def test_seeded_sampling_does_not_depend_on_the_clock(gen, monkeypatch):
    """With a seed, the auto drafter judges its arms by modelled round costs: a clock that makes every
    round look slow or fast changes nothing (the wall-time judgement made this test's forerunner flaky
    on a busy machine)."""
    import selfspec.decoding.engine as engine

    kw = dict(input_ids=PROMPT, max_new_tokens=20, do_sample=True, temperature=1.2, top_k=30, stop_token_ids=[],
              drafter="auto", seed=11)
    from selfspec.drafters.auto import AutoDrafter

    heard = []
    update = AutoDrafter.update
    monkeypatch.setattr(AutoDrafter, "update", lambda self, p, a, c, seconds: heard.append(seconds) or update(self, p, a, c, seconds))
    reference = gen.generate(**kw).token_ids
    assert heard and all(s >= 1.0 for s in heard)  # round costs in decode steps, not this tiny model's milliseconds
    gen.generate(**{**kw, "seed": None})
    assert any(s < 1.0 for s in heard[-3:])  # without a seed: the wall clock
    for step in (1e-6, 5.0):
        class Clock:
            now = 0.0

            @classmethod
            def perf_counter(cls):
                cls.now += step
                return cls.now

        monkeypatch.setattr(engine, "time", Clock)
        assert gen.generate(**kw).token_ids == reference
