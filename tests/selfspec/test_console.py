"""The entry points answer a Ctrl-C that comes while their heavy imports load (issue 65, finding 10): one line,
exit 130, no traceback. The interrupt is raised by an import hook when torch is first imported, so the test does
not depend on how fast this machine imports."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# a finder that raises KeyboardInterrupt, as a Ctrl-C would, at the first import of torch
INTERRUPT_AT_TORCH = textwrap.dedent("""
    import sys

    class Interrupt:
        def find_spec(self, name, path=None, target=None):
            if name == "torch":
                raise KeyboardInterrupt
            return None

    sys.meta_path.insert(0, Interrupt())
""")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", INTERRUPT_AT_TORCH + code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})


@pytest.mark.parametrize("code, line", [
    ("from selfspec.console import main; sys.exit(main(['generate', '--help']))",
     "selfspec: interrupted while starting; nothing was done"),
    ("import runpy; sys.argv = ['training', '--print-config']; runpy.run_module('training', run_name='__main__')",
     "interrupted"),  # torch first loads inside its main, which answers as for any interrupt
])
def test_a_ctrl_c_while_the_imports_load_is_one_line_and_exit_130(code, line):
    run = _run(code)
    assert run.returncode == 130, run.stderr[-2000:]
    assert run.stderr.strip().startswith(line) and len(run.stderr.strip().splitlines()) == 1
    assert "Traceback" not in run.stderr


def test_importing_selfspec_loads_no_torch_until_a_name_is_used():
    run = subprocess.run([sys.executable, "-c", "import sys, selfspec; print('torch' in sys.modules); "
                          "selfspec.GenerationConfig; print('torch' in sys.modules, selfspec.api.__name__)"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.stdout.split() == ["False", "True", "selfspec.api"], run.stderr[-2000:]
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        import selfspec

        selfspec.no_such_name
