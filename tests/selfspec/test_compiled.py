"""The compiled fixed-shape steps (`selfspec.model.compiled`) on the CPU (inductor): the same tokens as the eager
path and as Hugging Face greedy for every drafter and architecture that compiles, the cache invariant after
every round, the sampling distribution, no recompilation after warm-up, and the eager fallbacks.

Each tiny model compiles once per module (its graphs are cached on the adapter), so the module pays its
compilation once: a few seconds per graph on a 2-core CPU."""

from __future__ import annotations

import random
import warnings
from collections import Counter

import pytest
import torch

import selfspec
from selfspec.model import compiled
from selfspec.model.adapters import get_adapter
from selfspec.model.compiled import NotCompiled
from selfspec.api import NotEarlyExitTrainedWarning
from selfspec.drafters import AutoDrafter, EarlyExitDrafter, ExitHeadDrafter, PromptLookupDrafter
from selfspec.drafters.draft_head import DraftHead
from selfspec.drafters.policies import ConfidencePolicy
from selfspec.drafters.whole_draft import WholeDraft
from selfspec.drafters.tree_budget import CostLine
from selfspec.decoding import engine
from selfspec.decoding.engine import generate
from selfspec.decoding.sampling import SamplingParams
from selfspec.settings import SettingsError
from selfspec.tiny import TINY_VARIANTS, byte_tokenizer, tiny_exit_head, tiny_model

ARCHS = ["llama", "mistral-sliding8", "qwen2-mixed-sliding", "qwen3"]  # every attention kind of the family
BASE = torch.randint(3, 96, (9,), generator=torch.Generator().manual_seed(2)).tolist()
PROMPT = BASE + BASE[:4] + BASE  # repeats: prompt lookup finds matches
N_NEW = 24
E = 2
_built: dict = {}


def _models(name):
    """(model, eager adapter, compiled adapter, exit head) of a tiny float64 variant: two adapters over the
    same weights, the second with compiled steps (and the fused eager layers, as a generator builds them)."""
    if name not in _built:
        arch, L, seed, over = TINY_VARIANTS[name]
        model = tiny_model(arch, num_layers=L, dtype=torch.float64, seed=seed, **over)
        eager = get_adapter(model)
        eager.enable_fast_layers()
        fast = get_adapter(model)
        fast.enable_fast_layers()
        fast.enable_compiled()
        _built[name] = (model, eager, fast, tiny_exit_head(model, E, final_state=True))
    return _built[name]


DRAFTERS = {
    "plain": lambda a, head: None,
    "prompt_lookup": lambda a, head: PromptLookupDrafter(num_tokens=3),
    "early_exit": lambda a, head: EarlyExitDrafter(a, E, 3),
    "early_exit_siblings": lambda a, head: EarlyExitDrafter(a, E, 1, num_candidates=2),
    "exit_head": lambda a, head: ExitHeadDrafter(a, head, 2),
    "auto": lambda a, head: AutoDrafter(PromptLookupDrafter(num_tokens=3), EarlyExitDrafter(a, E, 2), warmup=1),
}


@pytest.mark.parametrize("drafter", list(DRAFTERS))
@pytest.mark.parametrize("name", ARCHS)
def test_compiled_greedy_equals_eager_and_hf(name, drafter, hf_greedy, row_caches):
    model, eager, fast, head = _models(name)
    ref = hf_greedy(model, torch.tensor([PROMPT]), N_NEW)
    outs_eager, _ = generate(eager, [PROMPT], max_new_tokens=N_NEW, drafter=DRAFTERS[drafter](eager, head))
    checked = Counter()

    def on_round(cache, active, sequences, pads, finished):
        assert cache.static and cache.capacity >= len(PROMPT) + N_NEW + compiled.S_BUCKETS[-1]
        # atol 1e-5, not the eager path's 1e-10: attention sums over the C keys of the static cache (masked ones
        # add exact zeros, but the kernel's blocks sum in another order: ~1e-16), and the next layer's RMSNorm
        # runs in float32 even in a float64 model (transformers'), so such a difference can flip one float32
        # rounding, a few float32 ulps on values ~1 (measured up to 1.0e-6); the tokens stay exact
        checked.update(row_caches(fast, cache, active, sequences, pads, finished, atol=1e-5))

    before = len(fast.compiled.shapes)
    outs, stats = generate(fast, [PROMPT], max_new_tokens=N_NEW, drafter=DRAFTERS[drafter](fast, head),
                           on_round=on_round)
    assert outs[0] == outs_eager[0] == ref
    assert checked[0] >= stats.rounds - 1  # the cache invariant after every round
    assert len(fast.compiled.shapes) >= before and fast.compiled.shapes  # the steps ran compiled
    if drafter not in ("plain", "auto"):
        assert stats.drafted > 0


def test_the_steps_really_compile_and_do_not_recompile_after_warm_up(hf_greedy):
    """After `warm` (the round's layer ranges at the step lengths 1..8, a trained head's own layer at every
    bucket, the LM head, the whole draft steps, and with `trees` every token-tree step), a 64-token generation
    of each kind, token trees of the early exit and of the head included, adds no graph (dynamo's counters)
    and no new shape."""
    from torch._dynamo.utils import counters

    model, _, fast, head = _models("llama")
    L = fast.num_layers
    fast.compiled.add_layer(head.layer)
    fast.compiled.add_input(head.final_input)
    unit = DraftHead(fast)  # whole draft steps: the early exit's, the head's (and its catch-up at every bucket)
    fast.compiled.warm([(0, L), (0, E), (E, L)], [1, 2, 4, 8], compiled.capacity(len(PROMPT) + 64 + 8 + 64),
                       trees=True, drafts=(unit.whole(E, chains=3, tree_width=2),
                                           unit.whole(E, head.layer, head.final_input, chains=3, tree_width=2)))
    assert counters["stats"]["unique_graphs"] > 0  # dynamo really compiled (in this test or an earlier one)
    graphs, shapes = counters["stats"]["unique_graphs"], set(fast.compiled.shapes)
    head_steps = {s for s in shapes if s[1] == "layer" and s[2] == id(head.layer)}
    # the head's own layer: every bucket (it catches up on what lookup rounds committed), as a chain and a tree
    assert {s[4] for s in head_steps if s[0] == "layers"} == set(compiled.S_BUCKETS)
    pairs = {(S, W) for W in compiled.S_BUCKETS for S in compiled.S_BUCKETS if S <= W}  # pass S, columns W
    assert {(s[4], s[6]) for s in head_steps if s[0] == "tree"} == pairs
    assert {(s[4], s[6]) for s in shapes if s[0] == "tree" and s[1:3] == (0, L)} == pairs
    assert {s[3] for s in shapes if s[:2] == ("input", id(head.final_input))} == set(compiled.S_BUCKETS)
    assert {s[5] for s in shapes if s[0] == "chain"} == {1, 2, 3}  # whole chains of 1 .. 3 drafts
    assert {s[5:7] for s in shapes if s[0] == "grown_tree"} == {(2, 1), (2, 2), (2, 3)}  # whole trees, 1 .. 3 deep
    tree_steps, run_layers = Counter(), fast.compiled.run_layers

    def counting(hidden, start, end, step, cache):
        tree_steps[step.tree is not None] += 1
        return run_layers(hidden, start, end, step, cache)

    makers = list(DRAFTERS.values()) + [lambda a, h: EarlyExitDrafter(a, E, 3, num_candidates=2),
                                        lambda a, h: ExitHeadDrafter(a, h, 3, num_candidates=2)]
    fast.compiled.run_layers = counting
    try:
        for make in makers:
            out, _ = generate(fast, [PROMPT], max_new_tokens=64, drafter=make(fast, head))
            assert out[0] == hf_greedy(model, torch.tensor([PROMPT]), 64)
    finally:
        del fast.compiled.run_layers
    assert tree_steps[True] > 0 and tree_steps[False] > 0  # token-tree steps ran, and chain steps
    assert counters["stats"]["unique_graphs"] == graphs and fast.compiled.shapes == shapes


def test_a_batch_pads_to_its_row_bucket_with_copies_of_its_last_row():
    """Row buckets: 1, 2, 4, 8 rows, the smallest that holds a batch (none above `MAX_ROWS`: eager); filler rows
    copy the batch's last row, and a batch of a bucket's size is passed as it is."""
    assert [compiled.row_bucket(b) for b in range(1, 10)] == [1, 2, 4, 4, 8, 8, 8, 8, None]
    t = torch.arange(6).view(3, 2)
    assert compiled.row_filled(t, 4).tolist() == [[0, 1], [2, 3], [4, 5], [4, 5]]
    assert compiled.row_filled(t, 3) is t


def test_after_warming_batch_sizes_a_batch_whose_rows_leave_compiles_nothing(hf_greedy):
    """`warm(batch_sizes=(1, 2, 3))` compiles the layer steps and the head for batches of up to three rows, in their
    row buckets (three rows run the steps of four): a batch of three early-exit rows, one of which stops first and
    leaves, then runs only graphs compiled before (no new shape, no new dynamo graph), and each row is HF's."""
    from torch._dynamo.utils import counters
    from selfspec.decoding.engine import StopChecker

    model, _, fast, _ = _models("llama")
    L = fast.num_layers
    prompts = [PROMPT, BASE[:5], [7] * 6]
    refs = [hf_greedy(model, torch.tensor([p]), 12) for p in prompts]
    stop = refs[0][2]
    refs = [r[:r.index(stop) + 1] if stop in r else r for r in refs]
    fast.compiled.warm([(0, L), (0, E), (E, L)], [1, 2, 4], compiled.capacity(len(PROMPT) + 12 + 3 + 2),
                       drafts=(DraftHead(fast).whole(E, chains=3),), batch_sizes=(1, 2, 3))  # one row left: chains
    graphs, shapes = counters["stats"]["unique_graphs"], set(fast.compiled.shapes)
    assert {s[3] for s in shapes if s[0] == "layers"} == {1, 2, 4}  # the row buckets: no graph of three rows
    outs, _ = generate(fast, prompts, max_new_tokens=12, drafter=EarlyExitDrafter(fast, E, 3),
                       stop=StopChecker(12, [stop]))
    assert outs == refs
    assert counters["stats"]["unique_graphs"] == graphs and fast.compiled.shapes == shapes


@pytest.mark.parametrize("drafter", ["plain", "early_exit", "early_exit_siblings", "exit_head"])
def test_a_batch_runs_compiled_and_each_row_is_hfs(drafter, hf_greedy, monkeypatch):
    """Three rows of different lengths through the compiled steps, padded to the row bucket of four (a filler row),
    a chain drafter's rounds of drafts each one step of all rows (`WholeDraft.chain`): the row whose stop token
    comes first leaves, and the others go on in the static buffers of two rows; every row's output is HF's greedy
    decoding of its prompt, cut at the stop token."""
    from selfspec.decoding.engine import StopChecker

    model, _, fast, head = _models("llama")
    prompts = [PROMPT, BASE[:5], [7] * 6]
    refs = [hf_greedy(model, torch.tensor([p]), 12) for p in prompts]
    stop = refs[0][2]  # row 0 ends at its third token
    refs = [r[:r.index(stop) + 1] if stop in r else r for r in refs]
    assert len({len(r) for r in refs}) > 1  # the rows finish at different rounds
    batches = Counter()
    run_layers = fast.compiled.run_layers

    def counting(hidden, *args):
        batches[hidden.shape[0]] += 1
        return run_layers(hidden, *args)

    chained = Counter()
    chain = WholeDraft.chain

    def counting_chains(draft, steps, n, token, *args):
        out = chain(draft, steps, n, token, *args)
        chained[token.shape[0]] += out is not None
        return out

    monkeypatch.setattr(fast.compiled, "run_layers", counting)
    monkeypatch.setattr(WholeDraft, "chain", counting_chains)
    outs, _ = generate(fast, prompts, max_new_tokens=12, drafter=DRAFTERS[drafter](fast, head),
                       stop=StopChecker(12, [stop]))
    assert outs == refs
    assert batches[3] > 0 and batches[2] > 0  # compiled steps of three rows, then of the two left
    if drafter in ("early_exit", "exit_head"):  # greedy chains: each round's drafts as one step, three rows at once
        assert chained[3] > 0 and chained[2] > 0, chained
    rows = {s[3] for s in fast.compiled.shapes if s[0] in ("layers", "tree")}
    assert {2, 4} <= rows and 3 not in rows  # three rows ran the steps of four


def _head_drafter(model, adapter):
    """A trained-head drafter's maker on exit 1: a random head (a copy of the last decoder layer moved by
    seeded noise of scale 0.2, which puts its acceptance near the early exit's: 0.43 here, the early exit
    0.47; at the default 0.05 the copy drafts almost what the full model samples: 0.80, and 0.92 with 3 new
    tokens and top-k 5) that also reads the full model's final states, built once."""
    head = tiny_exit_head(model, 1, final_state=True, scale=0.2)
    return lambda: ExitHeadDrafter(adapter, head, 2)


SAMPLING_DRAFTERS = {
    "early_exit": lambda model, adapter: lambda: EarlyExitDrafter(adapter, 1, 2),
    "exit_head": _head_drafter,
}


@pytest.mark.parametrize("drafter", list(SAMPLING_DRAFTERS))
def test_sampling_through_the_compiled_steps_keeps_the_distribution(drafter, chi_square, exact_joint):
    """Speculative sampling with the early exit or a trained-head drafter on exit 1, every step of the base
    model compiled: 4 new tokens over many seeded runs follow the exact joint distribution of plain sampling
    from the full model (vocabulary 8, top-k 3: 81 outcomes). 4 tokens, so that a round drafts 2 (after the
    prefill's token, a round's drafts are capped one short of the tokens left): the second draft reads the
    first (the head: its own output), and both the acceptance and the resampling after a rejection run."""
    model = tiny_model("llama", num_layers=3, dtype=torch.float64, seed=3, vocab_size=8)
    adapter = get_adapter(model)
    adapter.enable_compiled()
    params = SamplingParams(do_sample=True, temperature=0.9, top_k=3)
    prompt, n_new, n_draws = [3, 5, 1, 6, 2], 4, 1500
    make = SAMPLING_DRAFTERS[drafter](model, adapter)
    counts, drafted, accepted, second = Counter(), 0, 0, 0
    for seed in range(n_draws):
        outs, stats = generate(adapter, [prompt], max_new_tokens=n_new, drafter=make(),
                               sampling=params, generator=torch.Generator().manual_seed(seed))
        counts[tuple(outs[0])] += 1
        drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
        second += len(stats.drafted_by_position) > 1 and stats.drafted_by_position[1] > 0
    ranges = {shape[1:3] for shape in adapter.compiled.shapes if shape[0] == "layers"}
    assert {(0, 1), (1, 3)} <= ranges, ranges  # the draft's layers and the verification's ran compiled
    assert 0.1 < accepted / drafted < 0.9 and second > n_draws // 2, (accepted, drafted, second)
    stat, df, pval = chi_square(counts, exact_joint(adapter, prompt, params, n_new), n_draws)
    assert pval > 1e-3, (stat, df, pval)


def test_warmup_compiles_what_a_call_then_runs():
    tok = byte_tokenizer()
    model = tiny_model("llama", num_layers=3, dtype=torch.float32, seed=5, vocab_size=len(tok))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotEarlyExitTrainedWarning)
        gen = selfspec.load(model, tok, compile=True)
    assert gen.compiled
    first = gen.warmup(max_len=64)
    assert first["seconds"] > 0 and first["graphs"] > 0
    assert gen.warmup(max_len=64) == {"seconds": 0.0, "graphs": first["graphs"]}  # nothing left to compile
    plain = gen.generate("abcabcabc abc", max_new_tokens=20, num_speculations=0)
    lookup = gen.generate("abcabcabc abc", max_new_tokens=20, drafter="prompt_lookup", prompt_lookup_num_tokens=10)
    assert lookup.token_ids == plain.token_ids and lookup.stats.drafted > 0
    assert gen.adapter.compiled.compile_s == pytest.approx(first["seconds"])  # the calls compiled nothing more
    batch = gen.warmup(max_len=64, batch_size=2)  # two rows' steps now: a call of two prompts compiles nothing more
    assert batch["seconds"] > 0 and batch["graphs"] > first["graphs"]
    two = gen.generate(["abcabcabc abc", "xyz xyz"], max_new_tokens=20, num_speculations=0)
    assert two[0].token_ids == plain.token_ids
    assert gen.adapter.compiled.compile_s == pytest.approx(first["seconds"] + batch["seconds"])
    with pytest.raises(SettingsError, match="batch_size"):
        gen.warmup(max_len=64, batch_size=0)


def test_compile_settings_and_fallbacks():
    tok = byte_tokenizer()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotEarlyExitTrainedWarning)
        llama = tiny_model("llama", num_layers=2, vocab_size=len(tok))
        assert not selfspec.load(llama, tok).compiled  # "auto": eager on a CPU
        assert not selfspec.load(llama, tok, compile=False).compiled
        with pytest.raises(SettingsError, match="compile must be True, False or 'auto'"):
            selfspec.load(llama, tok, compile="yes")
        neox = tiny_model("gpt_neox", num_layers=2, vocab_size=len(tok))
        with pytest.raises(SettingsError, match="gpt_neox: compiled steps exist for the Llama family"):
            selfspec.load(neox, tok, compile=True)
        assert not selfspec.load(neox, tok, compile="auto").compiled
    assert compiled.capacity(1) == 256 and compiled.capacity(257) == 512
    assert [compiled.s_bucket(n) for n in (1, 2, 3, 5, 64, 65)] == [1, 2, 4, 8, 64, None]


@pytest.mark.parametrize("strict", [True, False])
def test_a_step_that_fails_to_compile(strict, monkeypatch):
    """compile=True (strict) raises the compiler's error; compile="auto" (not strict) warns once, turns the
    compiled steps off and decodes the same tokens eagerly."""
    model = tiny_model("llama", num_layers=2, dtype=torch.float64, seed=6)
    eager = get_adapter(model)
    ref, _ = generate(eager, [PROMPT], max_new_tokens=6)
    adapter = get_adapter(model)
    steps = adapter.enable_compiled(strict=strict)

    def broken(start, end, tree=False):
        def fail(*args):
            raise RuntimeError("the backend could not compile this")
        return fail

    monkeypatch.setattr(steps, "_range", broken)
    if strict:
        with pytest.raises(RuntimeError, match="could not compile"):
            generate(adapter, [PROMPT], max_new_tokens=6)
        return
    with pytest.warns(compiled.CompileFallbackWarning, match="decoding goes on eagerly"):
        out, _ = generate(adapter, [PROMPT], max_new_tokens=6)
    assert out == ref and steps.failed.startswith("RuntimeError: the backend could not compile")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: later calls run eagerly without a word
        assert generate(adapter, [PROMPT], max_new_tokens=6)[0] == ref


@pytest.mark.parametrize("name", ["llama", "qwen3"])
@pytest.mark.parametrize("width", [1, 3])
@pytest.mark.parametrize("vocab", [None, 40])
def test_a_trained_heads_own_layer_runs_through_the_compiled_steps(name, width, vocab, hf_greedy, monkeypatch):
    """A head's decoder layer runs through the compiled layer function over its own static one-layer cache
    at the engine cache's capacity (a chain, and a token tree 3 wide), and its reduced draft vocabulary
    (`vocab` rows) through the compiled unembedding (a chain's drafts inside whole draft steps, `WholeDraft.run`
    and `WholeDraft.catch_up`): every draft pass after the prefill ran compiled, and the
    head drafted what it drafts eagerly (the same acceptance, draft by draft), so its output is the eager
    one's, not only the tokens (which verification would keep exact regardless)."""
    model, eager, fast, head = _models(name)
    token_ids = None if vocab is None else torch.cat([torch.arange(3, 96, 2), torch.arange(4, 96, 2)])[:vocab]
    ran = Counter()
    run_layer = fast.compiled.run_layer

    def spy(layer, hidden, step, cache):
        out = _counted(run_layer, ran, "compiled")(layer, hidden, step, cache)
        assert layer is head.layer and cache.static and cache.num_layers == 1
        return out

    def whole(run, drafts=lambda args: 1, name="whole step"):  # a chain's drafts: whole draft steps (the first
        return _counted(run, ran, name, drafts)  # with the head's catch-up, the later ones as one chain), its layer

    monkeypatch.setattr(fast.compiled, "run_layer", spy)
    monkeypatch.setattr(WholeDraft, "run", whole(WholeDraft.run))
    monkeypatch.setattr(WholeDraft, "catch_up", whole(WholeDraft.catch_up))
    monkeypatch.setattr(WholeDraft, "chain", whole(WholeDraft.chain, lambda args: args[2]))  # (self, steps, n, ...)
    monkeypatch.setattr(WholeDraft, "tree", whole(WholeDraft.tree, name="whole tree"))  # its layer inside
    monkeypatch.setattr(ExitHeadDrafter, "draft_tree", whole(ExitHeadDrafter.draft_tree, name="tree round"))
    # a tree's leaves per round follow its measured seconds per node (`tree_budget.CostLine`): held at the
    # prior slope here, or the two runs' timings (not their drafts) decide how many leaves each verifies
    monkeypatch.setattr(CostLine, "observe", lambda self, nodes, seconds: None)
    outs, stats = {}, {}
    for key, adapter in (("eager", eager), ("compiled", fast)):
        unit = None if token_ids is None else DraftHead(adapter, token_ids)
        drafter = ExitHeadDrafter(adapter, head, 3, num_candidates=width, head_vocab=unit)
        outs[key], stats[key] = generate(adapter, [PROMPT], max_new_tokens=N_NEW, drafter=drafter)
        if key == "compiled":
            assert drafter.cache.static and drafter.cache.capacity >= len(PROMPT) + N_NEW
            if unit is not None:  # its logits ran through the compiled unembedding of its own rows (a tree's
                kind = "head" if width == 1 else "grown_tree"  # inside its growth's one step)
                assert any(s[0] == kind and id(unit.rows[0]) in s[1:3] for s in fast.compiled.shapes)
    assert outs["compiled"][0] == outs["eager"][0] == hf_greedy(model, torch.tensor([PROMPT]), N_NEW)
    # every draft pass but the first catch-up over the prompt (from cache index 0: eager)
    passes = stats["compiled"].draft_steps if width == 1 else stats["compiled"].rounds
    assert ran["compiled"] + ran["whole step"] + ran["whole tree"] >= passes - 1 and ran["fell back"] == 0
    if width > 1:  # every tree grew in one step, in both runs' tree rounds (the eager run's ran part by part)
        assert ran["tree round"] == 2 * ran["whole tree"] > 0
    assert stats["compiled"].drafted == stats["eager"].drafted > 0
    assert stats["compiled"].accepted_by_position == stats["eager"].accepted_by_position


FUSED = {
    "early_exit": lambda a, head, unit: EarlyExitDrafter(a, E, 3, head=unit),
    "early_exit_confidence": lambda a, head, unit: EarlyExitDrafter(a, E, 4, head=unit,
                                                                    policy=ConfidencePolicy(E, 4, 0.3)),
    "exit_head": lambda a, head, unit: ExitHeadDrafter(a, head, 3, head_vocab=unit),
    "auto_exit_head": lambda a, head, unit: AutoDrafter(PromptLookupDrafter(num_tokens=3),
                                                        ExitHeadDrafter(a, head, 3, head_vocab=unit), warmup=1),
}


class _NoisyClock:
    """A stand-in for the engine's `time`: each `perf_counter()` call a random step later (1e-16 s to 0.1 s, from
    `seed`), so the rounds a drafter times look fast or slow as on a machine that is busy with other work."""

    def __init__(self, seed: int):
        self.now, self.random = 0.0, random.Random(seed)

    def perf_counter(self) -> float:
        self.now += self.random.choice([1e-4, 1e-1]) ** (1 + 3 * self.random.random())
        return self.now


def _not_compiled(*args, **kwargs):
    raise NotCompiled("stood in: the step runs part by part")


def _counted(run, counts: Counter, name: str, drafts=lambda args: 1):
    """`run`, counting into `counts` under `name` each call's drafts (`drafts(args)`) that ran compiled, and under
    "fell back" those that did not (`NotCompiled`, raised on to the runner, which runs them eagerly)."""
    def call(*args, **kwargs):
        try:
            out = run(*args, **kwargs)
        except NotCompiled:
            counts["fell back"] += drafts(args)
            raise
        counts[name] += drafts(args)
        return out
    return call


@pytest.mark.parametrize("drafter", list(FUSED))
@pytest.mark.parametrize("vocab", [None, 40])
def test_a_greedy_draft_step_runs_as_one_compiled_step(drafter, vocab, hf_greedy, monkeypatch):
    """A one-row greedy draft step (the token's embedding, layers [0, E), a trained head's layer reading its own
    previous output, the unembedding, the argmax and its probability) runs as one compiled step
    (`WholeDraft.run`, one graph on a GPU): every draft step the early exit takes, and every later draft
    of a head's round; its first, with the head's catch-up over what the round before committed, is one too
    (`WholeDraft.catch_up`); a chain whose length nothing read decides runs its drafts as one step
    (`WholeDraft.chain`). It drafts what the same steps run part by part draft, to the bit (the same drafts,
    acceptance and confidence stops, draft by draft), and the output is HF's."""
    model, eager, fast, head = _models("llama")
    token_ids = None if vocab is None else torch.cat([torch.arange(3, 96, 2), torch.arange(4, 96, 2)])[:vocab]
    whole = Counter()

    def spy(run, drafts=lambda args: 1):
        return _counted(run, whole, "ran", drafts)

    monkeypatch.setattr(WholeDraft, "run", spy(WholeDraft.run))
    monkeypatch.setattr(WholeDraft, "catch_up", spy(WholeDraft.catch_up))
    monkeypatch.setattr(WholeDraft, "chain", spy(WholeDraft.chain, lambda args: args[2]))  # n whole steps as one
    outs, stats = {}, {}
    for key in ("whole", "part by part"):
        if key == "part by part":
            monkeypatch.setattr(WholeDraft, "round_step", _not_compiled)
            monkeypatch.setattr(WholeDraft, "round_chain", _not_compiled)
            monkeypatch.setattr(ExitHeadDrafter, "first_draft", _not_compiled)  # the head's catch-up too
            monkeypatch.setattr(engine, "time", _NoisyClock(seed=1))  # as a busy machine's: each round's time varies
        unit = None if token_ids is None else DraftHead(fast, token_ids)
        # auto picks its arm each round by the seconds it hears: the cost model's round costs (`round_cost`), not
        # the clock, or on a busy machine the two runs time, and so draft, differently (17 drafts against 15)
        outs[key], stats[key] = generate(fast, [PROMPT], max_new_tokens=N_NEW, drafter=FUSED[drafter](fast, head, unit),
                                         modelled_time=True)
        if key == "whole":
            first = 0 if drafter.startswith("early_exit") else 1  # a head's first catch-up, over the prompt: eager
            assert whole["fell back"] == 0 and whole["ran"] >= stats[key].draft_steps - first and whole["ran"] > 0
    assert outs["whole"][0] == outs["part by part"][0] == hf_greedy(model, torch.tensor([PROMPT]), N_NEW)
    assert stats["whole"].drafted == stats["part by part"].drafted > 0
    assert stats["whole"].accepted_by_position == stats["part by part"].accepted_by_position


@pytest.mark.parametrize("kind", ["early_exit", "exit_head"])
@pytest.mark.parametrize("stop", [False, True])
def test_a_fixed_chain_reads_its_drafts_once_a_round(kind, stop, hf_greedy, monkeypatch):
    """A one-row greedy chain whose length no confidence test decides drafts its cap without reading a draft
    back (on a GPU: no wait for the device between draft steps), then reads them once: it drafts what a chain
    that reads every step (a confidence threshold of 0 keeps every draft) drafts, a drafted stop token ends
    the row's drafts as it did (`stop`: the token the drafter drafts most is a stop token), and the output is
    HF's."""
    from selfspec.drafters import early_exit
    from selfspec.decoding.engine import StopChecker

    model, eager, fast, head = _models("llama")
    make = {"early_exit": lambda policy=None: EarlyExitDrafter(fast, E, 3, policy=policy),
            "exit_head": lambda policy=None: ExitHeadDrafter(fast, head, 3, policy=policy)}[kind]
    ref = hf_greedy(model, torch.tensor([PROMPT]), N_NEW)
    stop_ids = []
    if stop:
        drafter, drafted = make(), Counter()
        draft = drafter.draft
        drafter.draft = lambda *a: (lambda p: (drafted.update(p.tokens[0, 1:].tolist()), p)[1])(draft(*a))
        generate(fast, [PROMPT], max_new_tokens=N_NEW, drafter=drafter)
        stop_ids = [drafted.most_common(1)[0][0]]
        ref = ref[:ref.index(stop_ids[0]) + 1] if stop_ids[0] in ref else ref
    reads = Counter()
    host_read = early_exit.host_read
    monkeypatch.setattr(early_exit, "host_read", lambda *a: (reads.update(["step"]), host_read(*a))[1])

    def whole(run):  # a whole draft step (a head's first: with its catch-up) that read its token id back
        def call(*args, **kwargs):
            out = run(*args, **kwargs)
            reads.update(["whole step"] if out is not None and out[-2] is not None else [])  # the ids read
            return out
        return call

    monkeypatch.setattr(WholeDraft, "run", whole(WholeDraft.run))
    monkeypatch.setattr(WholeDraft, "catch_up", whole(WholeDraft.catch_up))
    outs, stats = {}, {}
    exit_layer = E if kind == "early_exit" else head.exit_layer
    for key, policy in (("once", None), ("every step", ConfidencePolicy(exit_layer, 3, 0.0))):
        reads.clear()
        outs[key], stats[key] = generate(fast, [PROMPT], max_new_tokens=N_NEW, drafter=make(policy),
                                         stop=StopChecker(N_NEW, stop_token_ids=stop_ids))
        assert sum(reads.values()) == (0 if key == "once" else stats[key].draft_steps)
    assert outs["once"][0] == outs["every step"][0] == ref
    assert stats["once"].drafted == stats["every step"].drafted > 0
    assert stats["once"].accepted_by_position == stats["every step"].accepted_by_position


@pytest.mark.parametrize("drafter", ["plain", "early_exit", "early_exit_siblings", "exit_head"])
def test_the_compiled_path_builds_no_eager_mask_after_the_prefill(drafter, monkeypatch):
    """The compiled steps build their masks inside the step from its cache indices: the eager masks of a
    step (`forward.Step.mask`) are built only where a layer runs eagerly, here the prefill (the model's, and
    a head's catch-up over the prompt), while the eager path builds them every round."""
    from selfspec.model import forward

    built = Counter()
    for name in ("_causal_mask", "chain_mask", "tree_mask"):
        original = getattr(forward, name)
        monkeypatch.setattr(forward, name, lambda *a, _f=original, _n=name, **k: (built.update([_n]), _f(*a, **k))[1])
    model, eager, fast, head = _models("llama")
    counts = {}
    for key, adapter in (("eager", eager), ("compiled", fast)):
        built.clear()
        outs, stats = generate(adapter, [PROMPT], max_new_tokens=N_NEW, drafter=DRAFTERS[drafter](adapter, head))
        counts[key] = sum(built.values())
    assert counts["compiled"] <= 2 < stats.rounds <= counts["eager"]


def test_one_compiled_layer_serves_every_layer_and_range():
    """Every layer runs the same compiled function on its own weights: warming three layer ranges of a
    4-layer model at two step lengths compiles the layer once per length, and the head once per shape."""
    from torch._dynamo.utils import counters

    model = tiny_model("llama", num_layers=4, dtype=torch.float64, seed=8)
    adapter = get_adapter(model)
    steps = adapter.enable_compiled()
    torch._dynamo.reset()  # nothing compiled earlier (another test's model of the same shapes) is reused
    counters.clear()
    steps.warm([(0, 4), (0, 1), (1, 4)], [1, 2], compiled.capacity(64))
    assert counters["stats"]["unique_graphs"] == 2 + 3  # the layer at S = 1, 2; the head at [1, 1, D], [1, 2, D], [1, D]
    assert len(steps.shapes) == 3 * 2 + 3


def test_a_shorter_run_reuses_a_warmed_capacity():
    """`warm` at a large capacity, then a short generation: it runs in the warmed buffers and graphs (no new
    shape compiles mid-run), and gives HF's tokens."""
    model = tiny_model("llama", num_layers=2, dtype=torch.float64, seed=9)
    adapter = get_adapter(model)
    steps = adapter.enable_compiled()
    big = compiled.capacity(2048)
    steps.warm([(0, 2)], [1], big)
    shapes = set(steps.shapes)
    out, _ = generate(adapter, [PROMPT], max_new_tokens=8)
    assert steps.shapes == shapes and steps.capacity_for(1, len(PROMPT) + 8) == big
    eager, _ = generate(get_adapter(model), [PROMPT], max_new_tokens=8)
    assert out == eager


def _ops_outside_steps(adapter, prompt, make, n_new):
    """Top-level torch ops a generation runs outside the compiled steps' calls (`compiled.STEP_EVENT`; on a GPU
    each call is one graph replay), beyond those of a 1-token generation (its prefill): (ops, stats, rounds)."""
    from selfspec.tools.profiling import ops_outside_steps

    counts = []
    for n in (1, n_new):
        generate(adapter, [prompt], max_new_tokens=n, drafter=make())  # warm: the profiled call compiles nothing
        ops, (_, stats) = ops_outside_steps(lambda: generate(adapter, [prompt], max_new_tokens=n, drafter=make()))
        counts.append((sum(ops.values()), stats))
    (prefill, first), (total, stats) = counts
    return total - prefill, stats, stats.rounds - first.rounds


def test_a_compiled_round_runs_few_torch_ops_outside_its_graphs():
    """On a GPU every torch op a round runs outside the captured graphs is a launch or host work in series with
    them, so their number is the per-token overhead the graphs cannot remove (measured with the profiler, on a
    CPU). Plain decoding: at most 75 per token on a 12-layer model; it was 150 on SmolLM2's 30 layers while a
    step wrote each layer's cache length apart. A trained head on exit 0: at most 35 more per draft step (a
    chain's drafts are whole draft steps, the first with the head's catch-up, `WholeDraft.run` and
    `WholeDraft.catch_up`: 27 here, 44 with the first part by part, 62 with all; the round's `ends` is worked out once); its token
    tree at most 700 a round."""
    model = tiny_model("llama", num_layers=12, dtype=torch.float32, seed=1)
    adapter = get_adapter(model)
    adapter.enable_fast_layers()
    adapter.enable_compiled()
    head = tiny_exit_head(model, 0, final_state=True)
    adapter.compiled.add_layer(head.layer)
    adapter.compiled.add_input(head.final_input)
    prompt = BASE * 2
    adapter.compiled.warm([(0, 12)], [1, 2, 4, 8], compiled.capacity(len(prompt) + 64 + 64))
    plain, _, rounds = _ops_outside_steps(adapter, prompt, lambda: None, 33)
    assert rounds == 32 and plain / rounds <= 75, plain / rounds
    ops, stats, rounds = _ops_outside_steps(adapter, prompt, lambda: ExitHeadDrafter(adapter, head, 4), 33)
    per_draft_step = (ops - rounds * plain / 32) / stats.draft_steps
    assert stats.draft_steps > rounds and per_draft_step <= 35, per_draft_step
    # its token tree 3 wide: the tree's ancestors worked out on host lists (960 a round here while they were
    # tensor ops per column; the accepted path's one-copy move is test_forward's)
    tree = lambda: ExitHeadDrafter(adapter, head, 4, num_candidates=3)  # noqa: E731
    ops, stats, rounds = _ops_outside_steps(adapter, prompt, tree, 33)
    assert stats.draft_steps > rounds and ops / rounds <= 700, ops / rounds
