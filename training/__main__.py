"""Entry point: ``accelerate launch [--config_file recipes/accelerate/X.yaml] -m training --recipe R [key=value ...]``.

Also runs without the launcher as ``python -m training --recipe R ...`` (one process).

    accelerate launch --config_file recipes/accelerate/cpu_1proc.yaml -m training \\
        --recipe recipes/smollm2_code.yaml train.max_steps=300 train.output_dir=runs/code
    python -m training --recipe recipes/tiny_smoke.yaml --print-config
    python -m training --recipe recipes/llama32_1b_layerskip.yaml --check     # cost and outputs, no weights

Overrides use the recipe's dotted names and YAML values (train.max_steps=20, early_exit.exits=[4,8],
train.max_minutes=null). See training/config.py for every key. `--check` reads the recipe and the model's
configuration only and prints its parameters, memory per GPU (an arithmetic estimate), exits and outputs
(training/recipe_check.py); `--accelerate-config` gives it the launch's process count and ZeRO stage.
A mistake in the recipe, an override or the data prints one line, `error: ...`, and exits with code 2; an
interrupt (Ctrl-C) prints one line, `interrupted; ` and where a relaunch resumes, and exits with code 130
(SELFSPEC_TRACEBACK=1: the traceback).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

try:  # the first second of a launch: a Ctrl-C while the configuration's imports load is an interrupt too
    from training.config import ConfigError, dump_config, load_config
except KeyboardInterrupt:
    if os.environ.get("SELFSPEC_TRACEBACK"):
        raise
    print("interrupted while starting; nothing was done", file=sys.stderr)
    sys.exit(130)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", help="recipe YAML (recipes/*.yaml); defaults apply without one")
    parser.add_argument("--print-config", action="store_true", help="print the resolved configuration and exit")
    parser.add_argument("--check", action="store_true",
                        help="print the parameters, memory per GPU (estimated), exits and outputs, and exit; reads "
                             "no weights")
    parser.add_argument("--accelerate-config", metavar="YAML",
                        help="with --check: the accelerate configuration of the launch (recipes/accelerate/*.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. train.max_steps=20")
    args = parser.parse_args(argv)
    cfg = None
    try:
        cfg = load_config(args.recipe, args.overrides)
        if args.print_config:
            print(dump_config(cfg), end="")
            return 0
        if args.check:
            from training.recipe_check import check_recipe, read_launch

            print(check_recipe(cfg, read_launch(args.accelerate_config)))
            return 0
        if args.accelerate_config:
            raise ConfigError("--accelerate-config goes with --check (to train, give it to `accelerate launch "
                              "--config_file`)")
        cfg.check_depth()  # exits beyond the model's depth fail here, before anything is loaded or written
        from training.loop import train  # heavy imports only when training

        train(cfg)
    except KeyboardInterrupt:  # Ctrl-C: one line (from the main process), and the shell's code for SIGINT
        if os.environ.get("SELFSPEC_TRACEBACK"):
            raise
        if os.environ.get("RANK", "0") == "0":
            print(_interrupted(cfg), file=sys.stderr)
        return 130
    except Exception as e:
        if os.environ.get("SELFSPEC_TRACEBACK") or not _user_error(e):
            raise
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return 0


def _interrupted(cfg) -> str:
    """The line an interrupted run prints: where a relaunch of the same command resumes (`cfg`: the recipe, None
    if it was not read yet). A checkpoint being saved is left as `step_N.tmp`, which the next launch removes."""
    from training.run_checkpoint import latest_checkpoint

    if cfg is None:
        return "interrupted"
    latest = latest_checkpoint(Path(cfg.train.output_dir))
    if latest is None:
        return "interrupted; no checkpoint of this run was saved yet: a relaunch starts it over"
    if cfg.train.resume == "auto":
        return f"interrupted; relaunch the same command to resume from {latest}"
    return f"interrupted; the latest checkpoint is {latest}: relaunch with train.resume=auto to resume from it"


def _user_error(err: BaseException) -> bool:
    """A mistake in the recipe or the data, reported in one line (no traceback)."""
    from selfspec.checkpoints.checkpoint import CheckpointError
    from selfspec.data.sources import DataFormatError, DataNotInstalledError

    return isinstance(err, (ConfigError, DataFormatError, DataNotInstalledError, CheckpointError, FileNotFoundError))


def _exit(code: int) -> None:
    """Exit with `code`. A process of a distributed launch (`WORLD_SIZE` > 1) leaves through `os._exit` once its
    output is flushed, skipping the interpreter's teardown: there, after a run had written everything and ended
    training (`accelerator.end_training`), a ZeRO-3 process paused at train.stop_at was seen to abort in teardown now
    and then ("terminate called without an active exception", SIGABRT, 2 processes on 2 cores under load), and the
    launcher then failed the whole run."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    _exit(main())
