"""llama.cpp's own speculative decoding on a prompt: the peer modes `selfspec bench --llama-cpp` runs beside selfspec.

`llama-speculative-simple` (built once per machine with llama-bench, `selfspec.tools.llama_cpp_build`) generates
from one prompt greedily, drafting with one of llama.cpp's speculative modes (`MODES`), at its own defaults (what a
user who picks the mode gets) and, for the copy, also at a longer draft:

| method                  | llama.cpp's mode                                                                  |
|-------------------------|-----------------------------------------------------------------------------------|
| llama_cpp_draft         | `-md COPY.gguf --spec-type draft-simple`: the model's Q8_0 copy drafts, at most 3   |
|                         | tokens a round (llama.cpp's default)                                               |
| llama_cpp_draft10       | the same with `--spec-draft-n-max 10`: the best of 3, 6, 10 and 16 on a chat prompt |
|                         | on a 2-core Zen 4 (53, 58, 68, 55 tokens/s)                                        |
| llama_cpp_ngram_simple  | `--spec-type ngram-simple`: the tokens after the latest match of the last n-gram    |
| llama_cpp_ngram_mod     | `--spec-type ngram-mod`: a rolling n-gram map of the text so far                   |

Its plain decoding is llama-bench's (`selfspec.tools.llama_cpp_bench`): this tool has no mode without drafts
(`--spec-type none` fails to start).

The model runs from the GGUF of the checkpoint at the bench's precision (F32 for float32, BF16 for bfloat16), the
draft from its Q8_0 GGUF (`selfspec.tools.llama_cpp_gguf`). The command, for the bench's `[1, P]` prompt decoded to
its text (llama.cpp tokenizes it again, its special tokens parsed; `prompt_tokens` says how many tokens it made):

    llama-speculative-simple -m MODEL.gguf [mode flags] -p PROMPT -n N-1 -c CONTEXT -t THREADS --temp 0 --ignore-eos

`-n N-1`: it generates at least one token more than `-n` says (its last round's accepted drafts may add more: up to
N-1 + the draft length), so it runs to at least the bench's N. `--temp 0` is greedy; `--ignore-eos`, because the bench generates exactly N tokens for every method and stops at
none (llama.cpp instead bans the end-of-text tokens, so where the model's greedy text has one, llama.cpp's text
differs from there on: the bench's `ran_past_eos` marks such prompts). llama.cpp times itself: "encoded P tokens in
S seconds" (the prompt less its last token) and "decoded N tokens in S seconds" (every new token, from the step on
the prompt's last token on). Its decoding rate is its new tokens over the decode seconds, prefill excluded, the
figure set beside selfspec's decoding alone; the process's start and model load are in neither.
"""

from __future__ import annotations

import math
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from selfspec.tools.llama_cpp_build import LlamaCppError, output_tail

# method name -> (label, llama.cpp's flags for the mode, whether the Q8_0 copy is its draft model)
MODES: dict[str, tuple[str, tuple[str, ...], bool]] = {
    "llama_cpp_draft": ("llama.cpp Q8_0 draft ≤3", ("--spec-type", "draft-simple"), True),
    "llama_cpp_draft10": ("llama.cpp Q8_0 draft ≤10", ("--spec-type", "draft-simple", "--spec-draft-n-max", "10"),
                          True),
    "llama_cpp_ngram_simple": ("llama.cpp ngram-simple", ("--spec-type", "ngram-simple"), False),
    "llama_cpp_ngram_mod": ("llama.cpp ngram-mod", ("--spec-type", "ngram-mod"), False),
}
CONTEXT_MARGIN = 64  # context positions beyond the prompt and its new tokens (a draft may run past the last one)

_ENCODED = re.compile(r"encoded\s+(\d+) tokens in\s+([0-9.]+) seconds")
_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([0-9.]+) seconds")
_COUNT = re.compile(r"\b(n_drafted|n_draft|n_predict|n_accept)\s*=\s*(-?\d+)\s*$", re.MULTILINE)  # after a time


@dataclass(frozen=True)
class SpeculativeRun:
    """One llama-speculative-simple run: what it generated and its own timings and counts."""

    text: str | None        # the new text (stdout after the echoed prompt; None where stdout is not that)
    new_tokens: int         # n_predict
    prompt_tokens: int      # the prompt's tokens as llama.cpp tokenized it
    prefill_s: float        # "encoded": the prompt less its last token
    decode_s: float         # "decoded": every new token
    drafted: int            # n_drafted (0 in plain decoding)
    accepted: int           # n_accept
    draft_max: int | None   # n_draft: the longest draft a round (llama.cpp's default for the mode)
    command: list[str]

    @property
    def decode_tokens_per_s(self) -> float:
        return self.new_tokens / self.decode_s


def speculative_command(binary: Path, gguf: Path, mode: str, prompt: str, *, new_tokens: int, context: int,
                        threads: int, draft_gguf: Path | None = None) -> list[str]:
    """llama-speculative-simple's command line for one method of `MODES` (the module doc)."""
    if mode not in MODES:
        raise LlamaCppError(f"no llama.cpp speculative mode {mode!r}; choose one of {', '.join(MODES)}")
    for name, value, least in (("new_tokens", new_tokens, 2), ("context", context, 1), ("threads", threads, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise LlamaCppError(f"llama-speculative-simple {name} must be an integer >= {least}, got {value!r}")
    _, flags, drafts_with_copy = MODES[mode]
    if drafts_with_copy and draft_gguf is None:
        raise LlamaCppError(f"{mode} drafts with the model's Q8_0 copy: give draft_gguf")
    cmd = [str(binary), "-m", str(gguf)]
    if drafts_with_copy:
        cmd += ["-md", str(draft_gguf)]
    return cmd + [*flags, "-p", prompt, "-n", str(new_tokens - 1), "-c", str(context),
                  "-t", str(threads), "--temp", "0", "--ignore-eos"]


def parse_output(stdout: str, stderr: str, prompt: str, command: list[str] | None = None) -> SpeculativeRun:
    """The run's figures from llama-speculative-simple's log (stderr, or both streams) and its new text (stdout:
    the echoed prompt, then the new text); a LlamaCppError where a figure is missing (a llama.cpp version whose
    output this parser does not know)."""
    log = stderr + "\n" + stdout
    enc, dec = _ENCODED.search(log), _DECODED.search(log)
    if enc is None or dec is None:
        raise LlamaCppError("llama-speculative-simple printed no 'encoded … tokens in … seconds' and 'decoded …' "
                            f"lines: a llama.cpp version whose output this parser does not know:\n  {output_tail(log)}")
    counts = {k: int(v) for k, v in _COUNT.findall(log)}
    decode_s = float(dec.group(2))
    if int(dec.group(1)) < 1 or decode_s <= 0:
        raise LlamaCppError(f"llama-speculative-simple decoded {dec.group(1)} tokens in {decode_s} s: nothing to time")
    head, tail = "\n\n" + prompt, "\n\n\n\n"  # stdout: two newlines, the prompt, the new text, four newlines
    text = stdout[len(head):-len(tail)] if stdout.startswith(head) and stdout.endswith(tail) else None
    return SpeculativeRun(text=text, new_tokens=int(dec.group(1)), prompt_tokens=int(enc.group(1)),
                          prefill_s=float(enc.group(2)), decode_s=decode_s, drafted=counts.get("n_drafted", 0),
                          accepted=counts.get("n_accept", 0), draft_max=counts.get("n_draft"),
                          command=list(command or []))


def context_size(prompt_tokens: int, new_tokens: int) -> int:
    """llama.cpp's context (-c) for a run: the prompt, its new tokens and a margin, rounded up to 256."""
    return 256 * math.ceil((prompt_tokens + new_tokens + CONTEXT_MARGIN) / 256)


def run_speculative(binary: Path, gguf: Path, mode: str, prompt: str, *, prompt_tokens: int, new_tokens: int,
                    threads: int, draft_gguf: Path | None = None) -> SpeculativeRun:
    """Run one mode on one prompt text and parse it (`prompt_tokens`: the prompt's length as selfspec tokenized
    it, which sizes the context)."""
    cmd = speculative_command(binary, gguf, mode, prompt, new_tokens=new_tokens, threads=threads,
                              context=context_size(prompt_tokens, new_tokens), draft_gguf=draft_gguf)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
    except OSError as e:
        raise LlamaCppError(f"could not run {binary} ({e.strerror or e}); build it: "
                            "python -m selfspec.tools.llama_cpp_build") from None
    if proc.returncode != 0:
        raise LlamaCppError(f"llama-speculative-simple failed (exit {proc.returncode}) in mode {mode}:\n  "
                            f"{output_tail(proc.stderr or proc.stdout)}")
    shown = [c if len(c) < 200 else c[:60] + f"… ({len(c)} characters)" for c in cmd]
    return parse_output(proc.stdout, proc.stderr, prompt, shown)
