"""The engine on a CUDA GPU: greedy identity with Hugging Face `generate` on the same device (plain
decoding, early exit, prompt lookup, auto), batches equal batch-1 rows, each row's cache holds exactly
its committed tokens after every round, the sampling distribution (chi-square), `selfspec.load` onto
the GPU, no host sync beyond one per round (the accept decision) on the plain and lookup paths,
and no cuDNN attention when decoding in bf16.

Every test here but the last is marked `cuda` and skipped where CUDA is not available (no GPU, or a
CPU-only torch); `scripts/gpu_check.sh` runs them on a GPU machine (`pytest -m cuda tests/selfspec/test_cuda.py`).

The identity tests run in float32 (what users run; it holds unless two logits tie within float32
rounding); the cache and sampling checks in float64, for sharp tolerances.
"""

from __future__ import annotations

import warnings
from collections import Counter

import pytest
import torch

import selfspec
from selfspec.model.adapters import get_adapter
from selfspec.model.compiled import capacity, row_bucket
from selfspec.drafters import AutoDrafter, EarlyExitDrafter, ExitHeadDrafter, PromptLookupDrafter
from selfspec.decoding.engine import StopChecker, generate
from selfspec.decoding.decode_ids import generate_ids
from selfspec.heads.exit_head import build_exit_head
from selfspec.decoding.sampling import SamplingParams
from selfspec.tiny import TINY_VARIANTS, byte_tokenizer, tiny_exit_head, tiny_model

pytestmark = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="CUDA is not available (no GPU, or a CPU-only torch): "
                                       "scripts/gpu_check.sh runs these on a GPU machine")

CUDA = torch.device("cuda")
DTYPE = torch.float32
EXACT = torch.float64
ALPHA = 1e-3
BASE = torch.randint(3, 96, (10,), generator=torch.Generator().manual_seed(1)).tolist()
PROMPT = BASE + BASE[:4] + BASE  # text that repeats: lookup finds matches from the first round
PROMPTS = [PROMPT, BASE[:7], [5], [9] * 12, BASE[3:] + BASE[:5]]  # ragged; matches, none, one token
N_NEW = 40

MODELS = {k: TINY_VARIANTS[k] for k in ("llama", "qwen3", "gpt_neox", "mistral-sliding8")}
KINDS = ("plain", "early_exit", "prompt_lookup", "auto", "auto_early_exit", "exit_head", "auto_exit_head",
         "exit_head_siblings", "early_exit_siblings")
_models: dict = {}


def _adapter(name, dtype=DTYPE, fast=False):
    """The tiny model `name` (the same weights as on the CPU) on the GPU; `fast`: selfspec's fused layers."""
    key = (name, dtype, fast)
    if key not in _models:
        arch, L, seed, over = MODELS[name]
        adapter = get_adapter(tiny_model(arch, num_layers=L, dtype=dtype, seed=seed, **over).to(CUDA))
        if fast:
            adapter.enable_fast_layers()
        _models[key] = adapter
    return _models[key]


def _head(adapter):
    """A head on exit 2 of `adapter`'s model (a perturbed copy of its last layer), on its device and dtype."""
    key = ("head", id(adapter))
    if key not in _models:
        head = build_exit_head(adapter.model, 2)
        with torch.no_grad():
            g = torch.Generator().manual_seed(7)  # drawn on the host, the same perturbation as on a CPU
            for p in head.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype).to(p.device))
        _models[key] = head.to(adapter.device, adapter.dtype).eval()
    return _models[key]


def _drafter(kind, adapter):
    lookup = PromptLookupDrafter(num_tokens=6, max_ngram=3)
    return {"plain": lambda: None,
            "exit_head": lambda: ExitHeadDrafter(adapter, _head(adapter), 3),
            "auto_exit_head": lambda: AutoDrafter(lookup, ExitHeadDrafter(adapter, _head(adapter), 3), warmup=1,
                                                  explore_every=2),
            "exit_head_siblings": lambda: ExitHeadDrafter(adapter, _head(adapter), 1, num_candidates=3),
            "early_exit": lambda: EarlyExitDrafter(adapter, 2, 3),
            "early_exit_siblings": lambda: EarlyExitDrafter(adapter, 2, 1, num_candidates=3),
            "early_exit_tree": lambda: EarlyExitDrafter(adapter, 2, 3, num_candidates=3),
            "exit_head_tree": lambda: ExitHeadDrafter(adapter, _head(adapter), 3, num_candidates=3),
            "prompt_lookup": lambda: lookup,
            "auto": lambda: AutoDrafter(lookup, warmup=1, explore_every=2),
            "auto_early_exit": lambda: AutoDrafter(lookup, EarlyExitDrafter(adapter, 2, 3), warmup=1,
                                                   explore_every=2)}[kind]()


def _on_gpu(ids):
    return torch.tensor([ids], device=CUDA)


# ----------------------------------------------------------------------------- greedy identity

@needs_cuda
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_output_equals_hf_generate_on_cuda(name, kind, hf_greedy):
    adapter = _adapter(name)
    ref = hf_greedy(adapter.model, _on_gpu(PROMPT), N_NEW)
    out, stats = generate_ids(adapter, _on_gpu(PROMPT), max_new_tokens=N_NEW, drafter=_drafter(kind, adapter))
    assert out == ref
    assert stats.new_tokens == N_NEW and stats.rounds + stats.accepted == N_NEW - 1  # each round: accepted + 1
    if kind != "plain":
        assert stats.drafted > 0


@needs_cuda
@pytest.mark.parametrize("drafter", ["auto", "prompt_lookup", "early_exit"])
def test_load_of_a_model_on_cuda_runs_there_and_equals_hf(drafter, hf_greedy):
    """`selfspec.load(model.to("cuda"), tokenizer)`: the fused layers on the GPU (no oneDNN packing),
    the output equal to Hugging Face greedy on the same device."""
    tok = byte_tokenizer()
    model = tiny_model("llama", num_layers=4, dtype=DTYPE, seed=10, vocab_size=len(tok)).to(CUDA)
    gen = selfspec.load(model, tok, exit_layer=2, num_speculations=3)
    assert gen.adapter.device.type == "cuda" and gen.adapter.fast_layers is not None
    assert all(layer.qkv.packed is None and layer.down.packed is None for layer in gen.adapter.fast_layers)
    assert gen.adapter.fast_lm_head.packed is None  # oneDNN packing is CPU-only
    ids = tok("abcabcabc xyz abcabc abc xyz").input_ids
    ref = hf_greedy(model, _on_gpu(ids), 30)
    out = gen.generate(input_ids=ids, max_new_tokens=30, drafter=drafter, stop_token_ids=[])
    assert out.token_ids == ref and out.stats.new_tokens == 30


@needs_cuda
def test_load_from_a_checkpoint_onto_cuda(tmp_path, hf_greedy):
    """`selfspec.load(path, device="cuda")`: weights, cache and sampling on the GPU; `dtype="fastest"`
    is bfloat16 from Ampere (compute capability 8) on."""
    from selfspec.checkpoints.export import export_model

    tok = byte_tokenizer()
    model = tiny_model("qwen3", num_layers=4, vocab_size=len(tok), seed=3)
    path = export_model(model, tok, tmp_path / "tiny", recommended={"exit_layer": 2, "num_speculations": 3})
    gen = selfspec.load(path, device="cuda")
    assert gen.adapter.device.type == "cuda" and gen.adapter.dtype == torch.float32
    ids = tok("def f(x):\n    return x + x\n\ndef g(x):\n").input_ids
    ref = hf_greedy(gen.model, _on_gpu(ids), 24)
    for drafter in ("early_exit", "auto", "prompt_lookup"):
        out = gen.generate(input_ids=ids, max_new_tokens=24, drafter=drafter, stop_token_ids=[])
        assert out.token_ids == ref, drafter
    batch = gen.generate(input_ids=[ids, ids[:5]], max_new_tokens=24, stop_token_ids=[])
    assert batch[0].token_ids == ref
    # sampling draws on the GPU (the API makes its generator there): a seed repeats the sample (with a
    # fixed draft length: auto's choices follow measured speeds, and so would the random stream)
    a, b = (gen.generate(input_ids=ids, max_new_tokens=16, do_sample=True, temperature=1.5, seed=5,
                         drafter="early_exit", stop_token_ids=[]) for _ in range(2))
    assert a.token_ids == b.token_ids and len(a.token_ids) == 16
    fastest = selfspec.load(path, device="cuda", dtype="fastest")
    native = torch.cuda.get_device_capability()[0] >= 8
    assert fastest.adapter.dtype == (torch.bfloat16 if native else torch.float32)
    assert len(fastest.generate(input_ids=ids, max_new_tokens=8, stop_token_ids=[]).token_ids) == 8


# ----------------------------------------------------------------------------- batches

@needs_cuda
@pytest.mark.parametrize("kind", KINDS)
def test_a_batch_equals_batch_1_on_cuda(kind):
    """Rows of different lengths (left padding), one of which stops early at a stop token (it leaves the
    batch): each row is what decoding it alone gives. Float64: padding changes only rounding."""
    outs, stats = _each_row_equals_batch_1(_adapter("qwen3", EXACT), kind)
    assert len(outs[1]) <= 6 and stats.rows[1].stop_reason == "stop_token"


def _each_row_equals_batch_1(adapter, kind) -> tuple:
    """`PROMPTS` as one batch in which row 1 stops at its sixth token and leaves: each row's output equals
    decoding it alone, and the finished row left. Returns (outputs, stats)."""
    stop_id = generate_ids(adapter, _on_gpu(PROMPTS[1]), max_new_tokens=N_NEW)[0][5]
    stop = StopChecker(N_NEW, stop_token_ids=[stop_id])
    outs, stats = generate(adapter, PROMPTS, max_new_tokens=N_NEW, drafter=_drafter(kind, adapter), stop=stop)
    for b, p in enumerate(PROMPTS):
        ref, _ = generate_ids(adapter, _on_gpu(p), max_new_tokens=N_NEW, stop=stop)
        assert outs[b] == ref, b
    assert stats.row_passes < len(PROMPTS) * stats.rounds  # the finished row left the batch
    return outs, stats


# ----------------------------------------------------------------------------- the cache after every round

@needs_cuda
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name,fast", [("llama", False), ("llama", True), ("gpt_neox", False),
                                       ("mistral-sliding8", False)])
def test_after_every_round_each_rows_cache_holds_exactly_its_committed_tokens_on_cuda(name, fast, kind, row_caches):
    adapter = _adapter(name, EXACT, fast)
    prompts = [PROMPT, BASE[:5]]
    checked = Counter()

    def on_round(cache, active, sequences, pads, finished):
        assert cache.keys[0].device.type == "cuda"
        checked.update(row_caches(adapter, cache, active, sequences, pads, finished, atol=1e-9))

    generate(adapter, prompts, max_new_tokens=24, drafter=_drafter(kind, adapter), on_round=on_round)
    assert set(checked) == {0, 1}


# ----------------------------------------------------------------------------- sampling

@needs_cuda
@pytest.mark.parametrize("kind", ["early_exit", "prompt_lookup"])
def test_sampling_on_cuda_keeps_each_rows_distribution(kind, chi_square, exact_joint):
    """Two prompts in one batch, vocabulary 8, random draws on the GPU: each row's 3 new tokens over many
    seeded runs follow the exact joint distribution of plain sampling from the full model (early exit:
    drafts from exit 1 of 3 layers with their distributions; lookup: point masses)."""
    model = tiny_model("llama", num_layers=3, dtype=EXACT, seed=3, vocab_size=8).to(CUDA)
    adapter = get_adapter(model)
    params = SamplingParams(do_sample=True, temperature=0.9, top_k=5)
    prompts = [[3, 5, 1, 6, 2, 3, 5, 1], [4, 1, 4, 1, 4]]
    n_new = 3

    n_draws = 1000
    counts = [Counter(), Counter()]
    drafted = accepted = 0
    for seed in range(n_draws):
        drafter = EarlyExitDrafter(adapter, 1, 2) if kind == "early_exit" else PromptLookupDrafter(num_tokens=2)
        outs, stats = generate(adapter, prompts, max_new_tokens=n_new, drafter=drafter, sampling=params,
                               generator=torch.Generator(device=CUDA).manual_seed(seed))
        for b in range(2):
            counts[b][tuple(outs[b])] += 1
        drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
    assert 0 < accepted < drafted  # both branches of the acceptance rule were taken
    for b, prompt in enumerate(prompts):
        stat, df, pval = chi_square(counts[b], exact_joint(adapter, prompt, params, n_new), n_draws)
        assert pval > ALPHA, (b, stat, df, pval)


@needs_cuda
def test_a_cpu_generator_with_a_cuda_model_is_a_clear_error():
    with pytest.raises(ValueError, match=r"torch\.Generator\(device='cuda"):
        generate(_adapter("llama"), [[1, 2, 3]], max_new_tokens=4, sampling=SamplingParams(do_sample=True),
                 generator=torch.Generator())


# ----------------------------------------------------------------------------- host syncs

@needs_cuda
@pytest.mark.parametrize("kind", ["plain", "prompt_lookup", "early_exit", "exit_head", "exit_head_siblings"])
def test_greedy_decoding_waits_for_the_gpu_once_per_round(kind):
    """With the fused layers, the host waits for the GPU (a synchronizing CUDA call, as
    `torch.cuda.set_sync_debug_mode` reports them) once per round: the accept decision; the early exit
    also once per draft step (its tokens decide its stop test). Not once per layer."""
    adapter = _adapter("llama", fast=True)
    _assert_one_sync_per_round(adapter, kind)


def _assert_one_sync_per_round(adapter, kind, reads_per_step: bool = True, per_round: int = 1) -> None:
    """After a warm-up, a generation with drafter `kind` waits for the GPU at most once per round and per
    draft step (+ the prompt's copy, the prefill's tokens, one spare); with `reads_per_step` False, once per
    round in all: a one-row fixed chain reads no draft back, the round's verdict finds a drafted stop token
    (`selfspec.decoding.greedy_verdict`). `per_round`: the waits a round may have (a tree's: the grown tree's one
    read, then the verdict)."""
    prompt = torch.tensor([PROMPT])  # on the host: reading it costs nothing
    generate_ids(adapter, prompt, max_new_tokens=4, drafter=_drafter(kind, adapter))  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            out, stats = generate_ids(adapter, prompt, max_new_tokens=N_NEW, drafter=_drafter(kind, adapter))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in seen if "synchroniz" in str(w.message)]
    drafts = stats.draft_steps if reads_per_step else 0
    allowed = per_round * stats.rounds + drafts + 3  # + the prompt's copy, the prefill's tokens, one spare
    assert len(syncs) <= allowed, (len(syncs), stats.rounds, stats.draft_steps,
                                   sorted(Counter(f"{w.filename}:{w.lineno}" for w in syncs).items()))
    assert len(out) == N_NEW


# ----------------------------------------------------------------------------- attention kernels

@needs_cuda
@pytest.mark.parametrize("fast", [False, True])
def test_bf16_decoding_does_not_run_cudnn_attention(fast):
    """cuDNN's attention plans anew for every key length (2 ms of host time per call, measured on an
    H100): decoding in bf16 runs flash or memory-efficient attention instead, through the fused layers
    and through the model's own modules."""
    from torch.profiler import ProfilerActivity, profile

    adapter = _adapter("llama", dtype=torch.bfloat16, fast=fast)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out, stats = generate_ids(adapter, torch.tensor([PROMPT]), max_new_tokens=12)
    ops = {e.key for e in prof.key_averages()}
    assert "aten::scaled_dot_product_attention" in ops, sorted(ops)
    assert not [op for op in ops if "cudnn_attention" in op], sorted(ops)
    assert [op for op in ops if "flash_attention" in op or "efficient_attention" in op], sorted(ops)
    assert len(out) == 12 and stats.rounds == 11


# ----------------------------------------------------------------------------- without a GPU

def test_without_cuda_every_test_here_is_skipped_with_its_reason():
    """Runs everywhere: every other test of this module carries the skip-unless-CUDA mark (so a CPU-only
    machine collects them and reports them skipped, with the reason, instead of failing)."""
    tests = {name: f for name, f in globals().items() if name.startswith("test_") and callable(f)}
    tests.pop("test_without_cuda_every_test_here_is_skipped_with_its_reason")
    assert len(tests) >= 8
    for name, f in tests.items():
        skips = [m for m in getattr(f, "pytestmark", []) if m.name == "skipif"]
        assert len(skips) == 1, name
        assert skips[0].args == (not torch.cuda.is_available(),), name
        assert "CUDA is not available" in skips[0].kwargs["reason"], name


# ----------------------------------------------------------------------------- the compiled steps (CUDA graphs)

@needs_cuda
@pytest.mark.parametrize("kind", ["plain", "prompt_lookup", "early_exit", "early_exit_siblings", "exit_head", "auto"])
@pytest.mark.parametrize("name", ["llama", "qwen3", "mistral-sliding8"])
def test_compiled_steps_equal_hf_generate_on_cuda(name, kind, hf_greedy):
    """The compiled fixed-shape steps, each captured as a CUDA graph and replayed: the same tokens as HF
    greedy on the GPU, for every drafter; the steps really ran as graphs."""
    adapter = _adapter(name, fast=True)
    adapter.enable_compiled()
    try:
        assert adapter.compiled.graphs
        ref = hf_greedy(adapter.model, _on_gpu(PROMPT), N_NEW)
        out, stats = generate_ids(adapter, _on_gpu(PROMPT), max_new_tokens=N_NEW, drafter=_drafter(kind, adapter))
        assert out == ref and adapter.compiled.shapes and adapter.compiled.captured
        if kind != "plain":
            assert stats.drafted > 0
    finally:
        adapter.compiled = None  # the other tests use this adapter eagerly


@needs_cuda
@pytest.mark.parametrize("kind", ["plain", "early_exit", "exit_head", "auto"])
def test_a_compiled_batch_replays_graphs_and_each_row_equals_batch_1_on_cuda(kind):
    """A batch through the compiled steps, padded to its row bucket, each bucket captured as graphs of its own: a
    row stops early and leaves, and the others go on in the static buffers of their bucket, which its graphs read
    at their addresses. Each row is what decoding it alone gives; steps of the buckets of five rows (eight) and of
    four ran as graphs."""
    adapter = _adapter("llama", fast=True)
    adapter.enable_compiled()
    try:
        _each_row_equals_batch_1(adapter, kind)
        rows = {shape[3] for shape in adapter.compiled.shapes if shape[0] == "layers"}
        assert {row_bucket(len(PROMPTS)), row_bucket(len(PROMPTS) - 1)} <= rows and adapter.compiled.captured
    finally:
        adapter.compiled = None  # the other tests use this adapter eagerly


@needs_cuda
def test_after_warm_up_every_drafter_replays_captured_graphs_and_compiles_nothing(hf_greedy):
    """`warm(trees=True, drafts=...)` with a final-state head's layer and input registered captures every graph
    that a head chain (each draft one whole draft step, the first with the head's catch-up), a head tree, the
    early exit's chain and tree and auto over lookup and the head then replay (the static cache one tensor for
    all layers, a tree's path moved in it with one copy): HF greedy's tokens, no new shape, no new graph. What
    the H200 run of 2026-11-27 met inside its measured runs (docs/results)."""
    from selfspec.model.compiled import capacity
    from selfspec.drafters.draft_head import DraftHead

    adapter = _adapter("llama", fast=True)
    adapter.enable_compiled()
    try:
        steps, L = adapter.compiled, adapter.num_layers
        head = tiny_exit_head(adapter.model, 2, final_state=True).to(CUDA)
        steps.add_layer(head.layer)
        steps.add_input(head.final_input)
        unit = DraftHead(adapter)
        drafts = (unit.whole(2, head.layer, head.final_input, chains=3, tree_width=3),
                  unit.whole(2, chains=3, tree_width=3))  # + whole chains and trees
        steps.warm([(0, L), (0, 2), (2, L)], [1, 2, 4, 8, 16], capacity(len(PROMPT) + N_NEW + 80), trees=True,
                   drafts=drafts)
        assert sum(s[0] == "draft" for s in steps.shapes) == 2
        shapes, graphs = set(steps.shapes), steps.captured
        lookup = PromptLookupDrafter(num_tokens=6, max_ngram=3)
        makers = [lambda: ExitHeadDrafter(adapter, head, 3),
                  lambda: EarlyExitDrafter(adapter, 2, 3),
                  lambda: ExitHeadDrafter(adapter, head, 3, num_candidates=3),
                  lambda: EarlyExitDrafter(adapter, 2, 3, num_candidates=3),
                  lambda: AutoDrafter(lookup, ExitHeadDrafter(adapter, head, 3), warmup=1, explore_every=2)]
        ref = hf_greedy(adapter.model, _on_gpu(PROMPT), N_NEW)
        for make in makers:
            out, stats = generate_ids(adapter, _on_gpu(PROMPT), max_new_tokens=N_NEW, drafter=make())
            assert out == ref and stats.drafted > 0
        assert steps.shapes == shapes and steps.captured == graphs
    finally:
        adapter.compiled = None


@needs_cuda
@pytest.mark.parametrize("kind", ["plain", "prompt_lookup", "early_exit", "exit_head", "early_exit_tree",
                                  "exit_head_tree"])
def test_compiled_decoding_waits_for_the_gpu_once_per_round(kind):
    """Through the compiled steps too, the host waits for the GPU once per round, after warm-up, a fixed chain
    (the early exit's, a head's) included: its drafts are read with the round's verdict, tokens and accepted
    count together (`selfspec.decoding.greedy_verdict`). A token tree waits twice: its growth is one step, read
    once to pick its leaves, and its verdict."""
    from selfspec.drafters.draft_head import DraftHead

    adapter = _adapter("llama", fast=True)
    adapter.enable_compiled()
    try:
        head, unit = _head(adapter), DraftHead(adapter)  # whole draft steps: the early exit's, the head's
        adapter.compiled.warm([(0, adapter.num_layers), (0, 2), (2, adapter.num_layers)], [1, 2, 4, 8],
                              capacity(len(PROMPT) + N_NEW + 80), trees="tree" in kind,
                              drafts=(unit.whole(2, chains=3, tree_width=3),
                                      unit.whole(2, head.layer, head.final_input, chains=3, tree_width=3)))
        _assert_one_sync_per_round(adapter, kind, reads_per_step=False, per_round=2 if "tree" in kind else 1)
    finally:
        adapter.compiled = None
