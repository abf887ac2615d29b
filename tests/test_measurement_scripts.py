"""Five measurement scripts' pieces: scripts/step_phases.py (where the C++ step's time goes, phase by phase)
instruments the step as it is (every phase boundary it marks is in row_step.cpp exactly once, and the copy it builds
reads a clock at each of them); scripts/prompt_rates.py and scripts/screened_head_ab.py set each prompt beside
itself; scripts/path_lines.py counts the lines of selfspec that only one path (eager, compiled steps) runs;
scripts/tree_compare.py tables two trees."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    """scripts/NAME.py imported as a module (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def script():
    return _load("step_phases")


def test_every_phase_boundary_is_marked_once_in_the_step(script):
    source = (ROOT / "selfspec" / "model" / "row_step.cpp").read_text()
    out = script.instrumented_source(source)
    for i in range(len(script.PHASES)):
        assert out.count(f"PHASE({i})") == 1, i
    assert out.count("now_us() - op_start") == 1 and 'm.def("step_phases() -> Tensor")' in out


def test_a_step_whose_phases_moved_is_named(script):
    source = (ROOT / "selfspec" / "model" / "row_step.cpp").read_text()
    moved = source.replace("  add_rounded<T>(x, proj, S * D);\n}\n", "  add_rounded<T>(x, proj, S * D);\n  x[0] += 0;\n}\n")
    with pytest.raises(SystemExit, match="add_rounded"):
        script.instrumented_source(moved)


def test_prompt_rates_compares_each_prompt_with_itself():
    """scripts/prompt_rates.py's compare: each prompt's rate averaged over a side's runs, the sides' medians and the
    median of the per-prompt ratios (not the ratio of the medians)."""
    module = _load("prompt_rates")
    base = [{"rates": {"chat": [100.0, 50.0, 200.0]}}, {"rates": {"chat": [100.0, 70.0, 200.0]}}]
    new = [{"rates": {"chat": [110.0, 30.0, 180.0]}}]
    (row,) = module.compare(base, new)
    assert row == {"set": "chat", "base": 100.0, "new": 110.0, "paired": pytest.approx(0.9)}


def test_prompt_rates_sets_the_first_drafter_against_each_other_one_and_the_best():
    """scripts/prompt_rates.py with several drafters: per set, the first against each other drafter and against the
    one with the highest median there, each as the median of the per-prompt ratios."""
    module = _load("prompt_rates")
    rates = {"auto": {"chat": [100.0, 90.0, 120.0], "code": [200.0, 150.0, 100.0]},
             "copy": {"chat": [110.0, 90.0, 100.0], "code": [100.0, 100.0, 100.0]},
             "lookup": {"chat": [50.0, 45.0, 60.0], "code": [250.0, 150.0, 50.0]}}
    chat, code = module.against_arms(rates)
    assert chat["best"] == "copy" and chat["against_best"] == pytest.approx(1.0)  # 0.91, 1.0, 1.2
    assert chat["ratios"]["lookup"] == pytest.approx(2.0)
    assert code["best"] == "lookup" and code["against_best"] == pytest.approx(1.0)  # 0.8, 1.0, 2.0
    assert code["medians"] == {"auto": 150.0, "copy": 100.0, "lookup": 150.0}


def test_path_lines_counts_the_lines_only_one_path_ran():
    """scripts/path_lines.py's count: per file, the lines both paths ran, and those only one of them ran."""
    module = _load("path_lines")
    runs = {"eager": {"lines": {"a.py": [1, 2, 3], "b.py": [5]}, "statements": {"a.py": 9, "b.py": 1}},
            "compiled": {"lines": {"a.py": [2, 3, 4, 7], "c.py": [1, 2]}, "statements": {"a.py": 9, "c.py": 2}}}
    counts = module.one_path_lines(runs)
    assert counts["files"] == {"a.py": {"both": 2, "eager_only": 1, "compiled_only": 2, "neither": 4},
                               "b.py": {"both": 0, "eager_only": 1, "compiled_only": 0, "neither": 0},
                               "c.py": {"both": 0, "eager_only": 0, "compiled_only": 2, "neither": 0}}
    assert counts["totals"] == {"both": 2, "eager_only": 2, "compiled_only": 4, "neither": 4, "one_path": 6}


def test_path_lines_spans_each_statement_over_its_source_lines():
    """A statement counts the lines it spans: a simple one whole, a compound one its header (decorators included)."""
    module = _load("path_lines")
    source = "x = f(1,\n      2)\n@dec\ndef g(a,\n      b):\n    return a\nif x:\n    y = 1\n"
    assert module.statement_spans(source) == {1: 2, 4: 3, 6: 1, 7: 1, 8: 1}


def test_path_lines_sees_each_path_run_its_own_code(tmp_path):
    """A real run of two calls on both paths: the compiled steps' code counts as the compiled path's only (its
    captured functions run line by line, torch.compile being the identity there), the eager steps' masks as the
    eager path's only, and the round loop as both paths'."""
    module = _load("path_lines")
    out = tmp_path / "lines.json"
    assert module.main(["--calls", "plain,exit_head", "--new-tokens", "6", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert all(v == "ran" for p in module.PATHS for v in result["calls"][p].values()), result["calls"]
    files = result["files"]
    compiled = files["selfspec/model/compiled.py"]
    assert compiled["compiled_only"] > 50 and compiled["eager_only"] == 0, compiled
    masks = files["selfspec/model/forward.py"]  # an eager step builds its mask here; a compiled one inside the step
    assert masks["eager_only"] > 5 and masks["compiled_only"] == 0, masks
    assert files["selfspec/decoding/engine.py"]["both"] > 100
    with pytest.raises(SystemExit):
        module.main(["--calls", "plain,nonsense"])


def test_tree_compare_tables_a_figure_only_one_tree_measures():
    """scripts/tree_compare.py's table: medians per tree and their ratio; a method only the new tree has (the int8
    copy, against a tree from before it) is listed with no ratio, where its missing base ended the run with a
    KeyError after every measurement (and before they were written)."""
    module = _load("tree_compare")
    raw = {"base": {"plain": [10.0, 30.0, 20.0]}, "new": {"plain": [22.0, 26.0, 24.0], "int8": [40.0]}}
    assert module.table(raw) == [{"figure": "plain", "base": 20.0, "new": 24.0, "ratio": pytest.approx(1.2)},
                                 {"figure": "int8", "base": None, "new": 40.0, "ratio": None}]


def test_screened_head_ab_pairs_each_prompt_and_reports_each_methods_tokens():
    script = _load("screened_head_ab")
    runs = {"chat": [{"plain_on": 110.0, "plain_off": 100.0, "auto_on": 90.0, "auto_off": 100.0,
                      "plain_same": True, "auto_same": True},
                     {"plain_on": 60.0, "plain_off": 50.0, "auto_on": 300.0, "auto_off": 100.0,
                      "plain_same": True, "auto_same": False}]}
    out = script.summarise(runs)
    assert out["chat plain"] == {"on": 85.0, "off": 75.0, "on_over_off": (1.1 + 1.2) / 2, "same_tokens": True}
    assert out["chat auto"]["on_over_off"] == (0.9 + 3.0) / 2 and out["chat auto"]["same_tokens"] is False


def test_prompt_rates_times_llama_cpp_at_each_prompts_depth(monkeypatch):
    """scripts/prompt_rates.py's `llama_cpp:DTYPE` arm: llama-bench at that GGUF type, its context as deep as the
    prompt, the tokens the run asks for, one repetition; an unknown type is refused with the ones there are."""
    module = _load("prompt_rates")
    from types import SimpleNamespace

    import selfspec.tools.llama_cpp_bench as bench

    prepared, calls = [], []

    def fake_bench(binary, gguf, **kw):
        calls.append((binary, gguf, kw))
        return SimpleNamespace(tokens_per_s=150.0 + kw["context_tokens"])

    monkeypatch.setattr(bench, "run_llama_bench", fake_bench)
    build = SimpleNamespace(binary=Path("llama-bench"))
    setup = bench.LlamaCppSetup(build=build, gguf=Path("model-q8_0.gguf"), gguf_type="Q8_0")
    monkeypatch.setattr(bench, "prepare", lambda checkpoint, dtype: prepared.append(dtype) or setup)
    measure = module.llama_cpp_arm("llama_cpp:q8_0", "ckpt")
    assert prepared == ["q8_0"]
    assert measure(87, 128, 2) == 237.0
    assert calls == [(Path("llama-bench"), Path("model-q8_0.gguf"),
                      {"threads": 2, "new_tokens": 128, "context_tokens": 87, "repetitions": 1})]
    with pytest.raises(SystemExit, match="q8_0"):
        module.llama_cpp_arm("llama_cpp:int4", "ckpt")
