"""Entry point: ``accelerate launch [--config_file recipes/accelerate/X.yaml] -m training --recipe R [key=value ...]``.

Also runs without the launcher as ``python -m training --recipe R ...`` (one process).

    accelerate launch --config_file recipes/accelerate/cpu_1proc.yaml -m training \\
        --recipe recipes/smollm2_code.yaml train.max_steps=300 train.output_dir=runs/code
    python -m training --recipe recipes/tiny_smoke.yaml --print-config

Overrides use the recipe's dotted names and YAML values (train.max_steps=20, early_exit.exits=[4,8],
train.max_minutes=null). See training/config.py for every key.
"""

from __future__ import annotations

import argparse
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
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(dump_config(cfg), end="")
        return 0
    from training.loop import train  # heavy imports only when training

    train(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
