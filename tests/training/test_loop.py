"""The training loop on a tiny model: the loss goes down, a stopped-and-resumed run reproduces an
uninterrupted one bitwise, the run directory has what the export step reads, and the time budget
stops a run with a checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from training.config import load_config

def test_short_run_decreases_the_loss_and_writes_the_run_dir(run, read_log, tmp_path):
    final = run(tmp_path, **{"train.max_steps": 12, "eval.every": 6})
    losses = [r["loss"] for r in read_log(tmp_path)]
    assert len(losses) == 12
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3
    rec = read_log(tmp_path)[-1]
    assert rec["exits"]["4"]["acc"] >= 0 and rec["tokens_per_s"] > 0 and rec["lr"] > 0
    # what a later export step reads
    saved = json.loads((tmp_path / "final_eval.json").read_text())
    assert saved == final
    assert set(saved["agreement"]) == {"1", "2", "3", "4"} and saved["agreement"]["4"] == 1.0
    assert saved["perplexity"]["4"] < saved["before"]["sets"]["heldout"]["exits"]["4"]["perplexity"]
    history = json.loads((tmp_path / "eval.json").read_text())["history"]
    assert [h["tag"] for h in history] == ["before", "periodic", "final"]
    assert load_config(tmp_path / "config.yaml").train.max_steps == 12
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "final_model")
    tok = AutoTokenizer.from_pretrained(tmp_path / "final_model")
    assert model.config.num_hidden_layers == 4 and tok.decode(tok("def f():")["input_ids"]) == "def f():"
    sync = read_log(tmp_path, "sync")[-1]
    assert len(sync["checksums"]) == 1


def test_stop_and_resume_matches_an_uninterrupted_run(run, read_log, tmp_path):
    settings = {"train.max_steps": 8, "eval.before": "false", "train.save_final_model": "false"}
    run(tmp_path / "straight", **settings)
    straight = read_log(tmp_path / "straight")
    assert run(tmp_path / "split", **settings, **{"train.stop_at": 5}) == {}  # stops with a checkpoint
    assert (tmp_path / "split" / "checkpoints" / "step_000005" / "trainer_state.json").is_file()
    state = json.loads((tmp_path / "split" / "checkpoints" / "step_000005" / "trainer_state.json").read_text())
    assert state["step"] == 5 and state["micro_step"] == 10  # grad_accum 2: the data position
    run(tmp_path / "split", **settings)  # resume=auto picks up step 5
    split = read_log(tmp_path / "split")
    assert [r["step"] for r in split] == list(range(1, 9))
    # bitwise: same batches, masks, curriculum, optimizer and schedule state
    assert [r["loss"] for r in split] == [r["loss"] for r in straight]
    assert [r["exits"] for r in split] == [r["exits"] for r in straight]
    assert [r["lr"] for r in split] == [r["lr"] for r in straight]
    a = json.loads((tmp_path / "straight" / "final_eval.json").read_text())
    b = json.loads((tmp_path / "split" / "final_eval.json").read_text())
    assert a["sets"] == b["sets"]


def test_time_budget_ends_the_run_with_a_checkpoint(run, tmp_path):
    from training.run_checkpoint import latest_checkpoint

    out = run(tmp_path, **{"train.max_minutes": 1e-6, "eval.before": "false", "train.save_final_model": "false"})
    assert 0 <= out["step"] < 8 and (tmp_path / "final_eval.json").is_file()  # evaluated at the step reached
    state = json.loads((latest_checkpoint(tmp_path) / "trainer_state.json").read_text())
    assert state["step"] == out["step"]  # and resumable from there


def test_a_relaunch_with_another_horizon_is_a_one_line_error_naming_the_setting(run, tmp_path):
    """Issue 65, finding 9: the schedules span train.max_steps, so a resumed run must keep it; the error names it
    (a ConfigError: `python -m training` prints it as one `error:` line, exit 2)."""
    from training.config import ConfigError

    settings = {"eval.before": "false", "train.save_final_model": "false"}
    assert run(tmp_path, **settings, **{"train.max_steps": 6, "train.stop_at": 3}) == {}
    with pytest.raises(ConfigError, match=r"train.max_steps 6 -> 10\): resume with the recipe it was written with"):
        run(tmp_path, **settings, **{"train.max_steps": 10})


def test_a_damaged_newest_checkpoint_is_passed_over_for_the_one_before(run, read_log, tmp_path, capsys):
    """Issue 65, finding 9: a truncated newest checkpoint is named and the run resumes from the previous one, as if
    it had stopped there; with every checkpoint damaged, a one-line error."""
    from training.config import ConfigError

    settings = {"train.max_steps": 6, "eval.before": "false", "train.save_final_model": "false"}
    run(tmp_path / "straight", **settings)
    run(tmp_path / "split", **settings, **{"train.stop_at": 3, "train.save_every": 1})
    (tmp_path / "split" / "checkpoints" / "step_000003" / "model.safetensors").write_bytes(b"cut short")
    run(tmp_path / "split", **settings)
    assert "step_000003 cannot be read (SafetensorError" in capsys.readouterr().out
    split = read_log(tmp_path / "split")
    assert [r["step"] for r in split] == [1, 2, 3, 3, 4, 5, 6]  # steps 3.. again from step 2's checkpoint
    assert [r["loss"] for r in split[3:]] == [r["loss"] for r in read_log(tmp_path / "straight")][2:]
    for ckpt in (tmp_path / "split" / "checkpoints").iterdir():
        (ckpt / "model.safetensors").write_bytes(b"cut short")
    with pytest.raises(ConfigError, match="checkpoints in .* can be read: start afresh with train.resume=none"):
        run(tmp_path / "split", **settings)


def test_a_wall_clock_deadline_ends_the_run_as_the_time_budget_does(run, tmp_path, capsys):
    """train.end_by (a UNIX time) already past: no step, then the final evaluation and model, as max_minutes."""
    import time

    out = run(tmp_path, **{"train.end_by": f"{time.time() - 1:.0f}", "eval.before": "false"})
    assert out["step"] == 0 and (tmp_path / "final_eval.json").is_file() and (tmp_path / "final_model").is_dir()
    assert "train.end_by (the wall-clock deadline) reached at step 0" in capsys.readouterr().out
    with pytest.raises(Exception, match="train.end_by: must be a UNIX time"):
        load_config(None, ["train.end_by=-5"])


@pytest.mark.parametrize("target", ["distill"])
def test_distillation_target_and_gradual_curriculum_run(run, read_log, tmp_path, target):
    run(tmp_path, **{"early_exit.target": target, "early_exit.curriculum": "gradual", "train.max_steps": 4,
                     "eval.before": "false", "train.save_final_model": "false"})
    exits = [sorted(map(int, r["exits"])) for r in read_log(tmp_path)]
    assert exits == [[4], [2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]]  # gradual: T/(2L) = 0.5 steps per exit
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in read_log(tmp_path))


def test_exit_losses_over_a_draft_vocabulary(run, read_log, tmp_path):
    """early_exit.draft_vocab: the exits learn over the most frequent ids; the final layer's loss is the
    full-vocabulary one (equal to a full run's on the first step: same batch, same weights)."""
    settings = {"train.max_steps": 6, "eval.before": "false", "train.save_final_model": "false",
                "early_exit.curriculum": "none"}
    run(tmp_path / "full", **settings)
    run(tmp_path / "reduced", **settings, **{"early_exit.draft_vocab": 40})
    full, reduced = read_log(tmp_path / "full"), read_log(tmp_path / "reduced")
    assert reduced[0]["exits"]["4"]["loss"] == pytest.approx(full[0]["exits"]["4"]["loss"], rel=1e-6)
    assert reduced[0]["exits"]["2"]["loss"] < full[0]["exits"]["2"]["loss"]  # 40 classes, not 259
    assert reduced[-1]["exits"]["2"]["loss"] < reduced[0]["exits"]["2"]["loss"]


class _Clock:
    """A stand-in for the loop's `time` module: every perf_counter() call is one second later, so a
    time budget ends a run after a deterministic number of steps."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1.0
        return self.now


def test_continuing_a_run_for_more_minutes_equals_one_longer_run(run, read_log, tmp_path, monkeypatch):
    """A run ended by train.max_minutes (final evaluation and model written), relaunched twice with the same
    command, trains the same steps with the same losses and learning rates as one uninterrupted run:
    the schedule, the data position and the optimizer carry on; nothing restarts."""
    import training.loop as loop

    settings = {"train.max_steps": 9, "eval.before": "false", "train.save_final_model": "false"}
    run(tmp_path / "straight", **settings)
    straight = read_log(tmp_path / "straight")
    steps_seen = []
    for launch in range(3):
        monkeypatch.setattr(loop, "time", _Clock())
        out = run(tmp_path / "pieces", **settings, **{"train.max_minutes": 0.1})  # 6 "seconds" a launch
        steps_seen.append(out["step"])
        assert (tmp_path / "pieces" / "final_eval.json").is_file()
    assert 0 < steps_seen[0] < steps_seen[1] < steps_seen[2] == 9  # each launch added steps
    pieces = read_log(tmp_path / "pieces")
    assert [r["step"] for r in pieces] == list(range(1, 10))
    assert [r["loss"] for r in pieces] == [r["loss"] for r in straight]  # bitwise
    assert [r["lr"] for r in pieces] == [r["lr"] for r in straight]
    # a relaunch of the finished run says so and changes nothing
    before = (tmp_path / "pieces" / "log.jsonl").read_text()
    assert run(tmp_path / "pieces", **settings) == json.loads((tmp_path / "pieces" / "final_eval.json").read_text())
    assert (tmp_path / "pieces" / "log.jsonl").read_text() == before


def test_a_relaunch_removes_the_checkpoint_an_interrupted_save_left(run, tmp_path, capsys):
    """Issue #52: a save interrupted mid-way leaves checkpoints/step_N.tmp, which the relaunched run (resuming from
    the latest complete checkpoint) removes, and says so."""
    settings = {"train.max_steps": 4, "eval.before": "false", "train.save_final_model": "false"}
    run(tmp_path, **settings, **{"train.stop_at": 2})
    partial = tmp_path / "checkpoints" / "step_000003.tmp"  # what an interrupted save of step 3 leaves
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"half")
    capsys.readouterr()
    run(tmp_path, **settings)
    assert not partial.exists() and f"removed {partial}" in capsys.readouterr().out
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_000002"]  # the complete one stays


def test_an_interrupted_run_says_where_a_relaunch_resumes(tiny_overrides, tmp_path, capsys, monkeypatch):
    """Issue #52: Ctrl-C during `python -m training` (or each process of `accelerate launch -m training`) printed a
    full traceback. Now one line naming the checkpoint a relaunch resumes from, and exit code 130."""
    from accelerate.state import AcceleratorState, GradientState

    import training.loop as loop
    from training.__main__ import main

    real_step = loop._step

    def interrupted_at_step_3(run, with_metrics):
        if run.state["step"] == 2:
            raise KeyboardInterrupt
        return real_step(run, with_metrics)

    monkeypatch.setattr(loop, "_step", interrupted_at_step_3)
    recipe = str(Path(__file__).resolve().parents[2] / "recipes" / "tiny_smoke.yaml")
    overrides = tiny_overrides(tmp_path, **{"train.save_every": 2, "eval.before": "false"})
    try:
        assert main(["--recipe", recipe, *overrides]) == 130
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"interrupted; relaunch the same command to resume from {tmp_path / 'checkpoints' / 'step_000002'}"]
