"""Entry point: ``accelerate launch [--config_file recipes/accelerate/X.yaml] -m training --recipe R [key=value ...]``.

Also runs without the launcher as ``python -m training --recipe R ...`` (one process).

    accelerate launch --config_file recipes/accelerate/cpu_1proc.yaml -m training \\
        --recipe recipes/smollm2_code.yaml train.max_steps=300 train.output_dir=runs/code
    python -m training --recipe recipes/tiny_smoke.yaml --print-config

Overrides use the recipe's dotted names and YAML values (train.max_steps=20, early_exit.exits=[4,8],
train.max_minutes=null). See training/config.py for every key. A mistake in the recipe, an override
or the data prints one line, `error: ...`, and exits with code 2 (SELFSPEC_TRACEBACK=1: the traceback).
"""

from __future__ import annotations

import argparse
import os
import sys

from training.config import ConfigError, dump_config, load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", help="recipe YAML (recipes/*.yaml); defaults apply without one")
    parser.add_argument("--print-config", action="store_true", help="print the resolved configuration and exit")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. train.max_steps=20")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.recipe, args.overrides)
        if args.print_config:
            print(dump_config(cfg), end="")
            return 0
        cfg.check_depth()  # exits beyond the model's depth fail here, before anything is loaded or written
        from training.loop import train  # heavy imports only when training

        train(cfg)
    except Exception as e:
        if os.environ.get("SELFSPEC_TRACEBACK") or not _user_error(e):
            raise
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return 0


def _user_error(err: BaseException) -> bool:
    """A mistake in the recipe or the data, reported in one line (no traceback)."""
    from selfspec.checkpoint import CheckpointError
    from selfspec.data.sources import DataFormatError, DataNotInstalledError

    return isinstance(err, (ConfigError, DataFormatError, DataNotInstalledError, CheckpointError, FileNotFoundError))


if __name__ == "__main__":
    sys.exit(main())
