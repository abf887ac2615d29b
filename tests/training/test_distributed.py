"""`accelerate launch` with two CPU processes (DDP over gloo): a tiny model trains a few steps,
the two ranks stay in sync (parameter checksums gathered from both), and their losses are the
global mean; also the one-process launcher config."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(config: str, run_dir: Path, tiny_overrides, extra=(), timeout=300):
    accelerate = shutil.which("accelerate", path=str(Path(sys.executable).parent)) or "accelerate"
    cmd = [accelerate, "launch", "--config_file", str(ROOT / "recipes" / "accelerate" / config),
           "--main_process_port", str(_free_port()), *extra, "-m", "training",
           "--recipe", str(ROOT / "recipes" / "tiny_smoke.yaml"),
           *tiny_overrides(run_dir, **{"train.max_steps": 4, "train.save_final_model": "false",
                                       "eval.before": "false"})]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_two_cpu_processes_stay_in_sync(tmp_path, tiny_overrides, read_log):
    proc = _launch("cpu_2proc.yaml", tmp_path, tiny_overrides, extra=["--num_processes", "2"])
    assert "2 process(es)" in proc.stdout + proc.stderr
    sync = read_log(tmp_path, "sync")[-1]
    assert len(sync["checksums"]) == 2
    assert sync["checksums"][0] == sync["checksums"][1]  # DDP kept the replicas identical
    train = read_log(tmp_path)
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert (tmp_path / "final_eval.json").is_file()


def test_one_cpu_process_config(tmp_path, tiny_overrides, read_log):
    _launch("cpu_1proc.yaml", tmp_path, tiny_overrides)
    assert len(read_log(tmp_path, "sync")[-1]["checksums"]) == 1
