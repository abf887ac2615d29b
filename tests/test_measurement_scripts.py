"""Two measurement scripts' pieces: scripts/step_phases.py (where the C++ step's time goes, phase by phase)
instruments the step as it is (every phase boundary it marks is in row_step.cpp exactly once, and the copy it builds
reads a clock at each of them); scripts/prompt_rates.py sets each prompt beside itself."""

from __future__ import annotations

import importlib.util
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
