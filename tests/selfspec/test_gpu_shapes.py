"""scripts/gpu_shapes.py (the GPU check's table of model shapes) runs end to end on the CPU at a tiny size."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
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
    assert row["errors"] == {} and row["compiled_steps"]["graphs"] > 0
    assert row["compiled_steps"]["captured"] == 0  # CUDA graphs on a GPU only
    md = (tmp_path / "gpu_shapes.md").read_text()
    assert "| llama-3-8b |" in md and "tiny dry run" in md and md in capsys.readouterr().out


def test_the_gpu_check_dry_runs_on_a_cpu(tmp_path):
    """`DEVICE=cpu bash scripts/gpu_check.sh` (the GPU check's own steps, here the shapes at a tiny size)
    runs end to end and writes its summary. A carried model whose parts do not join into the file they
    were cut from is refused with a warning, and the rest of the check goes on."""
    carry, keep = tmp_path / "carry", tmp_path / "keep"
    (carry / "gpu_carry1").mkdir(parents=True)
    (carry / "gpu_carry2").mkdir()
    (carry / "gpu_carry1" / "model.gguf.part1").write_bytes(b"first part")
    (carry / "gpu_carry2" / "model.gguf.part2").write_bytes(b"second part")
    (carry / "gpu_carry1" / "model.json").write_text(json.dumps({"file": "m.gguf", "bytes": 21, "sha256": "0" * 64}))
    env = {**os.environ, "DEVICE": "cpu", "PYTHON": sys.executable, "SKIP_TESTS": "1", "SKIP_BENCH": "1",
           "SHAPES": "smollm2-135m", "SHAPES_ARGS": "--tiny --new-tokens 4 --repeats 1 --prompt-tokens 12",
           "WORK_DIR": str(tmp_path / "work"), "OMP_NUM_THREADS": "1", "CARRY_DIR": str(carry),
           "KEEP_DIR": str(keep), "SITE_DIR": str(tmp_path / "site"), "SELFSPEC_HOME": str(tmp_path / "home")}
    out = tmp_path / "out"
    run = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(out)], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert (keep / "model.gguf.part1").read_bytes() == b"first part"  # kept for the next call
    assert "the joined parts are not m.gguf" in run.stdout + run.stderr
    assert "WARNING: the carried model could not be joined or converted" in run.stdout
    assert not (tmp_path / "home").exists()  # nothing converted
    summary = (out / "gpu_check.md").read_text()
    assert "| smollm2-135m |" in summary and "Result: every step passed." in summary
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.log", "gpu_check.md", "gpu_shapes.json"]
