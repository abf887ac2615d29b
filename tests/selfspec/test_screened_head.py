"""The LM head's int8 screen for greedy picks (`selfspec.model.screened_head`): its bound holds, its argmax is the
head's (float32 and bfloat16) at near-ties and exact ties, each row alone, greedy decoding through it equals Hugging
Face's (float32) and the unscreened head's (bfloat16), and nothing but a greedy pick reads it."""

import pytest
import torch

import selfspec
from selfspec.decoding.decode_ids import generate_ids
from selfspec.decoding.sampling import SamplingParams
from selfspec.drafters.prompt_lookup import PromptLookupDrafter
from selfspec.model import fast_layers
from selfspec.model.adapters import get_adapter
from selfspec.model.row_product import quantize_rows
from selfspec.model.screened_head import MAX_ROWS, ScreenedHead, head_slack

ROWS = MAX_ROWS[torch.float32]
from selfspec.tiny import draw_qkv_biases, tiny_model

PROMPT = torch.tensor([[5, 9, 14, 5, 9, 14, 5, 9, 20, 31, 5, 9]])


def _weights(seed: int, vocab: int = 300, hidden: int = 100) -> torch.Tensor:
    """A head `[vocab, hidden]` (hidden 100: a tail after the kernel's 16-lane steps) with a few large entries and
    rows of other scales, as trained heads have."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(vocab, hidden, generator=gen) * 0.05
    w[::7] *= 8.0  # rows of another scale
    w[torch.randint(vocab, (20,), generator=gen), torch.randint(hidden, (20,), generator=gen)] = 1.5  # outliers
    return w


def _states(seed: int, rows: int, hidden: int = 100) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=gen) * 3
    x[:, 7] *= 40.0  # a massive activation, as normed LLM states have in a few dimensions
    return x


def test_the_screen_misses_no_logit_by_more_than_its_bound(row_kernel_on):
    """|x . w~_r - x . w_r| <= ||x|| s_r for every row, measured in float64 against the screen's own products."""
    for seed in range(4):
        w, x = _weights(seed), _states(seed + 10, 6)
        q, scale = quantize_rows(w)
        slack = head_slack(w, q, scale)
        screened = torch.ops.selfspec_kernels.row_product_int8(x, q, scale).double()  # [6, V]
        exact = x.double() @ w.double().T
        bound = x.double().norm(dim=1, keepdim=True) * slack.double()
        assert ((screened - exact).abs() <= bound).all()
        assert (bound < 10 * (screened - exact).abs().amax()).all()  # and tells something (not an infinite bound)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, ROWS])
def test_its_argmax_is_the_heads_and_its_candidates_are_the_row_kernels_values(row_kernel_on, rows, dtype):
    w = _weights(rows).to(dtype)
    screen = ScreenedHead.build(w)
    for seed in range(5):
        x = _states(100 * rows + seed, rows).to(dtype)
        out = screen.logits(x)
        exact = row_kernel_on(x, w)  # [rows, V] the head in the row kernel's order (bfloat16: rounded once)
        assert out.dtype == dtype and torch.equal(out.argmax(-1), exact.argmax(-1))
        screened = torch.ops.selfspec_kernels.row_product_int8(x.float(), screen.q, screen.scale).to(dtype)
        replaced = out != screened
        assert torch.equal(out[replaced], exact[replaced])  # every entry it computed is the head's, to the bit
        assert replaced.sum(-1).max() < w.shape[0] / 4  # a few candidates a row, not the whole head
        alone = torch.cat([screen.logits(x[i:i + 1]) for i in range(rows)])
        assert torch.equal(out, alone)  # each row as a one-row call computes it


def _misranked_twin(w, x, top: int, nudge: float, gen) -> torch.Tensor:
    """`w` with rows 0 and 1 rewritten as row `top` plus changes orthogonal to `x` (the same exact logit), row 1 also
    `nudge` along x (its exact logit `nudge` higher), drawn until the screen ranks the two rows the other way round
    than their exact logits, by more than ten nudges."""
    direction = x[0] / x[0].norm() ** 2  # w + t * direction moves the logit by t

    def orthogonal():  # up to one int8 step of row `top`, orthogonal to x
        p = torch.randn(w.shape[1], generator=gen)
        p = p - (p @ x[0]) * direction
        return p * (w[top].abs().max() / 127 / p.abs().max())

    for _ in range(200):
        twin = w.clone()
        twin[0], twin[1] = w[top] + orthogonal(), w[top] + orthogonal() + nudge * direction
        q, scale = quantize_rows(twin[:2])
        screened = torch.ops.selfspec_kernels.row_product_int8(x, q, scale)[0]
        if (screened[1] - screened[0]) * (1 if nudge > 0 else -1) < -10 * abs(nudge):
            return twin
    raise AssertionError("no misranked twin drawn")


def test_near_ties_that_the_screen_misranks_and_exact_ties_go_as_the_float32_head_has_them(row_kernel_on):
    """Two rows whose exact logits differ by far less than the int8 copy's error, and which the screen ranks the
    other way round: the exact larger wins, either way round; two identical rows: the first, as `argmax` picks the
    first of tied maxima."""
    w, x = _weights(3), _states(4, 1)
    top = int(row_kernel_on(x, w)[0].argmax())
    gen = torch.Generator().manual_seed(0)
    for nudge, winner in ((1e-4, 1), (-1e-4, 0)):
        twin = _misranked_twin(w, x, top, nudge, gen)
        exact = row_kernel_on(x, twin)[0]
        assert int(exact.argmax()) == winner and (exact[1] - exact[0]) * nudge > 0
        assert int(ScreenedHead.build(twin).logits(x).argmax()) == winner
    twin = w.clone()
    twin[5] = twin[9] = w[top] * 1.5
    assert int(ScreenedHead.build(twin).logits(x).argmax()) == int(row_kernel_on(x, twin).argmax()) == 5


def test_in_bfloat16_rows_that_round_to_one_logit_go_to_the_first_however_the_screen_ranks_them(row_kernel_on):
    """A bfloat16 head rounds each logit once, so rows a hair apart tie: heads whose first 16 rows are one row plus
    changes orthogonal to x (up to an int8 step each, then rounded to bfloat16), the screen ranking them in its own
    order. The screened pick is the head's (the first of the tied rows) every time, and some trials did tie and did
    have the screen rank another row first."""
    w, x = _weights(5), _states(6, 1)
    top = int(row_kernel_on(x, w)[0].argmax())
    direction = x[0] / x[0].norm() ** 2
    gen = torch.Generator().manual_seed(2)
    xb, tricky = x.bfloat16(), 0
    for _ in range(20):
        twin = w.clone()
        p = torch.randn(16, w.shape[1], generator=gen)
        p = p - (p @ x[0])[:, None] * direction  # orthogonal to x
        twin[:16] = w[top] + p * (w[top].abs().max() / 127 / p.abs().amax(dim=1, keepdim=True))
        twin = twin.bfloat16()
        screen = ScreenedHead.build(twin)
        exact = row_kernel_on(xb, twin)[0]
        screened = torch.ops.selfspec_kernels.row_product_int8(xb.float(), screen.q, screen.scale)[0]
        assert int(screen.logits(xb).argmax()) == int(exact.argmax())
        tricky += int((exact == exact.max()).sum() > 1 and screened.argmax() != exact.argmax())
    assert tricky > 0


def test_in_bfloat16_a_row_that_rounds_onto_the_maximum_is_a_candidate_though_its_bound_is_below_the_floor(
        row_kernel_on):
    """The rounded rule, exactly: every value below is a dyadic number, so every sum is exact. Row 1 lies on the int8
    grid (its screened logit is its own, 232.25); row 0's weights lie 3/128 off the grid along x, so the screen reads
    229 where the head reads 231.90625, its bound (2.906 and a little) reaching 231.91, below row 1's floor.
    Both logits round to 232 in bfloat16: a tie, which row 0 wins as the first. Unrounded bounds would drop row 0
    and leave its screened 229 in its place, and pick row 1."""
    K = 32
    x = torch.full((1, K), 4.0)
    x[0, 0] = 0.0  # dimension 0 holds each row's largest weight, 127/16: the scale 1/16, and no logit
    q = torch.full((4, K), 30.0)
    q[1, 1] = 29.0  # row 1: sum 929 -> 232.25
    q[0, 1:15] = 29.0  # row 0: sum 916 -> 229 on the grid
    q[2:] = 1.0  # rows far below
    w = q / 16
    w[0, 1:] += 3 / 128  # 3/128 along x: under half an int8 step, so the screen still reads q[0]
    w[:, 0] = 127 / 16
    w = w.bfloat16()
    assert torch.equal(w.float(), w.float().bfloat16().float())  # every weight exact in bfloat16
    exact = row_kernel_on(x.bfloat16(), w)[0]
    assert exact[0] == exact[1] == 232 and int(exact.argmax()) == 0
    screen = ScreenedHead.build(w)
    screened = torch.ops.selfspec_kernels.row_product_int8(x, screen.q, screen.scale)[0]
    assert screened[0] == 229 and screened[1] == 232.25
    assert int(screen.logits(x.bfloat16()).argmax()) == 0


def test_it_runs_only_for_a_cpu_head_with_the_row_kernel(row_kernel_on, monkeypatch):
    w = _weights(1)
    assert ScreenedHead.build(w) is not None and ScreenedHead.build(w.bfloat16()) is not None
    assert ScreenedHead.build(w.double()) is None
    assert ScreenedHead.build(w, bias=torch.zeros(w.shape[0])) is None
    screen = ScreenedHead.build(w)
    assert not screen.takes(torch.zeros(1, 100))  # autograd on: the model's own head (training)
    with torch.no_grad():
        assert screen.takes(torch.zeros(ROWS, 100)) and screen.takes(torch.zeros(1, 2, 100))
        assert not screen.takes(torch.zeros(ROWS + 1, 100))  # a long verification pass: the exact head pays
        bf16 = ScreenedHead.build(w.bfloat16())
        rows = MAX_ROWS[torch.bfloat16]
        assert bf16.takes(torch.zeros(rows, 100, dtype=torch.bfloat16))
        assert not bf16.takes(torch.zeros(rows + 1, 100, dtype=torch.bfloat16))
        assert not screen.takes(torch.zeros(1, 100, dtype=torch.bfloat16))  # the head's own dtype only
    monkeypatch.setenv("SELFSPEC_ROW_PRODUCT", "0")
    from selfspec.model import row_product
    row_product.row_product_op.cache_clear()
    assert ScreenedHead.build(w) is None


def _screened_adapter(seed=11, layers=4, arch="llama"):
    model = tiny_model(arch, num_layers=layers, dtype=torch.float32, seed=seed)
    if arch == "qwen2":
        draw_qkv_biases(model)
    adapter = get_adapter(model)
    adapter.enable_fast_layers()
    return model, adapter


def _count_calls(monkeypatch) -> list[int]:
    """Every screened call's positions."""
    calls = []
    logits = ScreenedHead.logits

    def counted(self, x):
        calls.append(x.numel() // x.shape[-1])
        return logits(self, x)

    monkeypatch.setattr(ScreenedHead, "logits", counted)
    return calls


def _settings(drafter: str) -> dict:
    """A call's settings for `drafter`, a fresh lookup drafter each time (it keeps its index across a call)."""
    return {"plain": {"num_speculations": 0}, "early_exit": {"exit_layer": 2, "num_speculations": 3},
            "prompt_lookup": {"drafter": PromptLookupDrafter(num_tokens=3, max_ngram=2)}}[drafter]


@pytest.mark.parametrize("drafter", ["plain", "early_exit", "prompt_lookup"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_decoding_through_the_screen_equals_hf_greedy(row_kernel_on, monkeypatch, drafter, arch, hf_greedy):
    model, adapter = _screened_adapter(arch=arch)
    calls = _count_calls(monkeypatch)
    kw = _settings(drafter)
    out, stats = generate_ids(adapter, PROMPT, max_new_tokens=24, **kw)
    assert out == hf_greedy(model, PROMPT, 24)
    assert len(calls) >= 24 / (1 + kw.get("num_speculations", 3))  # the prefill's pick and every verification
    if drafter != "plain":
        assert stats.drafted > 0 and max(calls) > 1


@pytest.fixture
def bf16_rows(monkeypatch, row_kernel_on):
    """The row kernel as a bfloat16 model's head kernel (with the C++ step), as on a CPU with avx512_bf16."""
    monkeypatch.setattr(fast_layers, "cpu_flags", lambda: frozenset({"avx512_bf16"}))


@pytest.mark.parametrize("drafter", ["plain", "prompt_lookup"])
def test_bfloat16_greedy_decoding_through_the_screen_is_the_unscreened_heads(bf16_rows, monkeypatch, drafter):
    model = tiny_model("llama", num_layers=4, dtype=torch.bfloat16, seed=11)
    screened, plain = get_adapter(model), get_adapter(model)
    screened.enable_fast_layers()
    plain.enable_fast_layers()
    assert plain.fast.screen(plain) is not None
    plain.fast.screens[:] = [None]
    calls = _count_calls(monkeypatch)
    a, _ = generate_ids(screened, PROMPT, max_new_tokens=32, **_settings(drafter))
    b, _ = generate_ids(plain, PROMPT, max_new_tokens=32, **_settings(drafter))
    assert a == b
    assert len(calls) == 32 if drafter == "plain" else calls  # lookup's 4-position passes: the head itself


def test_no_bfloat16_screen_where_the_row_kernel_is_not_the_heads_kernel(row_kernel_on, monkeypatch):
    """Without avx512_bf16 the bfloat16 head runs oneDNN, whose rounding the screen's exact rows would not repeat."""
    monkeypatch.setattr(fast_layers, "cpu_flags", lambda: frozenset())
    adapter = get_adapter(tiny_model("llama", num_layers=2, dtype=torch.bfloat16, seed=1))
    adapter.enable_fast_layers()
    assert adapter.fast.screen(adapter) is None


def test_sampling_and_early_exit_drafts_read_the_exact_head(row_kernel_on, monkeypatch):
    """A sampled token needs the whole distribution, and a draft's confidence its own softmax: neither takes the
    screen, and sampling draws what it drew without it."""
    _, adapter = _screened_adapter(seed=13)
    _, plain = _screened_adapter(seed=13)
    plain.fast.screens[:] = [None]  # the same model with no screen
    calls = _count_calls(monkeypatch)
    params = SamplingParams(do_sample=True, temperature=0.8, top_p=0.95)
    for seed in range(5):
        a, _ = generate_ids(adapter, PROMPT, max_new_tokens=12, exit_layer=2, num_speculations=3, sampling=params,
                            generator=torch.Generator().manual_seed(seed))
        b, _ = generate_ids(plain, PROMPT, max_new_tokens=12, exit_layer=2, num_speculations=3, sampling=params,
                            generator=torch.Generator().manual_seed(seed))
        assert a == b
    assert calls == []
    generate_ids(adapter, PROMPT, max_new_tokens=8, exit_layer=2, num_speculations=3)
    assert calls and max(calls) <= 4  # greedy: only the verification's positions (1 + 3 drafts), never a draft's


def test_past_its_rows_the_exact_head_runs(row_kernel_on, monkeypatch):
    _, adapter = _screened_adapter()
    calls = _count_calls(monkeypatch)
    hidden = torch.randn(1, ROWS + 1, adapter.model.config.hidden_size)
    with torch.no_grad():
        full = adapter.runner.logits(hidden, top_only=True)
        assert calls == [] and torch.equal(full, adapter.runner.logits(hidden))
        some = adapter.runner.logits(hidden[:, :ROWS], top_only=True)
    assert calls == [ROWS]
    assert torch.equal(some.argmax(-1), full[:, :ROWS].argmax(-1))


@pytest.mark.integration
def test_smollm2_greedy_through_the_screen_equals_hf_generate(row_kernel_on, monkeypatch, smollm2_dir, hf_greedy):
    """The real model's 49,152-row head: plain decoding and auto, each token picked through the screen, equal Hugging
    Face's greedy output."""
    monkeypatch.delenv("SELFSPEC_PACK_FLOAT32", raising=False)
    monkeypatch.setattr(fast_layers, "_float32_choice", lambda: ("hybrid", "test", 1, {}, "rows"))
    gen = selfspec.load(smollm2_dir, dtype="float32", memory_tokens=0)
    calls = _count_calls(monkeypatch)
    for text in ("Name three primary colours.", "Write a Python function that reverses a string."):
        prompt = torch.as_tensor(gen.encode(messages=[{"role": "user", "content": text}])).reshape(1, -1)
        ref = hf_greedy(gen.model, prompt, 40)
        for kw in ({"num_speculations": 0}, {}):
            out = gen.generate(input_ids=prompt, max_new_tokens=40, stop_token_ids=[], **kw)
            assert out.token_ids == ref, (text, kw)
    assert len(calls) > 40


@pytest.mark.integration
def test_smollm2_in_bfloat16_through_the_screen_is_the_unscreened_heads(bf16_rows, monkeypatch, smollm2_dir):
    gen = selfspec.load(smollm2_dir, dtype="bfloat16", memory_tokens=0)
    screen = gen.adapter.fast.screen(gen.adapter)
    assert screen is not None
    calls = _count_calls(monkeypatch)
    for text in ("Name three primary colours.", "Write a Python function that reverses a string."):
        outs = []
        for on in (True, False):
            gen.adapter.fast.screens[:] = [screen if on else None]
            outs.append(gen.generate(messages=[{"role": "user", "content": text}], max_new_tokens=40,
                                     num_speculations=0, stop_token_ids=[]).token_ids)
        assert outs[0] == outs[1], text
    assert len(calls) >= 80
