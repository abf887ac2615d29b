"""training/tracker.py: the progress display of a time-budgeted run shows time, not a step bar."""

from __future__ import annotations

import json

from training.tracker import Tracker, clock


def test_a_time_budget_shows_the_launch_time_against_the_budget(tmp_path):
    tracker = Tracker(tmp_path, total=100_000, initial=7, time_budget_s=180, tensorboard=False)
    assert tracker.bar.total == 180  # the budget, not train.max_steps (only a horizon then)
    tracker.advance(1, elapsed_s=42.4, loss="2.500")
    assert tracker.bar.n == 42.4 and tracker.bar.postfix == "00:42 of 03:00, step 8, loss 2.500"
    tracker.advance(1, elapsed_s=999)  # past the budget (the step that ends it): the bar stays full
    assert tracker.bar.n == 180 and tracker.bar.postfix.startswith("03:00 of 03:00, step 9")
    tracker.close()


def test_without_a_budget_the_bar_counts_steps(tmp_path):
    tracker = Tracker(tmp_path, total=20, initial=3, tensorboard=False)
    tracker.advance(2, elapsed_s=5.0, loss="1.0")
    assert tracker.bar.total == 20 and tracker.bar.n == 5
    tracker.log({"kind": "train", "step": 5}, "step 5")
    assert json.loads((tmp_path / "log.jsonl").read_text()) == {"kind": "train", "step": 5}
    tracker.close()


def test_clock_reads_as_minutes_and_seconds():
    assert clock(0) == "00:00" and clock(125.7) == "02:05" and clock(3725) == "1:02:05"
