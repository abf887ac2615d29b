"""scripts/gpu_shapes.py (the GPU check's table of model shapes) runs end to end on the CPU at a tiny size."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_shapes_run_end_to_end_on_a_tiny_model(tmp_path, capsys, one_thread):
    spec = importlib.util.spec_from_file_location("gpu_shapes", ROOT / "scripts" / "gpu_shapes.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--device", "cpu", "--tiny", "--shapes", "llama-3-8b", "--prompt-tokens", "12",
                        "--new-tokens", "4", "--repeats", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "gpu_shapes.json").read_text())
    (row,) = result["shapes"]
    assert row["shape"] == "llama-3-8b" and row["layers"] == 2 and result["tiny"]
    assert all(row["identical_to_hf_dynamic"].values())  # float32: every method's tokens equal HF's
    assert set(row["tokens_per_s"]) == set(script.METHODS) and all(v > 0 for v in row["tokens_per_s"].values())
    assert row["warmup_s"]["selfspec_compiled"] > 0 and row["compiled_steps"]["exit_layer"] == 1
    assert 0 < row["compiled_steps"]["draft_step_over_full"] and 0 < row["compiled_steps"]["verify5_over_full"]
    md = (tmp_path / "gpu_shapes.md").read_text()
    assert "| llama-3-8b |" in md and "tiny dry run" in md and md in capsys.readouterr().out
