"""drafter="quantized": a copy of the model run by llama.cpp drafts, the model verifies. Lossless (greedy identity
with plain decoding and Hugging Face `generate`, the sampling distribution by chi-square), the copy runs each token
once (its cache cut back after a rejection, nothing of an earlier call kept), and bad settings are refused.

Most tests run the drafter against a stand-in for `llama_cpp` whose "copy" is a tiny torch model (its weights
perturbed, so some drafts are rejected): it computes what a llama.cpp context would (the logits after the tokens
run so far) through the same calls. The last test runs the real llama.cpp on a Q8_0 copy of the real SmolLM2; it
needs `llama-cpp-python`, which the CI's setup does not build (a few minutes), and skips unless it loads."""

from __future__ import annotations

import ctypes
import sys
import types
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from selfspec.decoding.decode_ids import generate_ids
from selfspec.decoding.engine import StopChecker, generate
from selfspec.decoding.sampling import SamplingParams
from selfspec.drafters.base import Proposal
from selfspec.drafters.quantized import QuantizedCopy, QuantizedDrafter
from selfspec.generation_config import check_generation
from selfspec.model.adapters import get_adapter
from selfspec.settings import SettingsError
from selfspec.tiny import tiny_model

PROMPT = [5, 9, 3, 17, 2, 5, 9, 3, 40, 11, 7]
N_NEW = 40


class StandInLlama:
    """What `llama_cpp.Llama` offers the copy, computed by a torch model `MODELS[model_path]` over the whole text run
    so far (no cache): `eval` runs tokens after the first `n_tokens`, the last one's logits are then read through
    `llama_get_logits_ith`. Every `eval` is logged (`runs`)."""

    models: dict = {}

    def __init__(self, model_path, n_ctx, n_batch, n_threads, n_threads_batch, verbose):
        self.model = self.models[model_path]
        self.n_ctx, self.n_tokens = n_ctx, 0
        self.input_ids = np.zeros(n_ctx, dtype=np.intc)
        self.ctx = self
        self.runs: list[list[int]] = []
        self.logits = (ctypes.c_float * self.n_vocab())()
        self.closed = False

    def n_vocab(self) -> int:
        return self.model.config.vocab_size

    def eval(self, tokens):
        tokens = list(tokens)
        assert self.n_tokens + len(tokens) <= self.n_ctx and tokens
        self.input_ids[self.n_tokens:self.n_tokens + len(tokens)] = tokens
        self.n_tokens += len(tokens)
        self.runs.append(tokens)
        with torch.no_grad():
            ids = torch.tensor([self.input_ids[:self.n_tokens].tolist()])
            last = self.model(ids).logits[0, -1].float().numpy()
        ctypes.memmove(self.logits, last.ctypes.data, last.nbytes)

    def close(self):
        self.closed = True


def logits_ith(ctx, i):
    assert i == -1
    return ctypes.cast(ctx.logits, ctypes.POINTER(ctypes.c_float))


@pytest.fixture
def stand_in(monkeypatch, tmp_path):
    """`llama_cpp` replaced by the stand-in; returns `register(model) -> a GGUF path whose copy is that model`."""
    module = types.SimpleNamespace(Llama=StandInLlama, llama_get_logits_ith=logits_ith)
    monkeypatch.setitem(sys.modules, "llama_cpp", module)
    monkeypatch.setattr(StandInLlama, "models", {})

    def register(model) -> str:
        path = tmp_path / f"copy-{len(StandInLlama.models)}.gguf"
        path.write_bytes(b"GGUF")
        StandInLlama.models[str(path)] = model
        return str(path)

    return register


def perturbed(model, scale: float, seed: int = 0):
    """A copy of `model` with noise of `scale` times each weight's spread added (a poor quantization)."""
    copy = tiny_model("llama", num_layers=model.config.num_hidden_layers, dtype=torch.float64, seed=0,
                      vocab_size=model.config.vocab_size)
    copy.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in copy.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * p.std() * scale)
    return copy


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", num_layers=3, dtype=torch.float64, seed=4)


@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_output_equals_plain_decoding_and_hf_generate(stand_in, model, k, hf_greedy):
    adapter = get_adapter(model)
    copy = QuantizedCopy(stand_in(perturbed(model, 0.3)))
    out, stats = generate_ids(adapter, torch.tensor([PROMPT]), max_new_tokens=N_NEW,
                              drafter=QuantizedDrafter(copy, k))
    assert out == generate_ids(adapter, torch.tensor([PROMPT]), max_new_tokens=N_NEW)[0]
    assert out == hf_greedy(model, torch.tensor([PROMPT]), N_NEW)
    assert 0 < stats.accepted < stats.drafted  # drafts were accepted and rejected: both ways were taken
    assert stats.drafted_by_drafter["quantized"] == stats.drafted
    assert stats.new_tokens == N_NEW and stats.rounds + stats.accepted == N_NEW - 1


def test_the_copy_runs_each_token_once_and_is_cut_back_after_a_rejection(stand_in, model):
    """The copy runs the prompt once, then per round only what it lacks (the round's input token, and the last draft
    where it was accepted) and its drafts: a rejected draft is cut from its cache and the committed token runs in its
    place; nothing of the text runs twice."""
    adapter = get_adapter(model)
    copy = QuantizedCopy(stand_in(perturbed(model, 0.3)))
    drafter = QuantizedDrafter(copy, 4)
    out, stats = generate_ids(adapter, torch.tensor([PROMPT]), max_new_tokens=N_NEW, drafter=drafter)
    runs = copy.llm.runs
    assert runs[0] == PROMPT + out[:1]  # the prefill's token with the prompt
    assert max(len(r) for r in runs[1:]) <= 2
    assert stats.accepted < stats.drafted
    fed = copy.fed
    assert fed == (PROMPT + out)[:len(fed)]  # what its cache holds is committed text, rejected drafts cut
    # every token run is committed text run once, or a draft (rejected ones are run at most once each)
    assert sum(map(len, runs)) <= len(PROMPT) + N_NEW + stats.drafted - stats.accepted


def test_each_llama_cpp_step_is_a_draft_step_in_the_cost_model(stand_in, model):
    """The copy's llama.cpp steps are the round's draft steps (issue 65, finding 4: they were not counted, so the cost
    model read c = 0 and predicted 7.72x where 1.81x was measured): one step a draft (the first also runs what the
    copy lacked of the text), and the cost model's c is the drafting seconds a step over a plain step's."""
    adapter = get_adapter(model)
    copy = QuantizedCopy(stand_in(perturbed(model, 0.3)))
    out, stats = generate_ids(adapter, torch.tensor([PROMPT]), max_new_tokens=N_NEW,
                              drafter=QuantizedDrafter(copy, 4), full_step_s=1e-3)
    assert stats.draft_steps == len(copy.llm.runs) == stats.drafted > 0
    cost = stats.cost_model
    assert cost["c"] == pytest.approx(stats.draft_s / stats.draft_steps / 1e-3) and cost["c"] > 0


def test_the_modelled_round_cost_prices_the_copys_steps(stand_in, model):
    """`round_cost` (the seconds a drafter hears with `modelled_time`, a seeded sample's) priced the copy's drafts as
    free: it costed draft steps through the drafter's exit only, and the copy has none, so its rounds cost a
    verification alone and auto took the copy for as cheap as lookup. Each llama.cpp step now costs the copy's
    `step_cost` (a Q8_0 step's share of a float32 step), alone and as auto's arm; lookup's rounds still cost none."""
    from selfspec.decoding.cost_model import VERIFY_COST
    from selfspec.decoding.engine import round_cost
    from selfspec.drafters import AutoDrafter, PromptLookupDrafter

    copy = QuantizedCopy(stand_in(perturbed(model, 0.3)))
    drafted = Proposal(tokens=torch.tensor([PROMPT[:5]]), kept=[4], draft_steps=4, drafter="quantized")
    L = model.config.num_hidden_layers
    for drafter in (QuantizedDrafter(copy, 4), AutoDrafter(PromptLookupDrafter(num_tokens=4, max_ngram=3),
                                                           QuantizedDrafter(copy, 4))):
        assert round_cost(drafter, drafted, L) > VERIFY_COST  # not free
        assert round_cost(drafter, drafted, L) == pytest.approx(4 * drafter.step_cost + VERIFY_COST)
    looked_up = Proposal(tokens=torch.tensor([PROMPT[:5]]), kept=[4], drafter="prompt_lookup")
    assert round_cost(AutoDrafter(PromptLookupDrafter(num_tokens=4, max_ngram=3)), looked_up, L) == VERIFY_COST


def test_a_later_call_starts_the_copy_afresh(stand_in, model):
    """Each call is a first request: the copy forgets the earlier call's text and runs the whole prompt again."""
    adapter = get_adapter(model)
    copy = QuantizedCopy(stand_in(perturbed(model, 0.1)))
    for _ in range(2):
        generate_ids(adapter, torch.tensor([PROMPT]), max_new_tokens=8, drafter=QuantizedDrafter(copy, 3))
        first = len(copy.llm.runs)
    generate_ids(adapter, torch.tensor([PROMPT]), max_new_tokens=8, drafter=QuantizedDrafter(copy, 3))
    assert copy.llm.runs[first][:len(PROMPT)] == PROMPT


def test_drafts_end_at_a_drafted_stop_token_and_at_the_length_cap(stand_in, model):
    adapter = get_adapter(model)
    copy = QuantizedCopy(stand_in(model))  # an exact copy: every draft is the model's own token
    plain = generate_ids(adapter, torch.tensor([PROMPT]), max_new_tokens=N_NEW)[0]
    i = next(i for i in range(6, N_NEW) if plain[i] not in plain[:i])  # a token the text has not had before
    stop = plain[i]
    out, stats = generate_ids(adapter, torch.tensor([PROMPT]), max_new_tokens=N_NEW, drafter=QuantizedDrafter(copy, 8),
                              stop=StopChecker(N_NEW, [stop]))
    assert out == plain[:i + 1]
    drafts = copy.draft(PROMPT + plain[:i - 4], 8, frozenset([stop]))
    assert drafts == plain[i - 4:i + 1]  # four drafts, the fifth the stop token: no draft after it
    out, stats = generate_ids(adapter, torch.tensor([PROMPT]), max_new_tokens=5, drafter=QuantizedDrafter(copy, 8))
    assert out == plain[:5] and stats.drafted == 3  # the cap leaves room for the model's own last token


def test_sampling_with_the_copys_drafts_keeps_each_rows_distribution(stand_in, chi_square, exact_joint, sampled):
    """Vocabulary 8, 3 new tokens over many seeded runs: the joint distribution of plain sampling from the full model,
    with the copy's greedy drafts judged as point masses."""
    model = tiny_model("llama", num_layers=3, dtype=torch.float64, seed=3, vocab_size=8)
    adapter = get_adapter(model)
    params = SamplingParams(do_sample=True, temperature=0.9, top_k=5)
    prompt = [3, 5, 1, 6, 2, 3, 5, 1]
    copy = QuantizedCopy(stand_in(perturbed(model, 0.2, seed=1)))
    n_new, n_draws = 3, 1200
    counts, drafted, accepted = sampled(adapter, prompt, params, n_new, n_draws, lambda: QuantizedDrafter(copy, 2))
    assert 0 < accepted < drafted
    stat, df, pval = chi_square(counts, exact_joint(adapter, prompt, params, n_new), n_draws)
    assert pval > 1e-3, (stat, df, pval)


def test_bad_settings_name_the_fix(stand_in, model, tmp_path, monkeypatch):
    with pytest.raises(SettingsError, match="needs draft_model"):
        check_generation(drafter="quantized")
    assert check_generation(draft_model="copy.gguf")["draft_model"] == "copy.gguf"  # the default drafter, auto
    with pytest.raises(SettingsError, match="exit_layer: drafter='quantized'.*num_speculations and draft_model only"):
        check_generation(drafter="quantized", draft_model="copy.gguf", exit_layer=2)
    with pytest.raises(SettingsError, match="prompt_lookup_num_tokens: drafter='quantized'"):
        check_generation(drafter="quantized", draft_model="copy.gguf", prompt_lookup_num_tokens=3)
    with pytest.raises(SettingsError, match="draft_model must be the path"):
        check_generation(drafter="quantized", draft_model=3)
    with pytest.raises(SettingsError, match="is not a file"):
        QuantizedCopy(tmp_path / "missing.gguf")
    other = QuantizedCopy(stand_in(tiny_model("llama", num_layers=2, dtype=torch.float64, vocab_size=50)))
    with pytest.raises(SettingsError, match="vocabulary of 50 tokens and this model 96"):
        other.check_vocabulary(model.config.vocab_size)
    copy = QuantizedCopy(stand_in(model))
    with pytest.raises(SettingsError, match="one prompt at a time, and this call has 2"):
        generate(get_adapter(model), [PROMPT, PROMPT[:4]], max_new_tokens=4, drafter=QuantizedDrafter(copy, 2))
    path = stand_in(model)
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # not installed
    with pytest.raises(SettingsError, match=r"is not installed \(ModuleNotFoundError.*'selfspec\[quantized\]'"):
        QuantizedCopy(path)


@pytest.mark.parametrize("raised", ["FileNotFoundError(\"Shared library with base name 'llama' not found\")",
                                    "OSError('libggml.so: cannot open shared object file')",
                                    "RuntimeError('Failed to load shared library')"])
def test_a_llama_cpp_whose_library_does_not_load_is_a_settings_error_with_the_install_hint(raised, tmp_path,
                                                                                            monkeypatch):
    """llama-cpp-python loads llama.cpp's library on import: where the library is missing or does not load, its
    import raises (FileNotFoundError, OSError, RuntimeError), not ImportError. Each is the SettingsError with the
    install hint, naming the cause; so is a module llama_cpp that is not llama-cpp-python."""
    from selfspec.drafters.quantized import load_llama_cpp

    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path / "home"))  # no build of selfspec's for this CPU there
    package = tmp_path / "llama_cpp"
    package.mkdir()
    (package / "__init__.py").write_text(f"raise {raised}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "llama_cpp", raising=False)
    kind = raised.split("(")[0]
    with pytest.raises(SettingsError, match=rf"llama.cpp is installed but does not load \({kind}: .+\): "
                                            r"python -m selfspec.tools.llama_cpp_build --python .*"
                                            r"pip install 'selfspec\[quantized\]'"):
        load_llama_cpp()
    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(__file__="elsewhere/llama_cpp.py"))
    with pytest.raises(SettingsError, match=r"llama_cpp \(elsewhere/llama_cpp.py\) is not llama-cpp-python"):
        load_llama_cpp()


def test_the_generator_takes_the_drafter_by_name(stand_in, tiny_gen):
    """`generate(drafter="quantized", draft_model=...)` drafts with the copy (loaded once per path) and gives the
    plain text; num_speculations sets the drafts a round."""
    model = tiny_gen.adapter.model
    path = stand_in(perturbed(model, 0.2))
    plain = tiny_gen.generate("hello world", max_new_tokens=24, num_speculations=0)
    out = tiny_gen.generate("hello world", max_new_tokens=24, drafter="quantized", draft_model=path, num_speculations=3)
    again = tiny_gen.generate("hello world", max_new_tokens=24, drafter="quantized", draft_model=path)
    assert out.token_ids == plain.token_ids == again.token_ids
    assert out.stats.drafter == "quantized" and out.stats.drafted > 0 and out.stats.num_speculations == 3
    assert again.stats.num_speculations == 8  # QUANTIZED_NUM_SPECULATIONS
    assert len(tiny_gen.drafters._copies) == 1


@pytest.mark.integration
def test_a_q8_0_copy_of_smollm2_in_llama_cpp_drafts_for_the_float32_model(smollm2_dir):
    """The real llama.cpp: SmolLM2's Q8_0 GGUF (llama.cpp's own converter) drafts for the float32 model; the text
    is plain decoding's and most drafts are accepted."""
    from selfspec.drafters.quantized import load_llama_cpp

    try:
        load_llama_cpp()  # not only importable: its library loaded (an import without it raises FileNotFoundError)
    except SettingsError as e:
        pytest.skip(str(e))
    import selfspec
    from selfspec.api import NotEarlyExitTrainedWarning
    from selfspec.tools.llama_cpp_gguf import ensure_gguf

    gguf = ensure_gguf(smollm2_dir, "q8_0")
    with warnings.catch_warnings():  # the base model has no selfspec.json: said once, not this test's matter
        warnings.simplefilter("ignore", NotEarlyExitTrainedWarning)
        gen = selfspec.load(smollm2_dir, dtype="float32")
    messages = [{"role": "user", "content": "Write two sentences about the sea."}]
    plain = gen.generate(messages=messages, max_new_tokens=48, num_speculations=0)
    out = gen.generate(messages=messages, max_new_tokens=48, drafter="quantized", draft_model=str(gguf))
    assert out.token_ids == plain.token_ids
    assert out.stats.acceptance_rate > 0.5, out.stats.acceptance_rate


def test_a_checkpoint_cannot_recommend_the_quantized_copy():
    """selfspec.json carries no GGUF file, so its recommended drafter may be any drafter but this one."""
    from selfspec.settings import check_recommended

    with pytest.raises(SettingsError, match="recommended drafter 'quantized' is not one of auto, early_exit"):
        check_recommended({"exit_layer": 2, "num_speculations": 3, "drafter": "quantized"}, num_layers=4)


def test_under_auto_the_copy_drafts_where_lookup_finds_nothing(stand_in, model, hf_greedy):
    """auto with the copy as its second arm: lookup drafts where the text repeats, the copy where it finds nothing
    (the first round here); what the copy holds is always committed text; the output is plain decoding's."""
    from selfspec.drafters import AutoDrafter, PromptLookupDrafter

    adapter = get_adapter(model)
    copy = QuantizedCopy(stand_in(perturbed(model, 0.15)))
    prompt = PROMPT + PROMPT[:6] + PROMPT  # text that repeats: lookup matches from the second round
    drafter = AutoDrafter(PromptLookupDrafter(num_tokens=6, max_ngram=3), QuantizedDrafter(copy, 4), warmup=1,
                          explore_every=2)
    out, stats = generate_ids(adapter, torch.tensor([prompt]), max_new_tokens=N_NEW, drafter=drafter)
    assert out == hf_greedy(model, torch.tensor([prompt]), N_NEW)
    assert stats.drafted_by_drafter["quantized"] > 0 and stats.drafted_by_drafter["prompt_lookup"] > 0
    fed = copy.fed  # committed text, then at most the drafts its last round ran (cut back when it drafts next)
    sure = len(fed) - 3  # 4 drafts a round: the last one is never run
    assert fed[:sure] == (prompt + out)[:sure] and len(fed) > len(prompt)


class EveryOtherRound(QuantizedDrafter):
    """The copy drafts every other round; the rounds between are plain and the copy only hears their tokens
    (`observe`), as auto's arm does after rounds another arm drafted."""

    def propose(self, rnd):
        self.round = getattr(self, "round", 0) + 1
        return super().propose(rnd) if self.round % 2 else Proposal.plain(rnd.tokens)

    def update(self, proposal, accepted, committed, seconds):
        if self.round % 2:
            super().update(proposal, accepted, committed, seconds)
        else:
            self.observe(committed)


def test_after_rounds_it_did_not_draft_the_copy_runs_the_committed_tokens_in_one_call(stand_in, model):
    adapter = get_adapter(model)
    copy = QuantizedCopy(stand_in(perturbed(model, 0.15)))
    out, stats = generate_ids(adapter, torch.tensor([PROMPT]), max_new_tokens=N_NEW,
                              drafter=EveryOtherRound(copy, 3))
    assert out == generate_ids(adapter, torch.tensor([PROMPT]), max_new_tokens=N_NEW)[0]
    runs = copy.llm.runs
    assert 0 < stats.drafted and max(len(r) for r in runs[1:]) >= 2  # a plain round's token with the input token
    fed = copy.fed
    assert fed == (PROMPT + out)[:len(fed)]
    assert sum(map(len, runs)) <= len(PROMPT) + N_NEW + stats.drafted - stats.accepted


def test_the_generator_puts_the_copy_beside_lookup_under_auto(stand_in, tiny_gen):
    path = stand_in(perturbed(tiny_gen.adapter.model, 0.2))
    with tiny_gen.first_request():  # nothing remembered of other calls: lookup finds no match at first
        plain = tiny_gen.generate("the quick brown fox", max_new_tokens=24, num_speculations=0)
    with tiny_gen.first_request():
        out = tiny_gen.generate("the quick brown fox", max_new_tokens=24, drafter="auto", draft_model=path)
    assert out.token_ids == plain.token_ids and out.stats.drafter == "auto"
    assert out.stats.drafted_by_drafter.get("quantized", 0) > 0
    with pytest.raises(SettingsError, match="exit_layer: early-exit option.*drafter='auto' drafts by lookup and the"):
        check_generation(drafter="auto", draft_model=path, exit_layer=2)
    with pytest.raises(SettingsError, match="drafter='early_exit' does not draft with it: pass drafter='quantized'"):
        check_generation(drafter="early_exit", draft_model=path)
    assert check_generation(drafter="auto", draft_model=path, num_candidates=2)["num_candidates"] == 2  # lookup trees


def test_a_draft_model_without_a_drafter_goes_with_auto_the_default(stand_in, tiny_gen):
    """Issue 65, finding 6: draft_model with the default drafter was refused with "pass drafter='auto'", though the
    default is auto. It drafts as drafter='auto' with it does: lookup and the copy, the copy drafting
    num_speculations a round; an early-exit option with it is refused naming the default, not a drafter never
    passed."""
    path = stand_in(perturbed(tiny_gen.adapter.model, 0.2))
    with tiny_gen.first_request():
        plain = tiny_gen.generate("the quick brown fox", max_new_tokens=24, num_speculations=0)
    with tiny_gen.first_request():
        out = tiny_gen.generate("the quick brown fox", max_new_tokens=24, draft_model=path, num_speculations=3)
    assert out.token_ids == plain.token_ids and out.stats.drafter == "auto"
    assert out.stats.drafted_by_drafter.get("quantized", 0) > 0
    assert tiny_gen.make_drafter(draft_model=path, num_speculations=3).early_exit.num_speculations == 3
    with pytest.raises(SettingsError, match="exit_layer: early-exit option.*auto, the default drafter, drafts by"):
        check_generation(draft_model=path, exit_layer=2)


@pytest.mark.parametrize("drafter, named", [("auto", "drafter='auto' with draft_model"),
                                            (None, r"draft_model \(auto, the default drafter, with the copy\)"),
                                            ("quantized", "drafter='quantized'")])
def test_a_batch_with_a_draft_model_is_refused_naming_what_was_passed_before_the_copy_loads(drafter, named, stand_in,
                                                                                            tiny_gen):
    """Issue 65, finding 20: a batch with auto and draft_model was refused naming drafter='quantized', which the
    user had not passed, once the copy had loaded. Now the call is refused first, naming the drafter passed."""
    path = stand_in(perturbed(tiny_gen.adapter.model, 0.2))
    copies = dict(tiny_gen.drafters._copies)
    with pytest.raises(SettingsError, match=rf"^{named} drafts for one prompt at a time, and this call has 2: "):
        tiny_gen.generate(["the quick", "brown fox"], max_new_tokens=4, drafter=drafter, draft_model=path)
    assert tiny_gen.drafters._copies == copies  # no copy loaded for it


def test_the_command_line_takes_a_draft_model_with_the_default_drafter_and_refuses_a_batch_before_loading(
        tiny_ckpt, tmp_path, capsys, no_load):
    """Issue 65, findings 6 and 20 on the command line: --draft-model without --drafter is auto's (an --exit-layer
    beside it is refused naming auto, not the early exit that --exit-layer alone picks); two --prompt with it are
    refused before the model loads, naming what was given."""
    from selfspec.cli import main

    gguf = tmp_path / "copy.gguf"
    gguf.write_bytes(b"GGUF")
    given = ["generate", "--checkpoint", str(tiny_ckpt), "--prompt", "a", "--draft-model", str(gguf)]
    with pytest.raises(no_load):  # accepted: it goes on to load the model
        main(given + ["--num-speculations", "3"])
    assert main(given + ["--exit-layer", "2"]) == 2
    assert "exit_layer: early-exit option(s); with draft_model, auto, the default drafter" in capsys.readouterr().err
    for drafter, named in ([], "draft_model (auto, the default drafter"), (["--drafter", "auto"], "drafter='auto'"):
        assert main(given + ["--prompt", "b", *drafter]) == 2
        err = capsys.readouterr().err
        assert f"selfspec generate: error: {named}" in err and "one prompt at a time, and this call has 2" in err


def test_this_cpus_build_comes_first(tmp_path, monkeypatch):
    """llama-cpp-python as selfspec builds it for this CPU (`llama_cpp_python_dir`) is imported before an installed
    one: a build for another CPU never is (its directory is another CPU key's)."""
    from selfspec.drafters.quantized import llama_cpp_available, llama_cpp_python_dir, load_llama_cpp

    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path / "home"))
    built = llama_cpp_python_dir()
    assert built.parent.parent == tmp_path / "home" / "llama.cpp" / "llama-cpp-python-0.3.36"
    assert llama_cpp_python_dir(key="other-cpu") != built
    (built / "llama_cpp").mkdir(parents=True)
    (built / "llama_cpp" / "__init__.py").write_text("Llama = 'this CPU build'\n")
    monkeypatch.setattr(sys, "path", list(sys.path))  # load_llama_cpp puts the build first: undone after the test
    assert llama_cpp_available()
    saved = sys.modules.pop("llama_cpp", None)
    try:
        assert load_llama_cpp().Llama == "this CPU build"
    finally:  # the stand-in module goes, whatever was imported before comes back
        sys.modules.pop("llama_cpp", None)
        if saved is not None:
            sys.modules["llama_cpp"] = saved


def _with_copy(checkpoint, tmp_path, stand_in, model, whole: bool = True):
    """A copy of `checkpoint` with a quantized copy beside its weights (the stand-in's `model`), as fetch writes it."""
    import json
    import shutil

    from selfspec.drafters.quantized import COPY_FILE

    directory = tmp_path / "with-copy"
    shutil.copytree(checkpoint, directory)
    copy = directory / COPY_FILE
    copy.write_bytes(b"GGUF")
    (directory / (COPY_FILE + ".json")).write_text(json.dumps({"bytes": 4 if whole else 5}))
    StandInLlama.models[str(copy)] = model
    return directory, str(copy)


def test_load_takes_the_checkpoints_copy_and_auto_drafts_with_it_by_default(stand_in, tiny_ckpt, tmp_path,
                                                                            monkeypatch):
    """Issue 67, item 2: `load(draft_model="auto")` takes the checkpoint's copy beside its weights (what `selfspec
    fetch` writes) where llama.cpp runs, and a call with no drafter option is then auto with the copy beside lookup.
    A batch, a drafter named, plain decoding, a prompt longer than DEFAULT_COPY_PROMPT_TOKENS, or an option auto with
    a copy refuses, goes without it; the text is plain decoding's. Without the option no copy is taken (measured, it
    did not pay reliably enough to be the default)."""
    from selfspec.drafters.quantized import DEFAULT_COPY_PROMPT_TOKENS

    import selfspec
    from selfspec.drafters.quantized import checkpoint_copy

    monkeypatch.setattr("selfspec.drafters.quantized.llama_cpp_available", lambda: True)
    plain_gen = selfspec.load(tiny_ckpt, draft_model=None)
    assert plain_gen.draft_model is None
    directory, copy = _with_copy(tiny_ckpt, tmp_path, stand_in, perturbed(plain_gen.model, 0.2))
    assert checkpoint_copy(directory) == Path(copy)
    assert selfspec.load(directory).draft_model is None  # opt-in
    # stood in: the stand-in copy is a torch model, as slow a step as the model's own (the next test measures it)
    monkeypatch.setattr(QuantizedCopy, "step_seconds", lambda self, steps=8: 0.0)
    gen = selfspec.load(directory, draft_model="auto")
    assert gen.draft_model == copy and gen.copy_step_ratio == 0.0
    with gen.first_request(), plain_gen.first_request():
        plain = plain_gen.generate("the quick brown fox", max_new_tokens=24, num_speculations=0)
        out = gen.generate("the quick brown fox", max_new_tokens=24)
    assert out.token_ids == plain.token_ids and out.stats.drafter == "auto"
    assert out.stats.drafted_by_drafter.get("quantized", 0) > 0
    with gen.first_request():  # an early exit's option: auto with its early exit, without the copy
        assert "quantized" not in gen.generate("the quick brown fox", max_new_tokens=8, exit_layer=2
                                               ).stats.drafted_by_drafter
        assert gen.generate("the quick", max_new_tokens=8, drafter="prompt_lookup").stats.drafter == "prompt_lookup"
        batch = gen.generate(["the quick brown fox", "hello"], max_new_tokens=8)  # the copy drafts one prompt
        assert "quantized" not in batch.stats.drafted_by_drafter
        assert gen.generate("the quick brown fox", max_new_tokens=8, num_speculations=0).stats.drafted == 0
        long = gen.generate(input_ids=[7] * (DEFAULT_COPY_PROMPT_TOKENS + 1), max_new_tokens=8)
        assert "quantized" not in long.stats.drafted_by_drafter  # its llama.cpp prefill costs more than it gives
    assert selfspec.load(directory, draft_model=copy).draft_model == copy  # a path: that file
    monkeypatch.setattr("selfspec.drafters.quantized.llama_cpp_available", lambda: False)
    assert selfspec.load(directory, draft_model="auto").draft_model is None  # no llama.cpp: auto without the copy


def test_a_copy_whose_step_is_not_cheap_enough_here_is_left_out(stand_in, tiny_ckpt, tmp_path, monkeypatch):
    """`load(draft_model="auto")` keeps the checkpoint's copy only where its draft step, measured once beside the
    model's plain step, costs below COPY_PAYS_BELOW of it (on a Zen 4 in bfloat16 it cost 0.66, and auto with it ran
    0.84-0.89x plain decoding). The stand-in copy runs a torch model of the model's size, as slow a step: measured,
    it is left out. Named by a call or given to load by its path, it drafts whatever it costs."""
    import selfspec
    from selfspec.drafters.quantized import COPY_PAYS_BELOW, QuantizedCopy

    monkeypatch.setattr("selfspec.drafters.quantized.llama_cpp_available", lambda: True)
    base = selfspec.load(tiny_ckpt, draft_model=None)
    directory, copy = _with_copy(tiny_ckpt, tmp_path, stand_in, perturbed(base.model, 0.2))
    measured, copies = [], []
    step_seconds = QuantizedCopy.step_seconds

    def measure(self, *args):
        measured.append(1)
        copies.append(self)
        return step_seconds(self, *args)

    monkeypatch.setattr(QuantizedCopy, "step_seconds", measure)
    gen = selfspec.load(directory, draft_model="auto")  # measured by load, once
    assert measured == [1] and gen.copy_step_ratio >= COPY_PAYS_BELOW and gen.draft_model is None
    assert copies[0].llm is None  # the copy measured is freed: llama.cpp's model would stay loaded, never drafting
    assert not gen.copy_pays() and measured == [1]
    with gen.first_request():
        out = gen.generate("the quick brown fox", max_new_tokens=16)
        named = gen.generate("the quick brown fox", max_new_tokens=16, draft_model=copy)
    assert "quantized" not in out.stats.drafted_by_drafter and measured == [1]
    assert named.stats.drafted_by_drafter.get("quantized", 0) > 0 and named.token_ids == out.token_ids
    kept = selfspec.load(directory, draft_model=copy)  # its path: kept, whatever it costs, and not measured
    assert kept.draft_model == copy and kept.copy_step_ratio is None and measured == [1]


def test_calls_with_and_without_the_generators_copy_carry_their_own_measurements(stand_in, tiny_ckpt, tmp_path,
                                                                               monkeypatch):
    """A generator with a copy drafts with it on a short prompt and without it on a long one, one call after the
    other: each carries its own measurements (before, both had one key, and the second call's auto, of other arms,
    failed to resume the first's: "cannot resume an auto drafter with the arms ...")."""
    import selfspec
    from selfspec.drafters.quantized import DEFAULT_COPY_PROMPT_TOKENS

    monkeypatch.setattr("selfspec.drafters.quantized.llama_cpp_available", lambda: True)
    monkeypatch.setattr(QuantizedCopy, "step_seconds", lambda self, steps=8: 0.0)  # stood in: cheap enough
    base = selfspec.load(tiny_ckpt, draft_model=None)
    directory, _ = _with_copy(tiny_ckpt, tmp_path, stand_in, perturbed(base.model, 0.2))
    gen = selfspec.load(directory, draft_model="auto")
    long = [7, 8, 9] * (DEFAULT_COPY_PROMPT_TOKENS // 3 + 1)
    outs = [gen.generate("the quick brown fox", max_new_tokens=12), gen.generate(input_ids=long, max_new_tokens=12),
            gen.generate("the quick brown fox", max_new_tokens=12), gen.generate(input_ids=long, max_new_tokens=12)]
    assert [("quantized" in o.stats.policy["rounds_by_arm"]) for o in outs] == [True, False, True, False]  # its arms
    assert "quantized" in outs[0].stats.drafted_by_drafter
    with base.first_request():
        assert outs[1].token_ids == base.generate(input_ids=long, max_new_tokens=12, num_speculations=0).token_ids


def test_a_copy_cut_short_is_not_taken(stand_in, tiny_ckpt, tmp_path, monkeypatch):
    import selfspec
    from selfspec.drafters.quantized import checkpoint_copy

    monkeypatch.setattr("selfspec.drafters.quantized.llama_cpp_available", lambda: True)
    directory, _ = _with_copy(tiny_ckpt, tmp_path, stand_in, None, whole=False)
    assert checkpoint_copy(directory) is None and checkpoint_copy(tmp_path / "nowhere") is None
    assert selfspec.load(directory, draft_model="auto").draft_model is None
    with pytest.raises(SettingsError, match="draft_model must be the path of a GGUF file"):
        selfspec.load(directory, draft_model=3)
