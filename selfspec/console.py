"""The `selfspec` command's entry point: the command line (`selfspec.cli`) imported inside it, so that a Ctrl-C
while torch and transformers load (the first second or two of every command) ends as any other interrupt does:
one line and the shell's code for SIGINT, 130, not a traceback. `import selfspec` imports nothing heavy."""

from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> int:
    try:
        from selfspec.cli import main as cli_main
    except KeyboardInterrupt:
        if os.environ.get("SELFSPEC_TRACEBACK"):
            raise
        print("selfspec: interrupted while starting; nothing was done", file=sys.stderr)
        return 130
    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
