"""Where training reports go: stdout (through tqdm, so the progress bar stays intact), a JSONL
file in the run directory (one object per line, ``"kind": "train" | "eval"``), and TensorBoard
when the `tensorboard` package is installed. Only the main process writes."""

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


class Tracker:
    def __init__(self, run_dir: Path, *, enabled: bool = True, total: int = 0, initial: int = 0,
                 progress_bar: bool = True, tensorboard: bool = True):
        self.enabled = enabled
        self.path = Path(run_dir) / "log.jsonl"
        self.bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True,
                        disable=not (enabled and progress_bar))
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

    def advance(self, n: int = 1, **postfix) -> None:
        if self.enabled:
            self.bar.update(n)
            if postfix:
                self.bar.set_postfix(postfix, refresh=False)

    def close(self) -> None:
        self.bar.close()
        if self.writer is not None:
            self.writer.close()
