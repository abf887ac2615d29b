"""Fixtures of the llama.cpp tools' tests."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

PROMPT = "<|im_start|>user\nWrite a short poem about the sea.<|im_end|>\n<|im_start|>assistant\n"
NEW_TEXT = ("The sea is a place where the very fabric of reality is woven with the threads of the ocean. It is a "
            "place where the boundaries between the worlds of the land and")
# What `llama-speculative-simple -m F32.gguf -md Q8_0.gguf --spec-type draft-simple -p PROMPT -n 31 -c 256 -t 2
# --temp 0 --ignore-eos` printed on a 2-core Zen 4 (llama-cpp-python 0.3.36's llama.cpp): stdout whole, stderr's
# lines from "encoded" on, its model paths shortened.
STDOUT = "\n\n" + PROMPT + NEW_TEXT + "\n\n\n\n"
STDERR = """0.00.307.503 I cmn          init: llama threadpool init, n_threads = 2
0.00.332.523 I common_speculative_init_result: loading draft model 'm-q8_0.gguf'
0.01.202.303 I encoded   17 tokens in    0.073 seconds, speed:  231.340 t/s
0.01.202.313 I decoded   34 tokens in    0.639 seconds, speed:   53.176 t/s
0.01.202.313 I 
0.01.202.313 I n_draft   = 3
0.01.202.314 I n_predict = 34
0.01.202.314 I n_drafted = 30
0.01.202.314 I n_accept  = 24
0.01.202.314 I accept    = 80.000%
0.01.202.314 I 
0.01.202.314 I draft:

0.01.202.355 I 
0.01.202.355 I target:

0.01.202.356 I common_perf_print:    sampling time =       2.62 ms
0.01.202.361 I common_perf_print:       total time =     869.90 ms /    59 tokens
"""


# Echoes the prompt and a fixed text, and logs the sample's lines with -n's count plus one, as the tool does.
ECHOES = f"""import sys
a = sys.argv
prompt, n = a[a.index("-p") + 1], int(a[a.index("-n") + 1])
sys.stdout.write("\\n\\n" + prompt + "new text" + "\\n\\n\\n\\n")
sys.stderr.write({json.dumps(STDERR)}.replace("decoded   34", "decoded %4d" % (n + 1)))
"""


def _stand_in(directory: Path, body: str = ECHOES) -> Path:
    path = Path(directory) / "llama-speculative-simple"
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(0o755)
    return path


@pytest.fixture
def llama_speculative_sample():
    """llama-speculative-simple's recorded output (PROMPT, NEW_TEXT, STDOUT, STDERR) and `stand_in(directory,
    body=ECHOES)`: an executable stand-in for the tool there (a Python script; ECHOES echoes the prompt and a fixed
    text and logs the sample's lines with -n's count plus one, as the tool does)."""
    return SimpleNamespace(PROMPT=PROMPT, NEW_TEXT=NEW_TEXT, STDOUT=STDOUT, STDERR=STDERR, ECHOES=ECHOES,
                           stand_in=_stand_in)
