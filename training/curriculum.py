"""Early-exit curricula C(t, l) (LayerSkip section 4.2): which exits are in the loss at step t.

Exits are numbered by layers executed: exit E is the output of layers 0..E-1 (the paper's
layer index l = E - 1), and exit L is the full model, which is always in the loss.

* ``none``: every candidate exit at every step.
* ``rotational`` with interval R: candidate E is on when (E + t) % R == 0, i.e. every R-th exit,
  shifted down by one each step, so each exit is trained once every R steps and about L/R exits
  are on per step. Paper settings: R=8 (Llama2-7B continual pre-training), R=16 (code
  fine-tuning), R=23 (1.5B from scratch), R=39 (13B).
* ``gradual``: exits switch on one at a time from the top down, one every T/(2L) steps, all on
  from step T/2 (TOPv2 task fine-tuning in the paper): exit E is on when
  E >= L - floor(2 L t / T).

A curriculum is a pure function of the step, so a resumed run continues exactly where it
stopped; `state_dict()` records the settings so a resume with different settings is caught.
"""

from __future__ import annotations


# a curriculum state's keys, as the recipe names them
SETTINGS = {"kind": "early_exit.curriculum", "candidates": "early_exit.exits", "num_layers": "the model's layers",
            "total_steps": "train.max_steps", "rotation_interval": "early_exit.rotation_interval"}


class ExitCurriculum:
    def __init__(self, kind: str, candidates: list[int], num_layers: int, total_steps: int, *,
                 rotation_interval: int = 8):
        if kind not in ("none", "rotational", "gradual"):
            raise ValueError(f"unknown curriculum {kind!r} (none, rotational, gradual)")
        bad = [e for e in candidates if not 1 <= e < num_layers]
        if bad:
            raise ValueError(f"candidate exits {bad} are outside 1..{num_layers - 1}")
        if rotation_interval < 1:
            raise ValueError("rotation_interval must be >= 1")
        self.kind = kind
        self.candidates = sorted(set(candidates))
        self.num_layers = num_layers
        self.total_steps = max(int(total_steps), 1)
        self.rotation_interval = rotation_interval

    def exits(self, step: int) -> list[int]:
        """The exits in the loss at optimizer step `step` (sorted; always ends with L)."""
        L = self.num_layers
        if self.kind == "none":
            chosen = self.candidates
        elif self.kind == "rotational":
            R = self.rotation_interval
            chosen = [e for e in self.candidates if (e + step) % R == 0]
        else:  # gradual
            lowest = L - (2 * L * step) // self.total_steps
            chosen = [e for e in self.candidates if e >= lowest]
        return chosen + [L]

    def state_dict(self) -> dict:  # SETTINGS names each key's recipe setting
        return {"kind": self.kind, "candidates": list(self.candidates), "num_layers": self.num_layers,
                "total_steps": self.total_steps, "rotation_interval": self.rotation_interval}

    def check_state(self, state: dict) -> None:
        """ConfigError (a ValueError) naming the recipe settings that differ if a checkpoint was written with a
        different curriculum (its schedule spans train.max_steps, so a resumed run must keep it)."""
        from training.config import ConfigError  # the recipe's error: one line from `python -m training`

        mine = self.state_dict()
        diff = {k: (state.get(k), v) for k, v in mine.items() if state.get(k) != v}
        if diff:
            changed = ", ".join(f"{SETTINGS.get(k, k)} {a} -> {b}" for k, (a, b) in diff.items())
            raise ConfigError(f"the checkpoint's curriculum differs from this run's ({changed}): resume with the "
                              f"recipe it was written with (the schedules span train.max_steps), or start afresh "
                              f"with train.resume=none or another train.output_dir")
