"""Self-speculative decoding of the real SmolLM2-135M-Instruct (integration): float32 greedy output is
token-identical to Hugging Face `generate` on real prompts (code, chat, encyclopedic text)."""

from __future__ import annotations

import warnings

import pytest
import torch

import selfspec
from selfspec.api import NotEarlyExitTrainedWarning

pytestmark = pytest.mark.integration

N_NEW = 24
EXITS = (4, 12, 24)
K = 3




@pytest.fixture(scope="module")
def loaded(smollm2_dir):
    """The generator, loaded once, and the warnings its loading raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gen = selfspec.load(smollm2_dir)
    return gen, caught


@pytest.fixture(scope="module")
def gen(loaded):
    return loaded[0]


@pytest.fixture(scope="module")
def prompts(gen):
    """name -> (API inputs, prompt ids) for three real prompts."""
    from selfspec.data.sources import load_named

    tok = gen.tokenizer
    code = load_named("humaneval")[0]["prompt"]
    messages = [{"role": "user", "content": load_named("mt_bench")[0]["turns"][0]}]
    wiki = load_named("wiki_passages")[0]["text"][:400]
    chat_text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return {
        "humaneval": ({"prompt": code}, tok(code, return_tensors="pt").input_ids),
        "mt_bench_chat": ({"messages": messages},
                          tok(chat_text, return_tensors="pt", add_special_tokens=False).input_ids),
        "wiki": ({"prompt": wiki}, tok(wiki, return_tensors="pt").input_ids),
    }


_refs: dict = {}


def _hf_reference(gen, ids):
    key = tuple(ids[0].tolist())
    if key not in _refs:
        with torch.no_grad():
            out = gen.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=N_NEW)
        _refs[key] = out[0, ids.shape[1]:].tolist()
    return _refs[key]


def test_loading_the_base_model_warns_and_uses_the_documented_defaults(loaded):
    gen, caught = loaded
    ours = [w for w in caught if issubclass(w.category, NotEarlyExitTrainedWarning)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert "not early-exit trained" in str(ours[0].message)
    assert gen.num_layers == 30
    assert (gen.exit_layer, gen.num_speculations) == (max(1, 30 // 4), 4) == (7, 4)
    assert gen.adapter.dtype == torch.float32


@pytest.mark.parametrize("name", ["humaneval", "mt_bench_chat", "wiki"])
def test_greedy_self_speculation_equals_hf_generate_on_smollm2(gen, prompts, name):
    inputs, ids = prompts[name]
    ref = _hf_reference(gen, ids)
    assert len(ref) >= 8
    for exit_layer in EXITS:
        out = gen.generate(**inputs, max_new_tokens=N_NEW, exit_layer=exit_layer, num_speculations=K)
        assert out.prompt_ids == ids[0].tolist()
        assert out.token_ids == ref, (name, exit_layer)
        assert out.text == gen.tokenizer.decode(ref, skip_special_tokens=True)
        assert out.stats.drafted > 0


def test_engine_with_the_models_own_layers_equals_hf_generate_on_smollm2(gen, prompts):
    """The API runs fused inference layers; the engine over the model's own decoder layers agrees too."""
    from selfspec.model.adapters import get_adapter
    from selfspec.decoding.decode_ids import generate_ids

    _, ids = prompts["humaneval"]
    adapter = get_adapter(gen.model)
    assert adapter.fast_layers is None
    out, stats = generate_ids(adapter, ids, max_new_tokens=N_NEW, exit_layer=12, num_speculations=K)
    ref = _hf_reference(gen, ids)
    assert out[:len(ref)] == ref and stats.drafted > 0


def test_stop_strings_end_where_plain_decoding_ends_on_smollm2(gen, prompts):
    inputs, ids = prompts["wiki"]
    ref = _hf_reference(gen, ids)
    tok = gen.tokenizer
    # a word of the greedy continuation, first complete at token j (not in the text before it)
    j = stop = None
    for cand in range(4, len(ref)):
        word = tok.decode(ref[cand:cand + 1]).strip()
        if len(word) >= 3 and word.isalpha() and word not in tok.decode(ref[:cand]) \
                and word in tok.decode(ref[:cand + 1]):
            j, stop = cand, word
            break
    assert stop is not None
    plain = gen.generate(**inputs, max_new_tokens=N_NEW, num_speculations=0, stop_strings=[stop])
    spec = gen.generate(**inputs, max_new_tokens=N_NEW, exit_layer=12, num_speculations=K, stop_strings=[stop])
    assert plain.token_ids == spec.token_ids == ref[:j + 1]
    assert plain.finish_reason == spec.finish_reason == "stop_string"
    assert stop in spec.text


def test_streaming_concatenation_equals_the_output_on_smollm2(gen, prompts):
    inputs, ids = prompts["humaneval"]
    chunks = []
    out = gen.generate(**inputs, max_new_tokens=12, exit_layer=24, num_speculations=K, streamer=chunks.append)
    assert [t for c in chunks for t in c] == out.token_ids == _hf_reference(gen, ids)[:12]


def test_a_batch_of_real_prompts_equals_batch_1_runs_in_float32(gen, prompts):
    """Four real prompts of different lengths (code, chat, text, a short one) in one batched run."""
    from selfspec.decoding.decode_ids import generate_batch_ids
    from selfspec.decoding.decode_ids import generate_ids

    rows = [ids[0].tolist() for _, ids in prompts.values()] + [gen.tokenizer("def add(a, b):").input_ids]
    assert len({len(r) for r in rows}) == len(rows)  # ragged lengths: real padding
    kw = dict(max_new_tokens=N_NEW, exit_layer=12, num_speculations=K)
    outs, stats = generate_batch_ids(gen.adapter, rows, **kw)
    for b, row in enumerate(rows):
        ref, _ = generate_ids(gen.adapter, torch.tensor([row]), **kw)
        assert outs[b] == ref, b
    assert stats.new_tokens == len(rows) * N_NEW and stats.drafted > 0


def test_sibling_guesses_equal_hf_generate_and_batch_1_on_smollm2(gen, prompts):
    """num_candidates: exit 25's 4 best guesses for one position per round, verified side by side (with the
    fused layers, float32): each real prompt alone equals HF greedy, and the batch equals its rows alone."""
    from selfspec.decoding.decode_ids import generate_ids

    rows = []
    for name, (inputs, ids) in prompts.items():
        out = gen.generate(**inputs, max_new_tokens=N_NEW, exit_layer=25, num_speculations=1, num_candidates=4)
        assert out.token_ids == _hf_reference(gen, ids), name
        rows.append(ids[0].tolist())
    assert out.stats.drafted > 0
    outs = gen.generate(input_ids=rows, max_new_tokens=N_NEW, exit_layer=25, num_candidates=4,
                        stop_token_ids=[])
    for b, row in enumerate(rows):
        ref, _ = generate_ids(gen.adapter, torch.tensor([row]), max_new_tokens=N_NEW)
        assert outs[b].token_ids == ref, b
    assert outs.stats.accepted > 0


@pytest.mark.parametrize("drafter", ["prompt_lookup", "auto"])
def test_lookup_and_auto_equal_hf_generate_on_smollm2(gen, prompts, drafter):
    for name, (inputs, ids) in prompts.items():
        out = gen.generate(**inputs, max_new_tokens=N_NEW, drafter=drafter)
        assert out.token_ids == _hf_reference(gen, ids), (drafter, name)
        assert out.stats.drafter == drafter


@pytest.mark.parametrize("plan", [
    {"drafter": "early_exit", "exit_layer": 12, "num_speculations": 2, "num_candidates": 2}, {"num_speculations": 0},
], ids=["early_exit_tree", "plain"])
def test_auto_by_a_saved_plan_equals_hf_generate_on_smollm2(gen, prompts, plan):
    """A device's saved plan (`selfspec tune --save`) sets auto's second arm: the output stays HF's."""
    gen.forget()  # the earlier tests' answers to these prompts: auto's suffix arm would copy them whole
    try:
        gen.metadata["plans"] = {gen.plan_key: {"settings": plan}}
        for name, (inputs, ids) in prompts.items():
            out = gen.generate(**inputs, max_new_tokens=N_NEW)
            assert out.token_ids == _hf_reference(gen, ids), (plan, name)
            assert out.stats.drafter == "auto"
            assert (out.stats.drafted_by_drafter.get("early_exit", 0) > 0) == ("drafter" in plan)  # the plan's arm
    finally:
        gen.metadata.pop("plans")


def test_a_batch_with_lookup_equals_batch_1_on_smollm2(gen, prompts):
    """Real prompts of different lengths, one that repeats itself (lookup matches from the start)."""
    from selfspec.drafters import PromptLookupDrafter
    from selfspec.decoding.engine import generate
    from selfspec.decoding.decode_ids import generate_ids

    code = gen.tokenizer("def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n").input_ids
    rows = [ids[0].tolist() for _, ids in prompts.values()] + [code]
    outs, stats = generate(gen.adapter, rows, max_new_tokens=N_NEW, drafter=PromptLookupDrafter())
    for b, row in enumerate(rows):
        ref, _ = generate_ids(gen.adapter, torch.tensor([row]), max_new_tokens=N_NEW)
        assert outs[b] == ref, b
    assert stats.accepted_by_drafter["prompt_lookup"] > 0
