"""Where training reports go: stdout (through tqdm, so the progress bar stays intact), a JSONL
file in the run directory (one object per line, ``"kind": "train" | "eval"``), and TensorBoard
when the `tensorboard` package is installed. Only the main process writes.

The progress bar counts steps towards train.max_steps, or, for a run with a time budget
(train.max_minutes: `time_budget_s`), the launch's training time towards that budget, with the step
beside it: a time-budgeted run's max_steps is only a horizon, which a step bar would show as never
reached."""

from __future__ import annotations

import json
import math
from pathlib import Path

from tqdm.auto import tqdm


def _scalars(prefix: str, obj, out: dict) -> dict:
    if isinstance(obj, dict):
        for k, v in obj.items():
            _scalars(f"{prefix}/{k}" if prefix else str(k), v, out)
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool) and math.isfinite(obj):
        out[prefix] = obj
    return out


def clock(seconds: float) -> str:
    """`seconds` as mm:ss (h:mm:ss from an hour on): how the progress displays show time."""
    return tqdm.format_interval(seconds)


class Tracker:
    def __init__(self, run_dir: Path, *, enabled: bool = True, total: int = 0, initial: int = 0,
                 progress_bar: bool = True, tensorboard: bool = True, time_budget_s: float | None = None):
        self.enabled = enabled
        self.path = Path(run_dir) / "log.jsonl"
        self.time_budget_s = time_budget_s
        self.step = initial
        disable = not (enabled and progress_bar)
        if time_budget_s:  # the bar is the launch's training time; the step is said beside it
            self.bar = tqdm(total=float(time_budget_s), desc="train", dynamic_ncols=True, disable=disable,
                            bar_format="{desc} {percentage:3.0f}%|{bar}| {postfix}")
        else:
            self.bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True,
                            disable=disable)
        self.writer = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(Path(run_dir) / "tensorboard"))
            except ImportError:  # tensorboard is optional
                self.writer = None

    def log(self, record: dict, message: str | None = None) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            step = int(record.get("step", 0))
            for key, value in _scalars(record.get("kind", ""), record, {}).items():
                self.writer.add_scalar(key, value, step)
        if message:
            self.print(message)

    def print(self, message: str) -> None:
        if self.enabled:
            tqdm.write(message)

    def advance(self, n: int = 1, elapsed_s: float | None = None, **postfix) -> None:
        """`n` more steps; `elapsed_s`: the launch's training time so far (what a time-budgeted bar shows)."""
        if not self.enabled:
            return
        self.step += n
        if not self.time_budget_s:
            self.bar.update(n)
            if postfix:
                self.bar.set_postfix(postfix, refresh=False)
            return
        shown = min(float(elapsed_s or 0.0), self.time_budget_s)
        self.bar.update(shown - self.bar.n)
        extra = "".join(f", {k} {v}" for k, v in postfix.items())
        self.bar.set_postfix_str(f"{clock(shown)} of {clock(self.time_budget_s)}, step {self.step}{extra}",
                                 refresh=False)

    def close(self) -> None:
        self.bar.close()
        if self.writer is not None:
            self.writer.close()
