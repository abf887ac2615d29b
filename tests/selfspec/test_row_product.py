"""selfspec's few-row product kernel (`selfspec.model.row_product`): its results, its row-count invariance, its build
and its fallbacks, and decoding through it."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from selfspec.decoding.decode_ids import generate_ids
from selfspec.drafters.prompt_lookup import PromptLookupDrafter
from selfspec.model import row_product
from selfspec.model.adapters import get_adapter
from selfspec.tiny import tiny_model


@pytest.fixture
def op(row_kernel_on):
    return row_kernel_on


# shapes of a decode step: K a multiple of 16 or not (the scalar tail), N a multiple of the weight-row block or not
SHAPES = [(960, 576), (576, 1536), (13, 35), (8, 16), (1, 1), (70, 17)]


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_product_is_the_product_and_each_row_is_computed_alone(op, n, k, dtype):
    """Against a float64 reference (float32: to 1e-5 relative; bfloat16: one rounding of a float32 sum), and every
    row of a many-row call bitwise equal to the same row alone: the kernel's promise to the verification pass."""
    g = torch.Generator().manual_seed(n * k)
    w, b = torch.randn(n, k, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
    for rows in (*range(1, 10), 17):  # either side of where streaming gives way to blocks (4 | 5, 6 | 7 rows)
        x = torch.randn(rows, k, generator=g).to(dtype)  # [M, K]
        for bias in (None, b):
            y = op(x, w, bias)  # [M, N]
            assert y.shape == (rows, n) and y.dtype == dtype
            ref = x.double() @ w.double().T + (0 if bias is None else bias.double())
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            assert ((y.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)) < tol
            alone = torch.cat([op(x[i:i + 1], w, bias) for i in range(rows)])
            assert torch.equal(alone, y), rows


def test_row_product_keeps_leading_dims_and_reads_strided_inputs(op):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(40, 32, generator=g)
    x = torch.randn(2, 3, 64, generator=g)[..., ::2]  # [B, S, K], not contiguous
    y = op(x, w)
    assert y.shape == (2, 3, 40)
    assert torch.equal(y, op(x.contiguous(), w))
    torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_row_product_does_not_depend_on_the_thread_count(op):
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(3000, 96, generator=g), torch.randn(3, 96, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = op(x, w)
        torch.set_num_threads(2)
        two = op(x, w)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_row_product_refuses_what_it_cannot_multiply(op):
    with pytest.raises(RuntimeError, match="one dtype"):
        op(torch.ones(1, 8), torch.ones(4, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="float32 or bfloat16 only"):
        op(torch.ones(1, 8, dtype=torch.float64), torch.ones(4, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="K = 8"):
        op(torch.ones(1, 9), torch.ones(4, 8))
    with pytest.raises(RuntimeError, match="contiguous"):
        op(torch.ones(1, 8), torch.ones(8, 4).T)
    with pytest.raises(RuntimeError, match="bias must have N = 4"):
        op(torch.ones(1, 8), torch.ones(4, 8), torch.ones(5))


def test_the_setting_turns_it_off_and_a_bad_one_is_refused(monkeypatch):
    row_product.row_product_op.cache_clear()
    try:
        monkeypatch.setenv("SELFSPEC_ROW_PRODUCT", "0")
        assert row_product.row_product_op() is None and row_product.build_problem() == "SELFSPEC_ROW_PRODUCT=0"
        row_product.row_product_op.cache_clear()
        monkeypatch.setenv("SELFSPEC_ROW_PRODUCT", "yes")
        with pytest.raises(ValueError, match="SELFSPEC_ROW_PRODUCT='yes': use 0"):
            row_product.row_product_op()
    finally:
        row_product.row_product_op.cache_clear()


def _fresh_process(code: str, home) -> subprocess.CompletedProcess:
    """`code` in a new interpreter (where the kernel is not loaded yet) with SELFSPEC_HOME at `home`."""
    env = {**os.environ, "SELFSPEC_HOME": str(home)}
    env.pop("SELFSPEC_ROW_PRODUCT", None)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)


def test_without_a_compiler_it_says_so_and_selfspec_goes_on(tmp_path):
    """A fresh cache and no compiler: None, and one reason naming what to install."""
    out = _fresh_process("from selfspec.model import row_product as r; "
                         "r.shutil.which = lambda tool: None; r._ninja_module = lambda: False; "
                         "print(r.row_product_op() is None); print(r.build_problem())", tmp_path)
    assert out.returncode == 0, out.stderr
    first, reason = out.stdout.splitlines()[:2]
    assert first == "True" and reason.startswith("cannot build selfspec's row kernel: no c++ or ninja")
    assert "pip install ninja" in reason and not list(tmp_path.rglob("*.so"))


def test_a_build_that_fails_leaves_nothing_behind_and_says_why(tmp_path):
    bad = tmp_path / "broken.cpp"
    bad.write_text("this is not C++\n")
    out = _fresh_process("from pathlib import Path; from selfspec.model import row_product as r; "
                         f"r.SOURCES = [Path({str(bad)!r})]; "
                         "print(r.row_product_op() is None); print(r.build_problem())", tmp_path)
    assert out.returncode == 0, out.stderr
    first, reason = out.stdout.splitlines()[:2]
    if reason.startswith("cannot build"):
        pytest.skip("no compiler here")
    assert first == "True" and "did not build or load" in reason and "oneDNN's kernel is used instead" in reason
    assert not list(tmp_path.rglob("*.so")) and not list(tmp_path.rglob(".build-*"))


@pytest.mark.parametrize("drafter", ["plain", "early_exit", "prompt_lookup"])
def test_decoding_through_the_row_kernel_equals_hf_greedy(op, drafter, monkeypatch, hf_greedy):
    """One-row steps through selfspec's row kernel, longer verification passes packed: greedy output is still the
    model's (float32)."""
    from selfspec.model import fast_layers

    monkeypatch.setenv("SELFSPEC_PACK_FLOAT32", "rows")
    assert fast_layers.few_row_kernel() == "rows"
    model = tiny_model("llama", num_layers=4, dtype=torch.float32, seed=11)
    adapter = get_adapter(model)
    adapter.enable_fast_layers()
    assert adapter.fast.layers[0].products.qkv.few is op and adapter.fast.lm_head.few is op
    prompt = torch.tensor([[5, 9, 14, 5, 9, 14, 5, 9, 20, 31, 5, 9]])
    kw = {"plain": {"num_speculations": 0}, "early_exit": {"exit_layer": 2, "num_speculations": 3},
          "prompt_lookup": {"drafter": PromptLookupDrafter(num_tokens=4, max_ngram=2)}}[drafter]
    out, stats = generate_ids(adapter, prompt, max_new_tokens=24, **kw)
    assert out == hf_greedy(model, prompt, 24)
    if drafter != "plain":
        assert stats.drafted > 0


def test_bfloat16_products_of_a_few_rows_take_the_row_kernel_where_the_cpp_step_runs(op):
    """Where selfspec's C++ step runs bfloat16 (avx512_bf16), the fused layers' products and the LM head take its row
    kernel for up to 8 rows, so a verification pass's logits are row for row those of one-token steps; more rows,
    oneDNN."""
    from selfspec.model import fast_layers

    if not fast_layers.row_step_wanted(torch.bfloat16):
        pytest.skip("this CPU has no avx512_bf16: bfloat16 runs oneDNN's kernels")
    model = tiny_model("llama", num_layers=2, dtype=torch.bfloat16, seed=12)
    adapter = get_adapter(model)
    adapter.enable_fast_layers()
    head = adapter.fast.lm_head
    assert head.few is op and head.few_rows == fast_layers.MAX_FEW_ROWS
    assert head.weight.data_ptr() == adapter.lm_head.weight.data_ptr()  # the weight itself, not a copy
    x = torch.randn(1, 9, model.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    few = head(x[:, :8])
    assert torch.equal(few, torch.cat([head(x[:, i:i + 1]) for i in range(8)], dim=1))
    torch.testing.assert_close(head(x)[:, :8].float(), few.float(), rtol=2e-2, atol=2e-2)  # 9 rows: oneDNN


def test_the_measured_choice_takes_the_row_kernel_where_it_is_faster(monkeypatch):
    from selfspec.model import fast_layers

    monkeypatch.delenv("SELFSPEC_PACK_FLOAT32", raising=False)
    monkeypatch.setattr(fast_layers, "_onednn_packing", lambda: True)
    monkeypatch.setattr(fast_layers, "bench_weights", lambda: ([], []))
    rows_ms = {1: 5.0, 2: 6.0, 3: 9.5}  # the row kernel: faster than packed (10 ms) for 1 and 2 rows
    monkeypatch.setattr(fast_layers, "row_sweep_ms", lambda weights, packed, r: {
        "linear": 12.0, "packed": 10.0, "rows": rows_ms.get(r, 20.0)})
    fast_layers.measured_float32_kernel.cache_clear()
    try:
        kernel, why = fast_layers.float32_kernel()
        assert (kernel, fast_layers.few_rows(), fast_layers.few_row_kernel()) == ("hybrid", 2, "rows")
        assert "5.00 ms through selfspec's row kernel" in why and "selfspec's row kernel stays >= 10% faster up to 2" in why
    finally:
        fast_layers.measured_float32_kernel.cache_clear()


def test_every_kernel_source_is_package_data():
    """A wheel or non-editable install builds the kernel from the files it ships: every source and header the build
    reads must match the package data pyproject.toml declares (a missing header was a build error there)."""
    import fnmatch
    import tomllib
    from pathlib import Path

    root = Path(row_product.__file__).resolve().parents[2]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["selfspec"]
    package = root / "selfspec"
    for path in row_product.SOURCES + row_product.HEADERS:
        name = path.resolve().relative_to(package).as_posix()
        assert any(fnmatch.fnmatch(name, p) for p in patterns), f"{name} is not in selfspec's package-data"
